"""Where a prompt's rows multiply dequantized weights (`runtime.prefill_weights: dequantized`):
the float type and the fewest rows at which that is measured faster than ggml's quantized
product on this CPU.

ggml multiplies a quantized matrix by rounding each activation row to 8-bit blocks and taking
integer dot products, one weight row against one activation row: on one core of an AMD EPYC
(Zen 5, AVX-512 BF16) a Q4_1 pass of 512 rows of SmolLM2's ffn_up shape ran at ~35 GFLOPS. The
same matrix dequantized inside the graph (its rows taken as float32, then cast to bfloat16) and
multiplied by ggml's tiled float kernels ran at ~160 GFLOPS, dequantizing included; at 8 rows
the dequantizing alone cost 4x the quantized product. So long passes (a prompt's chunks) win
and short ones (decode, verification) lose, and where the two cross depends on the CPU, its
threads and the type: it is measured, not listed. Which float type: bfloat16 where the CPU
multiplies it natively, else float16 or float32, whichever ran fastest.

A sample's rows take this way only when it brings at least `min_rows` rows to a pass (the rule
is the sample's own, so other samples in the pass never change its bits). Its rows round
otherwise than the quantized product's (bfloat16 weights and activations against 8-bit
activations), enough to change a small 4-bit model's greedy text often. `dequantized` starts
at the fewest rows measured faster, so a prompt's ids may depend on how it is chunked and on
what the prefix cache held; `auto` (the default, on a node whose backend auto chose) starts at
TILED_ROWS exactly, as the starter's prompt cuts do, so they do not (the README's
"Determinism"); its text then differs from llama.cpp's, whose products are the quantized ones,
so a node asked for ggml by name keeps those. Measured once per machine, type shapes and
threads (mdi.system.machine_cache).
"""
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from mdi.model.backend import PREFILL_WEIGHTS
from mdi.model.ggml import lib
from mdi.model.ggml.built import Built
from mdi.model.ggml.kernel_rows import TILED_ROWS
from mdi.model.ggml.products import DEQUANT_NODES, dequantized, products_graph
from mdi.system.machine_cache import MachineCache, digest

log = logging.getLogger(__name__)

TYPE_ROWS = 256  # the pass size the float types race at (larger passes win by more: the dequantizing is per pass)
PROBE_ROWS = (16, 32, 64, 128)  # smaller sizes timed against the quantized product, down to the first that loses
PROBE_BYTES = 2 << 20  # block matrices timed, in layer order, up to this many bytes of weights (a layer or two)
FLOAT_TYPES = ("BF16", "F16", "F32")
MARGIN = 0.8  # dequantized must be this much cheaper: a near tie keeps the exact product
ROUNDS = 4  # interleaved timing rounds; each way's least disturbed one counts
# Wall time, not CPU time: with 2+ threads ggml's pool spins at each op's barrier, and the
# dequantizing adds ops (Gemma 3 at 2 threads: 0.83x the quantized product's wall time, 1.2x its
# CPU time). Each way's least disturbed round is what counts against other tenants' work.

CACHE = MachineCache("ggml_dequant.json", 3)  # machine digest -> probe key -> [type name, min rows] or []

_measured: Dict[str, Optional["DequantRule"]] = {}


@dataclass(frozen=True)
class DequantRule:
    """A sample bringing `min_rows` rows or more to a pass multiplies them by weights dequantized
    to `type_id` in the graph."""
    type_id: int
    min_rows: int

    def describe(self) -> str:
        return "%s from %d rows" % (lib.TYPE_NAMES.get(self.type_id, self.type_id), self.min_rows)


def dequantizable(w: Any) -> bool:
    """A quantized matrix ggml can dequantize in a graph (not F32/F16/BF16, not repacked: the
    caller leaves those out)."""
    return lib.TYPE_NAMES.get(int(w.contents.type), "F32") not in ("F32", "F16", "BF16")


def rule_for(mode: str, backend: lib.ComputeBackend, weights: Dict[str, Any], names: List[str]) -> Optional[DequantRule]:
    """The rule runtime.prefill_weights `mode` gives a chunk computing with `backend` whose
    dequantizable matrices are `names`: None for "quantized", on a GPU (ggml-cuda multiplies a
    long pass its own way), or where nothing measured faster."""
    if mode not in PREFILL_WEIGHTS:
        raise ValueError("prefill_weights must be one of %s, got %r" % (", ".join(PREFILL_WEIGHTS), mode))
    if mode == "quantized" or not backend.on_cpu or not names:
        return None
    rule = measure_rule(backend, weights, names)
    if mode == "dequantized" or rule is None:
        return rule
    # auto: from TILED_ROWS rows exactly, where ggml's attention changes kernel too. The
    # starter's cuts give every row of a tiled ubatch a pass of TILED_ROWS rows or more and no
    # other row one (mdi.starter.prompt_passes), so which product a row takes follows from its
    # window alone, never from its chunking or the prefix cache. Where only longer passes win,
    # nothing is dequantized.
    return DequantRule(rule.type_id, TILED_ROWS) if rule.min_rows <= TILED_ROWS else None


def rule_text(rule: Optional[DequantRule], mode: str, quantized: bool = True) -> str:
    """What runtime.prefill_weights `mode` does on a node with `rule`, in words (`quantized`:
    whether the node has quantized matrices to dequantize at all)."""
    if rule is not None:
        return "dequantized to " + rule.describe()
    if mode == "quantized":
        return "quantized"
    if mode == "auto" and quantized:
        return "quantized (auto: dequantized measured no faster here from %d rows)" % TILED_ROWS
    return "quantized (dequantized measured no faster here)" if quantized else "as stored (no quantized matrices)"


