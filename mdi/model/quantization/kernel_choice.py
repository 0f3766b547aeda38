"""The quantized kernel each layer runs, chosen by measurement, and the memory kernels may hold.

At load a layer tries every kernel that this torch build, device and shape offer and the policy
allows (`mdi.model.quantization.qkernels.candidates`), keeps those whose output matches the float32
reference, and takes the fastest on that very shape: a kernel's name says nothing about its
speed (on a 2-core AVX-512 VM torch's int4/int8 packed kernels are 20x slower than float32
with float32 activations and 1.2-6x faster with bfloat16 ones). Decisions are cached per (spec,
shape, device, threads, policy): a model measures each shape once. What was chosen last, and
why, is kept for reports (`chosen`).

A layer that multiplies many rows at once (a prefill pass) may also keep a second kernel for
those passes (`choose_kernels`): on AVX2 torch's bfloat16 int4 kernel wins one-row decode but is
compute-bound on 64 rows, where fbgemm's int8 kernel does the same product in 0.7x the time
(SmolLM2's qkv and gate_up, 1 thread). The second packed copy costs memory, so it is kept only
where it is measurably faster and the node spares its bytes.

Kernels that hold more than the stored weight (fbgemm's padded int8 rows, second copies for
prefill) do so only within an allowance: 0 by default, so a node holds its stored weights and
no more; runtime.kernel_memory sets it (a size, or "auto": what the node's memory spares).
"""
import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from mdi.model.layout import QuantSpec
from mdi.model.quantization import kernel_memory, qkernels
from mdi.model.quantization.kernel_report import DOES_NOT_RUN, kernel_counts, summary  # noqa: F401  (named from here too)
from mdi.model.quantization.kernel_timing import nbytes as _nbytes, time_call as _time
from mdi.model.quantization.qkernels import DEQUANT, POLICIES, Kernel, Tensors, candidates
from mdi.system.memory import release_freed_memory

log = logging.getLogger(__name__)


# (spec, n_out, n_in, device, threads, policy) -> {kernel name: seconds, or None: wrong or unusable
# here}: what was measured, kept so that each shape is measured once, and a layer loaded later
# with more or less memory to spare picks again among the same measurements.
_measured: Dict[Tuple, Dict[str, Optional[float]]] = {}
_notes: Dict[Tuple, Dict[str, str]] = {}  # the same keys -> why a kernel was unusable or wrong
# The same keys -> what each layer loaded since start_report() took, as (kernel, why, prefill
# kernel or "", its first row count) -> layers: layers of one shape may differ, where the
# memory a node spares runs out partway through its load.
_choices: Dict[Tuple, Dict[Tuple[str, str, str, int], int]] = {}
# Bytes layers may hold beyond their stored weights (None: no limit). 0 until a node sets it:
# by default a layer holds its stored weight and no more (runtime.kernel_memory, `allowance_for`).
DEFAULT_ALLOWANCE = 0
_allowance: List[Optional[int]] = [DEFAULT_ALLOWANCE]
# The same keys -> seconds at PREFILL_ROWS rows (None: wrong or unusable)
_measured_prefill: Dict[Tuple, Dict[str, Optional[float]]] = {}
# (key, decode kernel, prefill kernel) -> (rows from which the second is faster, 0: not
# PREFILL_GAIN faster after all; how much faster at PREFILL_ROWS, timed in turns)
_crossovers: Dict[Tuple, Tuple[int, float]] = {}
_prefill_allowance: List[Optional[int]] = [DEFAULT_ALLOWANCE]  # of _allowance, what second copies may still take (None: none)

