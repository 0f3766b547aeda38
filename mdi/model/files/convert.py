"""From a checkpoint's own tensor names to mdi's canonical ones (see `mdi.model.layout`),
shared by every reader, and the check that a state dict matches the model."""
import re
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from mdi.model.config import ModelConfig
from mdi.model.layout import CheckpointError, expected_shapes
from mdi.model.quantization.quant import QParts, Stored, cat_rows

StateDict = Dict[str, Stored]  # canonical names -> tensors (a weight may be a quant.QParts)
Getter = Callable[[str], torch.Tensor]


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, Stored],
                     layer_range: Optional[Tuple[int, int]] = None, with_embedding: bool = True,
                     with_head: bool = True, where: str = "state dict") -> None:
    """Raise CheckpointError on missing, unexpected or wrongly shaped tensors."""
    shapes = expected_shapes(config, layer_range or (0, config.n_layer), with_embedding, with_head)
    missing = [k for k in shapes if k not in state_dict]
    extra = sorted(k for k in state_dict if k not in shapes)
    if missing or extra:
        raise CheckpointError("%s does not match the model: missing %s; unexpected %s"
                              % (where, short(missing), short(extra)))
    bad = ["%s %s != %s" % (k, tuple(state_dict[k].shape), s) for k, s in shapes.items()
           if tuple(state_dict[k].shape) != s]
    if bad:
        raise CheckpointError("%s has wrong tensor shapes: %s" % (where, short(bad)))


def short(items: Sequence[str], n: int = 6) -> str:
    if not items:
        return "none"
    return ", ".join(items[:n]) + (" (+%d more)" % (len(items) - n) if len(items) > n else "")


# ----------------------------------------------------------------------------- shared converters

def convert_gpt2(config: ModelConfig, get: Getter, has: Callable[[str], bool],
                  conv1d: bool) -> StateDict:
    """GPT-2 names (prefix already stripped) -> canonical. HF's Conv1D stores [in, out]."""
    def w(name: str) -> torch.Tensor:
        t = get(name)
        return t.t().contiguous() if conv1d and t.dim() == 2 else t

    def b(name: str, like: torch.Tensor) -> torch.Tensor:
        # nanoGPT with bias=False has no bias tensors: zeros compute the same function
        return get(name) if has(name) else torch.zeros(like.shape[0], dtype=like.dtype)

    sd: StateDict = {"tok_emb.weight": get("wte.weight"), "pos_emb.weight": get("wpe.weight")}
    pairs = [("ln_1", "norm1"), ("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
             ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj")]
    for i in range(config.n_layer):
        for src, dst in pairs:
            src, dst = "h.%d.%s" % (i, src), "blocks.%d.%s" % (i, dst)
            weight = get(src + ".weight") if src.endswith(("ln_1", "ln_2")) else w(src + ".weight")
            sd[dst + ".weight"] = weight
            sd[dst + ".bias"] = b(src + ".bias", weight)
    sd["norm_f.weight"] = norm_f = get("ln_f.weight")
    sd["norm_f.bias"] = b("ln_f.bias", norm_f)
    return sd


def convert_llama(config: ModelConfig, get: Getter) -> StateDict:
    """HF Llama / Qwen2 / Qwen3 names (``model.`` prefix stripped) -> canonical; q/k/v and
    gate/up fused."""
    sd: StateDict = {"tok_emb.weight": get("embed_tokens.weight")}
    for i in range(config.n_layer):
        s, d = "layers.%d." % i, "blocks.%d." % i
        sd[d + "norm1.weight"] = get(s + "input_layernorm.weight")
        for part in ("weight", "bias") if config.bias or config.qkv_bias else ("weight",):
            sd[d + "attn.qkv." + part] = cat_rows([get(s + "self_attn.%s_proj.%s" % (x, part)) for x in "qkv"])
        for part in ("weight", "bias") if config.bias else ("weight",):
            sd[d + "attn.proj." + part] = get(s + "self_attn.o_proj." + part)
        if config.qk_norm:
            sd[d + "attn.q_norm.weight"] = get(s + "self_attn.q_norm.weight")
            sd[d + "attn.k_norm.weight"] = get(s + "self_attn.k_norm.weight")
        sd[d + "norm2.weight"] = get(s + "post_attention_layernorm.weight")
        sd[d + "mlp.gate_up.weight"] = cat_rows([get(s + "mlp.gate_proj.weight"), get(s + "mlp.up_proj.weight")])
        sd[d + "mlp.down.weight"] = get(s + "mlp.down_proj.weight")
    sd["norm_f.weight"] = get("norm.weight")
    if not config.tied_head:
        sd["lm_head.weight"] = get("lm_head.weight")
    return sd


def convert_gemma3(config: ModelConfig, get: Getter, norm_shift: float) -> StateDict:
    """HF Gemma 3 text names (``model.`` prefix stripped) -> canonical. Four norms a block:
    input_layernorm -> norm1, post_attention_layernorm -> post_attn_norm, pre_feedforward_layernorm
    -> norm2, post_feedforward_layernorm -> post_mlp_norm. Canonical norm weights are the
    multipliers as applied: HF stores w for a norm computing (1 + w), so `norm_shift` 1 (added in
    float32); a GGUF stores w + 1 already (llama.cpp's converter adds it), so 0."""
    def norm(name: str) -> torch.Tensor:
        t = get(name)
        return (t.float() + norm_shift).to(t.dtype) if norm_shift else t

    sd: StateDict = {"tok_emb.weight": get("embed_tokens.weight")}
    for i in range(config.n_layer):
        s, d = "layers.%d." % i, "blocks.%d." % i
        sd[d + "norm1.weight"] = norm(s + "input_layernorm.weight")
        for part in ("weight", "bias") if config.bias else ("weight",):
            sd[d + "attn.qkv." + part] = cat_rows([get(s + "self_attn.%s_proj.%s" % (x, part)) for x in "qkv"])
            sd[d + "attn.proj." + part] = get(s + "self_attn.o_proj." + part)
        sd[d + "attn.q_norm.weight"] = norm(s + "self_attn.q_norm.weight")
        sd[d + "attn.k_norm.weight"] = norm(s + "self_attn.k_norm.weight")
        sd[d + "post_attn_norm.weight"] = norm(s + "post_attention_layernorm.weight")
        sd[d + "norm2.weight"] = norm(s + "pre_feedforward_layernorm.weight")
        sd[d + "mlp.gate_up.weight"] = cat_rows([get(s + "mlp.gate_proj.weight"), get(s + "mlp.up_proj.weight")])
        sd[d + "mlp.down.weight"] = get(s + "mlp.down_proj.weight")
        sd[d + "post_mlp_norm.weight"] = norm(s + "post_feedforward_layernorm.weight")
    sd["norm_f.weight"] = norm("norm.weight")
    if not config.tied_head:
        sd["lm_head.weight"] = get("lm_head.weight")
    return sd


def make_getter(tensors: Mapping[str, Callable[[], torch.Tensor]], dtype: torch.dtype,
                 where: str, used: set) -> Getter:
    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError("%s: tensor %r is missing" % (where, name))
        used.add(name)
        t = tensors[name]()
        return t if isinstance(t, QParts) else t.to(dtype)  # quantized weights stay quantized
    return get


def check_unused(names: Sequence[str], used: set, ignore: Optional[str], where: str) -> None:
    """Unknown tensors mean a layout we do not model (e.g. extra biases): refuse, don't drop."""
    extra = sorted(n for n in names if n not in used and not (ignore and re.search(ignore, n)))
    if extra:
        raise CheckpointError("%s: unsupported tensors %s" % (where, short(extra)))
