"""ggml compute graphs of a chunk's blocks, its embedding and its head, built once per pass
shape and reused: only their inputs change from step to step.

A pass's shape is the samples it carries, each as (cache slot, rows, attended length): the
linear layers run over every row of the pass at once, and each sample attends with its own
flash-attention op against a plain view of its own cache slot, exactly the op it would run
alone, so a sample's rows compute the same bits whatever else shares its pass. The attended
length is padded to a bucket (ATTEND_BUCKET positions, as llama.cpp pads its KV view), and the
mask hides the positions past each row, so a graph serves every step until a sample's context
crosses a bucket. The inputs of a graph are the pass's rows, their positions, the cache rows
their keys and values are written to (`ggml_set_rows`), and each sample's mask. A linear layer
multiplies a pass's rows in one product, or row by row at the pass sizes where that was
measured cheaper (mdi.model.ggml.row_split: the same bits either way).

The block follows the family table (mdi.model.families) and the op order of llama.cpp's graphs
for the same family, so a GGUF computes as llama.cpp computes it.
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from mdi.model.config import ModelConfig
from mdi.model.families import Family, family_of
from mdi.model.ggml import adapters as lora_ops
from mdi.model.ggml import lib
from mdi.model.ggml.built import Built
from mdi.model.ggml.kv_cache import GgmlKVCache
from mdi.model.ggml.kernel_rows import KV_PAD as ATTEND_BUCKET  # attended positions: padded as llama.cpp's KV view
from mdi.model.ggml.products import (DEQUANT_NODES, DequantScratch, dequant_slice_count, multiply, multiply_runs,
                                     split_nodes)

# Nodes a block's graph holds: about 40 per layer, and 10 more per sample that attends in it
# (its own view of q, of its cache slot, its flash attention, its rows back in place), with room.
NODES_PER_LAYER, NODES_PER_SAMPLE, NODES_MORE = 48, 12, 64
LINEARS_PER_BLOCK = 7  # q, k, v, output, gate, up, down: each may be multiplied row by row
NEG_INF = np.float16(-np.inf)


# Named tuples, not dataclasses: a pass's shape keys its graph in a dict every step, and a
# tuple hashes in C where a frozen dataclass runs Python code per field (decode's Python time
# per token is what separates it from llama.cpp's on a small model).
class SampleShape(NamedTuple):
    slot: int
    rows: int
    attend: int  # positions of the slot attended (a multiple of ATTEND_BUCKET, at most the cache length)


class PassShape(NamedTuple):
    samples: Tuple[SampleShape, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.samples)


def attend_bucket(end: int, max_len: int) -> int:
    """Positions to attend for a sample whose last row is at position end - 1."""
    return min(max_len, -(-end // ATTEND_BUCKET) * ATTEND_BUCKET)


def ring_attend(s: "SampleShape", cache: GgmlKVCache) -> int:
    """Rows of its slot's ring a sample attends in a sliding-window layer that keeps a ring:
    those its positions reached (every row, once they went round)."""
    return min(s.attend, cache.ring) if cache.ring else s.attend


@dataclass
class ModelTraits:
    """The per-model numbers a graph needs beyond the family table (from the config and the
    GGUF: its RoPE layout is the file's, not the family's)."""
    config: ModelConfig
    family: Family
    rope_mode: int  # lib.ROPE_NORMAL for llama.cpp's permuted llama q/k, lib.ROPE_NEOX otherwise
    context: int  # the model's trained context (RoPE's n_ctx_orig)

    @classmethod
    def of(cls, config: ModelConfig, rope_mode: int) -> "ModelTraits":
        return cls(config, family_of(config.family), rope_mode, config.block_size)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends within a sliding window (Gemma 3: all but every Nth)."""
        return self.config.layer_window(layer) > 0

    def rope_base(self, layer: int) -> float:
        c = self.config
        return c.rope_local_theta if self.is_local(layer) and c.rope_local_theta else c.rope_theta

    @property
    def attn_scale(self) -> float:
        c = self.config
        return c.query_scale