# The rows a prefill pass is timed at: runtime.prefill_chunk's default
# (mdi.runconfig.DEFAULT_PREFILL_CHUNK, which the model layer may not import).
PREFILL_ROWS = 64
# How much faster than the decode kernel at PREFILL_ROWS a second kernel must be, screened and
# then timed in turns with it, to earn its copy. One layer timed alone understates it: with 1.15
# the choice kept fbgemm for SmolLM2's gate_up at most and TTFT stayed within noise (0.99); with
# 1.0 it also took qkv and down, and TTFT fell to 0.83x, as fbgemm on all four did (0.85x;
# results/bench_prefill_kernels_paired.json, AVX2, 1 thread).
PREFILL_GAIN = 1.0
# Of what a node spares when loading begins, the most second copies may take: the layers load
# one after another, and a later one's decode kernel (the head's, the largest) comes first.
PREFILL_SHARE = 0.5


def set_memory_allowance(nbytes: Optional[int]) -> None:
    """The bytes the layers loaded from now on may hold beyond their stored (planned) size, for
    kernels that keep a larger packed form; None: no limit (a process that does not know its
    memory). A node sets it before loading to what runtime.kernel_memory allows within what its
    memory spares beside its plan (`allowance_for`); until then it is DEFAULT_ALLOWANCE (0: no
    layer holds more than its stored weight). Second kernels for prefill passes may take
    PREFILL_SHARE of it, and nothing where it is None."""
    _allowance[0] = allowance = None if nbytes is None else max(0, int(nbytes))
    _prefill_allowance[0] = None if allowance is None else int(allowance * PREFILL_SHARE)


def allowance_for(setting: object, spare: Optional[int]) -> Optional[int]:
    """The allowance a node loads with (`set_memory_allowance`) under runtime.kernel_memory
    `setting`, given what its memory spares beside its plan and prefix cache (`spare`, None:
    unknown): 0 / None (the default): none, every layer holds at most its stored weight; a byte
    count: that, within what the memory spares; "auto": whatever the memory spares (None where
    that is unknown: no limit)."""
    if not setting:
        return 0
    if setting == "auto":
        return None if spare is None else max(0, spare)
    nbytes = int(setting)  # type: ignore[call-overload]
    return nbytes if spare is None else max(0, min(nbytes, spare))


def start_report() -> None:
    """What the layers loaded from now on choose is what `chosen` reports: a node calls it as it
    starts loading a run's layers (a worker that loaded others before reports only these)."""
    _choices.clear()


@contextlib.contextmanager
def unreported() -> Iterator[None]:
    """Layers loaded within choose kernels as any do, but reports keep naming what they named
    before (a profile's random blocks, timed on a worker that holds a run's layers)."""
    kept = {key: dict(tally) for key, tally in _choices.items()}
    try:
        yield
    finally:
        _choices.clear()
        _choices.update(kept)


def memory_allowance() -> Optional[int]:
    return _allowance[0]


def extra_bytes(kernel: Kernel, spec: QuantSpec, n_out: int, n_in: int) -> int:
    """What `kernel` holds beyond the stored weight (0 for kernels that hold it or less)."""
    if kernel.held_bytes is None:
        return 0
    return max(0, kernel.held_bytes(spec, n_out, n_in) - spec.nbytes(n_out, n_in))


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


@dataclass
class Choice:
    """What a layer multiplies with: `kernel` on its `packed` tensors, and where a second kernel
    is faster on many rows, `prefill_kernel` on its own packing for passes of `prefill_from`
    rows or more."""
    kernel: Kernel
    packed: Tensors
    prefill_kernel: Optional[Kernel] = None
    prefill_packed: Optional[Tensors] = None
    prefill_from: int = 0


def choose(tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int, device: torch.device,
           where: str = "", resident: Sequence[torch.Tensor] = ()) -> Tuple[Kernel, Tensors]:
    """The fastest kernel on one row (decode) that computes this weight correctly here and fits
    the memory allowance, with its packed tensors. `resident`: other tensors the process holds
    (the chunk's other weights), read to fill the caches before each timed call (`_time`)."""
    c = choose_kernels(tensors, spec, n_in, device, where, resident, many_rows=False)
    return c.kernel, c.packed


