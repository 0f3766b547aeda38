"""The quantized kernel each layer runs, chosen by measurement, and the memory kernels may hold.

At load a layer tries every kernel that this torch build, device and shape offer and the policy
allows (`mdi.model.qkernels.candidates`), keeps those whose output matches the float32
reference, and takes the fastest on that very shape: a kernel's name says nothing about its
speed (on a 2-core AVX-512 VM torch's int4/int8 packed kernels are 20x slower than float32
with float32 activations and 1.2-6x faster with bfloat16 ones). Decisions are cached per (spec,
shape, device, threads, policy): a model measures each shape once. What was chosen last, and
why, is kept for reports (`chosen`).
"""
import logging
import time
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from mdi.model import qkernels
from mdi.model.layout import QuantSpec
from mdi.model.qkernels import DEQUANT, POLICIES, Kernel, Tensors, candidates
from mdi.system.devices import last_level_cache_bytes
from mdi.system.memory import release_freed_memory

log = logging.getLogger(__name__)

MEASURE_SECONDS = 0.03  # per candidate and shape

# (spec, n_out, n_in, device, threads, policy) -> {kernel name: seconds, or None: wrong or unusable
# here}: what was measured, kept so that each shape is measured once, and a layer loaded later
# with more or less memory to spare picks again among the same measurements.
_measured: Dict[Tuple, Dict[str, Optional[float]]] = {}
_notes: Dict[Tuple, Dict[str, str]] = {}  # the same keys -> why a kernel was unusable or wrong
_choices: Dict[Tuple, Tuple[str, str]] = {}  # the same keys -> (kernel chosen last, why)
_allowance: List[Optional[int]] = [None]  # bytes layers may hold beyond their stored weights


def set_memory_allowance(nbytes: Optional[int]) -> None:
    """The bytes the layers loaded from now on may hold beyond their stored (planned) size, for
    kernels that keep a larger packed form; None: no limit (a process that does not know its
    memory). A node sets it before loading to what its memory spares beside its plan."""
    _allowance[0] = None if nbytes is None else max(0, int(nbytes))


def memory_allowance() -> Optional[int]:
    return _allowance[0]


def extra_bytes(kernel: Kernel, spec: QuantSpec, n_out: int, n_in: int) -> int:
    """What `kernel` holds beyond the stored weight (0 for kernels that hold it or less)."""
    if kernel.held_bytes is None:
        return 0
    return max(0, kernel.held_bytes(spec, n_out, n_in) - spec.nbytes(n_out, n_in))


def _time(fn: Callable[[], torch.Tensor], device: torch.device, evict_from: int,
          resident: Sequence[torch.Tensor] = ()) -> float:
    """The least disturbed of a few calls (other processes only ever add time), each on a CPU
    with its caches first filled with something else: a decode step reads each layer's weights
    once, from memory, and a kernel that reads more bytes than another (fbgemm's padded rows)
    loses there what a call on cached weights hides (SmolLM2's gate_up at 1 thread: 0.17 ms
    cached, ~0.4 in a decode step). Filled by reading, as the other layers fill them: written
    lines would have to go back to memory during the timed call, which slowed the memory-bound
    kernels most and turned choices on the 1.1B shape. `evict_from`: the layer's bytes, for
    `_cache_fill` (twice the last-level cache, or nothing: a GPU, a small layer);
    `resident`: tensors the process holds anyway (the chunk's other weights), read first."""
    evict = _cache_fill(device, evict_from, resident)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()
    sync()
    times: List[float] = []
    deadline = time.perf_counter() + MEASURE_SECONDS
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 10):
        for t in evict:
            t.max()  # reads in the tensor's own dtype: an int8 sum() first copies it as int64
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


EVICT_FROM_BYTES = 128 * 1024  # smaller layers belong to models that stay cached (tests' tiny ones): timed hot


