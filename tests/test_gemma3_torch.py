"""Gemma 3 (its text model) on the torch backend: a tiny random Gemma3ForCausalLM saved as a
Hugging Face directory computes in mdi what transformers computes (within 1e-4 in float32), in
a prefill, step by step from the KV cache, several samples in one pass, a verification's rows
and the training path, with its sliding-window layers (window 4, every 2nd layer global)
mattering well inside a 16-token prompt. Its decode steps as one TorchScript call equal the
eager blocks bit for bit, and a CUDA graph's step logic (run on the CPU) equals them too. The
same model written as llama.cpp's converter writes a gemma3 GGUF reads back as the same model.
The real Gemma 3 270M GGUF (conftest's gemma3_gguf) decodes greedily what llama.cpp does."""
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from mdi.model import fused_decode, graph_decode  # noqa: E402
from mdi.model.config import ModelConfig  # noqa: E402
from mdi.model.files.checkpoints import read_hf_dir  # noqa: E402
from mdi.model.files.gguf import read_gguf  # noqa: E402
from mdi.model.layout import CheckpointError, expected_keys  # noqa: E402
from mdi.model.quantization.quant import QParts  # noqa: E402
from mdi.model.row_batch import RowBatch  # noqa: E402
from mdi.model.source import build_chunk  # noqa: E402

VOCAB, WINDOW, TOL = 300, 4, 1e-4


def tiny_hf(query_pre_attn_scalar=20):
    # heads 24 wide (4 x 24 != 64: wider than n_embd / n_head, as Gemma's are); queries scaled by
    # 20 ** -0.5, not 24 ** -0.5; layers 0 and 2 see their last 4 positions, 1 and 3 all
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, sliding_window=WINDOW, sliding_window_pattern=2,
        max_position_embeddings=64, query_pre_attn_scalar=query_pre_attn_scalar, rope_theta=10000.0,
        rope_local_base_freq=100.0, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at zero (a multiplier of one): make them, and the + 1, matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(HF model as read back from disk, its directory, mdi's full-model chunk of it)."""
    path = str(tmp_path_factory.mktemp("gemma3"))
    tiny_hf().save_pretrained(path)
    hf = transformers.Gemma3ForCausalLM.from_pretrained(path).eval()
    config, weights = read_hf_dir(path)
    return hf, path, build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, "cpu")


@torch.no_grad()
def reference(hf, ids):
    return hf(torch.as_tensor(ids)[None]).logits[0]


def test_hf_config_and_canonical_names(gemma):
    _, _, chunk = gemma
    c = chunk.config
    assert (c.family, c.sliding_window, c.sliding_pattern, c.rope_local_theta, c.rope_theta) == \
        ("gemma3", WINDOW, 2, 100.0, 10000.0)
    assert c.qk_norm and c.tied_head and c.head_dim == 24 and c.gelu_approximate == "tanh"
    assert c.attn_scale == pytest.approx(20 ** -0.5)
    assert [c.layer_window(i) for i in range(4)] == [WINDOW, 0, WINDOW, 0]
    assert ModelConfig.from_dict(c.to_dict()) == c  # travels in /init and mdi_config.json
    keys = expected_keys(c, (1, 2), False, False)
    assert keys == ["blocks.1.norm1.weight", "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight",
                    "blocks.1.attn.q_norm.weight", "blocks.1.attn.k_norm.weight", "blocks.1.post_attn_norm.weight",
                    "blocks.1.norm2.weight", "blocks.1.mlp.gate_up.weight", "blocks.1.mlp.down.weight",
                    "blocks.1.post_mlp_norm.weight"]
    assert sorted(chunk.state_dict()) == sorted(expected_keys(c, (0, 4), True, True))
    # canonical norms hold the multiplier: HF's w + 1
    hf, _, _ = gemma
    w = hf.model.layers[1].pre_feedforward_layernorm.weight
    assert torch.equal(chunk.state_dict()["blocks.1.norm2.weight"], w + 1)


