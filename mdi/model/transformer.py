"""One transformer for the GPT-2, Llama and Gemma 3 families, cut-able into contiguous chunks.

What a family's block is made of (norm, positions, MLP, post-norms, embedding scale) is read from
the family table (mdi.model.families), not branched on by name. Gemma 3's sliding-window layers
(`ModelConfig.layer_window`) mask every path (prefill, decode, several samples, verification, training) to
their last `sliding_window` positions and rotate with their own RoPE base.

A `ModelChunk` holds blocks [first, last) of the network and, optionally, the input side
(token + position embeddings) and the output side (final norm + LM head). The starter holds
embedding + first blocks + head; a worker holds a middle range. Block indices stay global so
that a chunk's state dict uses the same keys as the full model (`blocks.{i}....`).

Attention reads and writes a `KVCache` (mdi.model.kv_cache) with one preallocated slot per
in-flight sample; a call names its slot and the absolute position of its first token, so
prefill and decode are the same code path and nothing is ever recomputed.

Several samples go through one forward as a `RowBatch` (mdi.model.row_batch, ORCA's selective
batching): their token rows are stacked, so every linear layer and norm reads its weights once
for all of them, and only attention runs per sample, against that sample's own cache slot and
positions.
"""
import contextlib
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from mdi.model import fused_decode, graph_decode
from mdi.model.attention import attend_decode_rows, attend_sample, causal_mask, sdpa
from mdi.model.config import ModelConfig
from mdi.model.families import family_of
from mdi.model.kv_cache import KVCache
from mdi.model.layers import (Embedding, Linear, LoraDeltas, QuantEmbedding, QuantLinear, decode_kernels, held_bytes,
                              make_linear, make_norm)
