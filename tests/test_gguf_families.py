"""GGUF files of the llama / qwen2 / qwen3 architectures, written from random Hugging Face
models the way llama.cpp's convert_hf_to_gguf.py writes them (its tensor names, q/k permuted
for llama only, Llama 3's RoPE scaling as the rope_freqs tensor, its metadata keys): read
back, they compute what the Hugging Face directory computes, and what mdi does not model is
refused naming the key."""
import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from mdi.model.files.checkpoints import read_hf_dir  # noqa: E402
from mdi.model.files.gguf import read_gguf  # noqa: E402
from mdi.model.layout import CheckpointError  # noqa: E402
from mdi.model.quantization import qkernels  # noqa: E402
from mdi.model.quantization.quant import QParts, convert  # noqa: E402
from mdi.model.source import build_chunk  # noqa: E402
from test_model_parity import greedy  # noqa: E402

PREFILL, DECODE, GREEDY, VOCAB = 24, 4, 12, 500
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=128)


# ----------------------------------------------------------------------------- random HF models

def hf_llama3():
    # Llama 3.1/3.2's RoPE scaling over a context 8x the "original" one; tied head
    cfg = transformers.LlamaConfig(tie_word_embeddings=True, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                   **SMALL)
    return transformers.LlamaForCausalLM(cfg)


def hf_llama_wide():
    # llama with heads wider than n_embd / n_head: the q/k permutation works on head_dim rows
    cfg = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=10000.0, head_dim=16, **SMALL)
    return transformers.LlamaForCausalLM(cfg)


def hf_qwen2():
    cfg = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1000000.0, **SMALL)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # q/k/v biases start at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    return model


def hf_qwen3():
    # head_dim 16 while hidden / heads = 8; untied head
    cfg = transformers.Qwen3Config(tie_word_embeddings=False, rope_theta=1000000.0, head_dim=16, **SMALL)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # q/k norms start at one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("_norm.weight") and "self_attn" in name:
                p.uniform_(0.5, 1.5)
    return model


# ----------------------------------------------------------------------------- llama.cpp's conventions

def permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute (numpy)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def llama3_rope_factors(hparams, rope):
    """LlamaModel.generate_extra_tensors: the rope_freqs tensor for rope_type llama3. (llama.cpp
    reads original_max_position_embeddings from the top level of config.json, defaulting to
    Llama 3's 8192; this model keeps it only in its rope parameters, so it is taken there.)"""
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings",
                               hparams.get("original_max_position_embeddings", 8192))
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def rope_parameters(hparams):
    # transformers >= 5 writes rope_parameters; before, rope_theta and rope_scaling
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hparams.get("rope_theta", 10000.0))
    return rope