@torch.no_grad()
def test_prefill_and_cached_decode_past_the_window(gemma):
    hf, _, chunk = gemma
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (28,))
    ref = reference(hf, ids)
    assert ref.abs().max() > 1  # logits of some size, so 1e-4 says something
    chunk.allocate_cache(3, 28)
    slot = 2
    out = [chunk.head(chunk.forward_blocks(chunk.embed(ids[:16], 0), slot, 0))]
    for t in range(16, 28):
        out.append(chunk.head(chunk.forward_blocks(chunk.embed(ids[t:t + 1], t), slot, t)))
    got = torch.cat(out)
    assert (got[:16] - ref[:16]).abs().max() <= TOL
    assert (got[16:] - ref[16:]).abs().max() <= TOL
    # and the window is what made that so: with one as long as the context (the same RoPE bases),
    # rows past position 4 differ
    c = chunk.config
    whole = build_chunk(dataclasses.replace(c, sliding_window=c.block_size), chunk.state_dict(),
                        0, c.n_layer, True, True, torch.float32, "cpu")
    whole.allocate_cache(1, 16)
    unwindowed = whole.head(whole.forward_blocks(whole.embed(ids[:16], 0), 0, 0))
    assert (unwindowed[:WINDOW] - ref[:WINDOW]).abs().max() <= TOL
    assert (unwindowed[WINDOW:] - ref[WINDOW:16]).abs().max() > 1e-2


@torch.no_grad()
def test_forward_batch_training_path(gemma):
    hf, _, chunk = gemma
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 20))
    ref = hf(ids).logits
    assert (chunk.forward_batch(ids) - ref).abs().max() <= TOL


def _rows(chunk, batch, ids_per_sample):
    ids = torch.cat([torch.as_tensor(i) for i in ids_per_sample])
    return chunk.forward_rows(chunk.embed_rows(ids, batch.positions), batch)


@torch.no_grad()
def test_several_samples_in_one_pass(gemma):
    """Three samples in three slots, prefilled in one pass (each at its own length), then decoded
    together (one row each: one SDPA call), then unequal frames (one sample still prefilling):
    each sample's logits are transformers' for its own sequence."""
    hf, _, chunk = gemma
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (24, 22, 26)]
    refs = [reference(hf, s) for s in seqs]
    slots, lens = [2, 0, 1], [16, 7, 11]
    chunk.allocate_cache(3, 32)
    batch = RowBatch.of(slots, [0, 0, 0], lens)
    y = chunk.head(_rows(chunk, batch, [s[:n] for s, n in zip(seqs, lens)]))
    row = 0
    for ref, n in zip(refs, lens):
        assert (y[row:row + n] - ref[:n]).abs().max() <= TOL
        row += n
    for _ in range(5):  # decode steps of all three at once, at positions 16.., 7.., 11..
        batch = RowBatch.of(slots, lens, [1, 1, 1])
        y = chunk.head(_rows(chunk, batch, [s[n:n + 1] for s, n in zip(seqs, lens)]))
        for i, (ref, n) in enumerate(zip(refs, lens)):
            assert (y[i] - ref[n]).abs().max() <= TOL
        lens = [n + 1 for n in lens]
    counts = [1, 6, 3]  # unequal frame: sample 1 brings six rows, 2 three, 0 one
    batch = RowBatch.of(slots, lens, counts)
    y = chunk.head(_rows(chunk, batch, [s[n:n + c] for s, n, c in zip(seqs, lens, counts)]))
    row = 0
    for ref, n, c in zip(refs, lens, counts):
        assert (y[row:row + c] - ref[n:n + c]).abs().max() <= TOL
        row += c


@torch.no_grad()
def test_verification_rows_attend_row_by_row(gemma):
    """A speculative verification's rows (RowBatch.row_wise): each row as its own decode step,
    within its layer's window."""
    hf, _, chunk = gemma
    torch.manual_seed(4)
    a, b = torch.randint(0, VOCAB, (20,)), torch.randint(0, VOCAB, (18,))
    ra, rb = reference(hf, a), reference(hf, b)
    chunk.allocate_cache(2, 24)
    _rows(chunk, RowBatch.of([1, 0], [0, 0], [12, 9]), [a[:12], b[:9]])
    batch = RowBatch.of([1, 0], [12, 9], [5, 6], row_wise=True)
    assert batch.row_wise
    y = chunk.head(_rows(chunk, batch, [a[12:17], b[9:15]]))
    assert (y[:5] - ra[12:17]).abs().max() <= TOL
    assert (y[5:] - rb[9:15]).abs().max() <= TOL


