"""Matrix products with quantized weights, and the policy that says which of them a layer may try.

Each `Kernel` computes x @ W.T for a quantized W held in its own packed form. Which one a layer
runs is measured at load among the `candidates` the policy allows (mdi.model.quantization.kernel_choice).

Policies (runtime.quant_kernel): `fast` (the default) takes the fastest kernel measured here
among all that compute the layer correctly: torch's bfloat16 packed kernels (activations,
scales and outputs rounded to 8 significant bits; fast where the CPU has bfloat16
instructions), the engines' int8 integer kernels (fbgemm on x86, qnnpack on ARM; fast on AVX2
and ARM cores without them), or the float32 reference; greedy text can part from the exact
path's after some tokens. `exact` allows only float32 arithmetic, so a quantized model computes
exactly what its dequantized float32 twin does (a GGUF's Q4/Q8 blocks give the same logits and
greedy text as `quant: none`), at several times the decode time. Or one kernel's name.
`dequant` runs on every torch from 2.0 and is the reference; the others are feature-detected
(JetPack 5's torch 2.0 has no packed int4 kernel; a torch without quantized tensors has no
integer kernel).
"""
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from mdi.model.layout import QuantSpec
from mdi.model.torch_settings import DEFAULT_POLICY, KERNEL_NAMES, POLICIES, POLICY_NAMES  # noqa: F401  (re-exported)
from mdi.model.quantization.quant import DEQUANT_ELEMENTS, dequantize, quantized_linear, unpack_int4
from mdi.system.devices import unusable_reason
from mdi.system.memory import release_freed_memory

Tensors = Dict[str, torch.Tensor]


# A bfloat16 kernel rounds activations and scales to 8 significant bits: its relative error on
# a layer's output is ~1e-3-5e-3 (the integer kernels: see their `tolerance`). Anything beyond
# a kernel's `tolerance` is a wrong result, not rounding.
@dataclass
class Kernel:
    name: str
    supports: Callable[[QuantSpec, int, int, torch.device], bool]
    pack: Callable[[Mapping[str, torch.Tensor], QuantSpec, int], Tensors]  # canonical -> what run() reads
    run: Callable[[torch.Tensor, Tensors, QuantSpec, int], torch.Tensor]  # (x [rows, n_in], packed, spec, n_in)
    needs_canonical: bool = False  # keeps the canonical tensors (the dequant path)
    exact: bool = False  # float32 arithmetic: the same result as the dequantized float32 weight
    # bytes held in objects that are not tensors (an engine's packed weight), for memory reports
    held_bytes: Optional[Callable[[QuantSpec, int, int], int]] = None
    tolerance: float = 2e-2  # largest error relative to the output's range that is rounding, not a fault


def _op(name: str):
    return getattr(torch.ops.aten, name, None) if hasattr(torch, "ops") else None


# --- the reference -------------------------------------------------------------------

def _dequant_run(x, packed, spec, n_in):
    return quantized_linear(x, packed, spec, n_in)


DEQUANT = Kernel("dequant", lambda spec, n_out, n_in, device: True, lambda t, spec, n_in: dict(t), _dequant_run,
                 needs_canonical=True, exact=True)


# --- torch's packed int4 (CPU: _weight_int4pack_mm_for_cpu; CUDA sm80+: tinygemm) ----------
# Both compute (u - 8) * scale + zero per group for u in 0..15; mdi's int4 is q * scale + min,
# so zero = min + 8 * scale.

def _int4_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return torch.stack((scales.float(), zeros.float()), -1).transpose(0, 1).contiguous().to(torch.bfloat16)


PACK_ROWS = 1024  # rows packed at a time (a multiple of the CPU layout's 64-row tiles)


def _int4_pack_cpu_rows(values: Callable[[int, int], torch.Tensor], n_out: int) -> torch.Tensor:
    """Pack `values(a, b)` (rows a..b as 0..15) PACK_ROWS rows at a time: the op wants one
    int32 per value, and a whole matrix of those is 8x its int4 size (655 MB for a 7B head)."""
    op = _op("_convert_weight_to_int4pack_for_cpu")
    out: Optional[torch.Tensor] = None
    for a in range(0, n_out, PACK_ROWS):
        b = min(a + PACK_ROWS, n_out)
        part = op(values(a, b).to(torch.int32).contiguous(), 1)
        if out is None:  # written into one tensor as packed: a list then torch.cat held it twice
            out = part.new_empty((n_out,) + tuple(part.shape[1:]))
        out[a:b] = part
    assert out is not None
    return out