def measure_rule(backend: lib.ComputeBackend, weights: Dict[str, Any], names: List[str]) -> Optional[DequantRule]:
    """The rule for the block matrices `names` (quantized, none repacked), or None where no
    probed pass size multiplies faster dequantized (nothing changes then)."""
    key = probe_key(backend, weights, names)
    if key is None:
        return None
    if key not in _measured:
        rule = CACHE.recall_or_measure(lambda: _recall(key), lambda: _timed(backend, weights, names, key))
        _measured[key] = rule or None
    return _measured[key]


def _timed(backend: lib.ComputeBackend, weights: Dict[str, Any], names: List[str], key: str) -> Optional[DequantRule]:
    """The rule for `names` measured here, said and kept for the machine."""
    log.info("ggml: timing %d matrices quantized and dequantized for prefill passes (once per machine)", len(names))
    t0 = time.perf_counter()
    rule = _measure(backend, lib.leading_tensors(weights, names, PROBE_BYTES))
    remember(key, rule)
    # the measurement, not what the node does: runtime.prefill_weights decides that (rule_for)
    log.info("ggml: prefill weights measured %s (in %.1f s)", "faster dequantized to " + rule.describe()
             if rule is not None else "no faster dequantized", time.perf_counter() - t0)
    return rule


def probe_key(backend: lib.ComputeBackend, weights: Dict[str, Any], names: List[str]) -> Optional[str]:
    """What a measurement over `names` is remembered by: the probed matrices' types and shapes,
    and the threads (None: nothing to probe)."""
    probe = lib.leading_tensors(weights, names, PROBE_BYTES)
    if not probe:
        return None
    return digest({"shapes": ["%d:%d:%d" % (int(w.contents.type), int(w.contents.ne[0]), int(w.contents.ne[1]))
                              for w in probe], "threads": backend.threads})


def _recall(key: str) -> Any:
    """The remembered rule; False where it was measured that none wins; None: never measured."""
    got = CACHE.recall(key)
    if got == []:
        return False
    if isinstance(got, list) and len(got) == 2 and isinstance(got[0], str) and got[0] in lib.TYPE_IDS and \
            isinstance(got[1], int):  # anything else (a hand edit) is measured again, never a traceback
        return DequantRule(lib.TYPE_IDS[got[0]], got[1])
    return None


def remember(key: str, rule: Optional[DequantRule]) -> None:
    try:
        CACHE.remember(key, [lib.TYPE_NAMES[rule.type_id], rule.min_rows] if rule else [])
    except RuntimeError as e:  # measured again next time
        log.warning("mdi: ggml prefill-weight measurements not remembered: %s", e)


def _measure(backend: lib.ComputeBackend, probe: List[Any]) -> Optional[DequantRule]:
    raced = _race(backend, probe, TYPE_ROWS, [lib.TYPE_IDS[name] for name in FLOAT_TYPES])
    exact = raced.pop(None)
    if not raced or min(raced.values()) > MARGIN * exact:
        return None
    type_id = min(raced, key=lambda t: raced[t])
    # the fewest rows from which every larger size probed wins
    min_rows = TYPE_ROWS
    for rows in sorted((n for n in PROBE_ROWS if n < TYPE_ROWS), reverse=True):
        times = _race(backend, probe, rows, [type_id])
        if times.get(type_id, float("inf")) > MARGIN * times[None]:
            break
        min_rows = rows
    return DequantRule(type_id, min_rows)


def _race(backend: lib.ComputeBackend, probe: List[Any], rows: int, type_ids: List[int]) -> Dict[Any, float]:
    """Seconds of a pass of `rows` rows through every matrix of the probe, quantized (key None)
    and dequantized to each of `type_ids` (left out where this build cannot dequantize to it):
    each way's least disturbed of ROUNDS interleaved rounds."""
    ways: Dict[Any, Built] = {}
    try:
        rng = np.random.default_rng(0)
        ways[None] = _products(probe, rows, None, backend.buffer_type, rng)
        for type_id in type_ids:
            try:
                ways[type_id] = _products(probe, rows, type_id, backend.buffer_type, rng)
            except (RuntimeError, MemoryError) as e:
                log.debug("ggml: dequantizing to %s not measured: %s", lib.TYPE_NAMES.get(type_id), e)
        best = {way: float("inf") for way in ways}
        for _ in range(ROUNDS + 1):  # the first round warms
            for way, b in ways.items():
                t0 = time.perf_counter()
                backend.compute(b.graph)
                best[way] = min(best[way], time.perf_counter() - t0)
        return best
    finally:
        for b in ways.values():
            b.free()


def _products(probe: List[Any], rows: int, type_id: Optional[int], buffer_type: Optional[int],
              rng: np.random.Generator) -> Built:
    """A graph multiplying `rows` rows by every matrix of the probe, quantized (type_id None) or
    dequantized to type_id."""
    def product(gg: Any, ctx: Any, w: Any, x: Any) -> Any:
        return gg.ggml_mul_mat(ctx, w if type_id is None else dequantized(gg, ctx, w, type_id), x)
    return products_graph(probe, rows, product, DEQUANT_NODES + 1, buffer_type, rng)
