"""Which GGUF tensors a node's part of a model is made of, their shapes, and their types.

The names are llama.cpp's (`blk.N.attn_q.weight`...). What a family's block holds comes from
the family table (mdi.model.families) and the config; every tensor a node will compute with is
checked here against the shape the config gives it, before a graph is built: ggml checks its
operands with asserts that end the process, so a malformed or hostile file must be refused
first, in one line naming the file and the tensor.
"""
import re
from typing import Dict, Tuple

from mdi.model.config import ModelConfig
from mdi.model.families import family_of
from mdi.model.layout import CheckpointError

# ggml types a weight matrix may have (ggml's CPU backend multiplies by all of them); norms,
# biases and RoPE factors are float32 in every GGUF llama.cpp writes.
MATRIX_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                "TQ1_0", "TQ2_0", "MXFP4")
VECTOR_TYPES = ("F32",)
# How the torch backend holds a GGUF's matrices (mdi.model.files.gguf): block types that are mdi
# formats already (32 values per block, float16 scale [+ min]), kept without loss...
GGUF_DIRECT = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
# ... types dequantized then re-rounded to their nearest mdi format (as many bits or more) ...
GGUF_NEAREST = {"Q4_K": "int4", "Q5_K": "int8", "Q6_K": "int8", "Q5_0": "int8", "Q5_1": "int8",
                "Q8_1": "int8", "Q8_K": "int8", "Q2_K": "int4", "Q3_K": "int4", "IQ4_NL": "int4", "IQ4_XS": "int4"}
# ... and floats, as they are. ggml computes every one of them as stored.
GGUF_FLOAT = ("F32", "F16", "BF16")
ENDS_IN = ("token_embd.weight", "position_embd.weight")  # the starter's embedding side
BLOCK_NAME = re.compile(r"blk\.(\d+)\.")  # a block tensor's name, its layer


def block_tensors(config: ModelConfig, layer: int) -> Dict[str, Tuple[int, ...]]:
    """Every tensor block `layer` holds, by GGUF name, with its dims in ggml's order."""
    fam = family_of(config.family)
    E, H, KV, D, I = config.n_embd, config.n_head, config.kv_heads, config.head_dim, config.ffn_width
    p = "blk.%d." % layer
    out: Dict[str, Tuple[int, ...]] = {p + "attn_norm.weight": (E,), p + "ffn_norm.weight": (E,)}
    if fam.norm == "layer":
        out.update({p + "attn_norm.bias": (E,), p + "ffn_norm.bias": (E,)})
    if fam.linear_bias:  # GPT-2: q, k, v fused, every linear layer with a bias
        out.update({p + "attn_qkv.weight": (E, (H + 2 * KV) * D), p + "attn_qkv.bias": ((H + 2 * KV) * D,)})
    else:
        out.update({p + "attn_q.weight": (E, H * D), p + "attn_k.weight": (E, KV * D),
                    p + "attn_v.weight": (E, KV * D)})
        if config.bias or config.qkv_bias:
            out.update({p + "attn_q.bias": (H * D,), p + "attn_k.bias": (KV * D,), p + "attn_v.bias": (KV * D,)})
    out[p + "attn_output.weight"] = (H * D, E)
    if config.bias or fam.linear_bias:
        out[p + "attn_output.bias"] = (E,)
    if config.qk_norm or fam.always_qk_norm:
        out.update({p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)})
    if fam.post_norms:
        out.update({p + "post_attention_norm.weight": (E,), p + "post_ffw_norm.weight": (E,)})
    out[p + "ffn_up.weight"] = (E, I)
    out[p + "ffn_down.weight"] = (I, E)
    if fam.mlp != "gelu":
        out[p + "ffn_gate.weight"] = (E, I)
    if fam.linear_bias:
        out.update({p + "ffn_up.bias": (I,), p + "ffn_down.bias": (E,)})
    return out