def _int4_pack_cuda(q: torch.Tensor) -> torch.Tensor:
    op = _op("_convert_weight_to_int4pack")
    try:  # torch >= 2.5 takes the values packed two per byte
        return op(pack_nibbles_high_first(q), 8)
    except RuntimeError:  # older: one int32 per value
        return op(q.to(torch.int32).contiguous(), 8)


def pack_nibbles_high_first(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()


def _int4_supports(device_type: str):
    needed = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu") if device_type == "cpu" \
        else ("_convert_weight_to_int4pack", "_weight_int4pack_mm")

    def supports(spec, n_out, n_in, device):
        if device.type != device_type or not all(_op(n) for n in needed) or spec.group_size not in (32, 64, 128, 256):
            return False
        if device_type == "cuda":  # tinygemm: sm80+ (Orin yes, Xavier and TX2 no)
            return torch.cuda.get_device_capability(device) >= (8, 0) and n_in % 1024 == 0 and n_out % 8 == 0
        return n_out % 16 == 0  # the CPU packing's own requirement
    return supports


def _int4_pack(device_type: str):
    def packer(values: Callable[[int, int], torch.Tensor], n_out: int) -> torch.Tensor:
        if device_type == "cpu":
            return _int4_pack_cpu_rows(values, n_out)
        return _int4_pack_cuda(values(0, n_out))

    def pack(t, spec, n_in):
        q, n_out = t["qweight"], t["qweight"].shape[0]
        if spec.kind == "int4":
            zeros = t["mins"].float() + 8 * t["scales"].float()
            return {"w": packer(lambda a, b: unpack_int4(q[a:b]), n_out), "sz": _int4_scales_zeros(t["scales"], zeros)}
        # int8 as two int4 halves: q = 16 * hi + lo with lo = q & 15 in 0..15 and hi in -8..7, so
        # W = (16 s) * hi + s * lo: u_hi = hi + 8 with zero 0, u_lo = lo with zero 8 s. Exact.
        s = t["scales"].float()
        return {"w": packer(lambda a, b: (q[a:b].to(torch.int32) >> 4) + 8, n_out),
                "sz": _int4_scales_zeros(16 * s, torch.zeros_like(s)),
                "w2": packer(lambda a, b: q[a:b].to(torch.int32) & 15, n_out), "sz2": _int4_scales_zeros(s, 8 * s)}
    return pack


def _int4_run(device_type: str):
    mm = "_weight_int4pack_mm_for_cpu" if device_type == "cpu" else "_weight_int4pack_mm"

    def run(x, packed, spec, n_in):
        op = _op(mm)
        xb = x.to(torch.bfloat16)
        y = op(xb, packed["w"], spec.group_size, packed["sz"])
        if "w2" in packed:
            y = y.float() + op(xb, packed["w2"], spec.group_size, packed["sz2"]).float()
        return y.to(x.dtype)
    return run


def _int4_kernel(name: str, device_type: str, kind: str) -> Kernel:
    base = _int4_supports(device_type)
    return Kernel(name, lambda spec, n_out, n_in, device: spec.kind == kind and base(spec, n_out, n_in, device),
                  _int4_pack(device_type), _int4_run(device_type))


# --- torch's int8 weight-only matmul: one scale per output channel ---------------------

def _int8_channel_supports(spec, n_out, n_in, device):
    return spec.kind == "int8" and spec.group_size == n_in and _op("_weight_int8pack_mm") is not None


def _int8_channel_pack(t, spec, n_in):
    return {"w": t["qweight"].contiguous(), "s": t["scales"].reshape(-1).to(torch.bfloat16)}


def _int8_channel_run(x, packed, spec, n_in):
    return _op("_weight_int8pack_mm")(x.to(torch.bfloat16), packed["w"], packed["s"]).to(x.dtype)


# --- int8 activations x int8 weights in integer arithmetic (fbgemm on x86, qnnpack on ARM) ---
# torch's packed int4 kernel computes in bfloat16: fast only on CPUs with bfloat16 instructions
# (AVX-512 BF16, AMX). On AVX2, and on ARM cores without them, it is compute-bound, while an
# engine's integer kernel reads int8 weights at memory speed (a 5632x2048 layer, 1 thread,
# AVX2: 353 µs against 1,919 for int4pack and 3,811 for float32). The engines take one scale per
# output channel: a layer stored in groups (GGUF's Q4_1 / Q8_0 blocks of 32) is rounded once at
# load to int8 per channel, and fbgemm pads each row to a multiple of 512 values: it holds more
# than the stored weight (from int4 groups 1.6-2.9x), so it is a candidate only within the
# allowance runtime.kernel_memory sets within what the node can spare (none by default:
# `kernel_choice.set_memory_allowance`), never beyond what the plan counted.
#
# Activations: the engine quantizes its whole input with one range, to 7 bits on fbgemm
# (reduce_range: its AVX2 path saturates 16-bit pair sums at 8). Alone that cost SmolLM2 15%
# perplexity. So each row is divided by its largest magnitude, a last row of +1 and -1 pins the
# range to [-1, 1] whatever the other rows hold, and each row's rounding error, rescaled, rides
# along as another row of the same call: ~14 bits per row for one read of the weights
# (perplexity within 0.1% of float32), and a sample's result does not depend on its frame.


SHY = 0.999  # just inside [-1, 1]
# From this many rows the activations are rounded to the engine's grid by four plain ops rather
# than torch.fake_quantize_per_tensor_affine (same bits, tests/test_integer_kernels.py): the
# fused op is quicker on one row, ~6x slower on a 64-row prefill pass.
ROUND_BY_OPS_ROWS = 4


class Int8DynamicLinear(torch.nn.Module):
    """x [rows, n_in] @ W.T through an engine's packed int8 weight (see above). A module so that
    the eager path and mdi.model.fused_decode's scripted blocks run this same code."""

    def __init__(self, params: Any, levels: int, n_in: int, zero: int) -> None:
        super().__init__()
        self.params = params
        self.reduce_range = levels < 255  # asked of fbgemm; qnnpack keeps 8 bits and warns when asked
        # The engine's grid for [-1, 1]: `levels` steps, its zero point one of the two
        # integers beside the middle, as its own float arithmetic rounds (`engine_zero_point`).
        self.step = 2.0 / levels
        # fake_quantize's own reciprocal (1.0f / scale in float32): the rounding below matches its bits
        self.inv_step = float(torch.tensor(1.0) / torch.tensor(self.step, dtype=torch.float32))
        self.zero = zero
        self.levels = levels
        self.round_by_ops_rows = ROUND_BY_OPS_ROWS  # an attribute: TorchScript reads no module globals
        # A rounding error is at most half a step (1 / levels): this brings it inside [-1, 1].
        self.rest_gain = SHY * levels
        self.shy = SHY
        self.pin = pin_row(n_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        # each row's largest value to SHY, inside the pins: +-1 itself is a tie on the engine's
        # grid (63.5 steps), which the engine and fake_quantize round apart
        peak = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30).div_(self.shy)
        scaled = x / peak
        if rows < self.round_by_ops_rows:
            rounded = torch.fake_quantize_per_tensor_affine(scaled, self.step, self.zero, 0, self.levels)
        else:  # the same bits: its fused op took 0.4 ms on 64 x 576 (AVX2), 6x these four
            rounded = torch.round(scaled * self.inv_step).add_(self.zero).clamp_(0, self.levels).sub_(self.zero) \
                .mul_(self.step)
        rest = (scaled - rounded) * self.rest_gain
        y = torch.ops.quantized.linear_dynamic(torch.cat((scaled, rest, self.pin.to(x.dtype)), 0), self.params,
                                               self.reduce_range)
        return torch.add(y[:rows], y[rows:2 * rows], alpha=1.0 / self.rest_gain) * peak


# fbgemm keeps 7 bits (reduce_range); qnnpack ignores reduce_range and keeps 8.
ENGINE_LEVELS = {"fbgemm": 127, "qnnpack": 255}
FBGEMM_ROW_BLOCK = 512  # fbgemm's packed rows are padded to a multiple of this many values (AVX2, AVX-512)


def _engines() -> Tuple[str, ...]:
    try:
        return tuple(torch.backends.quantized.supported_engines)
    except (AttributeError, RuntimeError):
        return ()


def _offered(engine: str) -> bool:
    """Whether a layer tries `engine`: the one made for this CPU, fbgemm where it is built (x86),
    else qnnpack (ARM); another only when named (runtime.quant_kernel). x86 builds ship qnnpack
    too, but it lost every shape measured on AVX2 (SmolLM2's head 7.8 against 3.3 ms, its
    576-wide layers 0.71-1.18 against 0.45-0.63) and its packing held ~5x the weight while
    measured (+144 MB for the 28 MB head): timing it set a GGUF load's peak memory."""
    engines = _engines()
    if engine not in engines:
        return False
    native = "fbgemm" if "fbgemm" in engines else "qnnpack"
    return engine == native or preference == "int8dyn-" + engine


def _int8_dynamic_supports(engine: str):
    def supports(spec, n_out, n_in, device):
        return device.type == "cpu" and _offered(engine) and hasattr(torch, "_make_per_channel_quantized_tensor") \
            and hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch, "fake_quantize_per_tensor_affine")
    return supports