def q8_0_roundtrip(t):
    from gguf.quants import dequantize, quantize
    a = t.detach().float().numpy()
    return torch.from_numpy(dequantize(quantize(a, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
                            .reshape(a.shape))


def quantizable(name, shape, qtype):
    # llama.cpp quantizes 2-D weights whose rows split into 32-blocks, and keeps norms (1-D) F32
    return qtype is not None and len(shape) == 2 and shape[-1] % 32 == 0 and name.endswith(".weight")


def write_gguf(path, hf_dir, arch, qtype=None, extra=None):
    """A GGUF of the HF model in `hf_dir` as convert_hf_to_gguf.py writes it for `arch`:
    LlamaModel (llama) or Qwen2Model / Qwen3Model (qwen2, qwen3). `extra(writer)` adds keys."""
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    with open(hf_dir + "/config.json") as f:
        hp = json.load(f)
    n_layer, n_head, n_kv = hp["num_hidden_layers"], hp["num_attention_heads"], hp["num_key_value_heads"]
    rope = rope_parameters(hp)
    w = gguf.GGUFWriter(str(path), arch)
    # TextModel.set_gguf_parameters
    w.add_block_count(n_layer)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)
    # the tokenizer's special ids (mdi's config takes them from there)
    if hp.get("bos_token_id") is not None:
        w.add_bos_token_id(hp["bos_token_id"])
    if hp.get("eos_token_id") is not None:
        w.add_eos_token_id(hp["eos_token_id"])
    if extra:
        extra(w)

    if arch == "llama" and rope.get("rope_type", rope.get("type")) == "llama3":  # generate_extra_tensors
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hp, rope))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layer)
    for name, data in load_file(hf_dir + "/model.safetensors").items():
        data = data.astype(np.float32)
        if arch == "llama":  # LlamaModel.modify_tensors; Qwen2Model / Qwen3Model do not permute
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute(data, n_head, n_head)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute(data, n_head, n_kv)
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        if quantizable(new_name, data.shape, qtype):
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(new_name, quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(new_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def saved(tmp_path, make, q8=False):
    torch.manual_seed(0)
    model = make().eval()
    if q8:  # weights llama.cpp will store as Q8_0 rounded to it first, so both sides hold the same values
        with torch.no_grad():
            for name, p in model.named_parameters():
                if quantizable(name, p.shape, "Q8_0") and "norm" not in name:
                    p.copy_(q8_0_roundtrip(p))
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    return hf_dir


# ----------------------------------------------------------------------------- parity

def chunk_of(config, weights, quant=None):
    if quant is not None:
        weights = convert(weights, quant, torch.float32)
    return build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, "cpu", quant=quant)


@torch.no_grad()
def logits(chunk, ids):
    chunk.allocate_cache(2, len(ids))
    slot = 1
    out = [chunk.head(chunk.forward_blocks(chunk.embed(ids[:PREFILL], 0), slot, 0))]
    for t in range(PREFILL, len(ids)):
        out.append(chunk.head(chunk.forward_blocks(chunk.embed(ids[t:t + 1], t), slot, t)))
    return torch.cat(out)


def assert_same_model(hf_config, hf_weights, config, weights, quant=None):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (PREFILL + DECODE,))
    ref, ours = chunk_of(hf_config, hf_weights), chunk_of(config, weights, quant)
    a, b = logits(ref, ids), logits(ours, ids)
    assert (a - b).abs().max() <= 1e-5
    prompt = torch.tensor([5, 17, 99, 3, 250, 42])
    assert greedy(ref, prompt, GREEDY) == greedy(ours, prompt, GREEDY)


