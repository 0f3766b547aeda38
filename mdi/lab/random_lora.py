"""Random LoRA adapters of a model's shapes, written as PEFT directories (as `save_pretrained`
writes them): what benchmarks and tests load when no trained adapter exists. Their timing and
memory are real; their text is not."""
import json
import os
from typing import Dict, Sequence, Tuple

import torch
from safetensors.torch import save_file

from mdi.model.config import ModelConfig

GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: ModelConfig) -> Tuple[str, Dict[str, Tuple[int, int]]]:
    """The HF prefix of block i and each targeted module's (in, out)."""
    E, I = config.n_embd, config.ffn_width
    if config.family == "gpt2":
        return "base_model.model.transformer.h.%d.", {"attn.c_attn": (E, 3 * E), "attn.c_proj": (E, E),
                                                      "mlp.c_fc": (E, I), "mlp.c_proj": (I, E)}
    H, KV, D = config.n_head, config.kv_heads, config.head_dim
    return "base_model.model.model.layers.%d.", {
        "self_attn.q_proj": (E, H * D), "self_attn.k_proj": (E, KV * D), "self_attn.v_proj": (E, KV * D),
        "self_attn.o_proj": (H * D, E), "mlp.gate_proj": (E, I), "mlp.up_proj": (E, I), "mlp.down_proj": (I, E)}


def write_random_lora(path: str, config: ModelConfig, seed: int, rank: int = 8, std: float = 0.2,
                      layers: Sequence[int] = ()) -> str:
    """A PEFT LoRA directory at `path`: every linear layer of the blocks (or of `layers`)
    targeted, A and B drawn from N(0, std) (B not zero, so the adapter changes the text)."""
    g = torch.Generator().manual_seed(seed)
    prefix, modules = _shapes(config)
    tensors = {}
    for i in layers or range(config.n_layer):
        for name, (n_in, n_out) in modules.items():
            base = prefix % i + name
            tensors[base + ".lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[base + ".lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(GPT2_TARGETS if config.family == "gpt2" else LLAMA_TARGETS),
                   "fan_in_fan_out": config.family == "gpt2", "bias": "none", "lora_dropout": 0.0}
    if layers:
        config_json["layers_to_transform"] = sorted(layers)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config_json, f)
    return path