def per_channel_int8(t: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The weight as int8 [n_out, n_in] with one float32 scale per output row: taken as stored
    when it already is (int8 per channel), else dequantized a block of rows at a time and rounded."""
    q = t["qweight"]
    if spec.kind == "int8" and spec.group_size == n_in:
        return q, t["scales"].float().reshape(-1)
    n_out = q.shape[0]
    out = torch.empty(n_out, n_in, dtype=torch.int8)
    scales = torch.empty(n_out)
    block = max(1, DEQUANT_ELEMENTS // n_in)
    for a in range(0, n_out, block):
        w = dequantize({k: v[a:a + block] for k, v in t.items()}, spec, n_in)
        s = w.abs().amax(1) / 127.0
        s[s == 0] = 1.0
        scales[a:a + block] = s
        out[a:a + block] = w.div_(s[:, None]).round_().clamp_(-127, 127)  # in place: one block's floats at a time
    release_freed_memory()  # the blocks' floats, left as holes below `out` (a head's: ~40 MB)
    return out, scales


def pin_row(n_in: int) -> torch.Tensor:
    """[1, n_in] of +1, 0..., -1: with it in the input, the engine's range is [-1, 1]."""
    pin = torch.zeros(1, n_in)
    pin[0, 0], pin[0, -1] = 1.0, -1.0
    return pin


PROBE_ROWS = 16  # a weight's rows engine_zero_point compares with
_zero_points: Dict[str, int] = {}  # engine -> its zero point for [-1, 1]: its arithmetic's, not a weight's


def engine_zero_point(engine: str, params: Any, q: torch.Tensor, scales: torch.Tensor, levels: int) -> int:
    """Which zero point the engine takes for inputs spanning [-1, 1]: the one whose grid explains
    its output on a probe row exactly (a few of the weight's rows, in float, are the reference);
    probed on the first layer packed, then known."""
    if engine in _zero_points:
        return _zero_points[engine]
    n_in = q.shape[1]
    probe = torch.randn(1, n_in, generator=torch.Generator().manual_seed(0))
    probe /= probe.abs().max()
    pin = pin_row(n_in)
    rows = min(PROBE_ROWS, q.shape[0])
    y = torch.ops.quantized.linear_dynamic(torch.cat((probe, pin)), params, levels < 255)[0, :rows]
    w = q[:rows].float() * scales[:rows, None]
    errors = {}
    for zero in (levels // 2, levels // 2 + 1):
        grid = torch.fake_quantize_per_tensor_affine(probe, 2.0 / levels, zero, 0, levels)
        errors[zero] = float((y - (grid @ w.T)[0]).abs().max())
    _zero_points[engine] = min(errors, key=lambda z: errors[z])
    return _zero_points[engine]


def _int8_dynamic_pack(engine: str):
    def pack(t, spec, n_in):
        q, scales = per_channel_int8(t, spec, n_in)
        n_out = q.shape[0]
        levels = ENGINE_LEVELS[engine]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated: a torch without them never gets here
            qw = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros(n_out, dtype=torch.long), 0)
            # qw is a copy: the probe below needs a few rows, and the whole int8 matrix held
            # through the packing was a third copy of the weight (28 MB for SmolLM2's head)
            q = q[:PROBE_ROWS].clone()
            release_freed_memory()
            previous = torch.backends.quantized.engine
            try:
                torch.backends.quantized.engine = engine
                params = torch.ops.quantized.linear_prepack(qw, None)
            finally:
                torch.backends.quantized.engine = previous
        linear = Int8DynamicLinear(params, levels, n_in, engine_zero_point(engine, params, q, scales, levels))
        del q
        if engine == "fbgemm":
            # fbgemm keeps the int8 matrix it was given beside its packed copy, only to give it
            # back on request (unpack, pickling), which mdi never asks: let its bytes go, and
            # keep that only if one product comes out the same after.
            probe = torch.randn(2, n_in, generator=torch.Generator().manual_seed(0))
            before = linear(probe)
            qw.untyped_storage().resize_(0)
            if not torch.equal(linear(probe), before):
                raise RuntimeError("fbgemm read the weight it was given after packing it")
        return {"linear": linear}
    return pack


def _int8_dynamic_run(x, packed, spec, n_in):
    return packed["linear"](x)


def _int8_dynamic_held(engine: str):
    def held(spec, n_out, n_in):
        if engine == "fbgemm":
            # rows padded to the block; measured up to 11% above that (3072x576): counted with a margin
            return n_out * (-(-n_in // FBGEMM_ROW_BLOCK) * FBGEMM_ROW_BLOCK + 16) * 9 // 8
        return n_out * (2 * n_in + 16)  # the matrix and its packed copy
    return held


def _int8_dynamic_kernel(engine: str) -> Kernel:
    # tolerance: rounding a group-quantized weight again per channel costs up to ~2-3% of a
    # layer's output range on one random row where a row holds outliers (SmolLM2's qkv); the
    # model's perplexity moved 0.1% (scripts/bench_quant_quality.py)
    return Kernel("int8dyn-" + engine, _int8_dynamic_supports(engine), _int8_dynamic_pack(engine), _int8_dynamic_run,
                  held_bytes=_int8_dynamic_held(engine), tolerance=5e-2)


INT8_FBGEMM = _int8_dynamic_kernel("fbgemm")
KERNELS = [
    DEQUANT,
    _int4_kernel("int4pack-cpu", "cpu", "int4"),
    _int4_kernel("int8-as-2xint4-cpu", "cpu", "int8"),
    _int4_kernel("int4pack-cuda", "cuda", "int4"),
    _int4_kernel("int8-as-2xint4-cuda", "cuda", "int8"),
    Kernel("int8pack", _int8_channel_supports, _int8_channel_pack, _int8_channel_run),
    INT8_FBGEMM,
    _int8_dynamic_kernel("qnnpack"),
]
# The names configs and requests may give, without torch (mdi.model.torch_settings): these kernels'.
assert tuple(k.name for k in KERNELS) == KERNEL_NAMES, "mdi.model.torch_settings.KERNEL_NAMES is out of date"
preference = DEFAULT_POLICY  # a policy, or a kernel name to use wherever it applies


def set_preference(name: Optional[str]) -> None:
    global preference
    name = name or DEFAULT_POLICY
    if name not in POLICY_NAMES:
        raise ValueError("unknown quantized kernel policy %r (expected one of %s)" % (name, ", ".join(POLICY_NAMES)))
    preference = name


def candidates(spec: QuantSpec, n_out: int, n_in: int, device: torch.device) -> List[Kernel]:
    """The kernels the policy lets a layer of this shape try on `device` (the named one first)."""
    supported = [k for k in KERNELS if k.supports(spec, n_out, n_in, device)]
    if preference == "exact":
        return [k for k in supported if k.exact]
    if preference != "fast":
        return sorted((k for k in supported if k.name in (preference, DEQUANT.name)), key=lambda k: k.name != preference)
    return supported


def available(policy: str, device: torch.device) -> List[str]:
    """The kernels `policy` lets a layer try on `device` with this torch (any shape's), for
    --check: which ones win is measured at load."""
    if policy == "exact":
        return [k.name for k in KERNELS if k.exact]
    shapes = [(QuantSpec(kind, 32), 64, 1024) for kind in ("int4", "int8")]

    def offered(k: Kernel) -> bool:
        try:
            return any(k.supports(spec, n_out, n_in, device) for spec, n_out, n_in in shapes)
        except (RuntimeError, AssertionError):  # e.g. a CUDA device this machine does not have
            return False
    names = [k.name for k in KERNELS if offered(k)]
    return names if policy == "fast" else [n for n in names if n in (policy, DEQUANT.name)]


@functools.lru_cache(maxsize=4)
def offered_on(device: str) -> List[str]:
    """`available("fast", device)` for a device named as a node names it ("cpu", "cuda:1"), none
    on one this process cannot use; asked once per device (a worker's /status, polled as a
    heartbeat, lists them)."""
    if unusable_reason(device) is not None:
        return []
    return available("fast", torch.device(device.split(":")[0]))
