"""The pass sizes at which a weight is multiplied row by row: where n one-row products cost
less than one product of n rows.

ggml's CPU backend multiplies a one-row pass with its dot-product kernel, which streams the
weight once, and passes of 2+ rows of some types with llamafile's tiled kernel. On an AMD EPYC
(AVX-512, 1 thread), over weights that do not fit the core's L2 cache (60 SmolLM2 q
projections, as a pass meets them), one product of 2 rows cost 5.2 one-row products in Q8_0
and 3.2 in F16, while 2 one-row products cost 2.1 and 1.8; Q4_0's tiled kernel won (1.7 for 2
rows) and Q4_1, which has none, cost 2.1 either way. SmolLM2's Q8_0 head, 49152 rows: 4.5
one-row products for 2 rows, 5.7 for 4. Passes of a few rows are what batched decoding and
speculation's verifications send, so which way wins is measured at load, per weight shape and
type, on up to PROBE_TENSORS of the chunk's own matrices in a row (as a pass reads them: past
the caches), at every size from 2 rows to MAX_SPLIT_ROWS: the tiled kernel's tiles hold 4 rows,
and a pass of 5 to 7 (a tile and a remainder) cost that head 5.6-6.7 one-row products where 4
cost 3.6.

Only weights whose rows compute the same bits in passes of any size (min_rows: one row) are
split, so splitting never changes a result; repacked ones are left alone (they round per group
of 4 rows). What was measured is remembered per machine (mdi.system.machine_cache: a second node
or a second start measures nothing; the starter's first took about a second for SmolLM2).
"""
import logging
import time
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

import numpy as np

from mdi.model.ggml import lib
from mdi.model.ggml.graph import Built, multiply
from mdi.system.machine_cache import MachineCache, digest, machine_key

log = logging.getLogger(__name__)

MAX_SPLIT_ROWS = 8  # passes of more rows always take the one product (tiles fill; prefill)
PROBE_TENSORS = 4  # matrices of one shape multiplied in a row when timing: past a core's L2 cache, as in a pass
ROUNDS = 3  # interleaved timing rounds; each way's least disturbed one counts (others only add time)
MIN_TIMED_S = 0.002  # a timing repeats a small product until it lasts this long (a clock tick is not noise-free)
MARGIN = 0.85  # row by row must be this much cheaper: a tie (Q4_1's kernels) keeps the one product

CACHE = MachineCache("ggml_rows.json", 1)  # entries: machine digest -> key text -> pass sizes split
LOCK_WAIT_S = 60.0  # another node's merge takes milliseconds

# (type, k, out rows, tensors probed, threads) -> pass sizes multiplied row by row
_measured: Dict[Tuple[int, int, int, int, int], FrozenSet[int]] = {}


def split_sizes(cpu: lib.CpuBackend, weights: Dict[str, Any], names: Iterable[str]) -> Dict[str, FrozenSet[int]]:
    """For each of `names` (matrices whose rows compute the same bits in a pass of any size,
    none of them repacked): the pass sizes at which it is multiplied row by row (may be
    empty). Tensors of one type and shape share one measurement."""
    groups: Dict[Tuple[int, int, int], List[str]] = {}
    for name in names:
        c = weights[name].contents
        groups.setdefault((int(c.type), int(c.ne[0]), int(c.ne[1])), []).append(name)
    out: Dict[str, FrozenSet[int]] = {}
    for (kind, k, rows), members in groups.items():
        probe = [weights[n] for n in members[:PROBE_TENSORS]]
        key = (kind, k, rows, len(probe), cpu.threads)
        sizes = _measured.get(key)
        if sizes is None:
            sizes = _recall(key)
        if sizes is None:
            sizes = _measure(cpu, probe, k)
            _remember(key, sizes)
            if sizes:
                log.info("ggml: %s matrices %dx%d are multiplied row by row in passes of %s rows (measured faster "
                         "than one product)", lib.TYPE_NAMES.get(kind, kind), k, rows, ",".join(map(str, sorted(sizes))))
        _measured[key] = sizes
        for name in members:
            out[name] = sizes
    return out


def _key_text(key: Tuple[int, int, int, int, int]) -> str:
    return "%s|%d|%d|%d|%d" % ((lib.TYPE_NAMES.get(key[0], str(key[0])),) + key[1:])


def _recall(key: Tuple[int, int, int, int, int]) -> Optional[FrozenSet[int]]:
    sizes = CACHE.read().get(digest(machine_key()), {}).get(_key_text(key))
    if not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes):
        return None  # never measured here (or a hand-edited file: measured again)
    return frozenset(sizes)


def _remember(key: Tuple[int, int, int, int, int], sizes: FrozenSet[int]) -> None:
    try:
        with CACHE.locked(LOCK_WAIT_S):
            machines = CACHE.read()
            machines.setdefault(digest(machine_key()), {})[_key_text(key)] = sorted(sizes)
            CACHE.write(machines)
    except RuntimeError as e:  # measured again next time
        log.warning("mdi: ggml row-split measurements not remembered: %s", e)


def _measure(cpu: lib.CpuBackend, probe: List[Any], k: int) -> FrozenSet[int]:
    split = set()
    rng = np.random.default_rng(0)
    for n in range(2, MAX_SPLIT_ROWS + 1):
        ways = {False: _products(probe, k, n, False), True: _products(probe, k, n, True)}
        try:
            x = rng.standard_normal((n, k)).astype(np.float32)
            for b in ways.values():
                lib.set_data(b.inputs["x"], x)
            cpu.compute(ways[False].graph)  # warm, and a first guess of the time
            t0 = time.process_time()
            cpu.compute(ways[False].graph)
            repeats = max(1, int(MIN_TIMED_S / max(time.process_time() - t0, 1e-6)))
            best = {way: float("inf") for way in ways}
            for _ in range(ROUNDS):
                for way, b in ways.items():
                    t0 = time.process_time()
                    for _ in range(repeats):
                        cpu.compute(b.graph)
                    best[way] = min(best[way], time.process_time() - t0)
        finally:
            for b in ways.values():
                b.free()
        if best[True] < MARGIN * best[False]:
            split.add(n)
    return frozenset(split)


def _products(probe: List[Any], k: int, n: int, by_row: bool) -> Built:
    """A graph multiplying n rows by every matrix of `probe`, as one product each or row by row."""
    gg = lib.require()
    b = Built(len(probe) * (3 * n + 2) + 8)
    ctx = b.ctx.ptr
    x = gg.ggml_new_tensor_2d(ctx, lib.F32, k, n)
    gg.ggml_set_input(x)
    b.inputs["x"] = x
    total = None
    for w in probe:
        y = multiply(gg, ctx, w, x, n, by_row)
        s = gg.ggml_sum(ctx, y)  # every product feeds the output: none is left out of the graph
        total = s if total is None else gg.ggml_add(ctx, total, s)
    b.finish(total)
    return b