class GraphBuilder:
    """Builds the graphs of one chunk: its blocks over a pass, its embedding, its head."""

    def __init__(self, traits: ModelTraits, layers: Sequence[int], weights: Dict[str, Any],
                 buffer_type: Optional[int] = None, on_cpu: bool = True) -> None:
        self.gg = lib.require()
        self.buffer_type = buffer_type  # where the graphs' intermediates live: the chunk's device (None: the CPU)
        self.on_cpu = on_cpu  # whether ggml's CPU kernels compute the graphs (_attention_views)
        self.t = traits
        self.layers = list(layers)
        self.w = weights  # GGUF name -> tensor
        # GGUF name -> pass sizes at which it is multiplied row by row (mdi.model.ggml.row_split)
        self.split: Dict[str, FrozenSet[int]] = {}
        # runtime.prefill_weights dequantized: the rule (mdi.model.ggml.dequant_rows) and the
        # block matrices it applies to (None / empty: every product as stored)
        self.dequant: Any = None  # a DequantRule (its module builds on this one)
        self.dequant_names: FrozenSet[str] = frozenset()
        self.dequant_scratch: Optional[DequantScratch] = None  # where their dequantized slices live
        self._runs: Optional[List[Tuple[int, int, bool]]] = None  # the pass being built: its rows' runs
        self._lora: Optional[lora_ops.LoraOps] = None  # the adapter ops of the blocks graph being built
        self._graph: Any = None  # the blocks graph being built (its order: see _product)

    def set_dequant(self, rule: Any, names: Sequence[str]) -> None:
        """Dequantize the matrices `names` by `rule` in the blocks graphs built from now on
        (None: none), their slices in one scratch (the graphs built before must be gone)."""
        if self.dequant_scratch is not None:
            self.dequant_scratch.free()
        self.dequant, self.dequant_names, self.dequant_scratch = rule, frozenset(), None
        if rule is not None:
            self.dequant_scratch = DequantScratch([self.w[n] for n in names], rule.type_id)
            self.dequant_names = frozenset(names)

    # --- small pieces ------------------------------------------------------------------
    def _input(self, b: Built, name: str, type_id: int, *ne: int) -> Any:
        gg = self.gg
        fn = (gg.ggml_new_tensor_1d, gg.ggml_new_tensor_2d, gg.ggml_new_tensor_3d)[len(ne) - 1]
        t = fn(b.ctx.ptr, type_id, *ne)
        gg.ggml_set_name(t, name.encode())
        gg.ggml_set_input(t)
        b.inputs[name] = t
        return t

    def _norm(self, ctx: Any, x: Any, weight: str, eps: float) -> Any:
        gg, w = self.gg, self.w
        if self.t.family.norm == "layer":
            y = gg.ggml_norm(ctx, x, eps)
        else:
            y = gg.ggml_rms_norm(ctx, x, eps)
        y = gg.ggml_mul(ctx, y, w[weight + ".weight"])
        bias = w.get(weight + ".bias")
        return gg.ggml_add(ctx, y, bias) if bias is not None else y

    def _product(self, ctx: Any, name: str, x: Any) -> Any:
        rows = int(x.contents.ne[1])
        if self._runs is not None and name in self.dequant_names:
            # The graph computes its ops in the order they were added, and a dequantized matrix
            # depends on no activation: added where the output is, every layer's would be
            # computed first, all at once (10 SmolLM2 layers: 92 MB in the graph's buffer) or
            # over each other in the node's one scratch (products.DequantScratch). Its input,
            # then it and its product, go in here: each matrix is used before the next is made.
            gg, w = self.gg, self.w[name]
            gg.ggml_build_forward_expand(self._graph, x)
            y = multiply_runs(gg, ctx, w, x, self._runs, self.dequant.type_id, self.dequant_scratch)
            gg.ggml_build_forward_expand(self._graph, y)
            return y
        return multiply(self.gg, ctx, self.w[name], x, rows, rows in self.split.get(name, ()))

    def _dequant_runs(self, shape: PassShape) -> Optional[List[Tuple[int, int, bool]]]:
        """The pass's rows as runs (first row, rows, dequantized): a sample brings its rows
        dequantized where it brings at least the rule's rows, each such sample a run of its own
        (the float kernels' sums may depend on a product's rows); the others share runs (the
        quantized product rounds a row alike in a pass of any size). None where none does."""
        rule = self.dequant
        if rule is None or not any(s.rows >= rule.min_rows for s in shape.samples):
            return None
        runs: List[Tuple[int, int, bool]] = []
        first = 0
        for s in shape.samples:
            wide = s.rows >= rule.min_rows
            if runs and not wide and not runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1] + s.rows, wide)
            else:
                runs.append((first, s.rows, wide))
            first += s.rows
        return runs

    def _dequant_nodes(self, runs: Optional[List[Tuple[int, int, bool]]]) -> int:
        """Graph nodes dequantized products add per block: per run and slice a view, its
        dequantizing, a product and a join; per run a view, a product and a join."""
        if runs is None:
            return 0
        slices = max(dequant_slice_count(self.w[n]) for n in self.dequant_names)
        return LINEARS_PER_BLOCK * (len(runs) * (slices * (DEQUANT_NODES + 3) + 3) + 2)

    def _split_nodes(self, rows: int) -> int:
        """Graph nodes that multiplying row by row adds per block at a pass of `rows` rows."""
        return LINEARS_PER_BLOCK * split_nodes(rows) if any(rows in sizes for sizes in self.split.values()) else 0

    def _linear(self, ctx: Any, x: Any, name: str) -> Any:
        gg, w = self.gg, self.w
        y = self._product(ctx, name + ".weight", x)
        bias = w.get(name + ".bias")
        y = gg.ggml_add(ctx, y, bias) if bias is not None else y
        return self._lora.add(ctx, x, y, name) if self._lora is not None else y

    # --- the blocks ----------------------------------------------------------------------
    def blocks(self, shape: PassShape, cache: GgmlKVCache, lora: Optional[lora_ops.LoraShape] = None,
               held: Optional[Dict[int, Any]] = None, embedded: bool = False, head_rows: int = 0) -> Built:
        """The blocks over a pass; `lora` (with the chunk's `held` adapters): the adapters its
        samples name (mdi.model.ggml.adapters). `embedded`: the pass's token ids come in ("ids")
        and the chunk's embedding computes its rows in the same graph (a starter's pass: one
        graph and one copy fewer per step), else its rows ("x"). `head_rows` > 0: the head too,
        over that many of the blocks' output rows ("head_rows": their indices), so the graph's
        output is their logits (a one-node ring's decode step: one graph a token)."""
        gg, t = self.gg, self.t
        c = t.config
        E, R = c.n_embd, shape.rows
        more = len(self.layers) * (lora_ops.NODES_PER_LAYER + lora_ops.NODES_PER_GROUP * len(lora.groups)) if lora else 0
        runs = self._dequant_runs(shape)
        per_layer = NODES_PER_LAYER + NODES_PER_SAMPLE * len(shape.samples) + self._split_nodes(R) + \
            self._dequant_nodes(runs)
        head = NODES_MORE + self._split_nodes(head_rows) if head_rows else 0
        b = Built(len(self.layers) * per_layer + NODES_MORE + more + head, self.buffer_type)
        pos = self._input(b, "pos", lib.I32, R)
        x = self._embed(b, self._input(b, "ids", lib.I32, R), pos) if embedded else self._input(b, "x", lib.F32, E, R)
        # an input no op reads gets no buffer, and setting it aborts: each only where a layer writes by it
        rings = [cache.is_ring(li) for li in range(len(self.layers))]
        kv_rows = self._input(b, "kv_rows", lib.I64, R) if not all(rings) else None
        ring_rows = self._input(b, "kv_rows_ring", lib.I64, R) if any(rings) else None
        if lora is not None:
            widest = max((c.n_head + 2 * c.kv_heads) * c.head_dim, c.ffn_width, E)
            b.lora = lora_ops.LoraOps(gg, lambda name, kind, n: self._input(b, name, kind, n), lora, held or {}, widest)
            b.lora.inputs(R)
        self._lora, self._runs, self._graph = b.lora, runs, b.graph
        try:
            x = self._blocks(b, x, shape, cache, pos, (kv_rows, ring_rows))
        finally:
            self._lora, self._runs, self._graph = None, None, None
        if head_rows:
            x = self._head(b.ctx.ptr, gg.ggml_get_rows(b.ctx.ptr, x, self._input(b, "head_rows", lib.I32, head_rows)))
        b.finish(x)
        return b

    def _blocks(self, b: Built, x: Any, shape: PassShape, cache: GgmlKVCache, pos: Any,
                kv_rows: Tuple[Optional[Any], Optional[Any]]) -> Any:
        """The blocks' ops over rows `x`: their output rows (`kv_rows`: the cache rows they are
        written to, in full-length layers and in rings)."""
        t = self.t
        ctx = b.ctx.ptr
        # Only the masks some layer reads: an input no op reads gets no buffer (Gemma 3's
        # chunk of sliding-window layers alone has no use for the full mask).
        local = any(t.is_local(i) for i in self.layers)
        any_global = not all(t.is_local(i) for i in self.layers)
        masks: List[Tuple[Optional[Any], Optional[Any]]] = []
        for i, s in enumerate(shape.samples):
            rows = self.query_rows(s)
            full = self._input(b, "mask_%d" % i, lib.F16, s.attend, rows) if any_global else None
            win = self._input(b, "mask_local_%d" % i, lib.F16, ring_attend(s, cache), rows) if local else None
            masks.append((full, win))
        for li, layer in enumerate(self.layers):
            x = self._block(ctx, b, x, layer, li, shape, cache, pos, kv_rows, masks)
        return x

    def _lone_row_layout(self, s: SampleShape) -> Optional[str]:
        """How sample `s`'s heads are laid out where it is one row on a CPU (_attention_views):
        "groups" (its KV heads in ggml's fourth dimension), "rows" (one KV head: its heads as
        rows of one head), or None (as in any pass)."""
        c = self.t.config
        if s.rows != 1 or not self.on_cpu:
            return None
        if c.kv_heads > 1:
            return "groups"
        return "rows" if 1 < c.n_head < 64 else None

    def query_rows(self, s: SampleShape) -> int:
        """Query rows sample `s` attends with, so its mask's rows: its own, or one per head
        where its heads attend as rows."""
        return self.t.config.n_head if self._lone_row_layout(s) == "rows" else s.rows

    def _attention_views(self, ctx: Any, q: Any, kc: Any, vc: Any, s: SampleShape, q_offset: int, offset: int,
                         row_d: int, row_bytes: int) -> Tuple[Any, Any, Any]:
        """Sample `s`'s queries and its slot's keys and values as flash attention reads them:
        [D, rows, H, 1] against [D, attend, KV, 1], except a one-row sample's on a CPU. ggml's
        CPU kernel splits the positions of a query of one row in one group (from 512) across
        the node's threads and merges their partial sums, so a decode step's bits would depend
        on the thread count and the attended span, and part from the same row in a pass of
        several rows (a verification, a prompt's short tail): up to 0.6 in SmolLM2's logits and
        2.3 in Gemma 3's at 2 threads. So such a row's heads go in ggml's fourth dimension, as
        KV groups ([D, 1, H/KV, KV] against [D, attend, 1, KV]), or with one KV head, whose keys
        every head shares, they attend as H rows of one head ([D, H, 1, 1]; query_rows). Then
        every row attends in the kernel that takes each (row, head) whole on one thread: the
        same bits at any thread count, span and pass size, and at one thread the split
        kernel's (one chunk, merged with nothing: llama.cpp's). A one-head model keeps the split."""
        gg = self.gg
        D, H, KV = self.t.config.head_dim, self.t.config.n_head, self.t.config.kv_heads
        qnb = q.contents.nb
        layout = self._lone_row_layout(s)
        if layout == "groups":
            per = H // KV  # query heads per KV head, one after another (llama.cpp's GQA order)
            qs = gg.ggml_view_4d(ctx, q, D, 1, per, KV, qnb[2], qnb[1], qnb[1] * per, q_offset)
            ks = gg.ggml_view_4d(ctx, kc, D, s.attend, 1, KV, row_bytes, row_bytes * s.attend, row_d, offset)
            vs = gg.ggml_view_4d(ctx, vc, D, s.attend, 1, KV, row_bytes, row_bytes * s.attend, row_d, offset)
            return qs, ks, vs
        if layout == "rows":
            qs = gg.ggml_view_3d(ctx, q, D, H, 1, qnb[1], qnb[2], q_offset)  # [D, H(as rows), 1 head]
        else:
            qs = gg.ggml_permute(ctx, gg.ggml_view_3d(ctx, q, D, H, s.rows, qnb[1], qnb[2], q_offset), 0, 2, 1, 3)
        ks = gg.ggml_permute(ctx, gg.ggml_view_3d(ctx, kc, D, KV, s.attend, row_d, row_bytes, offset), 0, 2, 1, 3)
        vs = gg.ggml_permute(ctx, gg.ggml_view_3d(ctx, vc, D, KV, s.attend, row_d, row_bytes, offset), 0, 2, 1, 3)
        return qs, ks, vs

    def _block(self, ctx: Any, b: Built, x: Any, layer: int, li: int, shape: PassShape, cache: GgmlKVCache,
               pos: Any, kv_rows: Tuple[Optional[Any], Optional[Any]],
               masks: List[Tuple[Optional[Any], Optional[Any]]]) -> Any:
        gg, t, w = self.gg, self.t, self.w
        c, fam = t.config, t.family
        H, KV, D = c.n_head, c.kv_heads, c.head_dim
        R = shape.rows
        p = "blk.%d." % layer
        h = self._norm(ctx, x, p + "attn_norm", c.norm_eps)
        if (p + "attn_qkv.weight") in w:  # GPT-2's fused q, k, v
            qkv = self._linear(ctx, h, p + "attn_qkv")
            row = gg.ggml_row_size(lib.F32, D)
            q = gg.ggml_view_3d(ctx, qkv, D, H, R, row, qkv.contents.nb[1], 0)
            k = gg.ggml_view_3d(ctx, qkv, D, KV, R, row, qkv.contents.nb[1], row * H)
            v = gg.ggml_view_3d(ctx, qkv, D, KV, R, row, qkv.contents.nb[1], row * (H + KV))
            q, k, v = gg.ggml_cont(ctx, q), gg.ggml_cont(ctx, k), gg.ggml_cont(ctx, v)
        else:
            q = gg.ggml_reshape_3d(ctx, self._linear(ctx, h, p + "attn_q"), D, H, R)
            k = gg.ggml_reshape_3d(ctx, self._linear(ctx, h, p + "attn_k"), D, KV, R)
            v = gg.ggml_reshape_3d(ctx, self._linear(ctx, h, p + "attn_v"), D, KV, R)
        if fam.positions == "rope":
            if (p + "attn_q_norm.weight") in w:  # Qwen3 and Gemma 3: before RoPE
                q = gg.ggml_mul(ctx, gg.ggml_rms_norm(ctx, q, c.norm_eps), w[p + "attn_q_norm.weight"])
                k = gg.ggml_mul(ctx, gg.ggml_rms_norm(ctx, k, c.norm_eps), w[p + "attn_k_norm.weight"])
            factors = w.get("rope_freqs.weight")
            base = t.rope_base(layer)
            q = gg.ggml_rope_ext(ctx, q, pos, factors, D, t.rope_mode, t.context, base, 1.0, 0.0, 1.0, 32.0, 1.0)
            k = gg.ggml_rope_ext(ctx, k, pos, factors, D, t.rope_mode, t.context, base, 1.0, 0.0, 1.0, 32.0, 1.0)
        kq_scale = t.attn_scale
        if fam.scale_queries:  # q scaled itself, then attention with a scale of one (llama.cpp's Gemma order)
            q = gg.ggml_scale(ctx, q, kq_scale)
            kq_scale = 1.0
        # keys and values of these rows into their cache rows, before any sample attends
        kc, vc = cache.k[li], cache.v[li]
        ring = cache.is_ring(li)
        rows_at = kv_rows[1] if ring else kv_rows[0]
        gg.ggml_build_forward_expand(b.graph, gg.ggml_set_rows(ctx, kc, gg.ggml_reshape_2d(ctx, k, KV * D, R), rows_at))
        gg.ggml_build_forward_expand(b.graph, gg.ggml_set_rows(ctx, vc, gg.ggml_reshape_2d(ctx, v, KV * D, R), rows_at))
        local = t.is_local(layer)
        row_d = gg.ggml_row_size(cache.type_id, D)
        outs = []
        first = 0
        for (full, win), s in zip(masks, shape.samples):
            if ring:  # the slot's ring: its rows, whichever positions they hold (the mask says)
                s = s._replace(attend=ring_attend(s, cache))
            offset = s.slot * cache.lengths[li] * cache.row_bytes
            qs, ks, vs = self._attention_views(ctx, q, kc, vc, s, first * q.contents.nb[2], offset, row_d, cache.row_bytes)
            o = gg.ggml_flash_attn_ext(ctx, qs, ks, vs, win if local else full, kq_scale, 0.0, 0.0)
            gg.ggml_flash_attn_ext_set_prec(o, lib.PREC_F32)
            outs.append(gg.ggml_reshape_2d(ctx, o, D * H, s.rows))
            first += s.rows
        a = outs[0]
        for o in outs[1:]:
            a = gg.ggml_concat(ctx, a, o, 1)
        a = self._linear(ctx, a, p + "attn_output")
        if fam.post_norms:
            a = self._norm(ctx, a, p + "post_attention_norm", c.norm_eps)
        x = gg.ggml_add(ctx, a, x)
        h = self._norm(ctx, x, p + "ffn_norm", c.norm_eps)
        if fam.mlp == "gelu":
            m = self._linear(ctx, h, p + "ffn_up")
            m = gg.ggml_gelu(ctx, m) if c.gelu_approximate == "tanh" else gg.ggml_gelu_erf(ctx, m)
        else:
            up = self._linear(ctx, h, p + "ffn_up")
            gate = self._linear(ctx, h, p + "ffn_gate")
            m = gg.ggml_swiglu_split(ctx, gate, up) if fam.mlp == "swiglu" else gg.ggml_geglu_split(ctx, gate, up)
        m = self._linear(ctx, m, p + "ffn_down")
        if fam.post_norms:
            m = self._norm(ctx, m, p + "post_ffw_norm", c.norm_eps)
        return gg.ggml_add(ctx, m, x)

    # --- the ends ------------------------------------------------------------------------
    def embedding(self, rows: int, positions: bool = True) -> Built:
        """Token ids [rows] (and their positions, for learned position embeddings, unless not
        `positions`) -> [E, rows]."""
        b = Built(NODES_MORE, self.buffer_type)
        ids = self._input(b, "ids", lib.I32, rows)
        learned = self.t.family.positions == "learned" and positions
        b.finish(self._embed(b, ids, self._input(b, "pos", lib.I32, rows) if learned else None))
        return b

    def _embed(self, b: Built, ids: Any, pos: Optional[Any]) -> Any:
        """The rows of token `ids` (scaled where the family does), plus the learned position
        embeddings of `pos` where the family has them (None: not added here)."""
        gg, t = self.gg, self.t
        ctx = b.ctx.ptr
        x = gg.ggml_get_rows(ctx, self.w["token_embd.weight"], ids)
        if t.family.embed_scale:
            x = gg.ggml_scale(ctx, x, math.sqrt(t.config.n_embd))
        if t.family.positions == "learned" and pos is not None:
            x = self._add_positions(b, x, pos)
        return x

    def _add_positions(self, b: Built, x: Any, pos: Any) -> Any:
        return self.gg.ggml_add(b.ctx.ptr, x, self.gg.ggml_get_rows(b.ctx.ptr, self.w["position_embd.weight"], pos))

    def positions(self, rows: int) -> Built:
        """Embeddings [E, rows] plus their learned position embeddings (a soft prompt's rows)."""
        b = Built(NODES_MORE, self.buffer_type)
        x = self._input(b, "x", lib.F32, self.t.config.n_embd, rows)
        x = self._add_positions(b, x, self._input(b, "pos", lib.I32, rows))
        b.finish(x)
        return b

    def head(self, rows: int) -> Built:
        """Final norm and LM head: [E, rows] -> logits [vocab, rows]."""
        t = self.t
        b = Built(NODES_MORE + self._split_nodes(rows), self.buffer_type)
        b.finish(self._head(b.ctx.ptr, self._input(b, "x", lib.F32, t.config.n_embd, rows)))
        return b

    def _head(self, ctx: Any, x: Any) -> Any:
        return self._product(ctx, head_name(self.w), self._norm(ctx, x, "output_norm", self.t.config.norm_eps))


