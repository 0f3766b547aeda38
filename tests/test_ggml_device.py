"""A ggml chunk on a device of ggml's registry (runtime.device cuda: ggml-cuda where the binding was
built with it): every tensor in the device's buffers, the weights copied in from the GGUF's map.

Without a GPU the same path runs on ggml's CPU device reached by its registry name ("CPU"), the
weights copied into its buffers rather than read in place: the bits must be those of the CPU
chunk, the prefix cache's slot copies must go through the backend, and a GPU that this build of
ggml lacks is refused in one line naming the build, before anything is loaded."""
import numpy as np
import pytest

from mdi.model.backend_select import device_unusable, select_backend
from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.source import ModelSource

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def source(smollm2_dir):
    return ModelSource(smollm2_dir)


def passes(chunk, prompts, n_tokens):
    """Two samples' prompts in one pass, then `n_tokens` greedy steps of both in one pass each:
    every logits row (float32 bits) and the ids."""
    rows = [t for p in prompts for t in p]
    counts = [len(p) for p in prompts]
    seen, ids = [], []
    y = chunk.embed_forward_rows(np.array(rows, np.int32), PassRows([0, 1], [0, 0], counts))
    logits = chunk.head(y[np.cumsum(counts) - 1])
    at = list(counts)
    for _ in range(n_tokens):
        seen.append(logits.copy())
        ids.append([int(np.argmax(row)) for row in logits])
        y = chunk.embed_forward_rows(np.array(ids[-1], np.int32), PassRows([0, 1], at, [1, 1]))
        logits = chunk.head(y)
        at = [a + 1 for a in at]
    return np.stack(seen).view(np.uint32), ids, at


def test_a_chunk_on_a_ggml_device_computes_the_cpu_chunks_bits(source):
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    n = source.config.n_layer
    cpu = source.ggml_chunk(0, n, True, True, threads=1, repack=False)  # read in place from the map
    dev = source.ggml_chunk(0, n, True, True, threads=1, device="CPU")  # copied into the device's buffers
    assert cpu.compute_backend.maps_weights and not dev.compute_backend.maps_weights
    assert dev.weights.repacked == []  # re-laying for the CPU's kernels is the CPU backend's alone
    # the device's weights are its own copies, none left pointing into the file's map
    w = dev.tensors["blk.0.attn_q.weight"]
    base, size = dev.weights._base, dev.weights._size
    assert not base <= w.contents.data < base + size
    for c in (cpu, dev):
        c.allocate_cache(2, 64)
    bits_cpu, ids_cpu, at = passes(cpu, prompts, 6)
    bits_dev, ids_dev, _ = passes(dev, prompts, 6)
    assert source.tokenizer.decode([i for i, _ in ids_cpu]).startswith(" Paris")
    assert ids_dev == ids_cpu
    assert np.array_equal(bits_dev, bits_cpu)
    # the prefix cache's slot copies read and write through the backend: a slot's rows come out
    # as the CPU chunk's, and written into the other slot they read back the same
    kept = dev.cache.read_range(0, at[0])
    assert np.array_equal(kept.full, cpu.cache.read_range(0, at[0]).full)
    dev.cache.write_range(1, kept, at[0])
    assert np.array_equal(dev.cache.read_range(1, at[0]).full, kept.full)
    assert dev.cache.read_range(0, 0).full.shape[2] == 0
    # a GPU's graphs are checked op by op where they are built; the CPU device computes them all
    dev.compute_backend.on_cpu = False
    for built in dev._graphs.values():
        dev.compute_backend.check_supported(built.graph)
    dev.compute_backend.on_cpu = True
    for c in (cpu, dev):
        c.close()


@pytest.mark.skipif(lib.unavailable_reason() is None and bool(lib.gpu_device_names()),
                    reason="this ggml binding was built with a GPU backend")
