"""The pass sizes at which a node's weights are multiplied row by row: where n one-row
products cost less than one product of n rows.

ggml's CPU backend multiplies a one-row pass with its dot-product kernel, which streams each
weight once, and passes of 2+ rows of some types with llamafile's tiled kernel. On an AMD EPYC
(AVX-512, 1 thread), over weights streamed from memory (60 matrices of SmolLM2's ffn_up shape,
56 MB in Q8_0), one product of 2 rows cost 5.2 one-row products in Q8_0 and 3.2 in F16, while 2
one-row products cost 2.1 and 1.8; Q4_0's tiled kernel won (1.7 for 2 rows) and Q4_1, which has
none, cost 2.1 either way. One such Q8_0 matrix held in the caches (0.9 MB) multiplied 2 rows
for 1.2 one-row products: which way wins depends on where the weights are, so it is measured as
a pass meets them: each group (a node's block matrices, in layer order up to
PROBE_BYTES, and its head) multiplied in one graph both ways, at every size from 2 rows to
MAX_SPLIT_ROWS (the tiled kernel's tiles hold 4 rows, and SmolLM2's Q8_0 head cost 5.6-6.7
one-row products at 5-7 rows where 4 cost 3.6). Passes of a few rows are what batched decoding
and speculation's verifications send.

Only weights whose rows compute the same bits in passes of any size (min_rows: one row) are
split, so splitting never changes a result; repacked ones are left alone (they round per group
of 4 rows). What was measured is remembered per machine (mdi.system.machine_cache): a second
node or a second start measures nothing.
"""
import logging
import time
from typing import Any, Dict, FrozenSet, Iterable, List, Optional

import numpy as np

from mdi.model.ggml import lib
from mdi.model.ggml.built import Built
from mdi.model.ggml.products import multiply, products_graph, split_nodes
from mdi.system.machine_cache import MachineCache, digest

log = logging.getLogger(__name__)

MAX_SPLIT_ROWS = 8  # passes of more rows always take the one product (tiles fill; prefill)
PROBE_BYTES = 64 << 20  # a group's matrices timed, in layer order, up to this many bytes: past a board's caches
ROUNDS = 2  # interleaved timing rounds; each way's least disturbed one counts (others only add time)
MIN_TIMED_S = 0.002  # a timing repeats a small product until it lasts this long (a clock tick is not noise-free)
MARGIN = 0.85  # row by row must be this much cheaper: a tie (Q4_1's kernels) keeps the one product

CACHE = MachineCache("ggml_rows.json", 2)  # entries: machine digest -> group key -> pass sizes split

_measured: Dict[str, FrozenSet[int]] = {}  # group key -> pass sizes multiplied row by row


def split_sizes(backend: lib.ComputeBackend, weights: Dict[str, Any],
                groups: Iterable[List[str]]) -> Dict[str, FrozenSet[int]]:
    """For each matrix of `groups` (lists of names of matrices whose rows compute the same bits in
    a pass of any size, none of them repacked; each group one part of a pass, e.g. the blocks'
    matrices and the head): the pass sizes at which it is multiplied row by row (may be empty).
    A group's matrices share one measurement."""
    out: Dict[str, FrozenSet[int]] = {}
    for names in groups:
        if not names:
            continue
        probe = lib.leading_tensors(weights, names, PROBE_BYTES)
        key = _group_key(probe, backend.threads)
        sizes = _measured.get(key)
        if sizes is None:
            sizes = CACHE.recall_or_measure(lambda: _recall(key), lambda: _timed(backend, probe, key, len(names)))
        _measured[key] = sizes
        for name in names:
            out[name] = sizes
    return out


def _timed(backend: lib.ComputeBackend, probe: List[Any], key: str, n: int) -> FrozenSet[int]:
    """The `n` matrices' split sizes measured here (on `probe`), said and kept for the machine."""
    log.info("ggml: timing %d matrices (%s) row by row and whole for passes of 2-%d rows (once per machine)",
             n, _types(probe), MAX_SPLIT_ROWS)
    sizes = _measure(backend, probe)
    _remember(key, sizes)
    if sizes:
        log.info("ggml: %d matrices (%s) are multiplied row by row in passes of %s rows (measured faster than "
                 "one product)", n, _types(probe), ",".join(map(str, sorted(sizes))))
    return sizes


def _type_name(w: Any) -> str:
    kind = int(w.contents.type)
    return lib.TYPE_NAMES.get(kind, str(kind))


def _types(probe: List[Any]) -> str:
    return "/".join(sorted({_type_name(w) for w in probe}))


def _group_key(probe: List[Any], threads: int) -> str:
    """The group's matrices as type:k:out, in order, and the threads: what the timing depends on."""
    shapes = ["%s:%d:%d" % (_type_name(w), int(w.contents.ne[0]), int(w.contents.ne[1])) for w in probe]
    return digest({"shapes": shapes, "threads": threads})


def _recall(key: str) -> Optional[FrozenSet[int]]:
    sizes = CACHE.recall(key)
    if not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes):
        return None  # never measured here (or a hand-edited file: measured again)
    return frozenset(sizes)


def _remember(key: str, sizes: FrozenSet[int]) -> None:
    try:
        CACHE.remember(key, sorted(sizes))
    except RuntimeError as e:  # measured again next time
        log.warning("mdi: ggml row-split measurements not remembered: %s", e)


def _measure(backend: lib.ComputeBackend, probe: List[Any]) -> FrozenSet[int]:
    split = set()
    rng = np.random.default_rng(0)
    for n in range(2, MAX_SPLIT_ROWS + 1):
        ways = {by_row: _products(probe, n, by_row, backend.buffer_type, rng) for by_row in (False, True)}
        try:
            backend.compute(ways[False].graph)  # warm, and a first guess of the time
            t0 = time.process_time()
            backend.compute(ways[False].graph)
            repeats = max(1, int(MIN_TIMED_S / max(time.process_time() - t0, 1e-6)))
            best = {way: float("inf") for way in ways}
            for _ in range(ROUNDS):
                for way, b in ways.items():
                    t0 = time.process_time()
                    for _ in range(repeats):
                        backend.compute(b.graph)
                    best[way] = min(best[way], time.process_time() - t0)
        finally:
            for b in ways.values():
                b.free()
        if best[True] < MARGIN * best[False]:
            split.add(n)
    return frozenset(split)


def _products(probe: List[Any], n: int, by_row: bool, buffer_type: Optional[int],
              rng: np.random.Generator) -> Built:
    """A graph multiplying n rows by every matrix of `probe` in turn, as one product each or row by row."""
    return products_graph(probe, n, lambda gg, ctx, w, x: multiply(gg, ctx, w, x, n, by_row), split_nodes(n),
                          buffer_type, rng)
