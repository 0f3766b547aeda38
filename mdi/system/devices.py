"""Which dtype a node computes in, given its device and the dtype its weights are stored in.

Below compute capability 7.0 (Pascal: Jetson TX2 is 6.2) torch's float16 kernels gain little
(no tensor cores), and bfloat16 arithmetic needs 8.0 (Ampere: Jetson Orin). `compute_dtype`
lets a node keep half-precision weights (half the memory) while computing in float32.
"""
import os
from typing import TYPE_CHECKING, Dict, Optional, Tuple

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that need it (every one but for the CPU): a node that
# computes with ggml asks whether its device is usable without loading torch.

FAST_FP16_CAPABILITY = (7, 0)
BF16_CAPABILITY = (8, 0)


# ggml's device types (ggml-backend.h's enum ggml_backend_dev_type), read where ggml's registry
# is asked (mdi.model.ggml.lib; a GPU's free memory, mdi.system.memory)
GGML_DEVICE_CPU, GGML_DEVICE_GPU, GGML_DEVICE_IGPU = 0, 1, 2  # IGPU: integrated, sharing the host's RAM


def ggml_device_name(device: str) -> str:
    """mdi's device ("cuda", "cuda:N") as ggml's device registry names it ("CUDA0", "CUDAN");
    any other name is taken as ggml's own (e.g. "CPU": the CPU reached as a device, its weights
    copied into its buffers, which is how the tests run the GPU path on a machine without one)."""
    if device == "cuda" or device.startswith("cuda:"):
        return "CUDA%s" % (device.split(":", 1)[1] if ":" in device else "0")
    return device


def unusable_reason(device: str) -> Optional[str]:
    """None when this process can compute on `device` ("cpu", "cuda", "cuda:N"), else why not,
    in one line (asked before anything touches the device: torch answers a missing GPU with
    assertion errors and tracebacks)."""
    if not device.startswith("cuda"):
        return None
    import torch
    if not torch.cuda.is_available():
        return "%s: this node's torch sees no CUDA GPU (no GPU, no driver, or a CPU-only torch build)" % device
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    if index >= count:
        return "%s: this node has %d CUDA GPU%s (cuda:0%s)" % (device, count, "" if count == 1 else "s",
                                                              "" if count == 1 else " to cuda:%d" % (count - 1))
    return None


def use_shape_agnostic_attention(device: str) -> bool:
    """Keep torch's cuDNN attention out of `device`'s SDPA calls (True where it was on).

    mdi's attention changes shape at every decode step (the keys grow by one position), and
    torch's cuDNN backend, the one torch 2.11 picks first on an H200, builds a graph for each
    new shape, compiled at run time (NVRTC), and caches it per thread. A worker computes each
    run on a new thread, so it compiled again at every step of every run: a 10-layer SmolLM2
    forward took 63 ms instead of ~4, 20-40 ms per ring hop (py-spy, results/gpu/README.md).
    Flash and memory-efficient attention take any length as it is. Process-wide, as torch's
    switch is; torch without the switch (< 2.4) has no cuDNN attention to avoid."""
    if not device.startswith("cuda"):
        return False
    import torch
    enabled = getattr(torch.backends.cuda, "cudnn_sdp_enabled", None)
    if enabled is None or not enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def cuda_capability(device: str) -> Optional[Tuple[int, int]]:
    if not device.startswith("cuda"):
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.device(device))


_CPU_ARITHMETIC: "Dict[torch.dtype, bool]" = {}  # what this process's torch computes on the CPU


def cpu_computes(dtype: "torch.dtype") -> bool:
    """Whether this torch runs a linear layer, a layer norm and attention in `dtype` on the CPU:
    torch 2.0 (JetPack 5's) has no float16 linear, which fails at the first token otherwise."""
    if dtype not in _CPU_ARITHMETIC:
        import torch
        try:
            x = torch.ones(2, 8, dtype=dtype)
            torch.nn.functional.layer_norm(torch.nn.functional.linear(x, x), (2,))
            q = x.view(1, 1, 2, 8)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            _CPU_ARITHMETIC[dtype] = True
        except RuntimeError:
            _CPU_ARITHMETIC[dtype] = False
    return _CPU_ARITHMETIC[dtype]


def resolve_compute_dtype(device: str, dtype: "torch.dtype", compute_dtype: "Optional[torch.dtype]",
                          capability: Optional[Tuple[int, int]] = None) -> "Tuple[torch.dtype, Optional[str]]":
    """The dtype to compute in, and a message for the log when the choice needs explaining.

    An explicit compute_dtype is honoured where torch computes in it. Without one, bfloat16
    weights on a GPU older than 8.0 are computed in float32 (it has no bfloat16 arithmetic at
    all); float16 on one older than 7.0 works but slowly, so the message suggests compute_dtype:
    float32. On the CPU, a half type this torch cannot compute in is computed in float32.
    """
    if not device.startswith("cuda"):
        import torch
        wanted = compute_dtype or dtype
        if wanted in (torch.float16, torch.bfloat16) and not cpu_computes(wanted):
            name = str(wanted).replace("torch.", "")
            return torch.float32, ("torch %s has no %s arithmetic on the CPU: weights stay %s, computing in "
                                   "float32 (the KV cache too: twice its bytes)"
                                   % (torch.__version__, name, str(dtype).replace("torch.", "")))
    if capability is None:
        capability = cuda_capability(device)
    if compute_dtype is not None:
        return compute_dtype, None
    if capability is None:
        return dtype, None
    import torch
    sm = "sm_%d%d" % capability
    if dtype == torch.bfloat16 and capability < BF16_CAPABILITY:
        return torch.float32, ("%s (%s) has no bfloat16 arithmetic: weights stay bfloat16, "
                               "computing in float32" % (device, sm))
    if dtype == torch.float16 and capability < FAST_FP16_CAPABILITY:
        return dtype, ("%s (%s) has no tensor cores for float16: if it is slow, set "
                       "model.compute_dtype: float32 to keep float16 weights and compute in float32"
                       % (device, sm))
    return dtype, None


DEFAULT_CACHE_BYTES = 32 * 1024 * 1024  # when the device does not say: a large desktop L3 (more blocks, not fewer)


def _size_bytes(text: str) -> Optional[int]:
    """A sysfs cache size: "32768K", "2M", "512"."""
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024, "G": 1024 ** 3}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdigit() else None


def last_level_cache_bytes(device: str, sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache in front of `device`'s memory (a CPU's L3, a GPU's L2): weights that
    fit in it are read faster than a node holding real layers reads them."""
    if device.startswith("cuda") and torch.cuda.is_available():
        size = getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0)  # torch 2.1+
        return int(size) or DEFAULT_CACHE_BYTES
    sizes = []
    try:
        for entry in os.listdir(sysfs):
            if entry.startswith("index"):
                with open(os.path.join(sysfs, entry, "size")) as f:
                    sizes.append(_size_bytes(f.read()) or 0)
    except OSError:
        pass  # not Linux, or no cache information: the default
    return max(sizes) if sizes and max(sizes) > 0 else DEFAULT_CACHE_BYTES
