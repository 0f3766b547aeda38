"""The fewest rows a pass needs for its rows to round as they would in a pass of any size.

ggml's CPU matrix product multiplies a one-row pass with its dot-product kernel and passes of
2+ rows (4+ on NEON) of some weight types (F32, F16, BF16, IQ4_NL on x86) with llamafile's
tiled kernel, whose sums run in another order: a sample's logits then depend on how many rows
shared its pass, and greedy ids part at a near tie between batched and unbatched runs. Which
types and sizes do so depends on the CPU and the build, so it is measured, not listed: each
weight type (at each row length) the chunk multiplies is run over 1..PROBE_ROWS rows of its own
first output rows, and the fewest rows from which every row's result stops changing is what a
pass is padded to (the last row repeated, its result dropped). Matrices ggml re-lays for its
repacked kernels are left out: those round differently per group of 4 rows, which no minimum
fixes (the README's "Determinism", `runtime.repack`).
"""
import logging
from typing import Any, Dict, Iterable, Tuple

import numpy as np

from mdi.model.ggml import lib
from mdi.model.ggml.built import Built

log = logging.getLogger(__name__)

PROBE_ROWS = 8  # pass sizes measured: 1..8 (every kernel switch ggml has sits at 4 rows or fewer)
PROBE_OUT = 16  # output rows of the weight used (a multiple of 4, as llamafile's tiles need)

_measured: Dict[Tuple[int, int, int, int, str], int] = {}  # (type, k, out rows, threads, device) -> fewest rows


def fewest_rows(backend: lib.ComputeBackend, weights: Dict[str, Any], names: Iterable[str]) -> int:
    """The fewest rows a pass multiplying the tensors `names` (none of them repacked) must
    carry so that each row computes the same bits in a pass of any size (1: no padding)."""
    most = 1
    for name in names:
        w = weights[name]
        key = (int(w.contents.type), int(w.contents.ne[0]), min(PROBE_OUT, int(w.contents.ne[1])), backend.threads,
               backend.device)
        if key not in _measured:
            _measured[key] = _measure(backend, w, key[2])
            if _measured[key] > 1:
                log.debug("ggml: %s matrices (rows of %d) round the same from %d rows per pass: shorter passes are "
                          "padded", lib.TYPE_NAMES.get(key[0], key[0]), key[1], _measured[key])
        most = max(most, _measured[key])
    return most


def _measure(backend: lib.ComputeBackend, w: Any, out_rows: int) -> int:
    k = int(w.contents.ne[0])
    x = np.random.default_rng(0).standard_normal((PROBE_ROWS, k)).astype(np.float32)
    results = [_product(backend, w, out_rows, x[:n]) for n in range(1, PROBE_ROWS + 1)]
    full = results[-1]
    for fewest in range(1, PROBE_ROWS + 1):
        if all(np.array_equal(r, full[:len(r)]) for r in results[fewest - 1:]):
            return fewest
    return 1  # pragma: no cover  (the last size always agrees with itself)


def _product(backend: lib.ComputeBackend, w: Any, out_rows: int, x: np.ndarray) -> np.ndarray:
    """w's first `out_rows` output rows times x's rows, as the bits of the result."""
    gg = lib.require()
    n, k = x.shape
    b = Built(8, backend.buffer_type)
    try:
        ctx = b.ctx.ptr
        part = gg.ggml_view_2d(ctx, w, k, out_rows, w.contents.nb[1], 0)
        xin = gg.ggml_new_tensor_2d(ctx, lib.F32, k, n)
        gg.ggml_set_input(xin)
        y = gg.ggml_mul_mat(ctx, part, xin)
        b.finish(y)
        lib.set_data(xin, x)
        backend.compute(b.graph)
        return lib.get_data(y, np.empty((n, out_rows), dtype=np.float32)).view(np.uint32)
    finally:
        b.free()
