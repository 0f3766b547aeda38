"""The names the torch backend's run-time settings take, without torch: runtime.quant_kernel's
policies and kernel names, and runtime.fused_decode's default. The run config, /init and
/profile validate them, and a node computing with ggml reads those without importing torch.
The kernels themselves are mdi.model.quantization.qkernels', which checks that its names are these."""
import os

POLICIES = ("exact", "fast")
DEFAULT_POLICY = "fast"
KERNEL_NAMES = ("dequant", "int4pack-cpu", "int8-as-2xint4-cpu", "int4pack-cuda", "int8-as-2xint4-cuda", "int8pack",
                "int8dyn-fbgemm", "int8dyn-qnnpack")
POLICY_NAMES = POLICIES + KERNEL_NAMES  # what runtime.quant_kernel accepts

FUSED_DECODE_ENV = "MDI_FUSED_DECODE"  # "0": off unless a run says on (benchmarks, old starters)


def fused_decode_default() -> bool:
    """runtime.fused_decode's default (and a worker's when an older starter does not send it):
    on, unless $MDI_FUSED_DECODE is "0". Read at each call, not at import: a benchmark or test
    that sets the variable later is heard."""
    return os.environ.get(FUSED_DECODE_ENV, "1") != "0"
