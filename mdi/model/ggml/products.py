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
DEQUANT_NODES = 4  # what dequantized() adds to a graph: an index, its cast, the rows and a cast


class DequantScratch:
    """Where a chunk's dequantized slices live while a pass multiplies them: one float32 and one
    `type_id` copy of its largest slice, shared by every product of every graph of the chunk.
    In a graph's own buffer each cached prefill graph held a slice's copies (SmolLM2: 5 MB a
    graph, 65 MB a ring node serving 3 prompts; a 7B shape: up to 48 MB a graph); a graph
    computes its products one after another (GraphBuilder._product adds each in turn), so one
    copy serves them all."""

    def __init__(self, matrices: List[Any], type_id: int) -> None:
        gg = lib.require()
        most = max(_slice_rows(w) * int(w.contents.ne[0]) for w in matrices)
        self._ctx = lib.Context(2)
        self.f32 = gg.ggml_new_tensor_1d(self._ctx.ptr, lib.F32, most)
        self.floats = gg.ggml_new_tensor_1d(self._ctx.ptr, type_id, most) if type_id != lib.F32 else None
        self._ctx.allocate("a dequantizing scratch of %d values" % most)

    def place(self, gg: Any, t: Any, region: Any) -> Any:
        """Tensor t (an op's result) computed into `region`'s memory: the graph's allocator
        leaves a tensor that has memory alone."""
        if gg.ggml_backend_tensor_alloc(self._ctx.buffer, t, region.contents.data) != 0:
            raise MemoryError("ggml could not place a dequantized slice in its scratch")
        return t

    def free(self) -> None:
        self._ctx.free()


def dequantized(gg: Any, ctx: Any, w: Any, type_id: int, scratch: Optional[DequantScratch] = None) -> Any:
    """The quantized matrix w dequantized to float type `type_id` in the graph (into `scratch`
    where given, else the graph's buffer). ggml dequantizes to float32 only (float16 and
    bfloat16 are a second cast from there), and does it by taking all of w's rows (get_rows: a
    row per call of the type's dequantizer) rather than by casting w (a call per 32-value
    block, each locating its block anew): the same values, and at 64 rows the dequantized
    product cost 5.6 ms against 7.8 through the cast (SmolLM2's first 2 MB of Q4_1 matrices,
    1 Zen 5 core; ggml's own quantized product 11.4)."""
    rows = gg.ggml_cast(ctx, gg.ggml_arange(ctx, 0.0, float(w.contents.ne[1]), 1.0), lib.I32)
    y = gg.ggml_get_rows(ctx, w, rows)
    if scratch is not None:
        scratch.place(gg, y, scratch.f32)
    if type_id == lib.F32:
        return y
    y = gg.ggml_cast(ctx, y, type_id)
    return scratch.place(gg, y, scratch.floats) if scratch is not None else y


def _slice_rows(w: Any) -> int:
    """Output rows of w that one slice dequantizes: DEQUANT_SLICE_BYTES of float32 at most."""
    k, out = int(w.contents.ne[0]), int(w.contents.ne[1])
    return max(1, min(out, DEQUANT_SLICE_BYTES // (4 * k)))


def dequant_slice_count(w: Any) -> int:
    return -(-int(w.contents.ne[1]) // _slice_rows(w))


def multiply_runs(gg: Any, ctx: Any, w: Any, x: Any, runs: List[Tuple[int, int, bool]], type_id: int,
                  scratch: Optional[DequantScratch] = None) -> Any:
    """w times x, whose rows come in runs (first row, rows, dequantized): a dequantized run
    multiplies w dequantized to `type_id` (in `scratch` where given), the others w as stored;
    the runs' products joined in row order, so a run's bits are those it would get in a pass of
    its own. A matrix over DEQUANT_SLICE_BYTES of float32 is dequantized a slice of output rows
    at a time, each slice's product taken before the next slice is dequantized (into the same
    scratch), for each dequantized run. Joined with concat, never written into a tensor made
    for them: a graph's allocator holds a tensor no op computes for the whole graph (an op's
    result it frees after its last use), which kept ~1.2 MB a SmolLM2 layer in a 64-row pass."""
    k, out = int(w.contents.ne[0]), int(w.contents.ne[1])
    per = _slice_rows(w)
    if len(runs) == 1 and per == out:
        return gg.ggml_mul_mat(ctx, dequantized(gg, ctx, w, type_id, scratch) if runs[0][2] else w, x)
    if not gg.ggml_is_contiguous(x):
        x = gg.ggml_cont(ctx, x)
    stride = x.contents.nb[1]
    whole = None  # w dequantized once for every run that takes it, where one slice holds it
    products = []
    for first, rows, wide in runs:
        part = x if len(runs) == 1 else gg.ggml_view_2d(ctx, x, x.contents.ne[0], rows, stride, first * stride)
        if not wide:
            products.append(gg.ggml_mul_mat(ctx, w, part))
        elif per == out:
            whole = whole if whole is not None else dequantized(gg, ctx, w, type_id, scratch)
            products.append(gg.ggml_mul_mat(ctx, whole, part))
        else:
            products.append(_joined(gg, ctx, [gg.ggml_mul_mat(ctx, dequantized(gg, ctx, gg.ggml_view_2d(
                ctx, w, k, min(per, out - o), w.contents.nb[1], o * w.contents.nb[1]), type_id, scratch), part)
                for o in range(0, out, per)], 0))
    return _joined(gg, ctx, products, 1)


def _joined(gg: Any, ctx: Any, parts: List[Any], dim: int) -> Any:
    """`parts` joined along `dim` in order (each join after the parts before it: the graph
    computes them in that order)."""
    y = parts[0]
    for p in parts[1:]:
        y = gg.ggml_concat(ctx, y, p, dim)
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