def test_a_gpu_this_ggml_build_lacks_is_refused_in_one_line(source):
    why = lib.gpu_unusable_reason("cuda")
    assert "cuda" in why and "built for the CPU alone" in why and "\n" not in why
    with pytest.raises(RuntimeError, match="built for the CPU alone"):
        source.ggml_chunk(0, 1, False, False, device="cuda:0")
    config = source.config
    types = source.gguf_types(0, config.n_layer, False, False)
    with pytest.raises(ValueError, match="backend ggml cannot run here: cuda:1: this ggml binding has no GPU"):
        select_backend("ggml", config, 0, config.n_layer, types, "cuda:1", 1, 1)
    torch_why = device_unusable("cuda")
    import torch
    if not torch.cuda.is_available():  # neither backend can: both reasons in the one line
        assert "torch sees no CUDA GPU" in torch_why and "ggml: cuda: this ggml binding has no GPU" in torch_why


def tiny_gguf_dir(tmp_path, weight_type):
    """A small random Llama (head_dim 64, as every family mdi serves has: CUDA's flash attention
    takes 64 and up) whose GGUF holds `weight_type` matrices; its directory."""
    from conftest import CHARS, tiny_model
    from mdi.model.config import ModelConfig
    from mdi.model.files.gguf_export import export_gguf
    from mdi.model.files.model_dir import GGUF_FILE
    from mdi.model.files.store import save_model_dir
    from mdi.model.tokenizers import char_tokenizer
    config = ModelConfig(name="tiny-llama-64", family="llama", vocab_size=len(CHARS), n_layer=3, n_embd=128,
                         n_head=2, n_kv_head=1, intermediate_size=256, block_size=128, tied_head=False)
    net = tiny_model("llama", 3, config=config, std=0.1)
    path = str(tmp_path / ("tiny-" + weight_type))
    save_model_dir(path, net.config, net.state_dict(), "test")
    export_gguf(str(tmp_path / ("tiny-" + weight_type) / GGUF_FILE), net.config, net.state_dict(),
                weight_type=weight_type)
    char_tokenizer(CHARS).save(path)
    return path


@pytest.mark.skipif(lib.unavailable_reason() is not None or "CUDA0" not in lib.gpu_device_names(),
                    reason="this ggml binding has no CUDA device here")
@pytest.mark.parametrize("weight_type", ["F16", "Q8_0", "Q4_0"])
def test_ggml_cuda_logits_follow_the_cpu_chunk(tmp_path, weight_type):
    """On a GPU (ggml-cuda): a pass's logits within the GPU's rounding of the CPU chunk's (its
    kernels sum in another order: no bit-equality is claimed across devices), the same greedy
    ids where the best two are apart, and the prefix cache's copies through the device."""
    src = ModelSource(tiny_gguf_dir(tmp_path, weight_type))
    prompts = [src.tokenizer.encode(p) for p in PROMPTS]
    n = src.config.n_layer
    cpu = src.ggml_chunk(0, n, True, True, threads=1, repack=False)
    gpu = src.ggml_chunk(0, n, True, True, threads=1, device="cuda")
    for c in (cpu, gpu):
        c.allocate_cache(2, 64)
    bits_cpu, _, at = passes(cpu, prompts, 4)
    bits_gpu, _, _ = passes(gpu, prompts, 4)
    a, b = bits_cpu.view(np.float32)[0], bits_gpu.view(np.float32)[0]  # the prompts' passes: same inputs
    assert np.max(np.abs(a - b)) < 0.02 * np.max(np.abs(a))
    top2 = np.sort(a, axis=-1)[:, -2:]
    apart = top2[:, 1] - top2[:, 0] > 0.05 * np.max(np.abs(a))
    assert np.array_equal(np.argmax(a, -1)[apart], np.argmax(b, -1)[apart])
    kept = gpu.cache.read_range(0, at[0])
    gpu.cache.write_range(1, kept, at[0])
    assert np.array_equal(gpu.cache.read_range(1, at[0]).full, kept.full)
    from mdi.system import memory
    assert memory._ggml_gpu_free("cuda") > 0  # what a ggml node without torch plans its GPU by
    for c in (cpu, gpu):
        c.close()
