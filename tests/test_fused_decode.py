"""The decode step as one TorchScript call (mdi.model.fused_decode): the eager blocks' result
bit for bit, for every family variant and kernel it covers, and the eager path wherever it
does not apply."""
import pytest
import torch

from conftest import tiny_config
from mdi.model import fused_decode
from mdi.model.config import ModelConfig
from mdi.model.quantization import kernel_choice, qkernels
from mdi.model.quantization.quant import convert, gather, uniform_layout
from mdi.model.row_batch import RowBatch
from mdi.model.source import build_chunk
from mdi.model.transformer import ModelChunk, full_model

pytestmark = pytest.mark.skipif(not hasattr(torch, "rms_norm"), reason="this torch has no torch.rms_norm: decode stays eager")


def config_of(kind: str) -> ModelConfig:
    if kind == "llama":
        return tiny_config("llama")
    common = dict(family="llama", vocab_size=97, n_layer=3, n_embd=64, n_head=8, n_kv_head=2,
                  intermediate_size=128, block_size=64)
    if kind == "qwen2":  # a qkv bias, a tied head
        return ModelConfig(name="tiny-qwen2", tied_head=True, qkv_bias=True, rope_theta=1e6, **common)
    return ModelConfig(name="tiny-qwen3", tied_head=False, qk_norm=True, head_size=16, **common)  # q/k norms


def chunk_of(config: ModelConfig, quant: str, first: int = 0, last: int = -1):
    torch.manual_seed(1)
    model = full_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3) if p.dim() > 1 or name.endswith("bias") else p.uniform_(0.5, 1.5)
    last = config.n_layer if last < 0 else last
    ends = (first == 0, last == config.n_layer)
    if quant == "none":
        own = ModelChunk(config, first, last, *ends).state_dict()
        weights = {k: v for k, v in model.state_dict().items() if k in own}
        return build_chunk(config, weights, first, last, *ends, torch.float32, "cpu")
    layout = uniform_layout(config, (first, last), *ends, quant, 32)
    stored = gather(convert(model.state_dict(), layout, torch.float32))
    return build_chunk(config, convert(stored, layout, torch.float32), first, last, *ends, torch.float32, "cpu",
                       quant=layout)


def chunk_with_kernel(kind: str, quant: str, kernel):
    """chunk_of(config_of(kind), quant) with its layers on `kernel` (None: the float32 layers),
    skipped where this torch lacks that kernel."""
    if kernel is not None and "int4" in kernel and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("no int4 packed kernel in this torch")
    if kernel == "int8dyn-fbgemm" and not qkernels.INT8_FBGEMM.supports(qkernels.QuantSpec("int8", 32), 64, 64,
                                                                        torch.device("cpu")):
        pytest.skip("no fbgemm engine in this torch")
    qkernels.set_preference(kernel)
    kernel_choice.set_memory_allowance(None)  # a kernel that holds more (fbgemm's) too
    try:
        return chunk_of(config_of(kind), quant)
    finally:
        qkernels.set_preference(None)
        kernel_choice.set_memory_allowance(kernel_choice.DEFAULT_ALLOWANCE)


@pytest.fixture
def count_fused(monkeypatch):
    """How many forwards the scripted blocks ran."""
    calls = []
    real = fused_decode.forward

    def counting(*args, **kw):
        y = real(*args, **kw)
        calls.append(y is not None)
        return y
    monkeypatch.setattr(fused_decode, "forward", counting)
    return calls


def decode(chunk, fused: bool, samples: int, steps: int, monkeypatch):
    """Prefill `samples` prompts one by one, then `steps` greedy decode frames of every sample
    at once; the logits of every frame."""
    chunk.fused_decode = fused
    chunk._decode_script.clear()
    chunk.allocate_cache(samples + 1, 40)
    assert (chunk._decode_script["module"] is not None) == fused
    vocab = chunk.config.vocab_size
    out = []
    with torch.inference_mode():
        last = []
        for s in range(samples):
            prompt = torch.arange(3 + s) % vocab
            x = chunk.forward_rows(chunk.embed_rows(prompt, torch.arange(len(prompt))),
                                   RowBatch.of([s + 1], [0], [len(prompt)]))
            last.append(int(chunk.head(x[-1:]).argmax()))
        for step in range(steps):
            starts = [3 + s + step for s in range(samples)]
            batch = RowBatch.of([s + 1 for s in range(samples)], starts, [1] * samples)
            logits = chunk.head(chunk.forward_rows(chunk.embed_rows(torch.tensor(last), batch.positions), batch))
            out.append(logits)
            last = [int(t) for t in logits.argmax(-1)]
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant,kernel", [("none", None), ("int4", "int4pack-cpu"), ("int8", "int8-as-2xint4-cpu"),
                                          ("int4", "int8dyn-fbgemm"), ("int8", "int8dyn-fbgemm")])
