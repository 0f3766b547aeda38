"""LoRA adapters on the ggml backend (mdi.model.ggml.adapters) against the torch backend's on
the same tiny random models (their GGUF in float32): a sample's logits with an adapter, or a
mix of two, agree with torch's within the ggml tolerance; a pass of samples with different
adapters (and the base) gives each sample the bits it gets alone; adapters load and unload
between passes, their bytes counted; what does not fit the chunk is refused naming the layer."""
import numpy as np
import pytest
import torch

from conftest import CHARS, tiny_model
from mdi.model.adapters.lora import Adapter, LoraPart, fuse_parts, layer_shapes, mix_adapters
from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.row_batch import RowBatch

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

# ggml's own tolerance against torch (conftest's LOGPROBS_VS_TORCH on ggml: float16 K/V) for the
# log-probabilities a client sees (each row's top 5), whatever backend the suite runs on; over
# the whole vocabulary the tiny random models' large logits differ up to 0.025 without adapters
GGML_VS_TORCH, WHOLE_VOCAB = 0.03, 0.1


def assert_close(got, want):
    top = np.argsort(-want, axis=1)[:, :5]
    assert np.abs(np.take_along_axis(got - want, top, 1)).max() <= GGML_VS_TORCH
    assert np.abs(got - want).max() <= WHOLE_VOCAB


def random_adapter(config, seed, parts=None, rank=4, scale=0.3, b_scale=0.1):
    """A LoRA on every linear layer (whole fused layers), or on `parts` only (e.g. q and v:
    a fused layer's block-diagonal B, each part its own rank). B a third of A's scale: still a
    delta that moves the tiny models' log-probs by 5 to 10 (a fine-tune's is smaller); at B's
    scale 0.3 the chaotic models grow ggml's float16 pairs' rounding past the tolerance."""
    g = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(config)
    weights = {}
    if parts is None:
        for i in range(config.n_layer):
            for name, (n_out, n_in) in shapes.items():
                a = torch.randn(rank, n_in, generator=g) * scale
                b = torch.randn(n_out, rank, generator=g) * b_scale
                weights["blocks.%d.%s" % (i, name)] = (a, b)
    else:
        from mdi.model.adapters.lora import part_rows
        lp = []
        for i in range(config.n_layer):
            for mdi, part in parts:
                start, end = part_rows(config, mdi, part)
                n_in = shapes[mdi][1]
                lp.append(LoraPart(i, mdi, part, torch.randn(rank, n_in, generator=g) * scale,
                                   torch.randn(end - start, rank, generator=g) * b_scale))
        weights = fuse_parts(lp, config)
    return Adapter("a%d" % seed, "-", "lora", rank, 1.0, weights)


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma3"])
def models(request, tmp_path_factory):
    """(torch chunk, ggml chunk) of one tiny random model (its GGUF: float32, q/k permuted)."""
    from mdi.model.files.gguf_export import export_gguf
    from mdi.model.files.model_dir import GGUF_FILE
    from mdi.model.files.store import save_model_dir
    from mdi.model.source import ModelSource
    from mdi.model.tokenizers import char_tokenizer
    net = tiny_model(request.param)
    path = str(tmp_path_factory.mktemp("ggml-lora") / "tiny")
    save_model_dir(path, net.config, net.state_dict(), "test")
    export_gguf(path + "/" + GGUF_FILE, net.config, net.state_dict(), float_type="F32")
    char_tokenizer(CHARS).save(path)
    src = ModelSource(path)
    g = src.ggml_chunk(0, src.config.n_layer, True, True, threads=1)
    net.fused_decode = False
    yield net, g
    g.close()


IDS = [np.array([5, 17, 33, 2, 40, 41, 7, 9, 60, 11], np.int32), np.array([70, 3, 3, 21, 50, 8], np.int32),
       np.array([12, 13, 14, 15, 16, 17, 18], np.int32)]