def choose_kernels(tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int, device: torch.device,
                   where: str = "", resident: Sequence[torch.Tensor] = (), many_rows: bool = True,
                   keeps_canonical: bool = False) -> Choice:
    """`choose`'s kernel for decode, and with `many_rows` (a layer that prefill passes reach
    with many rows; not the head, which multiplies each sample's last row) a second kernel for
    passes of many rows when one is measurably faster there and its packing fits what the node
    spares (`_prefill_pick`). `keeps_canonical`: the layer keeps its stored tensors anyway (a
    tied embedding), so the float32 reference costs no copy."""
    n_out = int(tensors["qweight"].shape[0])
    preference = qkernels.preference
    key = (spec, n_out, n_in, device.type, torch.get_num_threads(), preference)
    if key not in _measured:
        _recall(key)
    before = _snapshot(key)
    measured = _measured.setdefault(key, {})
    measured_prefill = _measured_prefill.setdefault(key, {})
    notes = _notes.setdefault(key, {})
    allowance = _allowance[0]
    offered = candidates(spec, n_out, n_in, device)
    fits = [k for k in offered if allowance is None or extra_bytes(k, spec, n_out, n_in) <= allowance]
    named = preference not in POLICIES
    # a named kernel is that kernel everywhere; CUDA keeps its one choice
    prefill_on = many_rows and not named and device.type == "cpu" and len(offered) > 1

    def rank(k: Kernel):  # the named kernel first, else the fastest
        return (k.name != preference) if named else measured[k.name]

    def todo(k: Kernel) -> bool:
        return k.name not in measured or (prefill_on and measured[k.name] is not None and k.name not in measured_prefill)
    kept: Optional[Tuple[Kernel, Optional[Tensors]]] = None  # the best so far, packed while small: one extra copy at most
    if any(todo(k) for k in fits):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1, n_in, generator=generator).to(device)
        rows = torch.randn(PREFILL_ROWS, n_in, generator=generator).to(device) if prefill_on else x
        reference = DEQUANT.run(x, dict(tensors), spec, n_in).float()
        release_freed_memory()  # its dequantized blocks (a head's: tens of MB of holes)
        scale = float(reference.abs().max()) or 1.0
        for kernel in fits:
            if not todo(kernel):
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
            nbytes = spec.nbytes(n_out, n_in)
            if kernel.name not in measured:
                # a named kernel or a lone candidate is taken as it is: nothing to compare it with
                # (UNTIMED: reports say so rather than show a time)
                measured[kernel.name] = UNTIMED if named or len(offered) == 1 else \
                    _time(_timed(kernel, packed, spec, n_in, x), device, nbytes, resident)
            if prefill_on:
                measured_prefill[kernel.name] = _time(_timed(kernel, packed, spec, n_in, rows), device, nbytes, resident)
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
            return choose_kernels(tensors, spec, n_in, device, where, resident, many_rows, keeps_canonical)
    extra = extra_bytes(best, spec, n_out, n_in)
    if allowance is not None:
        _allowance[0] = allowance - extra
    choice = Choice(best, packed)
    why = "policy %s: %s" % (preference, _candidates_report(offered, fits, measured, measured_prefill, notes,
                                                            spec, n_out, n_in))
    if extra:
        why += "; holds %.1f MB beyond the stored weight" % (extra / 2 ** 20)
    if prefill_on:
        # every other candidate timed here, those the allowance kept from decode too: a copy for
        # prefill passes is weighed against what the node spares by _prefill_pick itself
        why += "; " + _prefill_pick(choice, key, tensors, spec, n_in, device, resident,
                                    keeps_canonical or best.needs_canonical, [k for k in offered if k is not best])
    outcome = (best.name, why, choice.prefill_kernel.name if choice.prefill_kernel is not None else "",
               choice.prefill_from)
    tally = _choices.setdefault(key, {})
    tally[outcome] = tally.pop(outcome, 0) + 1  # re-inserted: the latest outcome is last
    if _snapshot(key) != before:
        kernel_memory.remember(key, _snapshot(key))
    log.debug("quantized kernel for %s [%d x %d] %s: %s (%s)", where or "a layer", n_out, n_in, spec.label(),
              best.name, why)
    return choice