def test_scripted_decode_is_the_eager_result_bit_for_bit(kind, quant, kernel, count_fused, monkeypatch):
    chunk = chunk_with_kernel(kind, quant, kernel)
    assert fused_decode.why_not(chunk) == ""
    if kernel is not None:
        assert chunk.blocks["0"].mlp.down.kernel.name == kernel
    for samples in (1, 3):  # one sample (Attention._attend), several in one call (_attend_decode_rows)
        eager = decode(chunk, False, samples, 12, monkeypatch)
        del count_fused[:]
        scripted = decode(chunk, True, samples, 12, monkeypatch)
        assert count_fused.count(True) == 12  # every decode frame, and no prefill, ran as one call
        for step, (a, b) in enumerate(zip(eager, scripted)):
            assert torch.equal(a, b), "%s %s, %d samples: step %d differs by %.3g" % (
                kind, quant, samples, step, float((a - b).abs().max()))


def verify(chunk, fused: bool, counts, passes: int):
    """Prefill one prompt per sample, then `passes` speculative verification frames
    (RowBatch.row_wise) of `counts` rows per sample, each pass's tokens the greedy ids of the
    last; the logits of every row of every pass."""
    chunk.fused_decode = fused
    chunk._decode_script.clear()
    chunk.allocate_cache(len(counts) + 1, 60)
    vocab = chunk.config.vocab_size
    out = []
    with torch.inference_mode():
        for s in range(len(counts)):
            prompt = (torch.arange(3 + s) * 7) % vocab
            chunk.forward_rows(chunk.embed_rows(prompt, torch.arange(len(prompt))),
                               RowBatch.of([s + 1], [0], [len(prompt)]))
        starts = [3 + s for s in range(len(counts))]
        ids = torch.arange(sum(counts)) % vocab
        for _ in range(passes):
            batch = RowBatch.of([s + 1 for s in range(len(counts))], starts, counts, row_wise=True)
            logits = chunk.head(chunk.forward_rows(chunk.embed_rows(ids, batch.positions), batch))
            out.append(logits)
            ids = logits.argmax(-1)
            starts = [start + c - 1 for start, c in zip(starts, counts)]  # the last row rejected: overwritten
    return out


@pytest.mark.parametrize("quant,kernel", [("none", None), ("int4", "int4pack-cpu"), ("int4", "int8dyn-fbgemm")])
@pytest.mark.parametrize("counts", [[4], [3, 1, 5]])
def test_a_verification_runs_as_one_call_with_each_rows_decode_result(quant, kernel, counts, count_fused):
    """Every row of a verification (one sample or several, with plain decode rows beside) is
    bit for bit what the eager blocks give it, and each such frame runs as one call."""
    chunk = chunk_with_kernel("qwen3", quant, kernel)
    eager = verify(chunk, False, counts, 5)
    del count_fused[:]
    scripted = verify(chunk, True, counts, 5)
    assert count_fused.count(True) == 5  # the verifications; the prefills ran eagerly
    for i, (a, b) in enumerate(zip(eager, scripted)):
        assert torch.equal(a, b), "pass %d differs by %.3g" % (i, float((a - b).abs().max()))


def test_a_middle_chunk_and_long_contexts(count_fused, monkeypatch):
    """A worker's chunk (no embedding or head) takes the same path; several samples whose
    caches outgrow one call's gather fall back to the eager per-sample loop, still equal."""
    chunk = chunk_of(config_of("llama"), "none", 1, 3)
    monkeypatch.setattr("mdi.model.row_batch.ONE_CALL_MAX_CACHE", 4 * 2 * 8)  # 4 positions
    results = []
    for fused in (False, True):
        chunk.fused_decode = fused
        chunk._decode_script.clear()
        chunk.allocate_cache(2, 16)
        torch.manual_seed(0)
        ys = []
        with torch.inference_mode():
            chunk.forward_rows(torch.randn(6, 64), RowBatch.of([0, 1], [0, 0], [3, 3]))
            for step in range(6):
                batch = RowBatch.of([0, 1], [3 + step] * 2, [1, 1])
                ys.append(chunk.forward_rows(torch.randn(2, 64), batch))
        results.append(ys)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert count_fused[-6:] == [True, False, False, False, False, False]  # position 3 fits in 4, then not


def test_what_it_does_not_cover_runs_eagerly_and_says_why(monkeypatch):
    gpt2 = chunk_of(tiny_config("gpt2"), "none")
    assert "Llama" in fused_decode.why_not(gpt2)
    gpt2.allocate_cache(1, 8)
    assert gpt2._decode_script["module"] is None
    qkernels.set_preference("exact")
    try:
        exact = chunk_of(config_of("llama"), "int4")
    finally:
        qkernels.set_preference(None)
    assert "blocks.0.attn.qkv multiplies with dequant" in fused_decode.why_not(exact)
    head_only = chunk_of(config_of("llama"), "none", 4, 4)
    assert fused_decode.why_not(head_only) != ""
    off = chunk_of(config_of("llama"), "none")
    off.fused_decode = False
    assert "runtime.fused_decode: false" in fused_decode.why_not(off)
