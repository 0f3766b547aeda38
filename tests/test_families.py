"""The model families edge users run (Llama 3.x, Qwen2.5, Qwen3): named shapes with their real
parameter counts, Hugging Face configs mapped onto them, and each family over a 3-node ring
giving the one-node ids (logit parity with transformers is tests/test_model_parity.py)."""
import pytest
import torch

from conftest import CHARS, save_test_model
from ringconfigs import parse_run_config
from mdi.model.config import ModelConfig
from mdi.model.layout import weight_bytes
from mdi.model.tokenizers import char_tokenizer
from mdi.model.transformer import full_model
from mdi.starter import batch

# Published sizes (billions of parameters, embeddings included).
SIZES = {"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03, "qwen2.5-0.5b": 0.49,
         "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62, "qwen3-0.6b": 0.60,
         "qwen3-1.7b": 1.72, "qwen3-4b": 4.02, "qwen3-8b": 8.19}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_named_configs_have_the_published_sizes(name):
    config = ModelConfig.from_name(name)
    params = weight_bytes(config, [0, config.n_layer], "float32", with_ends=True) / 4 / 1e9
    assert abs(params - SIZES[name]) <= 0.01, params
    assert ModelConfig.from_dict(config.to_dict()) == config  # travels in /init and mdi_config.json


def test_hf_configs_map_onto_the_family_flags():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=256)
    qwen2 = ModelConfig.from_hf(dict(base, model_type="qwen2", rope_theta=1e6))
    assert qwen2.qkv_bias and not qwen2.bias and not qwen2.qk_norm and qwen2.rope_theta == 1e6
    qwen3 = ModelConfig.from_hf(dict(base, model_type="qwen3", head_dim=16, attention_bias=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.head_size == 16 and qwen3.rope_theta == 5e5
    llama3 = ModelConfig.from_hf(dict(base, model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert llama3.rope_scaling == {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_context": 8192}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(dict(base, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_factors"):
        ModelConfig(n_embd=64, n_head=8, rope_factors=[1.0, 2.0])


def family_config(kind: str) -> ModelConfig:
    common = dict(family="llama", vocab_size=len(CHARS), n_layer=4, n_embd=64, n_head=8, n_kv_head=2,
                  intermediate_size=128, block_size=128)
    if kind == "llama3":
        return ModelConfig(name="tiny-llama3", tied_head=True, rope_theta=500000.0, **common, rope_scaling={
            "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context": 16})
    if kind == "qwen2":
        return ModelConfig(name="tiny-qwen2", tied_head=True, qkv_bias=True, rope_theta=1e6, **common)
    return ModelConfig(name="tiny-qwen3", tied_head=False, qk_norm=True, head_size=16, rope_theta=1e6, **common)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    out = {}
    for i, kind in enumerate(("llama3", "qwen2", "qwen3")):
        torch.manual_seed(i)
        model = full_model(family_config(kind))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 0.3) if p.dim() > 1 or name.endswith("bias") else p.uniform_(0.5, 1.5)
        path = str(tmp_path_factory.mktemp(kind))
        save_test_model(path, model.config, model.state_dict(), "tests/test_families.py")
        char_tokenizer(CHARS).save(path)
        out[kind] = path
    return out


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_each_family_over_a_ring_gives_the_one_node_ids(kind, family_models, workers):
    prompts = ["The quick brown fox", "Hi", "To be, or not to be"]

    def run(ring=(), layers=None):
        cfg = parse_run_config(family_models[kind], ring, layers=layers, n_tokens=40, runtime={"ring_timeout": 20})
        return [s.token_ids for s in batch.run(cfg, prompts).samples]

    alone = run()
    assert all(len(ids) == 40 for ids in alone) and len({tuple(i) for i in alone}) == 3
    assert run(workers[:2], [1, 2, 1]) == alone