def head_name(weights: Dict[str, Any]) -> str:
    """The head's matrix: its own, or the token embedding (a tied head)."""
    return "output.weight" if "output.weight" in weights else "token_embd.weight"


def fill_masks(b: Built, shape: PassShape, row_positions: Sequence[Any], traits: ModelTraits,
               ring_cells: Optional[Sequence[np.ndarray]] = None) -> None:
    """Each sample's masks: a row (at its position in `row_positions`) sees positions <= its
    own, and, in a sliding-window layer, only the last `sliding_window` of them. `ring_cells`:
    where those layers keep a ring, the position each row of each sample's ring holds."""
    window = traits.config.sliding_window or 0
    for i, (s, positions) in enumerate(zip(shape.samples, row_positions)):
        for name, windowed in (("mask_%d" % i, False), ("mask_local_%d" % i, True)):
            if name not in b.inputs:
                continue
            ring = windowed and ring_cells is not None
            if len(positions) == 1 and not ring:  # one row, at p: it sees [0, p], or (p - window, p]
                b.fill_band(name, int(positions[0]) - window + 1 if windowed else 0, int(positions[0]) + 1, NEG_INF)
                continue
            rows = np.asarray(positions)[:, None]
            width = int(b.inputs[name].contents.ne[0])
            cols = (ring_cells[i][:width] if ring else np.arange(width))[None, :]  # type: ignore[index]
            seen = (cols <= rows) & (cols >= 0)
            mask = np.where(seen & (rows - cols < window) if windowed else seen, np.float16(0), NEG_INF)
            query_rows = int(b.inputs[name].contents.ne[1])
            if query_rows != s.rows:  # a one-row sample's heads attending as rows: its row for each
                mask = np.broadcast_to(mask, (query_rows, width))
            b.set(name, mask)  # float16 already: no copy to convert