def _frames(chunk, fused, counts, passes, row_wise):
    """Prompts of 6, 9, 12 tokens (past the window) in slots 1.., then `passes` frames of
    `counts` rows per sample (a verification's where `row_wise`); the logits of every frame."""
    chunk.fused_decode = fused
    chunk._decode_script.clear()
    chunk.allocate_cache(len(counts) + 1, 64)
    assert (chunk._decode_script["module"] is not None) == fused
    out = []
    with torch.inference_mode():
        for s in range(len(counts)):
            prompt = (torch.arange(6 + 3 * s) * 7) % VOCAB
            chunk.forward_rows(chunk.embed_rows(prompt, torch.arange(len(prompt))),
                               RowBatch.of([s + 1], [0], [len(prompt)]))
        starts = [6 + 3 * s for s in range(len(counts))]
        ids = torch.arange(sum(counts)) % VOCAB
        for _ in range(passes):
            batch = RowBatch.of([s + 1 for s in range(len(counts))], starts, counts, row_wise=row_wise)
            logits = chunk.head(chunk.forward_rows(chunk.embed_rows(ids, batch.positions), batch))
            out.append(logits)
            ids = logits.argmax(-1)
            starts = [start + c for start, c in zip(starts, counts)]
    return out


@pytest.mark.skipif(not hasattr(torch, "rms_norm"), reason="this torch has no torch.rms_norm: decode stays eager")
@pytest.mark.parametrize("counts, row_wise", [([1], False), ([1, 1, 1], False), ([3, 1, 5], True)],
                         ids=["one-sample", "several-in-one-call", "verification"])