def end_tensors(config: ModelConfig, with_embedding: bool, with_head: bool) -> Dict[str, Tuple[int, ...]]:
    fam = family_of(config.family)
    E, V = config.n_embd, config.vocab_size
    out: Dict[str, Tuple[int, ...]] = {}
    if with_embedding or (with_head and config.tied_head):
        out["token_embd.weight"] = (E, V)
    if with_embedding and fam.positions == "learned":
        out["position_embd.weight"] = (E, config.block_size)
    if with_head:
        out["output_norm.weight"] = (E,)
        if fam.norm == "layer":
            out["output_norm.bias"] = (E,)
        if not config.tied_head:
            out["output.weight"] = (E, V)
    return out


def node_tensors(config: ModelConfig, first: int, last: int, with_embedding: bool, with_head: bool,
                 rope_freqs: bool = False) -> Dict[str, Tuple[int, ...]]:
    """All a node of layers [first, last) (and the ends it holds) computes with."""
    out: Dict[str, Tuple[int, ...]] = {}
    for layer in range(first, last):
        out.update(block_tensors(config, layer))
    out.update(end_tensors(config, with_embedding, with_head))
    if rope_freqs and last > first:
        out["rope_freqs.weight"] = (config.head_dim // 2,)
    return out


def check_present(where: str, want: Dict[str, Tuple[int, ...]], have: Dict[str, Tuple[str, Tuple[int, ...]]]) -> None:
    """Refuse a file missing a tensor of `want` or holding one of other dims, named as the file
    names it (both backends' GGUF readers check with it). `have`: name -> (type, dims)."""
    missing = [n for n in want if n not in have]
    if missing:
        raise CheckpointError("%s: GGUF has no tensor %s" % (where, ", ".join(missing[:4])))
    for name, dims in want.items():
        if _trimmed(have[name][1]) != _trimmed(dims):
            raise CheckpointError("%s: GGUF tensor %s has dims %s, the model needs %s"
                                  % (where, name, list(have[name][1]), list(dims)))


def check_tensors(where: str, want: Dict[str, Tuple[int, ...]], have: Dict[str, Tuple[str, Tuple[int, ...]]],
                  layers: Tuple[int, int], n_layer: int) -> None:
    """ggml's check of a file for these layers: `check_present`, then refused where it holds
    blocks past the model's `n_layer` (its block_count says fewer layers than it has: run, it
    would leave some out without a word), a block tensor mdi does not compute with, or a tensor
    of a type it cannot have."""
    check_present(where, want, have)
    blocks = {n: int(m.group(1)) for n, m in ((n, BLOCK_NAME.match(n)) for n in have) if m}
    beyond = sorted((layer, n) for n, layer in blocks.items() if layer >= n_layer)
    if beyond:
        raise CheckpointError("%s: GGUF tensor %s is past the model's %d layers (its block_count)"
                              % (where, beyond[0][1], n_layer))
    first, last = layers
    prefixes = tuple("blk.%d." % i for i in range(first, last))
    extra = sorted(n for n in have if n.startswith(prefixes) and n not in want)
    if extra:
        raise CheckpointError("%s: GGUF tensor %s is not part of this model's block (mdi does not compute it)"
                              % (where, extra[0]))
    for name, dims in want.items():
        kind = have[name][0]
        allowed = MATRIX_TYPES if len(dims) == 2 else VECTOR_TYPES
        if kind not in allowed:
            raise CheckpointError("%s: GGUF tensor %s is %s; mdi computes %s with %s" % (
                where, name, kind, "a matrix" if len(dims) == 2 else "a vector", ", ".join(allowed)))


def _trimmed(dims: Tuple[int, ...]) -> Tuple[int, ...]:
    """Dims without trailing ones ([576, 1, 1, 1] and [576] are one shape)."""
    out = list(dims)
    while len(out) > 1 and out[-1] == 1:
        out.pop()
    return tuple(int(d) for d in out)


def tensor_bytes(kind: str, dims: Tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type `kind` and dims (gguf's table: no binding needed)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n = 1
    for d in dims[1:]:
        n *= d
    return n * (dims[0] // block) * size


def typed_bytes(config: ModelConfig, types: Dict[str, str], first: int, last: int, with_embedding: bool = False,
                with_head: bool = False) -> int:
    """Bytes of a node's GGUF tensors given their types (a starter plans a ggml worker with it)."""
    dims = node_tensors(config, first, last, with_embedding, with_head, rope_freqs=True)
    return sum(tensor_bytes(kind, dims[name]) for name, kind in types.items() if name in dims)