CASES = {  # id -> (HF model, GGUF architecture, what the GGUF must have made of it)
    "llama3-rope-scaling-tied": (hf_llama3, "llama", dict(tied_head=True, head_size=None)),
    "llama-wide-heads": (hf_llama_wide, "llama", dict(tied_head=False, head_size=16)),
    "qwen2-qkv-bias-tied": (hf_qwen2, "qwen2", dict(tied_head=True, qkv_bias=True, bias=False)),
    "qwen3-qk-norm-wide-heads": (hf_qwen3, "qwen3", dict(tied_head=False, qk_norm=True, head_size=16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_family_computes_what_the_hf_dir_does(tmp_path, case):
    make, arch, expect = CASES[case]
    hf_dir = saved(tmp_path, make)
    hf_config, hf_weights = read_hf_dir(hf_dir)
    config, weights = read_gguf(write_gguf(tmp_path / "m.gguf", hf_dir, arch))
    for key, value in expect.items():
        assert getattr(config, key) == value, key
    # the same model but for its name and the form of the RoPE scaling
    same = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("name", "rope_scaling", "rope_factors")}  # noqa: E731
    assert same(config) == same(hf_config)
    if hf_config.rope_scaling is not None:
        assert config.rope_scaling is None and len(config.rope_factors) == config.head_dim // 2
        assert max(config.rope_factors) == hf_config.rope_scaling["factor"]
    else:
        assert config.rope_factors is None
    assert sorted(weights) == sorted(hf_weights)
    assert_same_model(hf_config, hf_weights, config, weights)


@pytest.mark.parametrize("case", ["llama3-rope-scaling-tied", "qwen3-qk-norm-wide-heads"])
def test_q8_0_gguf_family_kept_quantized(tmp_path, case):
    """Q8_0 blocks taken over as int8 (llama's permuted q/k rows too) compute what the HF
    model with the same (Q8_0-rounded) weights does: with the exact kernels, bit for bit."""
    qkernels.set_preference("exact")
    try:
        _q8_0_kept_quantized(tmp_path, case)
    finally:
        qkernels.set_preference(None)


def _q8_0_kept_quantized(tmp_path, case):
    make, arch, _ = CASES[case]
    hf_dir = saved(tmp_path, make, q8=True)
    hf_config, hf_weights = read_hf_dir(hf_dir)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, arch, qtype="Q8_0")
    config, stored = read_gguf(path, keep_quant=True)
    spec = {k[:-len(".weight")]: v.spec for k, v in stored.items() if isinstance(v, QParts)}
    assert spec["blocks.0.attn.qkv"].kind == "int8" and "blocks.0.mlp.gate_up" in spec
    assert "blocks.0.mlp.down" not in spec  # 176 columns: not 32-blocks, stored F32 as llama.cpp does
    assert_same_model(hf_config, hf_weights, config, stored, quant=spec)
    _, floats = read_gguf(path)  # dequantized: the same numbers
    assert_same_model(hf_config, hf_weights, config, floats)


# ----------------------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("qwen2"), hf_qwen2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("llama"), hf_llama_wide)


@pytest.mark.parametrize("arch, split, match", [
    ("gemma2", None, r"g\.gguf: GGUF general\.architecture 'gemma2' is not supported"),
    # llama-gguf-split's first part holds the metadata and some tensors: read as a whole model it
    # had failed on a missing tensor (and its later parts as "architecture None")
    ("llama", 3, r"g\.gguf: one part of a GGUF split into 3 files .*llama-gguf-split --merge"),
])
def test_a_gguf_mdi_cannot_read_is_refused_saying_why(tmp_path, arch, split, match):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch)
    if split:
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", split)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=match):
        read_gguf(str(tmp_path / "g.gguf"))


@pytest.mark.parametrize("extra, match", [
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0),
                w.add_rope_scaling_orig_ctx_len(32)),
     r"m\.gguf: GGUF metadata qwen2\.rope\.scaling\.type = 'yarn'"),
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(2.0)),
     r"m\.gguf: GGUF metadata qwen2\.rope\.scaling\.factor = 2\.0: linear RoPE scaling"),
    (lambda w: w.add_rope_dimension_count(4), r"qwen2\.rope\.dimension_count = 4: partial rotary"),
    (lambda w: w.add_expert_count(8), r"qwen2\.expert_count = 8: a mixture of experts"),
], ids=["yarn", "linear", "partial-rotary", "experts"])
def test_unmodelled_metadata_is_refused_naming_the_key(tmp_path, qwen2_dir, extra, match):
    with pytest.raises(CheckpointError, match=match):
        read_gguf(write_gguf(tmp_path / "m.gguf", qwen2_dir, "qwen2", extra=extra))


def test_scaling_type_none_or_unit_factor_reads(tmp_path, qwen2_dir):
    for i, extra in enumerate([lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.NONE),
                               lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                          w.add_rope_scaling_factor(1.0))]):
        config, _ = read_gguf(write_gguf(tmp_path / ("m%d.gguf" % i), qwen2_dir, "qwen2", extra=extra))
        assert config.qkv_bias and config.rope_factors is None


def test_qk_norms_in_a_llama_gguf_are_refused(tmp_path, llama_dir):
    # llama's layout has no q/k norms (llama.cpp would not load them): refused, not dropped
    path = write_gguf(tmp_path / "n.gguf", llama_dir, "llama",
                      extra=lambda w: w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, dtype=np.float32)))
    with pytest.raises(CheckpointError, match=r"unsupported tensors blk\.0\.attn_q_norm\.weight"):
        read_gguf(path)