def test_scripted_decode_is_the_eager_result_bit_for_bit(gemma, counts, row_wise, monkeypatch):
    """The TorchScript decode (mdi.model.fused_decode) covers Gemma 3's block: decode frames and
    verifications, windows and local RoPE included, equal the eager blocks' bit for bit."""
    _, _, chunk = gemma
    assert fused_decode.why_not(chunk) == ""
    calls = []
    real = fused_decode.forward
    monkeypatch.setattr(fused_decode, "forward", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    try:
        eager = _frames(chunk, False, counts, 8, row_wise)
        del calls[:]
        scripted = _frames(chunk, True, counts, 8, row_wise)
    finally:
        chunk.fused_decode = True
    assert sum(c is not None for c in calls) == 8  # every frame but the prefills ran as one call
    for step, (a, b) in enumerate(zip(eager, scripted)):
        assert torch.equal(a, b), "step %d differs by %.3g" % (step, float((a - b).abs().max()))


@torch.no_grad()
def test_a_recorded_steps_logic_is_the_eager_result(gemma):
    """A CUDA graph's step (mdi.model.graph_decode.DecodeStep, run here without recording, as
    tests/test_cuda.py checks it on a CPU): whole slots read, the window's mask and the local RoPE
    tables built from the step's own tensors, one row or a verification's four per sample."""
    _, _, chunk = gemma
    chunk.allocate_cache(4, 64)
    history = {0: 5, 1: 17, 3: 30}  # past the window of 4 everywhere
    g = torch.Generator().manual_seed(5)
    for slot, n in history.items():
        b = RowBatch.of([slot], [0], [n])
        chunk.forward_rows(chunk.embed_rows(torch.randint(0, VOCAB, (n,), generator=g), b.positions), b)
    steps = {}

    def step(slots, rows=1):
        starts = [history[s] for s in slots]
        frame = lambda: RowBatch.of(slots, starts, [rows] * len(slots))  # noqa: E731
        x = chunk.embed_rows(torch.randint(0, VOCAB, (rows * len(slots),), generator=g), frame().positions)
        before = chunk.cache.k.clone(), chunk.cache.v.clone()
        eager = chunk.forward_rows(x, frame())
        chunk.cache.k.copy_(before[0])
        chunk.cache.v.copy_(before[1])
        key = (len(slots), rows)
        got = steps.setdefault(key, graph_decode.DecodeStep(chunk, len(slots), rows, x.dtype, record=False))(
            chunk, x, frame())
        assert (got - eager).abs().max() <= 1e-5 * max(1.0, float(eager.abs().max())), (slots, starts, rows)
        for s in slots:
            history[s] += rows

    for _ in range(2):
        step([1])
        step([0, 1, 3])
        step([3], rows=4)
        step([0, 1], rows=4)


# ----------------------------------------------------------------------------- other HF layouts, refusals

def _rewrite_config(path, **changes):
    fn = os.path.join(path, "config.json")
    with open(fn) as f:
        hp = json.load(f)
    hp.update(changes)
    with open(fn, "w") as f:
        json.dump(hp, f)
    return hp


def test_multimodal_gemma3_dir_reads_its_text_model(gemma, tmp_path):
    """model_type gemma3: the text model under model.language_model., a vision tower left aside."""
    from safetensors.torch import load_file, save_file
    hf, path, chunk = gemma
    tensors = load_file(os.path.join(path, "model.safetensors"))
    moved = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    moved["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    moved["model.multi_modal_projector.mm_input_projection_weight"] = torch.ones(8, 64)
    save_file(moved, str(tmp_path / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}, f)
    config, weights = read_hf_dir(str(tmp_path))
    assert dataclasses.replace(config, name=chunk.config.name) == chunk.config
    assert all(torch.equal(weights[k], v) for k, v in chunk.state_dict().items())


BASE = dict(model_type="gemma3_text", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=8)


@pytest.mark.parametrize("changes, match", [
    (dict(final_logit_softcapping=30.0), r"final_logit_softcapping = 30\.0: logit soft-capping is not supported"),
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping = 50\.0: logit soft-capping"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 8.0}), r"rope type 'linear' \(full_attention layers\)"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
     r"layer_types: only every Nth layer global"),
    (dict(use_bidirectional_attention=True), r"bidirectional attention is not supported"),
    (dict(hidden_activation="relu"), r"hidden_activation 'relu' is not supported"),
], ids=["final-softcap", "attn-softcap", "rope-scaling", "layer-types", "bidirectional", "activation"])
def test_unmodelled_hf_configs_are_refused_in_one_line(tmp_path, changes, match):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(BASE, **changes), f)
    with pytest.raises(CheckpointError, match=match) as e:
        read_hf_dir(str(tmp_path))
    assert "\n" not in str(e.value)


def test_hf_config_defaults_and_older_layouts():
    # transformers < 4.53: sliding_window_pattern, rope_local_base_freq, rope_theta; nulls are fine
    c = ModelConfig.from_hf(dict(BASE, sliding_window_pattern=3, rope_local_base_freq=5000.0, rope_theta=2e5,
                                 final_logit_softcapping=None, rope_scaling=None))
    assert (c.sliding_pattern, c.rope_local_theta, c.rope_theta, c.attn_scale) == (3, 5000.0, 2e5, 256 ** -0.5)
    d = ModelConfig.from_hf(dict(model_type="gemma3_text"))  # Gemma3TextConfig's own defaults
    assert (d.n_layer, d.n_embd, d.head_dim, d.sliding_window, d.sliding_pattern, d.vocab_size) == \
        (26, 2304, 256, 4096, 6, 262208)


# ----------------------------------------------------------------------------- GGUF