UNTIMED = -1.0  # in _measured: a kernel taken without timing (a named one, or the only candidate)


def _snapshot(key: Tuple) -> Dict[str, object]:
    """What is known of `key`'s kernels: the form kernel_memory keeps per machine."""
    return {"decode": dict(_measured.get(key, {})), "prefill": dict(_measured_prefill.get(key, {})),
            "notes": dict(_notes.get(key, {})),
            "crossovers": {"%s|%s" % (d, p): list(v) for (k, d, p), v in _crossovers.items() if k == key}}


def _recall(key: Tuple) -> None:
    """This machine's measurements of `key` from an earlier process (kernel_memory), if any."""
    held = kernel_memory.recall(key)
    if not held:
        return
    try:
        _measured[key] = {str(k): (None if v is None else float(v)) for k, v in held["decode"].items()}
        _measured_prefill[key] = {str(k): (None if v is None else float(v)) for k, v in held["prefill"].items()}
        _notes[key] = {str(k): str(v) for k, v in held["notes"].items()}
        for pair, (rows, gain) in held["crossovers"].items():
            decode, prefill = pair.split("|")
            _crossovers[(key, decode, prefill)] = (int(rows), float(gain))
        if DEQUANT.name in _measured[key] and _measured[key][DEQUANT.name] is None:
            raise ValueError("dequant always runs")  # (a hand edit: nothing left to choose from)
    except (KeyError, TypeError, ValueError, AttributeError):  # a damaged entry: measure again
        for table in (_measured, _measured_prefill, _notes):
            table.pop(key, None)


def _candidates_report(offered: Sequence[Kernel], fits: Sequence[Kernel], measured: Mapping[str, Optional[float]],
                       measured_prefill: Mapping[str, Optional[float]], notes: Mapping[str, str], spec: QuantSpec,
                       n_out: int, n_in: int) -> str:
    """Each candidate's time on one row (and on PREFILL_ROWS), or why it was not taken: what a
    report says of one layer's choice. A named kernel that does not run here says so."""
    named = qkernels.preference not in POLICIES
    report = []
    if named and qkernels.preference not in [k.name for k in offered]:
        report.append("%s %s %s weights" % (qkernels.preference, DOES_NOT_RUN, spec.label()))
    for k in offered:
        if k.name not in measured:
            continue
        t = measured[k.name]
        if t is None:
            report.append("%s %s" % (k.name, notes[k.name]))
        elif t == UNTIMED:
            role = "the only candidate" if not named else "named" if k.name == qkernels.preference else "the fallback"
            report.append("%s (%s; not timed)" % (k.name, role))
        else:
            report.append("%s %s" % (k.name, _times(t, measured_prefill.get(k.name))))
    report += ["%s needs %.1f MB more than the node spares%s" % (k.name, extra_bytes(k, spec, n_out, n_in) / 2 ** 20,
                                                                 _ALLOWANCE_HINT)
               for k in offered if k not in fits]
    return "; ".join(report)


# Said where a kernel was refused its copy: the allowance is the user's (0 unless set).
_ALLOWANCE_HINT = " (runtime.kernel_memory)"


def _times(one_row: float, many_rows: Optional[float]) -> str:
    text = "%.3f ms" % (one_row * 1e3)
    return text if many_rows is None else text + " / %.3f at %d rows" % (many_rows * 1e3, PREFILL_ROWS)


def copy_bytes(kernel: Kernel, spec: QuantSpec, n_out: int, n_in: int, keeps_canonical: bool) -> int:
    """What a second kernel's packing holds beside the decode kernel's: its own packed form (the
    stored size for torch's packed kernels), or the stored tensors for the float32 reference
    unless the layer keeps them anyway."""
    if kernel.needs_canonical:
        return 0 if keeps_canonical else spec.nbytes(n_out, n_in)
    return kernel.held_bytes(spec, n_out, n_in) if kernel.held_bytes is not None else spec.nbytes(n_out, n_in)