from mdi.model.layout import QuantLayout, QuantSpec
from mdi.model.rope import RotaryEmbedding
from mdi.model.row_batch import RowBatch, attends_in_one_call, decode_window_key
from mdi.system.memory import release_freed_memory
from mdi.system.transfers import to_device, torch_view


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, quant: Mapping[str, QuantSpec], prefix: str = "",
                 window: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.qkv = make_linear(config.n_embd, (config.n_head + 2 * config.kv_heads) * config.head_dim,
                               config.bias or config.qkv_bias, quant.get(prefix + "qkv"))
        self.proj = make_linear(config.n_head * config.head_dim, config.n_embd, config.bias, quant.get(prefix + "proj"))
        self.qk_norm = config.qk_norm or family_of(config.family).always_qk_norm
        if self.qk_norm:  # Qwen3, Gemma 3: each head's q and k normalised before RoPE
            self.q_norm = make_norm(config, config.head_dim)
            self.k_norm = make_norm(config, config.head_dim)
        self.window = window  # > 0: a sliding-window layer (ModelConfig.layer_window)
        # None: SDPA's 1 / sqrt(head_dim) (torch 2.0 takes no scale)
        self.scale = config.query_scale if config.attn_scale is not None else None

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: RowBatch,
                rope: Optional[RotaryEmbedding]) -> torch.Tensor:
        # x: [rows, C] for the samples of `batch`; k_cache/v_cache: [slots, kv_heads, max_len, head_dim].
        # A decode step is a few µs per op and ~30 ops per layer: q and k travel together
        # (one RoPE pass over both) and a one-sample batch is not sliced.
        R = x.shape[0]
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x).view(R, H + 2 * KV, D)
        qk, v = qkv[:, :H + KV], qkv[:, H + KV:]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        if rope is not None:
            qk = rope.of_layer(self.window).at_rows(qk, batch)
        if batch.row_wise and batch.rows > len(batch.slots):
            ys, row = [], 0
            for slot, start, T in zip(batch.slots, batch.starts, batch.counts):
                for t in range(row, row + T):  # each row's keys written, then its own decode step
                    ys.append(self._attend(qk[t:t + 1], v[t:t + 1], k_cache[slot], v_cache[slot], start + t - row))
                row += T
            y = torch.cat(ys)
        elif batch.whole_slots:  # a recorded CUDA graph's step: its tensors alone (mdi.model.graph_decode)
            assert batch.decode_tables is not None  # DecodeStep fills them with whole_slots
            slots, positions, mask = batch.decode_tables
            if self.window:  # narrowed to the window by the step (DecodeStep._run)
                mask = batch.window_masks[decode_window_key(self.window)]
            y = attend_decode_rows(qk, v, k_cache, v_cache, slots, positions, mask, H, KV, D, batch.counts[0],
                                   self.scale)
        elif len(batch.slots) == 1:
            y = self._attend(qk, v, k_cache[batch.slots[0]], v_cache[batch.slots[0]], batch.starts[0],
                             batch.sample_mask(0, H // KV, x.device, self.window))
        elif attends_in_one_call(batch, KV * D):
            y = self._attend_decode_rows(qk, v, k_cache, v_cache, batch)  # several one-row samples at once
        else:
            ys, row = [], 0
            for i, (slot, start, T) in enumerate(zip(batch.slots, batch.starts, batch.counts)):
                ys.append(self._attend(qk[row:row + T], v[row:row + T], k_cache[slot], v_cache[slot], start,
                                       batch.sample_mask(i, H // KV, x.device, self.window)))
                row += T
            y = torch.cat(ys)
        return self.proj(y)

    def _attend(self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                start: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One sample's T rows against its own cache slot (attention.attend_sample, which the
        scripted blocks run too); `mask`: the pass's (RowBatch.sample_mask)."""
        return attend_sample(qk, v, k_cache, v_cache, start, self.n_head, self.n_kv_head, self.head_dim, mask,
                             self.window, self.scale)

    def _attend_decode_rows(self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: RowBatch) -> torch.Tensor:
        """S samples with one row each, in one SDPA call (~10 ops per layer instead of ~9 per
        sample): attention.attend_decode_rows, which the scripted blocks run too."""
        slots, positions, mask = batch.decode_index(k_cache.device, self.window)
        return attend_decode_rows(qk, v, k_cache, v_cache, slots, positions, mask,
                                  self.n_head, self.n_kv_head, self.head_dim, 1, self.scale)

    def forward_batch(self, x: torch.Tensor, rope: Optional[RotaryEmbedding]) -> torch.Tensor:
        """Causal attention over whole sequences x [B, T, C] without a cache (training)."""
        B, T, _ = x.shape
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, H + 2 * KV, D).split([H, KV, KV], dim=2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(H // KV, dim=1)
        v = v.transpose(1, 2).repeat_interleave(H // KV, dim=1)
        if rope is not None:
            rope = rope.of_layer(self.window)
            q, k = rope(q, 0), rope(k, 0)
        if self.window or self.scale is not None:
            y = sdpa(q, k, v, causal_mask(0, T, 1, x.device, self.window), self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, quant: Mapping[str, QuantSpec], prefix: str = "") -> None:
        super().__init__()
        self.kind = family_of(config.family).mlp  # "gelu" | "swiglu" | "geglu"
        self.gelu_approximate = config.gelu_approximate
        E, I = config.n_embd, config.ffn_width
        if self.kind == "gelu":
            self.fc = make_linear(E, I, True, quant.get(prefix + "fc"))
            self.proj = make_linear(I, E, True, quant.get(prefix + "proj"))
        else:
            self.gate_up = make_linear(E, 2 * I, False, quant.get(prefix + "gate_up"))
            self.down = make_linear(I, E, False, quant.get(prefix + "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return self.proj(F.gelu(self.fc(x), approximate=self.gelu_approximate))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if self.kind == "geglu":
            return self.down(F.gelu(gate, approximate=self.gelu_approximate) * up)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """norm1 -> attention (-> post_attn_norm) + residual; norm2 -> MLP (-> post_mlp_norm) + residual.
    The post-norms where the family has them (Gemma 3: there norm2 is its pre-feed-forward norm)."""

    def __init__(self, config: ModelConfig, quant: Mapping[str, QuantSpec], prefix: str = "", window: int = 0) -> None:
        super().__init__()
        self.post_norms = family_of(config.family).post_norms
        self.norm1 = make_norm(config)
        self.attn = Attention(config, quant, prefix + "attn.", window)
        if self.post_norms:
            self.post_attn_norm = make_norm(config)
        self.norm2 = make_norm(config)
        self.mlp = MLP(config, quant, prefix + "mlp.")
        if self.post_norms:
            self.post_mlp_norm = make_norm(config)

    def forward(self, x, k_cache, v_cache, batch, rope):
        if self.post_norms:
            x = x + self.post_attn_norm(self.attn(self.norm1(x), k_cache, v_cache, batch, rope))
            return x + self.post_mlp_norm(self.mlp(self.norm2(x)))
        x = x + self.attn(self.norm1(x), k_cache, v_cache, batch, rope)
        return x + self.mlp(self.norm2(x))

    def forward_batch(self, x, rope):
        if self.post_norms:
            x = x + self.post_attn_norm(self.attn.forward_batch(self.norm1(x), rope))
            return x + self.post_mlp_norm(self.mlp(self.norm2(x)))
        x = x + self.attn.forward_batch(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class ModelChunk(nn.Module):
    """Blocks [first, last) plus, optionally, the embeddings and the final norm + head.
    `quant` names the weights kept quantized (mdi.model.layout.QuantLayout)."""

    backend = "torch"  # mdi.model.backend: the ggml chunk (mdi.model.ggml.chunk) answers the same calls

    def __init__(self, config: ModelConfig, first: int, last: int,
                 with_embedding: bool = False, with_head: bool = False,
                 quant: Optional[QuantLayout] = None) -> None:
        super().__init__()
        if not 0 <= first <= last <= config.n_layer:
            raise ValueError("layer range [%d, %d) outside the model's %d layers" % (first, last, config.n_layer))
        quant = dict(quant or {})
        family = self.family = family_of(config.family)
        self.config, self.first, self.last = config, first, last
        self.with_embedding, self.with_head = with_embedding, with_head
        if with_embedding or (with_head and config.tied_head):
            spec = quant.get("tok_emb")
            self.tok_emb = Embedding(config.vocab_size, config.n_embd) if spec is None \
                else QuantEmbedding(config.vocab_size, config.n_embd, spec)
        if with_embedding and family.positions == "learned":
            self.pos_emb = Embedding(config.block_size, config.n_embd)
        windows = [config.layer_window(i) for i in range(first, last)]
        self.blocks = nn.ModuleDict({str(i): Block(config, quant, "blocks.%d." % i, w)
                                     for i, w in zip(range(first, last), windows)})
        # with Gemma 3's sliding-window layers' tables inside (RotaryEmbedding.of_layer)
        self.rope = RotaryEmbedding(config) if family.positions == "rope" and last > first else None
        if with_head:
            self.norm_f = make_norm(config)
            if not config.tied_head:
                self.lm_head = make_linear(config.n_embd, config.vocab_size, False, quant.get("lm_head"))
        self.cache: Optional[KVCache] = None
        self.compute_dtype: Optional[torch.dtype] = None  # None: the weights' dtype
        self.lora = LoraDeltas()
        # The blocks' decode step as one TorchScript call (mdi.model.fused_decode), built with
        # the first cache after the kernels are chosen; a dict so nn.Module does not register it.
        self._decode_script: Dict[str, Any] = {}
        # Whether it may (runtime.fused_decode): set per chunk by whoever loads it for a run or
        # a profile, so one process (tests, benchmarks, a starter timing itself) can hold both.
        self._fused_decode_on = fused_decode.default_on()
        for name, module in self.named_modules():
            if isinstance(module, (Linear, QuantLinear)) and name.startswith("blocks."):
                module.lora, module.lora_name = self.lora, name

    @property
    def n_layers(self) -> int:
        return self.last - self.first

    @property
    def device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def weight_bytes(self) -> int:
        """What the chunk's weights hold: its tensors, and what kernels keep outside them."""
        return held_bytes(self)

    @property
    def fused_decode(self) -> bool:
        """Decode frames run the blocks as one TorchScript call where they are covered
        (mdi.model.fused_decode); False: always the eager blocks. Off takes effect at once;
        on, at the next allocate_cache (which scripts the blocks)."""
        return self._fused_decode_on

    @fused_decode.setter
    def fused_decode(self, on: bool) -> None:
        if bool(on) != self._fused_decode_on:
            self._decode_script.clear()
        self._fused_decode_on = bool(on)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype activations are computed, cached and sent in: compute_dtype, else the float
        weights' dtype (a chunk of quantized layers only: float32)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        p = next(self.parameters(), None)
        return p.dtype if p is not None and p.dtype.is_floating_point else torch.float32

    def set_adapter(self, adapter: int, weights: Mapping[str, Tuple[Any, Any]]) -> None:
        """Hold adapter `adapter` (> 0): (A, B) per linear layer name of this chunk's blocks
        (numpy arrays or torch tensors), the scale folded into B. Layers it does not name run
        as the base."""
        if adapter <= 0:
            raise ValueError("adapter ids start at 1 (0 is the base model)")
        # numpy pairs (mdi.model.adapters.lora's) are viewed, not copied
        weights = {k: (torch_view(a), torch_view(b)) for k, (a, b) in weights.items()}
        layers = {m.lora_name: m for m in self.modules() if isinstance(m, (Linear, QuantLinear)) and m.lora is self.lora}
        for name, (a, b) in weights.items():
            layer = layers.get(name)
            if layer is None:
                raise ValueError("adapter %d names %s, not a linear layer of blocks [%d, %d)"
                                 % (adapter, name, self.first, self.last))
            n_in, n_out = (layer.in_features, layer.out_features) if isinstance(layer, Linear) else (layer.n_in, layer.n_out)
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
                raise ValueError("adapter %d: %s has lora_A %s and lora_B %s; this layer needs [r, %d] and [%d, r]"
                                 % (adapter, name, list(a.shape), list(b.shape), n_in, n_out))
        p, work = next(self.parameters()), self.activation_dtype
        self.lora.adapters[adapter] = {k: (a.t().to(p.device, work).contiguous(), b.t().to(p.device, work).contiguous())
                                       for k, (a, b) in weights.items()}

    def drop_adapter(self, adapter: int) -> None:
        self.lora.adapters.pop(adapter, None)

    @property
    def adapter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.lora.adapters.values() for ab in w.values() for t in ab)

    # --- state ---------------------------------------------------------------------
    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        """Load canonical weights, failing with the names of missing or unexpected tensors."""
        own = self.state_dict()
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        if missing or unexpected:
            raise ValueError("weights do not match layers [%d, %d): missing %s; unexpected %s"
                             % (self.first, self.last, missing[:5] or "none", unexpected[:5] or "none"))
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError("tensor %s has shape %s, expected %s"
                                 % (name, tuple(tensor.shape), tuple(own[name].shape)))
        self.load_state_dict(weights, strict=True)
        self._decode_script.clear()

    def pick_kernels(self) -> None:
        """After loading: each quantized layer chooses how it multiplies (by measurement)."""
        for name, module in self.named_modules():
            if isinstance(module, QuantEmbedding) and not (self.with_head and self.config.tied_head):
                continue  # only looked up (rows dequantized): no matrix product to choose
            if isinstance(module, QuantLinear):
                own = {id(t) for t in module.buffers()}
                # what it reads to fill the caches while timing: weights held anyway, no new buffer
                resident = [t for t in list(self.parameters()) + list(self.buffers()) if id(t) not in own]
                module.pick_kernel(name, resident=resident)
                release_freed_memory()  # its packing and test products left holes between kept tensors
        self._decode_script.clear()

    def allocate_cache(self, n_slots: int, max_len: int, prefill_chunk: Optional[int] = None) -> KVCache:
        """`prefill_chunk`: taken as the ggml chunk takes it (rings there); torch keeps every position."""
        p = next(self.parameters(), None)
        dtype = self.activation_dtype
        device = p.device if p is not None else torch.device("cpu")
        self.cache = None  # free the previous run's cache before allocating the next one
        self._decode_script.pop("graphs", None)  # recorded steps point into the old cache
        self.cache = KVCache(self.config, self.n_layers, n_slots, max_len, dtype, device)
        if self.rope is not None:
            self.rope.reserve(max_len)  # the tables a run's positions reach, built before its first token
        if "module" not in self._decode_script:  # built here, before the run: ~13 ms per block
            self._decode_script["module"] = fused_decode.build(self)
        return self.cache

    def free_cache(self) -> None:
        self.cache = None
        self._decode_script.pop("graphs", None)

    # --- compute -------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One sample's tokens at positions start.."""
        return self.embed_rows(ids, torch.arange(start, start + ids.shape[0], device=ids.device))

    def embed_rows(self, ids: torch.Tensor, positions: torch.Tensor,
                   virtual: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Token rows [rows] at their own positions (several samples stacked: a RowBatch);
        `virtual` (rows, embeddings) replaces those rows' token embeddings (a soft prompt's
        virtual tokens; positions are added to them as to any token, as PEFT does)."""
        x = self._token_embeddings(ids)
        if virtual is not None:  # not scaled (Gemma): PEFT hands a prompt's embeddings over as they are
            rows, values = virtual
            x = x.clone()
            x[to_device(rows, x.device)] = to_device(values, x.device, x.dtype)
        if self.family.positions == "learned":
            x = x + self.pos_emb(positions.to(ids.device))
        # A quantized embedding looks rows up in float32: they join the chunk's dtype here.
        return x.to(self.activation_dtype)

    def _token_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids)
        if self.family.embed_scale:  # Gemma: times sqrt(n_embd) rounded to the activations' dtype, as HF does
            dtype = self.activation_dtype
            x = x.to(dtype) * torch.tensor(self.config.n_embd ** 0.5, dtype=torch.float32).to(dtype)
        return x

    def forward_blocks(self, x: torch.Tensor, slot: int, start: int) -> torch.Tensor:
        """Run this chunk's blocks on one sample's activations x [T, C] at positions start.."""
        return self.forward_rows(x, RowBatch.of([slot], [start], [x.shape[0]], x.device))

    def embed_forward_rows(self, ids: torch.Tensor, batch: RowBatch,
                           virtual: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """A starter's pass: its tokens' embeddings through its blocks (the ggml chunk does both
        in one graph)."""
        return self.forward_rows(self.embed_rows(ids, batch.positions, virtual), batch)

    def forward_rows(self, x: torch.Tensor, batch: RowBatch) -> torch.Tensor:
        """Run this chunk's blocks once over the stacked rows x [batch.rows, C] of several
        samples: linear layers see every row, attention each sample's own slot."""
        if self.n_layers == 0:
            return x
        cache = self.cache
        if cache is None:
            raise RuntimeError("no KV cache allocated")
        if x.shape[0] != batch.rows:
            raise ValueError("%d rows of activations for %d tokens" % (x.shape[0], batch.rows))
        if len(set(batch.slots)) != len(batch.slots):
            raise ValueError("a sample slot appears twice in one batch")
        for slot, start, count in zip(batch.slots, batch.starts, batch.counts):
            if not 0 <= slot < cache.n_slots:
                raise ValueError("sample slot %d outside the %d allocated" % (slot, cache.n_slots))
            if start < 0 or start + count > cache.max_len:
                raise ValueError("positions [%d, %d) exceed the cache length %d" % (start, start + count, cache.max_len))
        if batch.adapters:
            missing = sorted({a for a in batch.adapters if a and a not in self.lora.adapters})
            if missing:
                raise ValueError("adapter %d is not loaded on layers [%d, %d)" % (missing[0], self.first, self.last))
        self.lora.groups = batch.adapter_rows(x.device)
        try:
            y = self._fused_decode(x, batch)
            if y is None:
                y = self._decode_script.setdefault("graphs", graph_decode.Recorder()).forward(self, x, batch)
            if y is not None:
                return y
            # a verification's rows (row_wise) each stand for a decode step: decode kernels only
            with decode_kernels() if batch.row_wise else contextlib.nullcontext():
                for block, (k, v) in zip(self.blocks.values(), cache.layers):
                    x = block(x, k, v, batch, self.rope)
        finally:
            self.lora.groups = []
        return x

    def _fused_decode(self, x: torch.Tensor, batch: RowBatch) -> Optional[torch.Tensor]:
        """The blocks as one TorchScript call where this frame is a decode step they cover."""
        module = self._decode_script.get("module")
        if module is None or not self._fused_decode_on:
            return None
        kv_width = self.config.kv_heads * self.config.head_dim
        return fused_decode.forward(module, self, x, batch, attends_in_one_call(batch, kv_width))

    def forward_batch(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits for whole sequences ids [B, T], no cache: the training path (full model only)."""
        if not (self.with_embedding and self.with_head and self.first == 0 and self.last == self.config.n_layer):
            raise RuntimeError("forward_batch needs the full model")
        B, T = ids.shape
        x = self._token_embeddings(ids)
        if self.family.positions == "learned":
            x = x + self.pos_emb(torch.arange(T, device=ids.device))
        for block in self.blocks.values():
            x = block.forward_batch(x, self.rope)  # type: ignore[operator]  # a Block's: mypy sees only Module
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_f(x)
        if self.config.tied_head:
            return self.tok_emb.logits(x)
        return self.lm_head(x)


def full_model(config: ModelConfig) -> ModelChunk:
    return ModelChunk(config, 0, config.n_layer, with_embedding=True, with_head=True)


def parameter_count(weights: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() for t in weights)
