"""How a matrix multiplies a pass's rows in a graph: as one product of the weights as stored,
row by row (mdi.model.ggml.row_split), or, for the runs of rows runtime.prefill_weights
dequantizes (mdi.model.ggml.dequant_rows), by the weights dequantized in the graph, in slices of
bounded size; and the graph of products a measurement times."""
from typing import Any, List, Optional, Tuple

import numpy as np

from mdi.model.ggml import lib
from mdi.model.ggml.built import Built


def split_nodes(rows: int) -> int:
    """Graph objects one product multiplied row by row takes: per row a view, a product and a
    copy into place, and the result they are copied into."""
    return 3 * rows + 1


def multiply(gg: Any, ctx: Any, w: Any, x: Any, rows: int, by_row: bool) -> Any:
    """w times the `rows` rows of x: one product, or one per row written into place in one
    result (each row's product lives only until it is copied: joining them pairwise kept every
    partial join too, 7 MB against 4 for a 3-row head of a 262k vocabulary)."""
    if not by_row or rows < 2:
        return gg.ggml_mul_mat(ctx, w, x)
    if not gg.ggml_is_contiguous(x):
        x = gg.ggml_cont(ctx, x)
    stride = x.contents.nb[1]
    y = gg.ggml_new_tensor_2d(ctx, lib.F32, w.contents.ne[1], rows)
    out_stride = y.contents.nb[1]
    for r in range(rows):
        part = gg.ggml_mul_mat(ctx, w, gg.ggml_view_2d(ctx, x, x.contents.ne[0], 1, stride, r * stride))
        y = gg.ggml_set_2d_inplace(ctx, y, part, out_stride, r * out_stride)
    return y


DEQUANT_SLICE_BYTES = 32 << 20  # a matrix is dequantized in slices of output rows of at most this many float32 bytes


DEQUANT_NODES = 5  # what dequantized() adds to a graph: an index, its cast, the rows, a cast, and a view before


def dequantized(gg: Any, ctx: Any, w: Any, type_id: int) -> Any:
    """The quantized matrix w dequantized to float type `type_id` in the graph. ggml dequantizes
    to float32 only (float16 and bfloat16 are a second cast from there), and does it by taking
    all of w's rows (get_rows: a row per call of the type's dequantizer) rather than by casting
    w (a call per 32-value block, each locating its block anew): the same values, and at 64 rows
    the dequantized product cost 5.6 ms against 7.8 through the cast (SmolLM2's first 2 MB of
    Q4_1 matrices, 1 Zen 5 core; ggml's own quantized product 11.4)."""
    rows = gg.ggml_cast(ctx, gg.ggml_arange(ctx, 0.0, float(w.contents.ne[1]), 1.0), lib.I32)
    y = gg.ggml_get_rows(ctx, w, rows)
    return y if type_id == lib.F32 else gg.ggml_cast(ctx, y, type_id)


def dequant_slices(gg: Any, ctx: Any, w: Any, type_id: int) -> List[Tuple[int, Any]]:
    """w dequantized as (first output row, slice) pairs of at most DEQUANT_SLICE_BYTES of float32
    each: a graph holds one slice's float copy at a time, not the whole matrix's."""
    k, out = int(w.contents.ne[0]), int(w.contents.ne[1])
    per = max(1, min(out, DEQUANT_SLICE_BYTES // (4 * k)))
    return [(o, dequantized(gg, ctx, gg.ggml_view_2d(ctx, w, k, min(per, out - o), w.contents.nb[1], o * w.contents.nb[1]),
                            type_id)) for o in range(0, out, per)]


def dequant_slice_count(w: Any) -> int:
    k, out = int(w.contents.ne[0]), int(w.contents.ne[1])
    return -(-out // max(1, min(out, DEQUANT_SLICE_BYTES // (4 * k))))


def multiply_slices(gg: Any, ctx: Any, slices: List[Tuple[int, Any]], x: Any, out_rows: int) -> Any:
    """The product of the whole matrix `slices` came from with x's rows: [out_rows, x's rows]."""
    if len(slices) == 1:
        return gg.ggml_mul_mat(ctx, slices[0][1], x)
    y = gg.ggml_new_tensor_2d(ctx, lib.F32, out_rows, x.contents.ne[1])
    for first, w in slices:
        y = gg.ggml_set_2d_inplace(ctx, y, gg.ggml_mul_mat(ctx, w, x), y.contents.nb[1], first * 4)
    return y


def multiply_runs(gg: Any, ctx: Any, w: Any, x: Any, runs: List[Tuple[int, int, bool]],
                  slices: List[Tuple[int, Any]]) -> Any:
    """w times x, whose rows come in runs (first row, rows, dequantized): a dequantized run
    multiplies `slices` (w dequantized), the others w as stored; each run's product is written
    into place, so a run's bits are those it would get in a pass of its own."""
    if len(runs) == 1:
        return multiply_slices(gg, ctx, slices, x, int(w.contents.ne[1])) if runs[0][2] else gg.ggml_mul_mat(ctx, w, x)
    if not gg.ggml_is_contiguous(x):
        x = gg.ggml_cont(ctx, x)
    stride = x.contents.nb[1]
    y = gg.ggml_new_tensor_2d(ctx, lib.F32, w.contents.ne[1], x.contents.ne[1])
    for first, rows, wide in runs:
        part = gg.ggml_view_2d(ctx, x, x.contents.ne[0], rows, stride, first * stride)
        part = multiply_slices(gg, ctx, slices, part, int(w.contents.ne[1])) if wide else gg.ggml_mul_mat(ctx, w, part)
        y = gg.ggml_set_2d_inplace(ctx, y, part, y.contents.nb[1], first * y.contents.nb[1])
    return y


def products_graph(matrices: List[Any], rows: int, product: Any, nodes_each: int,
                   buffer_type: Optional[int], rng: np.random.Generator) -> Built:
    """A graph multiplying `rows` rows (an input per row length, "x<k>", filled with normal
    values from `rng`) by each of `matrices` in turn, `product(gg, ctx, w, x)` each (taking up to
    `nodes_each` nodes), every product summed into the output so none is left out: what a
    measurement times."""
    gg = lib.require()
    b = Built(len(matrices) * (nodes_each + 2) + 8, buffer_type)  # and a sum and an add each
    ctx = b.ctx.ptr
    total = None
    for w in matrices:
        k = int(w.contents.ne[0])
        x = b.inputs.get("x%d" % k)
        if x is None:
            x = gg.ggml_new_tensor_2d(ctx, lib.F32, k, rows)
            gg.ggml_set_input(x)
            b.inputs["x%d" % k] = x
        s = gg.ggml_sum(ctx, product(gg, ctx, w, x))
        total = s if total is None else gg.ggml_add(ctx, total, s)
    b.finish(total)
    for x in b.inputs.values():
        lib.set_data(x, rng.standard_normal((rows, int(x.contents.ne[0]))).astype(np.float32))
    return b