def _prefill_pick(choice: Choice, key: Tuple, tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int,
                  device: torch.device, resident: Sequence[torch.Tensor], keeps_canonical: bool,
                  others: Sequence[Kernel]) -> str:
    """Give `choice` a second kernel for prefill passes where one is PREFILL_GAIN faster than the
    decode kernel at PREFILL_ROWS and its copy fits both the allowance and the share second
    copies may take; says what was decided, and why."""
    n_out = int(tensors["qweight"].shape[0])
    times = _measured_prefill.get(key, {})
    own = times.get(choice.kernel.name)
    timed = [(k, t) for k, t in ((k, times.get(k.name)) for k in others)
             if t is not None and _measured[key].get(k.name) not in (None, UNTIMED)]
    if own is None or not timed:
        return "prefill: %s (nothing else to compare at %d rows)" % (choice.kernel.name, PREFILL_ROWS)
    fastest, fastest_time = min(timed, key=lambda kt: kt[1])
    faster = own / fastest_time
    if faster < 1:
        return "prefill: %s too (the fastest at %d rows)" % (choice.kernel.name, PREFILL_ROWS)
    if faster < PREFILL_GAIN:
        return "prefill: %s too (%s only %.2fx faster at %d rows)" % (choice.kernel.name, fastest.name, faster,
                                                                      PREFILL_ROWS)
    nbytes = copy_bytes(fastest, spec, n_out, n_in, keeps_canonical)
    room = [r for r in (_allowance[0], _prefill_allowance[0]) if r is not None]
    if not room:  # a copy only buys speed: taken only where the memory is known to spare it
        return "prefill: %s (%s would be %.2fx faster at %d rows but this process does not know what its " \
               "memory spares for a copy)" % (choice.kernel.name, fastest.name, faster, PREFILL_ROWS)
    if nbytes > min(room):
        return "prefill: %s (%s would be %.2fx faster at %d rows but its copy needs %.1f MB more than the node " \
               "spares)" % (choice.kernel.name, fastest.name, faster, PREFILL_ROWS, nbytes / 2 ** 20) + _ALLOWANCE_HINT
    pair = (key, choice.kernel.name, fastest.name)
    if pair in _crossovers and not _crossovers[pair][0]:  # another layer of this shape found the lead not to hold
        return _not_held(choice, fastest, faster, _crossovers[pair][1])
    try:
        packed = dict(tensors) if fastest is DEQUANT else fastest.pack(tensors, spec, n_in)
    except RuntimeError as e:
        return "prefill: %s (%s refused this layer: %s)" % (choice.kernel.name, fastest.name, str(e).splitlines()[0][:80])
    release_freed_memory()
    if pair not in _crossovers:
        _crossovers[pair] = _crossover(choice, fastest, packed, spec, n_out, n_in, device, resident)
    rows, paired = _crossovers[pair]
    if not rows:
        return _not_held(choice, fastest, faster, paired)
    for budget in (_allowance, _prefill_allowance):
        if budget[0] is not None:
            budget[0] -= nbytes
    choice.prefill_kernel, choice.prefill_packed, choice.prefill_from = fastest, packed, rows
    return "prefill: %s from %d rows (%.2fx faster at %d rows, %.2fx timed in turns; its copy holds %.1f MB)" % (
        fastest.name, rows, faster, PREFILL_ROWS, paired, nbytes / 2 ** 20)


def _not_held(choice: Choice, fastest: Kernel, faster: float, paired: float) -> str:
    return "prefill: %s (%s was %.2fx faster at %d rows, %.2fx timed in turns: not %.2fx)" % (
        choice.kernel.name, fastest.name, faster, PREFILL_ROWS, paired, PREFILL_GAIN)


PAIRED_TIMINGS = 3  # alternate timings of two kernels, each the least of its own


