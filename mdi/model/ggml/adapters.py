"""LoRA adapters on the ggml backend: each adapter's A / B pairs as ggml tensors in its own
buffer, and the graph ops that add them to the rows of the samples that name them.

An adapter arrives as the torch chunk takes it (mdi.model.adapters.lora): per mdi linear layer
("blocks.3.attn.qkv") a pair (A [r, in], B [out, r]) with the scale folded into B, mixes already
stacked (A's rows) and scaled (B's columns). The GGUF keeps some of mdi's fused layers apart
(attn_q / attn_k / attn_v, ffn_gate / ffn_up), so B's rows are cut the same way, q and k
permuted where the file's RoPE layout is llama.cpp's (mdi.model.files.gguf_export's Part), and the
columns of B a part leaves zero (another part's rank) are dropped with their rows of A: each
GGUF matrix W gets its own pair and its own y = W x + B (A x), llama.cpp's build_lora_mm.

In a pass, each adapter some sample names is one group: its samples' rows are gathered
(`ggml_get_rows`), multiplied by A then B, and the deltas of all groups (zeros for the rows of
the base model, and for a group whose adapter leaves this matrix alone) are put back in row
order by one more gather and added. A group's rows are padded to the fewest that multiply the
same bits in a pass of any size (mdi.model.ggml.min_rows), as a pass's rows are: a sample's rows
then compute the same bits whatever else shares its pass.
"""
import ctypes
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from mdi.model.config import ModelConfig
from mdi.model.ggml import lib

Pairs = Dict[str, Tuple[np.ndarray, np.ndarray]]  # GGUF matrix ("blk.3.attn_q") -> (A [r, in], B [out, r])


