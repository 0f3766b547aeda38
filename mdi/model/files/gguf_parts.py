"""Which canonical weight each GGUF tensor of a model is made of (llama.cpp's names, as
convert_hf_to_gguf.py writes them): fused q/k/v rows split, q/k rows permuted for llama.cpp's
RoPE layout, gate/up rows split, Llama 3's RoPE factors (mdi.model.files.gguf_export writes them)."""
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import numpy as np
import torch

from mdi.model.config import ModelConfig
from mdi.model.families import family_of
from mdi.model.files.gguf_config import PERMUTED_QK
from mdi.model.files.gguf_encode import rows_of
from mdi.model.files.gguf_write import arch_of
from mdi.model.quantization.quant import Stored


@dataclass(frozen=True)
class Part:
    """A GGUF tensor as a part of a canonical one: rows [start, stop) of `key`, q/k rows
    permuted for llama.cpp's RoPE layout over `heads` heads (0: not permuted)."""
    key: str
    start: int = 0
    stop: Optional[int] = None
    heads: int = 0


def tensor_parts(config: ModelConfig) -> Dict[str, Part]:
    """Every GGUF tensor of the model (llama.cpp's names) -> the canonical tensor it is made
    of (RoPE factors aside: they come from the config)."""
    fam = family_of(config.family)
    permuted = arch_of(config) in PERMUTED_QK
    H, KV, D, I = config.n_head, config.kv_heads, config.head_dim, config.ffn_width
    out: Dict[str, Part] = {"token_embd.weight": Part("tok_emb.weight")}
    if fam.positions == "learned":
        out["position_embd.weight"] = Part("pos_emb.weight")
    norm_parts = ("weight", "bias") if fam.norm == "layer" else ("weight",)

    def norm(gguf: str, canonical: str) -> None:
        for part in norm_parts:
            out["%s.%s" % (gguf, part)] = Part("%s.%s" % (canonical, part))

    for i in range(config.n_layer):
        p, c = "blk.%d." % i, "blocks.%d." % i
        norm(p + "attn_norm", c + "norm1")
        if fam.linear_bias:  # GPT-2: q, k, v stay fused, every linear layer has a bias
            out[p + "attn_qkv.weight"] = Part(c + "attn.qkv.weight")
            out[p + "attn_qkv.bias"] = Part(c + "attn.qkv.bias")
        else:
            q, k = H * D, KV * D
            for part in ("weight", "bias") if config.bias or config.qkv_bias else ("weight",):
                key = c + "attn.qkv." + part
                out[p + "attn_q." + part] = Part(key, 0, q, H if permuted else 0)
                out[p + "attn_k." + part] = Part(key, q, q + k, KV if permuted else 0)
                out[p + "attn_v." + part] = Part(key, q + k, q + 2 * k)
        out[p + "attn_output.weight"] = Part(c + "attn.proj.weight")
        if config.bias or fam.linear_bias:
            out[p + "attn_output.bias"] = Part(c + "attn.proj.bias")
        if config.qk_norm or fam.always_qk_norm:
            out[p + "attn_q_norm.weight"] = Part(c + "attn.q_norm.weight")
            out[p + "attn_k_norm.weight"] = Part(c + "attn.k_norm.weight")
        if fam.post_norms:
            norm(p + "post_attention_norm", c + "post_attn_norm")
            norm(p + "post_ffw_norm", c + "post_mlp_norm")
        norm(p + "ffn_norm", c + "norm2")
        if fam.mlp == "gelu":
            for part in ("weight", "bias"):
                out[p + "ffn_up." + part] = Part(c + "mlp.fc." + part)
                out[p + "ffn_down." + part] = Part(c + "mlp.proj." + part)
        else:
            out[p + "ffn_gate.weight"] = Part(c + "mlp.gate_up.weight", 0, I)
            out[p + "ffn_up.weight"] = Part(c + "mlp.gate_up.weight", I, 2 * I)
            out[p + "ffn_down.weight"] = Part(c + "mlp.down.weight")
    norm("output_norm", "norm_f")
    if not config.tied_head:
        out["output.weight"] = Part("lm_head.weight")
    return out


def permutation(n: int, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute as a row order: within each head, HF's halves
    [x0..x(h-1), y0..y(h-1)] become llama.cpp's pairs [x0, y0, x1, y1, ...]."""
    return torch.arange(n).reshape(heads, 2, n // heads // 2).transpose(1, 2).reshape(n)


def take_part(state: Mapping[str, Stored], part: Part) -> Stored:
    w = state[part.key]
    if part.start or part.stop is not None:
        w = rows_of(w, slice(part.start, part.stop))
    if part.heads:
        w = rows_of(w, permutation(int(w.shape[0]), part.heads))
    return w


def rope_factors(config: ModelConfig) -> Optional[np.ndarray]:
    """The rope_freqs tensor (divisors of RoPE's inverse frequencies), from either form the
    config may hold Llama 3's scaling in; None without scaling."""
    if config.rope_factors is not None:
        return np.asarray(config.rope_factors, np.float32)
    if config.rope_scaling is None:
        return None
    from mdi.model.rope import llama3_scaled
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return (inv / llama3_scaled(inv, config.rope_scaling)).numpy().astype(np.float32)