def _crossover(decode: Choice, prefill: Kernel, prefill_packed: Tensors, spec: QuantSpec, n_out: int, n_in: int,
               device: torch.device, resident: Sequence[torch.Tensor]) -> Tuple[int, float]:
    """The fewest rows, a power of two up to PREFILL_ROWS, from which `prefill` is faster than
    the decode kernel (0 where it is not PREFILL_GAIN faster at PREFILL_ROWS after all), and how
    much faster it is there. Timed
    in turns (another process's burst then slows both), first at PREFILL_ROWS, then bisected
    between one row (the decode kernel's, as measured) and PREFILL_ROWS."""
    nbytes = spec.nbytes(n_out, n_in)
    generator = torch.Generator().manual_seed(1)

    def times(rows: int) -> Tuple[float, float]:
        x = torch.randn(rows, n_in, generator=generator).to(device)
        calls = (_timed(decode.kernel, decode.packed, spec, n_in, x), _timed(prefill, prefill_packed, spec, n_in, x))
        best = [float("inf"), float("inf")]
        for _ in range(PAIRED_TIMINGS):
            for i, fn in enumerate(calls):
                best[i] = min(best[i], _time(fn, device, nbytes, resident))
        return best[0], best[1]
    t_decode, t_prefill = times(PREFILL_ROWS)
    paired = t_decode / t_prefill
    if paired < PREFILL_GAIN:
        return 0, paired
    slower, faster = 0, PREFILL_ROWS.bit_length() - 1  # exponents of two: decode wins at 2**slower, prefill at 2**faster
    while faster - slower > 1:
        middle = (slower + faster) // 2
        t_decode, t_prefill = times(2 ** middle)
        slower, faster = (slower, middle) if t_prefill < t_decode else (middle, faster)
    return 2 ** faster, paired


KEEP_PACKED_BYTES = 16 * 2 ** 20  # a larger best-so-far packing is dropped before the next candidate is packed


def _packed_bytes(kernel: Kernel, packed: Tensors, spec: QuantSpec, n_out: int, n_in: int) -> int:
    """What a packing holds: its tensors, and what an engine's packed weight holds (its own count)."""
    opaque = kernel.held_bytes(spec, n_out, n_in) if kernel.held_bytes is not None else 0
    return sum(_nbytes(t) if isinstance(t, torch.Tensor) else opaque for t in packed.values())


def chosen() -> List[Dict[str, str]]:
    """What the layers loaded since start_report() chose, and why, at this process's current
    thread count and policy, for reports (the run summary, /status, the metrics record): one
    entry per weight shape and outcome, the latest first within a shape, e.g. {"weight":
    "int4/g32 576x1536", "device": "cpu", "kernel": "int4pack-cpu", "why": "policy fast:
    dequant 1.598 ms; int4pack-cpu 0.144 ms; int8dyn-fbgemm 0.191 ms", "matrices": "30"}; with a
    second kernel for prefill passes also "prefill_kernel" and "prefill_from_rows"."""
    out = []
    for k, tally in _choices.items():
        if k[4] != torch.get_num_threads() or k[5] != qkernels.preference:
            continue
        for (name, why, prefill, rows), n in reversed(list(tally.items())):
            entry = {"weight": "%s %dx%d" % (k[0].label(), k[1], k[2]), "device": k[3], "kernel": name, "why": why,
                     "matrices": str(n)}
            if prefill:
                entry["prefill_kernel"], entry["prefill_from_rows"] = prefill, str(rows)
            out.append(entry)
    return out


def chosen_by_weight() -> Dict[str, str]:
    """`chosen()` as text per weight shape: "int4/g32 576x1536" -> "int4pack-cpu: policy fast:
    ...; on 30 matrices", whose why has "; prefill: int8dyn-fbgemm from 16 rows (...)" where a
    second kernel runs prefill passes. Where layers of one shape chose differently (the memory a
    node spares ran out partway), the shape's earlier outcomes follow as "int4/g32 576x1536 #2"..."""
    out: Dict[str, str] = {}
    for e in chosen():
        key, i = e["weight"], 1
        while key in out:
            i += 1
            key = "%s #%d" % (e["weight"], i)
        n = int(e["matrices"])
        out[key] = "%s: %s; on %d matri%s" % (e["kernel"], e["why"], n, "x" if n == 1 else "ces")
    return out