def _floats(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return np.asarray(t, dtype=np.float32)
    return t.detach().to("cpu").float().numpy()


def _rope_order(n: int, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its RoPE layout (gguf_parts.permutation, in numpy)."""
    return np.arange(n).reshape(heads, 2, n // heads // 2).transpose(0, 2, 1).reshape(n)


def _spans(config: ModelConfig, layer_name: str, prefix: str, tensors: Mapping[str, Any],
           permuted: bool) -> Optional[List[Tuple[str, int, int, int]]]:
    """The GGUF matrices an mdi linear layer is made of: (name, first row, end row, RoPE heads)."""
    H, KV, D, I = config.n_head, config.kv_heads, config.head_dim, config.ffn_width
    if layer_name == "attn.qkv":
        if prefix + "attn_qkv.weight" in tensors:  # GPT-2 keeps it fused
            return [("attn_qkv", 0, (H + 2 * KV) * D, 0)]
        q, k = H * D, KV * D
        return [("attn_q", 0, q, H if permuted else 0), ("attn_k", q, q + k, KV if permuted else 0),
                ("attn_v", q + k, q + 2 * k, 0)]
    if layer_name == "attn.proj":
        return [("attn_output", 0, config.n_embd, 0)]
    if layer_name == "mlp.gate_up":
        return [("ffn_gate", 0, I, 0), ("ffn_up", I, 2 * I, 0)]
    if layer_name == "mlp.fc":
        return [("ffn_up", 0, I, 0)]
    if layer_name in ("mlp.down", "mlp.proj"):
        return [("ffn_down", 0, config.n_embd, 0)]
    return None


def gguf_pairs(config: ModelConfig, first: int, last: int, tensors: Mapping[str, Any], permuted: bool,
               adapter: int, weights: Mapping[str, Tuple[Any, Any]]) -> Pairs:
    """An adapter's pairs (mdi names, torch tensors or numpy) as pairs per GGUF matrix of this
    chunk (float32 numpy), checked against the chunk's weights (ValueError naming the layer)."""
    out: Pairs = {}
    for name, (a, b) in weights.items():
        parts = name.split(".", 2)
        layer = int(parts[1]) if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() else -1
        prefix = "blk.%d." % layer
        spans = _spans(config, parts[2], prefix, tensors, permuted) if first <= layer < last else None
        if spans is None or any(prefix + s[0] + ".weight" not in tensors for s in spans):
            raise ValueError("adapter %d names %s, not a linear layer of blocks [%d, %d)" % (adapter, name, first, last))
        a_np, b_np = _floats(a), _floats(b)
        n_in = int(tensors[prefix + spans[0][0] + ".weight"].contents.ne[0])
        n_out = spans[-1][2]
        if a_np.ndim != 2 or b_np.ndim != 2 or a_np.shape[1] != n_in or b_np.shape[0] != n_out \
                or a_np.shape[0] != b_np.shape[1]:
            raise ValueError("adapter %d: %s has lora_A %s and lora_B %s; this layer needs [r, %d] and [%d, r]"
                             % (adapter, name, list(a_np.shape), list(b_np.shape), n_in, n_out))
        for gguf, start, end, heads in spans:
            bp = b_np[start:end]
            if heads:
                bp = bp[_rope_order(end - start, heads)]
            used = np.flatnonzero(np.any(bp != 0, axis=0))  # this part's own rank (a fused layer's B is block-diagonal)
            if used.size == 0:
                continue
            ap = a_np if used.size == a_np.shape[0] else a_np[used]
            bp = bp if used.size == a_np.shape[0] else bp[:, used]
            out[prefix + gguf] = (np.ascontiguousarray(ap, dtype=np.float32), np.ascontiguousarray(bp, dtype=np.float32))
    return out


# The pairs' type. A decode step reads every pair of every adapter its samples name, so their
# bytes are what adapters cost: 4 rank-16 adapters over SmolLM2's 30 layers hold 75 MB in float32,
# as much as its Q4_1 base (80 MB), and a pass of 8 one-row samples ran 0.81x the base's speed;
# float16 halves that read. ggml then rounds the activations to float16 for the two small
# products (as for any F16 matrix): about 1e-3 of the delta, far inside the backend's tolerance.
PAIR_TYPE = lib.F16
# An adapter holding a value past this keeps its pairs in float32: float16 would store 1e5 as an
# infinity, and a delta of such weights makes activations whose float16 rounding for the next
# product overflows (h66: an adapter torch served made every logit NaN here). LoRA weights are
# far below it (about 1e-2, scale included).
F16_PAIR_LIMIT = 1024.0


def pair_type(pairs: Pairs) -> int:
    """PAIR_TYPE, or float32 for an adapter with a value past F16_PAIR_LIMIT."""
    big = any(float(np.abs(m).max()) > F16_PAIR_LIMIT for ab in pairs.values() for m in ab if m.size)
    return lib.F32 if big else PAIR_TYPE


class HeldAdapter(lib.Freed):
    """One adapter's pairs (`type_id`, by default pair_type's) in a ggml buffer of their own
    (freed with `free`)."""

    def __init__(self, pairs: Pairs, backend: lib.ComputeBackend, type_id: Optional[int] = None) -> None:
        gg = lib.require()
        type_id = pair_type(pairs) if type_id is None else type_id
        self._ctx = lib.Context(2 * len(pairs) + 1)
        self.pairs: Dict[str, Tuple[Any, Any]] = {}
        for name, (a, b) in pairs.items():
            ta = gg.ggml_new_tensor_2d(self._ctx.ptr, type_id, a.shape[1], a.shape[0])
            tb = gg.ggml_new_tensor_2d(self._ctx.ptr, type_id, b.shape[1], b.shape[0])
            self.pairs[name] = (ta, tb)
        self.nbytes = 0
        self.min_rows = 1
        if pairs:
            self.nbytes = self._ctx.allocate("an adapter's %d matrices" % (2 * len(pairs)),
                                             buffer_type=backend.buffer_type)
            dtype = lib.NUMPY_TYPES[type_id]
            for name, (a, b) in pairs.items():
                lib.set_data(self.pairs[name][0], a.astype(dtype))
                lib.set_data(self.pairs[name][1], b.astype(dtype))
            from mdi.model.ggml.min_rows import fewest_rows  # (it imports graph, which imports this module)
            flat = {"%s.%s" % (n, side): t for n, ab in self.pairs.items() for side, t in zip("ab", ab)}
            self.min_rows = fewest_rows(backend, flat, list(flat))

    def free(self) -> None:
        self.pairs = {}
        self._ctx.free()


class GgmlAdapters:
    """The adapters a ggml chunk holds, by id (`adapters`: the frame decoder checks ids
    against it; an id whose adapter leaves this chunk's layers alone holds no pairs)."""

    def __init__(self) -> None:
        self.adapters: Dict[int, HeldAdapter] = {}

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.adapters.values())

    def plan(self, adapters: Optional[Sequence[int]], counts: Sequence[int]) -> Optional["LoraPlan"]:
        """Which rows of a pass (samples' `counts`, padding included) each adapter takes; None
        where none of its samples' adapters changes this chunk's layers."""
        if not adapters:
            return None
        rows: Dict[int, List[int]] = {}
        owner = np.full(sum(counts), -1, dtype=np.int64)
        row = 0
        for adapter, count in zip(adapters, counts):
            if adapter and self.adapters[adapter].pairs:
                rows.setdefault(adapter, []).extend(range(row, row + count))
            row += count
        if not rows:
            return None
        groups, index, offset = [], [], 0
        for adapter in sorted(rows):
            r = rows[adapter]
            pad = self.adapters[adapter].min_rows - len(r)
            gathered = np.array(r + [r[-1]] * max(0, pad), dtype=np.int32)
            owner[r] = offset + np.arange(len(r))  # the row's delta: its first place in the concatenated groups
            groups.append((adapter, int(gathered.shape[0])))
            index.append(gathered)
            offset += gathered.shape[0]
        base = bool((owner < 0).any())
        owner[owner < 0] = offset  # the zero row after the groups
        return LoraPlan(LoraShape(tuple(groups), base), index, owner.astype(np.int32))


@dataclass(frozen=True)
class LoraShape:
    """What a blocks graph's adapter ops are built for (part of the graph's cache key)."""
    groups: Tuple[Tuple[int, int], ...]  # (adapter id, rows gathered for it)
    base: bool  # some row takes no adapter: a zero row follows the groups' deltas

    @property
    def adapter_ids(self) -> Tuple[int, ...]:
        return tuple(a for a, _ in self.groups)


@dataclass
class LoraPlan:
    shape: LoraShape
    index: List[np.ndarray]  # per group, the pass rows gathered
    owner: np.ndarray  # per pass row, its delta's row in the groups' deltas (or the zero row)


# graph nodes per layer and group (7 linear layers: 2 products, a gather, views, a concat), with room
NODES_PER_GROUP = 7 * 6
NODES_PER_LAYER = 7 * 4


class LoraOps:
    """The adapter ops of one blocks graph: its inputs, and `add` for each linear layer."""

    def __init__(self, gg: Any, new_input: Any, shape: LoraShape, held: Mapping[int, HeldAdapter],
                 max_out: int) -> None:
        self.gg, self.shape, self.held = gg, shape, held
        self.index = [new_input("lora_rows_%d" % i, lib.I32, n) for i, (_, n) in enumerate(shape.groups)]
        self.owner: Any = None
        self.zero: Any = None
        self._new_input = new_input
        self._max_out = max_out
        self._gathered: Dict[Tuple[int, int], Any] = {}

    def inputs(self, rows: int) -> None:
        """The inputs sized by the pass: made once the pass's rows are known."""
        self.owner = self._new_input("lora_owner", lib.I32, rows)
        most = max([n for _, n in self.shape.groups] + [1])
        self.zero = self._new_input("lora_zero", lib.F32, self._max_out * most)

    def _gather(self, ctx: Any, x: Any, group: int) -> Any:
        key = (ctypes.addressof(x.contents), group)
        g = self._gathered.get(key)
        if g is None:
            g = self._gathered[key] = self.gg.ggml_get_rows(ctx, x, self.index[group])
        return g

    def _zeros(self, ctx: Any, out: int, n: int) -> Any:
        return self.gg.ggml_view_2d(ctx, self.zero, out, n, out * 4, 0)

    def add(self, ctx: Any, x: Any, y: Any, name: str) -> Any:
        """y (= W x [+ bias], [out, rows]) plus each group's B (A x) on its rows."""
        gg = self.gg
        pairs = [self.held[a].pairs.get(name) for a, _ in self.shape.groups]
        if not any(p is not None for p in pairs):
            return y
        out = int(y.contents.ne[0])
        deltas = None
        for i, (pair, (_, n)) in enumerate(zip(pairs, self.shape.groups)):
            if pair is None:
                d = self._zeros(ctx, out, n)
            else:
                d = gg.ggml_mul_mat(ctx, pair[1], gg.ggml_mul_mat(ctx, pair[0], self._gather(ctx, x, i)))
            deltas = d if deltas is None else gg.ggml_concat(ctx, deltas, d, 1)
        if self.shape.base:
            deltas = gg.ggml_concat(ctx, deltas, self._zeros(ctx, out, 1), 1)
        return gg.ggml_add(ctx, y, gg.ggml_get_rows(ctx, deltas, self.owner))

    def fill(self, plan: LoraPlan) -> Tuple[Tuple[Any, np.ndarray], ...]:
        """(input, values) for this pass (an input no op reads has no memory: left out)."""
        out = [(t, i) for t, i in zip(self.index, plan.index)]
        out.append((self.owner, plan.owner))
        out.append((self.zero, np.zeros(int(self.zero.contents.ne[0]), dtype=np.float32)))
        return tuple((t, v) for t, v in out if t.contents.data)
