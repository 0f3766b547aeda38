"""What a model family is made of, in one table both compute backends read.

A family is the block's recipe: which norm, how positions enter, the MLP's activation, whether
the block has norms after attention and after the MLP, whether embeddings are scaled. The
numbers that vary inside a family (widths, heads, epsilons, RoPE bases, biases on q/k/v,
q/k norms, sliding windows) stay in ModelConfig; this table holds only what differs *between*
families, so that a new family is a row here plus what its checkpoints name differently, not
`if family ==` branches through the code.
"""
from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Family:
    name: str
    norm: str                   # "rms" (RMSNorm) | "layer" (LayerNorm with bias)
    positions: str              # "rope" | "learned" (a position embedding added to the tokens')
    mlp: str                    # "swiglu" (silu(gate) * up), "geglu" (tanh-GELU(gate) * up), "gelu" (no gate)
    post_norms: bool = False    # an RMSNorm on attention's and on the MLP's output, before each residual add (Gemma 2/3)
    embed_scale: bool = False   # token embeddings times sqrt(n_embd) (Gemma)
    always_qk_norm: bool = False  # RMSNorm on each head's q and k whatever the config says (Gemma 3)
    linear_bias: bool = False   # every linear layer and norm has a bias (GPT-2)
    # RMSNorm multiplies by its weight in float32 and then casts to the activations' dtype (Gemma);
    # else it casts the normalised rows first and multiplies in that dtype (Llama). Equal in float32.
    norm_weight_in_float: bool = False
    # the queries are multiplied by the attention scale before attention, which then scales by
    # one (Gemma's reference and llama.cpp's graph); else attention scales q.k itself
    scale_queries: bool = False


FAMILIES: Dict[str, Family] = {
    "gpt2": Family("gpt2", norm="layer", positions="learned", mlp="gelu", linear_bias=True),
    "llama": Family("llama", norm="rms", positions="rope", mlp="swiglu"),
    "gemma3": Family("gemma3", norm="rms", positions="rope", mlp="geglu", post_norms=True, embed_scale=True,
                     always_qk_norm=True, norm_weight_in_float=True, scale_queries=True),
}


def family_of(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError("unknown model family %r (known: %s)" % (name, ", ".join(sorted(FAMILIES)))) from None
