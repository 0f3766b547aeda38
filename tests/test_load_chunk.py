"""ModelSource.load_chunk (the starter's loader: tensors read into the chunk one weight at a
time) builds exactly what build_chunk(config, ModelSource.weights(...)) builds."""
import pytest
import torch

from conftest import make_tiny_model
from mdi.model.files.prepare import prepare
from mdi.model.layout import QuantSpec
from mdi.model.quantization import qkernels
from mdi.model.source import ModelSource, build_chunk


@pytest.fixture(autouse=True)
def exact_policy():
    qkernels.set_preference("exact")
    yield
    qkernels.set_preference(None)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("load_chunk")
    out = {}
    for family in ("llama", "gpt2"):
        out[family] = make_tiny_model(str(base / family), family)
        out[family + "-int4"] = prepare(out[family], str(base / (family + "-int4")), [], quant="int4")
    return out


def _same(a, b):
    sa, sb = dict(a.named_buffers()), dict(b.named_buffers())
    sa.update(a.state_dict())
    sb.update(b.state_dict())
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.compute_dtype == b.compute_dtype


@pytest.mark.parametrize("model", ["llama", "gpt2", "llama-int4", "gpt2-int4"])
@pytest.mark.parametrize("mode,dtype,layers", [
    ("auto", torch.float32, (0, 4, True)),    # as stored: read straight into the chunk
    ("none", torch.float16, (1, 3, False)),   # float, converted (a quantized dir: dequantized)
    ("int8", torch.float32, (0, 2, True)),    # quantized (or re-quantized) one weight at a time
])
def test_load_chunk_is_build_chunk_of_weights(dirs, model, mode, dtype, layers):
    first, last, ends = layers
    source = ModelSource(dirs[model])
    quant = source.layout(first, last, ends, mode)
    compute = torch.float32 if dtype == torch.float16 else None
    old = build_chunk(source.config, source.weights(first, last, ends, ends, dtype, quant), first, last, ends, ends,
                      dtype, "cpu", compute, quant)
    new = source.load_chunk(first, last, ends, ends, dtype, "cpu", compute, quant)
    _same(old, new)
    ids = torch.tensor([1, 2, 3])
    if ends:
        for chunk in (old, new):
            chunk.allocate_cache(1, 8)
        with torch.inference_mode():
            assert torch.equal(old.head(old.forward_blocks(old.embed(ids, 0), 0, 0)),
                               new.head(new.forward_blocks(new.embed(ids, 0), 0, 0)))


def test_load_chunk_names_a_layout_that_does_not_match(dirs):
    source = ModelSource(dirs["llama"])
    chunk = source.load_chunk(0, 1, False, False, torch.float32, "cpu")
    with pytest.raises(ValueError, match="missing"):
        source.fill(chunk.state_dict(), 0, 1, False, False, torch.float32,
                    {"blocks.0.mlp.down": QuantSpec("int8", 128)})


def test_converting_reads_go_through_a_small_bounce_buffer(dirs, monkeypatch):
    from mdi.model.files import store
    source = ModelSource(dirs["llama"])
    want = build_chunk(source.config, source.weights(0, 4, True, True, torch.float16), 0, 4, True, True,
                       torch.float16, "cpu")
    monkeypatch.setattr(store, "BOUNCE_BYTES", 100)  # 25 float32 values at a time: many pieces per tensor
    _same(want, source.load_chunk(0, 4, True, True, torch.float16, "cpu"))
