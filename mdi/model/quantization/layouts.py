"""Which weights a node keeps quantized, and how: layouts (name -> QuantSpec) chosen, cut to
a node's layers and described, without torch (a ggml starter plans with them; the arithmetic
on quantized tensors is mdi.model.quantization.quant's)."""
from typing import Dict, List, Optional

from mdi.model.layout import QuantLayout, QuantSpec, quantizable

DEFAULT_INT4_GROUP = 32  # GGUF's Q4 block: the best quality of mdi's int4 groups
HEAD_WEIGHTS = ("tok_emb", "lm_head")


def uniform_layout(config, layer_range, with_embedding: bool, with_head: bool, kind: str,
                   group_size: Optional[int] = None) -> Dict[str, QuantSpec]:
    """`kind` for every quantizable weight of the range; `group_size` None: int8 per output
    channel (the layer's width), int4 in groups of 32. With int4 the embedding / LM head stay
    int8 (per channel): rounding the head to 4 bits costs SmolLM2 ~9% perplexity, the blocks
    next to nothing (llama.cpp keeps its output tensor at 6-8 bits for the same reason).
    Refused, naming the layer, when a group size does not divide a layer's width."""
    out = {}
    for base, (_, n_in) in quantizable(config, layer_range, with_embedding, with_head).items():
        if kind == "int4" and base in HEAD_WEIGHTS:
            out[base] = QuantSpec("int8", n_in)
            continue
        spec = QuantSpec(kind, group_size or (n_in if kind == "int8" else DEFAULT_INT4_GROUP))
        spec.check(base, n_in)
        out[base] = spec
    return out


def describe(layout: QuantLayout, n_weights: int) -> str:
    """'int4/g32 x 210, int8/g32 x 1, float x 0' style summary for logs and prepare output."""
    counts: Dict[str, int] = {}
    for spec in layout.values():
        counts[spec.label()] = counts.get(spec.label(), 0) + 1
    parts = ["%s x %d" % (k, v) for k, v in sorted(counts.items())]
    if n_weights > len(layout):
        parts.append("float x %d" % (n_weights - len(layout)))
    return ", ".join(parts) or "float"


def restrict(layout: QuantLayout, bases: List[str]) -> Dict[str, QuantSpec]:
    return {b: layout[b] for b in bases if b in layout}