def _cache_fill(device: torch.device, layer_bytes: int, resident: Sequence[torch.Tensor] = ()) -> List[torch.Tensor]:
    """What to read before each timed call to fill the CPU's caches: twice the last-level cache.
    Tensors the process holds anyway (the chunk's other weights) come first; only what they
    fall short of is a buffer made here and freed after. A fresh 2x-cache buffer for every layer
    (64 MB on a 32 MB L3), held beside the candidates' packings, set a GGUF load's peak memory."""
    if device.type != "cpu" or layer_bytes < EVICT_FROM_BYTES:
        return []
    need = 2 * last_level_cache_bytes("cpu")
    reads: List[torch.Tensor] = []
    for t in sorted((t for t in resident if t.device.type == "cpu" and t.numel()), key=_nbytes, reverse=True):
        if need <= 0:
            break
        reads.append(t)
        need -= _nbytes(t)
    if need > 0:
        reads.append(torch.ones(-(-need // 4)))
    return reads


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _timed(kernel: Kernel, packed: Tensors, spec: QuantSpec, n_in: int, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """What to time: the kernel's product as decode runs it. A module kernel (the integer ones)
    runs as TorchScript inside mdi.model.fused_decode's blocks, where its dozen small ops cost
    60-150 µs less than eager (SmolLM2's 576-wide layers): timed eager it would lose shapes it
    wins. Prefill rows amortize those ops either way."""
    module = packed.get("linear")
    if isinstance(module, torch.nn.Module):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scripted = torch.jit.script(module)
            return lambda: scripted(x)
        except Exception:  # noqa: BLE001 - a TorchScript that rejects it: eager is how it will run
            pass
    return lambda: kernel.run(x, packed, spec, n_in)


def choose(tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int, device: torch.device,
           where: str = "", resident: Sequence[torch.Tensor] = ()) -> Tuple[Kernel, Tensors]:
    """The fastest kernel that computes this weight correctly here and fits the memory
    allowance, with its packed tensors. `resident`: other tensors the process holds (the
    chunk's other weights), read to fill the caches before each timed call (`_time`)."""
    n_out = int(tensors["qweight"].shape[0])
    preference = qkernels.preference
    key = (spec, n_out, n_in, device.type, torch.get_num_threads(), preference)
    measured = _measured.setdefault(key, {})
    notes = _notes.setdefault(key, {})
    allowance = _allowance[0]
    offered = candidates(spec, n_out, n_in, device)
    fits = [k for k in offered if allowance is None or extra_bytes(k, spec, n_out, n_in) <= allowance]
    named = preference not in POLICIES

    def rank(k: Kernel):  # the named kernel first, else the fastest
        return (k.name != preference) if named else measured[k.name]
    kept: Optional[Tuple[Kernel, Optional[Tensors]]] = None  # the best so far, packed while small: one extra copy at most
    if any(k.name not in measured for k in fits):
        x = torch.randn(1, n_in, generator=torch.Generator().manual_seed(0)).to(device)
        reference = DEQUANT.run(x, dict(tensors), spec, n_in).float()
        release_freed_memory()  # its dequantized blocks (a head's: tens of MB of holes)
        scale = float(reference.abs().max()) or 1.0
        for kernel in fits:
            if kernel.name in measured:
                continue
            if kernel is DEQUANT:
                packed = dict(tensors)
            else:
                if kept is not None and kept[1] is not None and \
                        _packed_bytes(kept[0], kept[1], spec, n_out, n_in) > KEEP_PACKED_BYTES:
                    # the best so far is packed again if it wins: two large packings at once
                    # (a head's, tens of MB each) set a GGUF load's peak memory
                    kept = (kept[0], None)
                    release_freed_memory()
                try:
                    packed = kernel.pack(tensors, spec, n_in)
                    release_freed_memory()  # the packing's temporaries, before it is timed beside what stays
                    err = float((kernel.run(x, packed, spec, n_in).float() - reference).abs().max()) / scale
                except (RuntimeError, TypeError, ValueError) as e:  # a kernel this build cannot run on this shape
                    measured[kernel.name], notes[kernel.name] = None, "unusable (%s)" % str(e).splitlines()[0][:80]
                    continue
                if not err <= kernel.tolerance:
                    measured[kernel.name], notes[kernel.name] = None, "wrong (error %.2g)" % err
                    continue
            # a named kernel or a lone candidate is taken as it is: nothing to compare it with
            measured[kernel.name] = 0.0 if named or len(offered) == 1 else \
                _time(_timed(kernel, packed, spec, n_in, x), device, spec.nbytes(n_out, n_in), resident)
            if kept is None or rank(kernel) < rank(kept[0]):
                kept = (kernel, packed)
            del packed
            # A dropped candidate's packing (tens of MB for a head) goes back before the next
            # is packed: glibc keeps freed holes resident, and they set a GGUF load's peak.
            release_freed_memory()
    best = min((k for k in fits if measured.get(k.name) is not None), key=rank)  # dequant always qualifies
    if kept is not None and kept[0] is best and kept[1] is not None:
        packed = kept[1]
    else:
        kept = None
        try:
            packed = dict(tensors) if best is DEQUANT else best.pack(tensors, spec, n_in)
        except RuntimeError as e:  # measured on another layer of this shape, and refused here
            measured[best.name], notes[best.name] = None, "unusable (%s)" % str(e).splitlines()[0][:80]
            return choose(tensors, spec, n_in, device, where, resident)
    extra = extra_bytes(best, spec, n_out, n_in)
    if allowance is not None:
        _allowance[0] = allowance - extra
    report = ["%s %s" % (k.name, notes[k.name] if measured.get(k.name) is None else "%.3f ms" % (measured[k.name] * 1e3))
              for k in offered if k.name in measured]
    report += ["%s needs %.1f MB more than the node spares" % (k.name, extra_bytes(k, spec, n_out, n_in) / 2 ** 20)
               for k in offered if k not in fits]
    why = "policy %s: %s" % (preference, "; ".join(report))
    if extra:
        why += "; holds %.1f MB beyond the stored weight" % (extra / 2 ** 20)
    _choices[key] = (best.name, why)
    log.debug("quantized kernel for %s [%d x %d] %s: %s (%s)", where or "a layer", n_out, n_in, spec.label(),
              best.name, why)
    return best, packed


KEEP_PACKED_BYTES = 16 * 2 ** 20  # a larger best-so-far packing is dropped before the next candidate is packed


def _packed_bytes(kernel: Kernel, packed: Tensors, spec: QuantSpec, n_out: int, n_in: int) -> int:
    """What a packing holds: its tensors, and what an engine's packed weight holds (its own count)."""
    opaque = kernel.held_bytes(spec, n_out, n_in) if kernel.held_bytes is not None else 0
    return sum(_nbytes(t) if isinstance(t, torch.Tensor) else opaque for t in packed.values())


def chosen() -> List[Dict[str, str]]:
    """What this process chose last for each shape, and why, at its current thread count and
    policy, for reports (the run summary, /status, the metrics record), e.g. {"weight":
    "int4/g32 576x1536", "device": "cpu", "kernel": "int4pack-cpu", "why": "policy fast:
    dequant 1.598 ms; int4pack-cpu 0.144 ms; int8dyn-fbgemm 0.191 ms"}."""
    return [{"weight": "%s %dx%d" % (k[0].label(), k[1], k[2]), "device": k[3], "kernel": name, "why": why}
            for k, (name, why) in _choices.items()
            if k[4] == torch.get_num_threads() and k[5] == qkernels.preference]


def chosen_by_weight() -> Dict[str, str]:
    """`chosen()` as one entry per weight shape: "int4/g32 576x1536" -> "int4pack-cpu: policy fast: ..."."""
    return {e["weight"]: "%s: %s" % (e["kernel"], e["why"]) for e in chosen()}


def summary(kernels: Mapping[str, str]) -> str:
    """'int4pack-cpu x3, int8dyn-fbgemm x2' over the weight shapes of `chosen_by_weight()`."""
    counts: Dict[str, int] = {}
    for text in kernels.values():
        name = text.split(":", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return ", ".join("%s x%d" % kv for kv in sorted(counts.items()))