def write_gemma3_gguf(path, hf_dir, extra=None):
    """A gemma3 GGUF as llama.cpp's convert_hf_to_gguf.py (Gemma3Model) writes one: its metadata,
    q/k not permuted, every norm weight stored plus one."""
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        hp = json.load(f)
    n_layer = hp["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_rope_freq_base(hp["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(hp["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_sliding_window_pattern(2)
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])
    if extra:
        extra(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n_layer)
    for name, data in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        data = data.astype(np.float32)
        if name.endswith("norm.weight"):
            data = data + 1  # Gemma3Model.modify_tensors: norm_shift
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        w.add_tensor(new_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@torch.no_grad()
def test_gemma3_gguf_computes_what_the_hf_dir_does(gemma, tmp_path):
    hf, path, chunk = gemma
    config, weights = read_gguf(write_gemma3_gguf(tmp_path / "g.gguf", path))
    # llama.cpp scales queries by 1 / sqrt(head_dim) whatever query_pre_attn_scalar says: all else is the same
    assert config.attn_scale == pytest.approx(24 ** -0.5)
    hf_config = dataclasses.replace(chunk.config, name=config.name, attn_scale=config.attn_scale)
    assert config == hf_config
    assert sorted(weights) == sorted(chunk.state_dict())
    for k, v in chunk.state_dict().items():
        assert (weights[k] - v).abs().max() <= 1e-6, k  # the norms: w + 1 in float32 on either side
    ours = build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, "cpu")
    ref = build_chunk(hf_config, chunk.state_dict(), 0, config.n_layer, True, True, torch.float32, "cpu")
    ids = torch.randint(0, VOCAB, (2, 16))
    assert (ours.forward_batch(ids) - ref.forward_batch(ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_soft_capping_gguf_is_refused_in_one_line(gemma, tmp_path, key):
    _, path, _ = gemma
    extra = (lambda w: w.add_final_logit_softcapping(30.0)) if key == "final_logit_softcapping" \
        else (lambda w: w.add_attn_logit_softcapping(50.0))
    with pytest.raises(CheckpointError, match=r"g\.gguf: GGUF metadata gemma3\.\w+_softcapping = \d+\.0: "
                                              r"logit soft-capping is not supported") as e:
        read_gguf(write_gemma3_gguf(tmp_path / "g.gguf", path, extra))
    assert "\n" not in str(e.value)


PROMPT = [2, 818, 5279, 529, 7001, 563]  # "<bos>The capital of France is"
LLAMA_CPP = [506, 5279, 529, 506, 2891, 529, 7001]  # llama.cpp's: " the capital of the country of France"


@pytest.fixture(scope="module")
def real(gemma3_gguf):
    return read_gguf(gemma3_gguf)


@torch.no_grad()
def test_real_270m_gguf_decodes_greedily_as_llama_cpp(real):
    from test_model_parity import greedy
    config, weights = real
    assert (config.family, config.n_layer, config.sliding_window, config.sliding_pattern, config.head_dim) == \
        ("gemma3", 18, 512, 6, 256)
    chunk = build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, "cpu")
    ids = greedy(chunk, torch.tensor(PROMPT), 12)
    assert ids[:len(LLAMA_CPP)] == LLAMA_CPP, ids


def test_real_270m_gguf_kept_quantized(real, gemma3_gguf):
    """Q8_0 taken over as int8 (the embedding too), the K-quants and Q5_0 re-quantized to their
    nearest mdi format; norms stay float."""
    requantized = []
    config, stored = read_gguf(gemma3_gguf, keep_quant=True, requantized=requantized)
    assert config == real[0]
    kinds = {k: v.spec.kind for k, v in stored.items() if isinstance(v, QParts)}
    assert kinds["tok_emb.weight"] == "int8"  # Q8_0: the same numbers
    assert torch.equal(stored["tok_emb.weight"].rows(slice(0, 64)).dequantize(), real[1]["tok_emb.weight"][:64])
    assert kinds["blocks.0.attn.proj.weight"] == "int4"  # Q4_K
    assert kinds["blocks.0.mlp.down.weight"] == "int8"  # Q6_K
    assert kinds["blocks.0.mlp.gate_up.weight"] == "int8"  # Q5_0
    assert any(" Q4_K -> int4" in r for r in requantized) and any(" Q5_0 -> int8" in r for r in requantized)
    assert not isinstance(stored["blocks.0.post_mlp_norm.weight"], QParts)
    assert torch.equal(stored["blocks.0.post_mlp_norm.weight"], real[1]["blocks.0.post_mlp_norm.weight"])