def log_probs(logits):
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@torch.no_grad()
def torch_run(net, ids, adapter):
    """Logits of a prefill of all but the last token, then a decode step of it."""
    net.allocate_cache(1, 32)
    t = torch.tensor(ids.astype(np.int64))
    out = []
    for start, count in ((0, len(ids) - 1), (len(ids) - 1, 1)):
        batch = RowBatch.of([0], [start], [count], adapters=[adapter])
        out.append(net.head(net.forward_rows(net.embed_rows(t[start:start + count], batch.positions), batch)).numpy())
    return np.concatenate(out)


def ggml_run(chunk, seqs, adapters, slots=None):
    """Each sample's logits when all of `seqs` share every pass (prefill, then one decode step)."""
    slots = list(range(len(seqs))) if slots is None else slots
    chunk.allocate_cache(max(slots) + 1, 32)
    out = [[] for _ in seqs]
    for step in ("prefill", "decode"):
        starts = [0 if step == "prefill" else len(s) - 1 for s in seqs]
        counts = [len(s) - 1 if step == "prefill" else 1 for s in seqs]
        rows = np.concatenate([s[a:a + c] for s, a, c in zip(seqs, starts, counts)])
        positions = np.concatenate([np.arange(a, a + c, dtype=np.int32) for a, c in zip(starts, counts)])
        batch = PassRows(slots, starts, counts)
        batch.adapters = list(adapters) if any(adapters) else None
        logits = chunk.head(chunk.forward_rows(chunk.embed_rows(rows, positions), batch))
        row = 0
        for i, c in enumerate(counts):
            out[i].append(logits[row:row + c])
            row += c
    return [np.concatenate(o) for o in out]


def test_an_adapter_s_logits_agree_with_torch(models):
    net, chunk = models
    for adapter, parts in ((1, None), (2, [("attn.qkv", "q"), ("attn.qkv", "v"), ("mlp.gate_up" if
                                                                                   net.config.family != "gpt2"
                                                                                   else "mlp.fc", None)])):
        a = random_adapter(net.config, adapter, parts)
        net.set_adapter(adapter, a.weights)
        chunk.set_adapter(adapter, a.weights)
        for ids in IDS:
            want = log_probs(torch_run(net, ids, adapter))
            base = log_probs(torch_run(net, ids, 0))
            got = log_probs(ggml_run(chunk, [ids], [adapter])[0])
            assert_close(got, want)
            assert np.abs(base - want).max() > 10 * GGML_VS_TORCH  # the adapter changes the model
        net.drop_adapter(adapter)
        chunk.drop_adapter(adapter)
    assert chunk.adapter_bytes == 0


def test_an_adapter_past_float16_s_range_is_held_in_float32_and_computes(models):
    """One B value of 1e5 (torch serves it): float16 pairs made every logit NaN (h66)."""
    net, chunk = models
    a = random_adapter(net.config, 6)
    chunk.set_adapter(6, a.weights)
    in_float16 = chunk.adapter_bytes
    chunk.drop_adapter(6)
    name = sorted(a.weights)[0]
    a.weights[name][1][0, 0] = 1e5
    net.set_adapter(6, a.weights)
    chunk.set_adapter(6, a.weights)
    assert chunk.adapter_bytes >= 1.9 * in_float16  # float32 pairs
    got = ggml_run(chunk, [IDS[0]], [6])[0]
    assert np.isfinite(got).all() and np.isfinite(torch_run(net, IDS[0], 6)).all()
    net.drop_adapter(6)
    chunk.drop_adapter(6)


def test_a_mix_agrees_with_torch_s_mix(models):
    net, chunk = models
    a, b = random_adapter(net.config, 3), random_adapter(net.config, 4, [("attn.proj", None)])
    mix = mix_adapters([(a, 0.5), (b, -1.5)], "mix")
    net.set_adapter(7, mix.weights)
    chunk.set_adapter(7, mix.weights)
    try:
        for ids in IDS[:2]:
            want = log_probs(torch_run(net, ids, 7))
            got = log_probs(ggml_run(chunk, [ids], [7])[0])
            assert_close(got, want)
    finally:
        net.drop_adapter(7)
        chunk.drop_adapter(7)


