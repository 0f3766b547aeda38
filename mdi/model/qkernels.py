"""Matrix products with quantized weights, and the choice among them by measurement.

Each `Kernel` computes x @ W.T for a quantized W held in its own packed form. At load a layer
tries every kernel that this torch build, device and shape offer and the policy allows, keeps
those whose output matches the float32 reference, and takes the fastest on that very shape: a
kernel's name says nothing about its speed (on a 2-core AVX-512 VM torch's int4/int8 packed
kernels are 20x slower than float32 with float32 activations and 1.2-6x faster with bfloat16
ones). Decisions are cached per (spec, shape, device, threads, policy): a model measures each
shape once.

Policies (runtime.quant_kernel): `exact` (the default) allows only float32 arithmetic, so a
quantized model computes exactly what its dequantized float32 twin does (a GGUF's Q4/Q8 blocks
give the same logits and greedy text as `quant: none`); `fast` also allows the bfloat16 packed
kernels (activations, scales and outputs rounded to 8 significant bits: ~1% of the logit range
on SmolLM2, greedy text can part after some tokens; decode 2-4x faster on CPU); or one
kernel's name. `dequant` runs on every torch from 2.0 and is the reference; the packed kernels
are feature-detected (JetPack 5's torch 2.0 has none).
"""
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from mdi.model.layout import QuantSpec
from mdi.model.quant import quantized_linear, unpack_int4

log = logging.getLogger(__name__)

Tensors = Dict[str, torch.Tensor]

# A bfloat16 kernel rounds activations and scales to 8 significant bits: its relative error on
# a layer's output is ~1e-3-5e-3. Anything beyond this is a wrong result, not rounding.
TOLERANCE = 2e-2
MEASURE_SECONDS = 0.03  # per candidate and shape


@dataclass
class Kernel:
    name: str
    supports: Callable[[QuantSpec, int, int, torch.device], bool]
    pack: Callable[[Mapping[str, torch.Tensor], QuantSpec, int], Tensors]  # canonical -> what run() reads
    run: Callable[[torch.Tensor, Tensors, QuantSpec, int], torch.Tensor]  # (x [rows, n_in], packed, spec, n_in)
    needs_canonical: bool = False  # keeps the canonical tensors (the dequant path)
    exact: bool = False  # float32 arithmetic: the same result as the dequantized float32 weight


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
    return torch.cat([op(values(a, min(a + PACK_ROWS, n_out)).to(torch.int32).contiguous(), 1)
                      for a in range(0, n_out, PACK_ROWS)])


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


KERNELS = [
    DEQUANT,
    _int4_kernel("int4pack-cpu", "cpu", "int4"),
    _int4_kernel("int8-as-2xint4-cpu", "cpu", "int8"),
    _int4_kernel("int4pack-cuda", "cuda", "int4"),
    _int4_kernel("int8-as-2xint4-cuda", "cuda", "int8"),
    Kernel("int8pack", _int8_channel_supports, _int8_channel_pack, _int8_channel_run),
]
KERNEL_NAMES = tuple(k.name for k in KERNELS)
_BY_NAME = {k.name: k for k in KERNELS}

POLICIES = ("exact", "fast")
DEFAULT_POLICY = "exact"
POLICY_NAMES = POLICIES + KERNEL_NAMES  # what runtime.quant_kernel accepts

_choices = {}  # type: Dict[Tuple, str]  # (spec, n_out, n_in, device, threads, policy) -> kernel name
preference = DEFAULT_POLICY  # a policy, or a kernel name to use wherever it applies


def set_preference(name: Optional[str]) -> None:
    global preference
    name = name or DEFAULT_POLICY
    if name not in POLICY_NAMES:
        raise ValueError("unknown quantized kernel policy %r (expected one of %s)" % (name, ", ".join(POLICY_NAMES)))
    preference = name


_hinted = []  # type: List[bool]  # the hint about `fast` is logged once per process


def _time(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()
    sync()
    times = []  # type: List[float]
    deadline = time.perf_counter() + MEASURE_SECONDS
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: other processes only ever add time


def choose(tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int, device: torch.device,
           where: str = "") -> Tuple[Kernel, Tensors]:
    """The fastest kernel that computes this weight correctly here, with its packed tensors."""
    n_out = int(tensors["qweight"].shape[0])
    key = (spec, n_out, n_in, device.type, torch.get_num_threads(), preference)
    if key in _choices:
        kernel = _BY_NAME[_choices[key]]
        try:
            return kernel, kernel.pack(tensors, spec, n_in)
        except RuntimeError as e:  # a shape the cached choice has not seen: measure again
            log.debug("kernel %s cannot pack %s: %s", kernel.name, where, e)
    candidates = [k for k in KERNELS if k.supports(spec, n_out, n_in, device)]
    if preference == "exact":
        faster = [k.name for k in candidates if not k.exact]
        if faster and not _hinted:
            _hinted.append(True)
            log.info("quantized layers use exact float32 kernels; runtime.quant_kernel: fast would also try %s "
                     "(bfloat16 rounding, usually several times faster)", ", ".join(faster))
        candidates = [k for k in candidates if k.exact]
    elif preference != "fast":
        candidates = [k for k in candidates if k.name in (preference, DEQUANT.name)]
        candidates.sort(key=lambda k: k.name != preference)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, n_in, generator=gen).to(device)
    reference = DEQUANT.run(x, dict(tensors), spec, n_in).float()
    scale = float(reference.abs().max()) or 1.0
    best = None  # type: Optional[Tuple[float, Kernel, Tensors]]
    report = []
    for kernel in candidates:
        if kernel is DEQUANT:
            packed = dict(tensors)
        else:
            try:
                packed = kernel.pack(tensors, spec, n_in)
                err = float((kernel.run(x, packed, spec, n_in).float() - reference).abs().max()) / scale
            except (RuntimeError, TypeError, ValueError) as e:  # a kernel this build cannot run on this shape
                report.append("%s unusable (%s)" % (kernel.name, str(e).splitlines()[0][:80]))
                continue
            if not err <= TOLERANCE:
                report.append("%s wrong (error %.2g)" % (kernel.name, err))
                continue
        if kernel.name == preference or len(candidates) == 1:
            best = (0.0, kernel, packed)
            break
        seconds = _time(lambda: kernel.run(x, packed, spec, n_in), device)
        report.append("%s %.3f ms" % (kernel.name, seconds * 1e3))
        if best is None or seconds < best[0]:
            best = (seconds, kernel, packed)
    assert best is not None  # dequant always qualifies
    _choices[key] = best[1].name
    log.debug("quantized kernel for %s [%d x %d] %s: %s (%s)", where or "a layer", n_out, n_in, spec.label(),
             best[1].name, "; ".join(report))
    return best[1], best[2]


def chosen() -> Dict[str, str]:
    """What was chosen so far, for reports: 'int4/g32 576x1536 cpu' -> kernel name."""
    return {"%s %dx%d %s t%d" % (k[0].label(), k[1], k[2], k[3], k[4]): v for k, v in _choices.items()}
