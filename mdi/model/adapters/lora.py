"""LoRA adapters in mdi's own weight naming: the values, and the maths that fuses, mixes and
merges them (`mdi.model.adapters.adapter_files` reads them from the files users already have).

An `Adapter` holds, per linear layer of mdi's blocks (e.g. "blocks.3.attn.qkv"), a pair
(A [r, in], B [out, r]) of float32 numpy arrays with the LoRA scale folded into B, which
`ModelChunk.set_adapter` takes without a copy and `merge_adapter` adds into float weights (W += B @ A).
numpy, not torch: a starter computing with ggml reads, mixes and sends adapters without
loading torch (193 MB resident); a torch chunk views the same memory (torch.from_numpy).

mdi fuses some layers the checkpoints keep apart (q/k/v into attn.qkv, gate/up into
mlp.gate_up). The LoRA of a fused layer is the parts' LoRAs side by side: A stacks the parts'
A rows (rank r_q + r_k + r_v) and B is block-diagonal, each part's B in its own output rows
and its own rank columns, zero elsewhere; so B @ A is each part's delta in its own rows, and a
part the adapter does not target simply has no block.

A `SoftPrompt` (PEFT prompt tuning) is the one other kind of adapter: it answers the same
questions (layers, for_layers, nbytes) so the starter holds either kind in one list.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from mdi.model.config import ModelConfig
from mdi.model.sampling import host_array

Pair = Tuple[np.ndarray, np.ndarray]  # (A [r, in], B [out, r]) float32, the scale folded into B


class AdapterError(ValueError):
    """An adapter that cannot be read, or does not fit the base model."""


@dataclass
class Adapter:
    name: str
    path: str
    kind: str  # "lora"
    rank: int  # the largest rank of any module (before fusing)
    alpha: float  # lora_alpha as the source gives it (per-module alphas may differ: alpha_pattern)
    weights: Dict[str, Pair] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A and B (numpy, or torch tensors as training makes them) are held as float32 views of
        # contiguous A.T and B.T, the layout ModelChunk.set_adapter computes with: the starter's
        # torch chunk then shares this memory for its own layers instead of keeping a
        # transposed second copy beside it.
        self.weights = {k: (_transposed_layout(a), _transposed_layout(b)) for k, (a, b) in self.weights.items()}

    def layers(self) -> Set[int]:
        """The block indices the adapter changes."""
        return {block_index(k) for k in self.weights}

    def for_layers(self, first: int, last: int) -> Dict[str, Pair]:
        """The pairs of blocks [first, last): what a node holding those blocks needs."""
        return {k: ab for k, ab in self.weights.items() if first <= block_index(k) < last}

    def nbytes(self, weights: Optional[Mapping[str, Pair]] = None) -> int:
        """Bytes of the float32 A / B pairs (all of them, or of `weights`, e.g. for_layers's)."""
        pairs = self.weights if weights is None else weights
        return sum(int(t.nbytes) for ab in pairs.values() for t in ab)


def _transposed_layout(t: Any) -> np.ndarray:
    """`t` as float32 numpy whose transpose is C-contiguous (a no-op when it already is)."""
    return np.ascontiguousarray(host_array(t).T).T


def block_index(name: str) -> int:
    return int(name.split(".")[1])  # "blocks.3.attn.qkv" -> 3


# ----------------------------------------------------------------------------- mdi's linear layers

PART_ORDER = ("q", "k", "v", "gate", "up")


def layer_shapes(config: ModelConfig) -> Dict[str, Tuple[int, int]]:
    """mdi's linear layer (within a block) -> (n_out, n_in)."""
    E, I, D = config.n_embd, config.ffn_width, config.head_dim
    H, KV = config.n_head, config.kv_heads
    if config.family == "gpt2":
        return {"attn.qkv": ((H + 2 * KV) * D, E), "attn.proj": (E, H * D), "mlp.fc": (I, E), "mlp.proj": (E, I)}
    return {"attn.qkv": ((H + 2 * KV) * D, E), "attn.proj": (E, H * D), "mlp.gate_up": (2 * I, E),
            "mlp.down": (E, I)}


def part_rows(config: ModelConfig, layer: str, part: Optional[str]) -> Tuple[int, int]:
    """The output rows [start, end) of a fused layer that `part` owns (all of them for None)."""
    H, KV, D, I = config.n_head, config.kv_heads, config.head_dim, config.ffn_width
    spans = {"q": (0, H * D), "k": (H * D, (H + KV) * D), "v": ((H + KV) * D, (H + 2 * KV) * D),
             "gate": (0, I), "up": (I, 2 * I)}
    return spans[part] if part is not None else (0, layer_shapes(config)[layer][0])


@dataclass
class LoraPart:
    """One source module's LoRA, checked against the base model: where it lands in mdi."""
    layer: int
    mdi: str  # "attn.qkv"
    part: Optional[str]  # "q" or None
    a: np.ndarray  # [r, in] float32
    b: np.ndarray  # [out, r] float32, the scale folded in


def fuse_parts(parts: Sequence[LoraPart], config: ModelConfig) -> Dict[str, Pair]:
    """Per mdi layer: A = the parts' A stacked by rows, B = block-diagonal (see the module doc)."""
    shapes = layer_shapes(config)
    by_layer: Dict[str, List[LoraPart]] = {}
    for p in parts:
        by_layer.setdefault("blocks.%d.%s" % (p.layer, p.mdi), []).append(p)
    out: Dict[str, Pair] = {}
    for name in sorted(by_layer, key=lambda n: (block_index(n), n)):
        group = sorted(by_layer[name], key=lambda p: PART_ORDER.index(p.part) if p.part else 0)
        mdi = group[0].mdi
        if len(group) == 1 and group[0].part is None:
            out[name] = (group[0].a, group[0].b)
            continue
        a = np.concatenate([p.a for p in group], axis=0)
        b = np.zeros((shapes[mdi][0], a.shape[0]), dtype=np.float32)
        col = 0
        for p in group:
            start, end = part_rows(config, mdi, p.part)
            r = p.a.shape[0]
            b[start:end, col:col + r] = p.b
            col += r
        out[name] = (a, b)
    return out


# ----------------------------------------------------------------------------- prompt tuning

@dataclass
class SoftPrompt:
    """A PEFT prompt-tuning adapter: learned embeddings of `n` virtual tokens put before every
    prompt (positions 0..n-1). It changes no layer: only the starter, which embeds, holds it."""
    name: str
    path: str
    embeddings: np.ndarray  # [n, n_embd] float32
    kind: str = "prompt"
    rank: int = 0

    def __post_init__(self) -> None:
        self.embeddings = np.ascontiguousarray(host_array(self.embeddings))

    @property
    def n_virtual(self) -> int:
        return int(self.embeddings.shape[0])

    def layers(self) -> Set[int]:
        return set()

    def for_layers(self, first: int, last: int) -> Dict[str, Pair]:
        return {}

    def nbytes(self, weights: Optional[Mapping[str, Pair]] = None) -> int:
        return 0 if weights is not None else int(self.embeddings.nbytes)


# ----------------------------------------------------------------------------- mixing and merging

def mix_adapters(parts: Sequence[Tuple[Adapter, float]], name: str) -> Adapter:
    """One LoRA that adds sum_i scale_i * B_i @ A_i to every layer (llama.cpp's per-request
    `lora: [{id, scale}, ...]`): the parts' A rows stacked and their scaled B columns side by
    side, so a layer's delta is one gather over the summed rank, exactly the sum of the scaled
    deltas. Prompt-tuning adapters change no layer and cannot be scaled: refused."""
    if not parts:
        raise AdapterError("an adapter mix needs at least one adapter")
    for adapter, scale in parts:
        if adapter.kind != "lora":
            raise AdapterError("adapter %s is a prompt-tuning adapter: it cannot be scaled or mixed" % adapter.name)
        if not math.isfinite(scale):
            raise AdapterError("adapter %s: scale %r is not a finite number" % (adapter.name, scale))
    weights: Dict[str, Pair] = {}
    for layer in sorted(set().union(*(a.weights for a, _ in parts))):
        pairs = [(a.weights[layer][0], scale * a.weights[layer][1]) for a, scale in parts if layer in a.weights]
        weights[layer] = (np.concatenate([a for a, _ in pairs]), np.concatenate([b for _, b in pairs], axis=1))
    return Adapter(name=name, path=", ".join(a.path for a, _ in parts), kind="lora",
                   rank=sum(a.rank for a, _ in parts), alpha=0.0, weights=weights)  # alphas folded into B


def merge_adapter(state_dict: Mapping[str, Any], adapter: Adapter) -> Dict[str, Any]:
    """A new state dict (mdi names) with W += B @ A for each layer of `adapter` whose block the
    state dict holds (a chunk's state dict: the other blocks are another node's). Computed in
    float32, stored back in each weight's dtype. Quantized weights are refused: merge into the
    float weights, then quantize. (torch: mdi-prepare's state dicts are torch's.)"""
    import torch

    from mdi.model.quantization.quant import QParts
    out = dict(state_dict)
    blocks = {int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")}
    merged = 0
    for name, (a, b) in sorted(adapter.weights.items()):
        if block_index(name) not in blocks:
            continue
        key = name + ".weight"
        w = state_dict.get(key)
        if (w is None and name + ".qweight" in state_dict) or isinstance(w, QParts) or (
                isinstance(w, torch.Tensor) and not w.dtype.is_floating_point):
            raise AdapterError("adapter %s: %s is quantized; merge the adapter into the float weights, then quantize"
                               % (adapter.name, key))
        if w is None:
            raise AdapterError("adapter %s: the state dict has no %s to merge into" % (adapter.name, key))
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise AdapterError("adapter %s: %s has shape %s, the adapter's delta %s"
                               % (adapter.name, key, list(w.shape), [b.shape[0], a.shape[1]]))
        out[key] = (w.float() + torch.from_numpy(b @ a)).to(w.dtype)
        merged += 1
    if adapter.weights and not merged:
        raise AdapterError("adapter %s: the state dict holds none of its layers (%s)"
                           % (adapter.name, ", ".join(sorted(adapter.weights)[:3])))
    return out