def test_samples_of_different_adapters_keep_their_bits_alone(models):
    net, chunk = models
    chunk.set_adapter(1, random_adapter(net.config, 1).weights)
    chunk.set_adapter(2, random_adapter(net.config, 2, [("attn.qkv", "k"), ("attn.proj", None)]).weights)
    held = chunk.adapter_bytes
    assert held > 0
    try:
        seqs = IDS + [IDS[0][::-1].copy()]
        adapters = [1, 0, 2, 1]
        alone = [ggml_run(chunk, [s], [a])[0] for s, a in zip(seqs, adapters)]
        for order in ([0, 1, 2, 3], [3, 2, 0, 1], [1, 0]):
            together = ggml_run(chunk, [seqs[i] for i in order], [adapters[i] for i in order],
                                slots=[i for i in order])
            for k, i in enumerate(order):
                assert np.array_equal(together[k], alone[i]), (order, i)
        # loaded and dropped between passes: the others keep their bits, the dropped one is refused
        chunk.set_adapter(3, random_adapter(net.config, 5).weights)
        assert chunk.adapter_bytes > held
        chunk.drop_adapter(3)
        assert chunk.adapter_bytes == held
        assert np.array_equal(ggml_run(chunk, [seqs[0], seqs[2]], [1, 2])[1], alone[2])
        with pytest.raises(ValueError, match="adapter 3 is not loaded"):
            ggml_run(chunk, [seqs[0]], [3])
    finally:
        chunk.clear_adapters()
    assert chunk.adapter_bytes == 0 and not chunk.lora.adapters


def test_an_adapter_that_does_not_fit_is_refused(models):
    net, chunk = models
    a = random_adapter(net.config, 1)
    name = "blocks.0.attn.proj"
    bad = dict(a.weights)
    bad[name] = (a.weights[name][0][:, :-1], a.weights[name][1])
    with pytest.raises(ValueError, match="blocks.0.attn.proj has lora_A"):
        chunk.set_adapter(1, bad)
    with pytest.raises(ValueError, match="not a linear layer of blocks"):
        chunk.set_adapter(1, {"blocks.9.attn.proj": a.weights[name]})
    with pytest.raises(ValueError, match="ids start at 1"):
        chunk.set_adapter(0, a.weights)
    assert not chunk.lora.adapters


def test_a_soft_prompt_s_rows_embed_as_on_torch(models):
    """The starter's soft prompt: virtual rows replace token embeddings, learned positions
    added to them (GPT-2), as the torch chunk does."""
    net, chunk = models
    ids = torch.tensor([3, 4, 5, 6, 7, 8])
    positions = torch.tensor([4, 5, 6, 0, 1, 2])
    values = torch.randn(3, net.config.n_embd)
    virtual = (torch.tensor([0, 1, 4]), values)
    with torch.no_grad():
        want = net.embed_rows(ids, positions, virtual).numpy()
    got = chunk.embed_rows(ids, positions, virtual).numpy()
    assert np.allclose(got, want, atol=1e-6)
    assert np.allclose(chunk.embed_rows(ids, positions).numpy(), net.embed_rows(ids, positions).detach().numpy(),
                       atol=1e-6)


def test_a_training_job_beside_a_ggml_ring_is_refused_in_one_line():
    """POST /v1/mdi/train where nodes compute with ggml (no backward pass): a 400 that says what
    to run instead, before any node is touched; on a quantized base served with torch's fast
    kernels (no backward either) the answer names runtime.quant_kernel: exact too, so that
    following it does not meet a second refusal (h97)."""
    from types import SimpleNamespace
    from mdi.serving.train_routes import TrainControl
    from mdi.serving.validation import ApiError
    spare = SimpleNamespace(name="board3", backend="ggml")
    cfg = SimpleNamespace(runtime=SimpleNamespace(quant_kernel="fast"), backend_of=lambda node: node.backend)
    engine = SimpleNamespace(ggml_nodes=lambda: ["starter", "board2"], cfg=cfg,
                             plan=SimpleNamespace(nodes=[SimpleNamespace(quant={"mode": "int4"})] * 2, spares=[]))
    control = TrainControl(SimpleNamespace(job=None, engine=engine), None, "tiny", lambda: None)
    with pytest.raises(ApiError) as e:
        control.start({"data": "x.txt", "out": "y"})
    assert e.value.status == 400 and "\n" not in e.value.message
    assert "starter, board2 compute with ggml" in e.value.message and "runtime.backend: torch" in e.value.message
    assert "runtime.quant_kernel: exact" in e.value.message
    cfg.runtime.quant_kernel = "exact"
    with pytest.raises(ApiError) as e:
        control.start({"data": "x.txt", "out": "y"})
    assert "runtime.backend: torch" in e.value.message and "quant_kernel" not in e.value.message
    cfg.runtime.quant_kernel = "fast"
    # a spare asked for ggml would fail the job mid-way once it replaced a lost node: refused too
    engine.ggml_nodes, engine.plan.spares = (lambda: []), [spare]
    with pytest.raises(ApiError) as e:
        control.start({"data": "x.txt", "out": "y"})
    assert e.value.status == 400 and "board3 computes with ggml" in e.value.message


def test_a_ggml_worker_reads_an_adapter_body_without_torch(models):
    """POST /adapters/<id>'s safetensors body as numpy arrays (a ggml worker never loads torch):
    the same pairs, the same checks."""
    from mdi.ring.adapter_request import adapter_body, read_adapter_tensors
    from mdi.ring.init_request import RequestError
    net, chunk = models
    weights = random_adapter(net.config, 1).weights
    arrays = read_adapter_tensors(adapter_body(weights), arrays=True)
    assert set(arrays) == set(weights)
    for name, (a, b) in arrays.items():
        assert isinstance(a, np.ndarray) and np.array_equal(a, weights[name][0])
        assert np.array_equal(b, weights[name][1])
    chunk.set_adapter(1, arrays)
    chunk.drop_adapter(1)
    bad = dict(weights)
    bad["blocks.0.attn.proj"] = (weights["blocks.0.attn.proj"][0] * float("nan"), weights["blocks.0.attn.proj"][1])
    with pytest.raises(RequestError, match="NaN"):
        read_adapter_tensors(adapter_body(bad), arrays=True)


def test_auto_keeps_ggml_for_a_run_that_serves_adapters():
    from mdi.model.backend_select import ggml_cannot
    assert ggml_cannot({"blk.0.attn_q.weight": "Q4_1"}, "cpu", adapters=True) is None


def test_a_ggml_worker_budgets_an_adapter_by_what_it_holds(models):
    """ggml holds the float32 body's pairs in float16: judged by the body, a board took a third
    of the adapters it could hold (h66); a guess short of the pairs held is refused after all."""
    from mdi.ring.adapter_request import adapter_body
    from mdi.ring.init_request import TooLarge
    from mdi.worker.adapter_intake import hold_adapter
    net, chunk = models
    body = adapter_body(random_adapter(net.config, 7).weights)
    got = hold_adapter(chunk, 7, body, held=0, limit=int(0.6 * len(body)), what="--max-memory")
    assert got["bytes"] == chunk.adapter_bytes <= 0.6 * len(body)
    chunk.drop_adapter(7)
    with pytest.raises(TooLarge, match="adapter 7 needs"):
        hold_adapter(chunk, 7, body, held=0, limit=int(0.4 * len(body)), what="--max-memory")
    big = random_adapter(net.config, 8)
    big.weights[sorted(big.weights)[0]][1][0, 0] = 1e5  # float32 pairs: twice the guess
    with pytest.raises(TooLarge, match="adapter 8 needs"):
        hold_adapter(chunk, 8, adapter_body(big.weights), held=0, limit=int(0.6 * len(body)), what="--max-memory")
    assert chunk.adapter_bytes == 0
