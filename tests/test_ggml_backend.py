"""The ggml backend on the embedded default model (SmolLM2-135M Q4_1, its GGUF as stored):
greedy ids that do not depend on how samples share passes or how prompts are chunked, logits
that agree with the torch backend's within the quantization's error, the prefix cache's slot
copies, and GGUF files refused in one line before ggml sees them."""
import numpy as np
import pytest
import torch

from mdi.model.ggml import lib
from mdi.model.layout import CheckpointError
from mdi.model.pass_rows import PassRows
from mdi.model.row_batch import RowBatch
from mdi.model.source import ModelSource

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fibonacci(n):", "In 1492, Columbus"]


@pytest.fixture(scope="module")
def source(smollm2_dir):
    return ModelSource(smollm2_dir)


@pytest.fixture(scope="module")
def chunk(source):
    c = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1)
    c.allocate_cache(4, 256)
    return c


def greedy(chunk, prompts, groups, n_tokens, prefill_chunk=None, logits_out=None):
    """Each sample's greedy ids when the samples of each group travel together in every pass
    (a prompt in passes of `prefill_chunk` tokens; None: whole); `logits_out` (a dict) gets
    each sample's logits, step by step."""
    out = {i: [] for g in groups for i in g}
    seen = logits_out if logits_out is not None else {}
    for g in groups:
        at = {i: 0 for i in g}
        left = {i: list(prompts[i]) for i in g}
        while any(left.values()):
            slots, starts, counts, rows = [], [], [], []
            for i in g:
                if left[i]:
                    take = left[i][:prefill_chunk] if prefill_chunk else left[i]
                    left[i] = left[i][len(take):]
                    slots.append(i)
                    starts.append(at[i])
                    counts.append(len(take))
                    rows += take
                    at[i] += len(take)
            y = chunk.forward_rows(chunk.embed_rows(np.array(rows, np.int32), None), PassRows(slots, starts, counts))
            logits = chunk.head(y[np.cumsum(counts) - 1])
            for k, i in enumerate(slots):
                if not left[i]:
                    out[i].append(int(np.argmax(logits[k])))
                    seen.setdefault(i, []).append(logits[k].copy())
        for _ in range(n_tokens - 1):
            x = chunk.embed_rows(np.array([out[i][-1] for i in g], np.int32), None)
            logits = chunk.head(chunk.forward_rows(x, PassRows(list(g), [at[i] for i in g], [1] * len(g))))
            for k, i in enumerate(g):
                at[i] += 1
                out[i].append(int(np.argmax(logits[k])))
                seen[i].append(logits[k].copy())
    return out


def test_a_pass_keeps_its_rows_when_the_next_pass_computes(source, chunk):
    """A pass's rows and logits are copies out of the graph's memory, not views of it (the graph's
    inputs and output are written and read in place on the CPU): the next pass of the same shape
    leaves them as they were, and an input given the wrong number of values is refused by name."""
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((1, source.config.n_embd)).astype(np.float32) for _ in range(2)]
    first = chunk.forward_rows(rows[0], PassRows([0], [0], [1]))
    kept = first.copy()
    logits = chunk.head(first)
    kept_logits = logits.copy()
    second = chunk.forward_rows(rows[1], PassRows([0], [0], [1]))
    chunk.head(second)
    assert not np.array_equal(second, kept)
    assert np.array_equal(first, kept) and np.array_equal(logits, kept_logits)
    g = next(iter(chunk._graphs.values()))
    name = next(iter(g.inputs))
    with pytest.raises(ValueError, match="input %s" % name):
        g.set(name, np.zeros(10 ** 6, np.float32))


def test_greedy_ids_do_not_depend_on_batching_or_prefill_chunks(source, chunk):
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    alone = greedy(chunk, prompts, [[0], [1], [2], [3]], 20)
    assert source.tokenizer.decode(alone[0]).startswith(" Paris")
    assert greedy(chunk, prompts, [[0, 1, 2, 3]], 20) == alone  # every pass carries the four samples
    assert greedy(chunk, prompts, [[0], [1], [2], [3]], 20, prefill_chunk=2) == alone
    assert greedy(chunk, prompts, [[2, 0], [3, 1]], 20, prefill_chunk=3) == alone  # other slots' rows between


def test_a_one_node_run_decodes_in_one_graph_a_token_with_the_same_ids(source, chunk, monkeypatch):
    """A one-node ring on ggml (the pipeline over a local loop) runs the head in the blocks'
    graph for its decode steps: the head graph runs only for the prompts' passes, and every
    sample's greedy ids (numpy from the chunk to the draw) are those the chunk gives with the
    head apart, batched or not."""
    from mdi.model.sampling import SamplingParams, sample_generator
    from mdi.ring.transport import LocalLoop
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import Sample
    prompts = [source.tokenizer.encode(p) for p in PROMPTS[:3]]
    want = greedy(chunk, prompts, [[0], [1], [2]], 12)
    heads = []
    head = chunk.head
    monkeypatch.setattr(chunk, "head", lambda x, **kw: heads.append(x.shape[0]) or head(x, **kw))
    for max_batch in (1, 3):
        heads.clear()
        samples = [Sample(i, PROMPTS[i], p, 12, sample_generator(0, i)) for i, p in enumerate(prompts)]
        pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None, PipelineSettings(max_batch=max_batch))
        pipe.run(samples)
        assert [s.token_ids for s in samples] == [want[i] for i in range(3)], max_batch
        assert 1 <= len(heads) <= 3 and sum(heads) == 3  # each prompt's last row once; no decode step's
        assert not pipe._logit_frames  # every frame that left with logits came back


def test_lent_logits_stay_readable_until_the_next_pass_even_if_their_graph_is_dropped(source, chunk):
    """`head(lend=True)` gives the logits where the graph wrote them: the same values as a copy;
    a graph dropped while lent (an adapter loaded on another thread drops graphs) is freed only
    at the chunk's next lookup, so the rows being drawn from never point into freed memory."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, source.config.n_embd)).astype(np.float32)
    want = chunk.head(x)
    lent = chunk.head(x, lend=True)
    assert not lent.flags.owndata and np.array_equal(lent, want)
    held = chunk._graphs[("head", 3)]
    chunk._drop_graphs(lambda key: key[0] == "head")
    assert held.galloc is not None and np.array_equal(lent, want)  # retired, not freed
    chunk.head(x[:1])  # the next lookup ends the lend
    assert held.galloc is None
    assert np.array_equal(chunk.head(x), want)  # and a copy is a copy: the next pass leaves it
    assert np.array_equal(want, chunk.head(x, lend=True))


def test_frames_waiting_in_a_one_node_loop_hold_no_rows(source, chunk):
    """A one-node ring computes a pass when it takes the frame back (Deferred rows), so frames
    queued in its loop hold no activations or logits (1 MB a sample on a 262k vocabulary), and
    its samples' greedy ids are those of the chunk's own passes, with one sample a frame too."""
    from mdi.model.sampling import SamplingParams, sample_generator
    from mdi.ring.transport import Deferred, LocalLoop
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import Sample
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    want = greedy(chunk, prompts, [[i] for i in range(4)], 8)
    loop = LocalLoop()
    queued = []
    send = loop.send
    loop.send = lambda frame: (queued.append(isinstance(frame.tensor, Deferred)), send(frame))
    samples = [Sample(i, PROMPTS[i], p, 8, sample_generator(0, i)) for i, p in enumerate(prompts)]
    Pipeline(chunk, loop, 1, SamplingParams(0.0), None, PipelineSettings(max_batch=1)).run(samples)
    assert [s.token_ids for s in samples] == [want[i] for i in range(4)]
    assert queued and all(queued)


def test_more_samples_than_the_logits_budget_are_scored_in_groups_with_the_same_ids(source, chunk, monkeypatch):
    """A head computes at most LOGITS_BUDGET_BYTES of logits at once (1 MB a row on a 262k
    vocabulary): a one-node ring's decode frame of more samples computes its rows in one graph
    and scores them in groups, each drawn from before the next, with the ids of one graph a token."""
    from mdi.model.sampling import SamplingParams, sample_generator
    from mdi.ring.transport import LocalLoop
    from mdi.starter import pass_compute
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import Sample
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    want = greedy(chunk, prompts, [[i] for i in range(4)], 10)
    monkeypatch.setattr(pass_compute, "LOGITS_BUDGET_BYTES", 2 * 4 * source.config.vocab_size)  # 2 rows
    heads = []
    head = chunk.head
    monkeypatch.setattr(chunk, "head", lambda x, **kw: heads.append(x.shape[0]) or head(x, **kw))
    samples = [Sample(i, PROMPTS[i], p, 10, sample_generator(0, i)) for i, p in enumerate(prompts)]
    pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None, PipelineSettings(max_batch=4))
    pipe.run(samples)
    assert [s.token_ids for s in samples] == [want[i] for i in range(4)]
    assert heads and max(heads) <= 2 and sum(heads) >= 4 * 9  # every decode step's rows, two at a time


@pytest.mark.parametrize("float_type", ["F32", "F16"])
def test_float_weights_give_every_row_the_same_bits_in_a_pass_of_any_size(tmp_path, float_type):
    """ggml multiplies float matrices with one kernel for a one-row pass and llamafile's tiled
    kernel for longer ones (on x86), whose sums run in another order; a chunk measures where its
    weights' kernels switch and pads shorter passes, so every sample's logits are bit for bit
    those it gets alone, whatever shares its passes or however its prompt is chunked."""
    from conftest import CHARS, tiny_config
    from mdi.model.files.gguf_export import export_gguf
    from mdi.model.files.model_dir import GGUF_FILE
    from mdi.model.files.store import save_model_dir
    from mdi.model.tokenizers import char_tokenizer
    from mdi.model.transformer import full_model
    torch.manual_seed(5)
    net = full_model(tiny_config("llama"))
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)  # a chaotic model: any rounding difference grows into other ids
    path = str(tmp_path / "tiny")
    save_model_dir(path, net.config, net.state_dict(), "test")
    export_gguf(str(tmp_path / "tiny" / GGUF_FILE), net.config, net.state_dict(), float_type=float_type)
    char_tokenizer(CHARS).save(path)
    src = ModelSource(path)
    chunk = src.ggml_chunk(0, src.config.n_layer, True, True, threads=1)
    chunk.allocate_cache(4, src.config.block_size)
    prompts = [src.tokenizer.encode(p) for p in PROMPTS]
    alone_logits = {}
    alone = greedy(chunk, prompts, [[0], [1], [2], [3]], 12, logits_out=alone_logits)
    for groups, prefill_chunk in (([[0, 1, 2, 3]], None), ([[0], [1], [2], [3]], 1), ([[2, 0], [3, 1]], 3)):
        logits = {}
        assert greedy(chunk, prompts, groups, 12, prefill_chunk, logits_out=logits) == alone, (groups, prefill_chunk)
        for i in alone_logits:
            assert all(np.array_equal(a, b) for a, b in zip(alone_logits[i], logits[i])), (groups, prefill_chunk, i)


def test_logits_agree_with_the_torch_backend(source, chunk):
    """The same Q4_1 blocks: torch multiplies them exactly in float32 (runtime.quant_kernel:
    exact), ggml against activations quantized to 8 bits per block of 32, with K/V in float16,
    as llama.cpp does. The difference is that rounding over 30 layers: measured 0.06 of the
    logits' standard deviation (median), 0.40 at most, cosine 0.991, the same top token on
    every row of a 10-token prompt."""
    from mdi.model.quantization import qkernels
    ids = source.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    before = qkernels.preference
    qkernels.set_preference("exact")
    torch_chunk = source.load_chunk(0, source.config.n_layer, True, True, torch.float32, "cpu", None,
                                    source.layout(0, source.config.n_layer, True, "auto"))
    qkernels.set_preference(before)
    torch_chunk.fused_decode = False
    torch_chunk.allocate_cache(1, 64)
    with torch.inference_mode():
        batch = RowBatch.of([0], [0], [len(ids)])
        ref = torch_chunk.head(torch_chunk.forward_rows(torch_chunk.embed_rows(torch.tensor(ids), batch.positions),
                                                         batch)).numpy()
    got = chunk.head(chunk.forward_rows(chunk.embed_rows(np.array(ids, np.int32), None), PassRows([0], [0], [len(ids)])))
    assert got.shape == ref.shape
    spread = ref.std(axis=1, keepdims=True)
    err = np.abs(got - ref) / spread
    assert float(np.median(err)) < 0.1, np.median(err)
    assert float(err.max()) < 0.7, err.max()
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.9
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert float(cos.min()) > 0.98


def test_prefix_store_copies_a_slot_range_on_the_ggml_cache(source, chunk):
    from mdi.model.prefix_store import CacheOp, PrefixStore
    ids = source.tokenizer.encode("The capital of France is")
    cache = chunk.cache
    store = PrefixStore(cache, budget_bytes=cache.range_bytes(len(ids)))
    chunk.forward_rows(chunk.embed_rows(np.array(ids, np.int32), None), PassRows([0], [0], [len(ids)]))
    store.apply([CacheOp("save", 1, slot=0, length=len(ids))])
    assert store.stats.bytes == cache.range_bytes(len(ids))
    with pytest.raises(RuntimeError, match="over the budget"):
        store.apply([CacheOp("save", 2, slot=0, length=len(ids))])
    store.apply([CacheOp("load", 1, slot=3, length=len(ids) - 1)])  # all but the last: it is fed again
    last = chunk.embed_rows(np.array(ids[-1:], np.int32), None)
    a = chunk.head(chunk.forward_rows(last, PassRows([3], [len(ids) - 1], [1])))
    b = chunk.head(chunk.forward_rows(last, PassRows([0], [len(ids) - 1], [1])))
    np.testing.assert_array_equal(a, b)  # the copied positions are the computed ones, bit for bit


def test_a_q8_0_cache_holds_about_half_the_bytes_and_keeps_the_text(source, chunk):
    """runtime.kv_type q8_0 stores K and V in 8-bit blocks (34 bytes per 32 values, against 64
    in float16), as llama.cpp's --cache-type-k/v q8_0: the logits move by that rounding only."""
    small = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1, kv_type="q8_0")
    small.allocate_cache(1, 256)
    assert small.cache.nbytes * 64 == chunk.cache.nbytes // 4 * 34
    ids = source.tokenizer.encode("The capital of France is")
    x = np.array(ids, np.int32)
    ref = chunk.head(chunk.forward_rows(chunk.embed_rows(x, None), PassRows([0], [0], [len(ids)])))
    got = small.head(small.forward_rows(small.embed_rows(x, None), PassRows([0], [0], [len(ids)])))
    assert not np.array_equal(got, ref)  # the cache really is stored otherwise
    err = np.abs(got - ref) / ref.std(axis=1, keepdims=True)
    assert float(np.median(err)) < 0.15, np.median(err)  # measured 0.065
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.8
    assert source.tokenizer.decode(greedy(small, [ids], [[0]], 4)[0]).startswith(" Paris")
    small.close()


def _copy_gguf(tmp_path, source, drop=(), retype=None, reshape=None):
    """The model's GGUF rewritten: tensors dropped, given another type's label, or other dims."""
    from mdi.model.files.gguf_write import write_gguf
    reader = source._gguf_reader
    tensors = {}
    for t in reader.tensors:
        if t.name in drop:
            continue
        dims = tuple(int(d) for d in t.shape)
        kind = t.tensor_type.name
        data = t.data
        if reshape and t.name in reshape:
            dims, data = reshape[t.name], np.ones(reshape[t.name][::-1], np.float32)
        if retype and t.name in retype:  # (a float type's own bytes: the tensors after it stay where they are)
            kind = retype[t.name]
            data = np.zeros(dims[::-1], {"F16": np.float16, "F32": np.float32}[kind])
        tensors[t.name] = (kind, dims, data)
    path = str(tmp_path / "bad.gguf")
    write_gguf(path, source.config, tensors, arch="llama")
    return path


@pytest.mark.parametrize("damage, message", [
    ({"drop": ("blk.3.ffn_up.weight",)}, "no tensor blk.3.ffn_up.weight"),
    ({"reshape": {"blk.1.attn_norm.weight": (288,)}}, "blk.1.attn_norm.weight has dims"),
    ({"retype": {"blk.0.attn_norm.weight": "F16"}}, "blk.0.attn_norm.weight is F16"),
])
def test_a_gguf_that_does_not_fit_the_model_is_refused_in_one_line(tmp_path, source, damage, message):
    from mdi.model.ggml.chunk import GgmlChunk
    from mdi.model.ggml.weights import GgufWeights
    source.gguf()
    path = _copy_gguf(tmp_path, source, **damage)
    with pytest.raises(CheckpointError, match=message) as e:
        GgmlChunk(source.config, 0, source.config.n_layer, True, True, GgufWeights(path), lib.ROPE_NORMAL)
    assert "\n" not in str(e.value) and "bad.gguf" in str(e.value)


@pytest.mark.parametrize("damage, message", [
    ({"drop": ("blk.3.ffn_up.weight",)}, "no tensor blk.3.ffn_up.weight"),
    ({"reshape": {"blk.1.attn_norm.weight": (288,)}}, "blk.1.attn_norm.weight has dims"),
])
def test_the_torch_backend_names_a_gguf_s_faults_as_the_file_names_its_tensors(tmp_path, source, damage, message):
    from mdi.model.files.gguf import read_gguf
    source.gguf()
    with pytest.raises(CheckpointError, match=message) as e:  # as ggml says it, not by mdi's own names
        read_gguf(_copy_gguf(tmp_path, source, **damage))
    assert "\n" not in str(e.value) and "bad.gguf" in str(e.value)


def test_a_tokenizer_larger_than_the_model_s_vocabulary_is_refused_naming_the_model(source):
    import dataclasses
    from mdi.model.source import check_vocab
    from mdi.model.tokenizer_base import TokenizerError
    small = dataclasses.replace(source.config, vocab_size=1000)
    with pytest.raises(TokenizerError, match=r"^m\.gguf: tokenizer has 49152 tokens but the model only 1000$"):
        check_vocab(source.tokenizer, small, "m.gguf")


def test_a_gguf_with_more_blocks_than_its_block_count_is_refused(source):
    """llama.cpp refuses such a file; run, ggml would have left its last blocks out without a word."""
    import dataclasses
    from mdi.model.ggml.chunk import GgmlChunk
    from mdi.model.ggml.weights import GgufWeights
    fewer = dataclasses.replace(source.config, n_layer=source.config.n_layer - 1)  # what block_count said
    with pytest.raises(CheckpointError, match=r"tensor blk\.29\.\S+ is past the model's 29 layers") as e:
        GgmlChunk(fewer, 0, fewer.n_layer, True, True, GgufWeights(source.gguf_path), lib.ROPE_NORMAL)
    assert "\n" not in str(e.value)


def test_gemma3_greedy_ids_do_not_depend_on_batching_without_repack(gemma3_gguf):
    """Gemma 3's Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0 matrices, and ggml re-lays its Q4_K ones
    for a matrix kernel whose rounding on passes of 4+ rows differs from its one-row kernel's
    (runtime.repack, llama.cpp's default): with repack off every sample's ids are its own alone."""
    source = ModelSource(gemma3_gguf)
    chunk = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1, repack=False)
    assert not chunk.weights.repacked
    chunk.allocate_cache(4, 256)
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    alone = greedy(chunk, prompts, [[0], [1], [2], [3]], 16)
    assert greedy(chunk, prompts, [[0, 1, 2, 3]], 16) == alone
    assert greedy(chunk, prompts, [[1, 3], [0, 2]], 16, prefill_chunk=3) == alone
    if lib.cpu_features().get("avx2"):  # where ggml re-lays Q4_K (x86's AVX2 kernels)
        repacked = source.ggml_chunk(0, 2, True, False, threads=1)
        assert any(n.endswith("attn_output.weight") for n in repacked.weights.repacked)


def _twin_chunks(model, request, head, slots):
    """(source, two identical ggml chunks of the model's first 3 layers with the embedding, and
    the head where `head`, each with a cache of `slots` slots of 64 positions)."""
    if model == "smollm2":
        source = ModelSource(request.getfixturevalue("smollm2_dir"))
    elif model == "gemma3":
        source = ModelSource(request.getfixturevalue("gemma3_gguf"))
    else:
        source = ModelSource(request.getfixturevalue("tiny_models")["gpt2"])
    layers = min(3, source.config.n_layer)
    chunks = [source.ggml_chunk(0, layers, True, head, threads=1) for _ in range(2)]
    for c in chunks:
        c.allocate_cache(slots, 64)
    return source, chunks


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "gpt2"])
def test_a_starter_pass_embedded_in_the_blocks_graph_gives_the_same_bits(model, request):
    """embed_forward_rows (the token ids embedded in the blocks' own graph: one graph a step on
    a starter) computes what embed_rows then forward_rows compute, bit for bit: the token rows
    (Gemma's scaled ones, GPT-2's learned positions added), a prefill of two samples and their
    next decode step, and a soft prompt's rows, which take the two-graph way."""
    source, (fused, apart) = _twin_chunks(model, request, head=False, slots=2)
    rng = np.random.default_rng(0)
    vocab = source.config.vocab_size
    passes = [PassRows([0, 1], [0, 0], [5, 3]), PassRows([0, 1], [5, 3], [1, 1]), PassRows([1], [4], [2])]
    for batch in passes:
        ids = rng.integers(0, vocab, batch.rows).astype(np.int32)
        one = fused.embed_forward_rows(torch.from_numpy(ids), RowBatch.of(batch.slots, batch.starts, batch.counts))
        two = apart.forward_rows(apart.embed_rows(ids, np.concatenate(
            [np.arange(s, s + n) for s, n in zip(batch.starts, batch.counts)]).astype(np.int32)), batch)
        assert isinstance(one, torch.Tensor) and np.array_equal(one.numpy().view(np.uint32), two.view(np.uint32))
    soft = (torch.tensor([0]), torch.from_numpy(rng.standard_normal((1, source.config.n_embd)).astype(np.float32)))
    batch = RowBatch.of([0], [6], [2])
    ids = torch.from_numpy(rng.integers(0, vocab, 2).astype(np.int32))
    assert np.array_equal(fused.embed_forward_rows(ids, batch, soft).numpy(),
                          apart.forward_rows(apart.embed_rows(ids, batch.positions, soft), batch).numpy())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused.embed_forward_rows(torch.tensor([vocab]), RowBatch.of([0], [8], [1]))


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "gpt2"])
def test_logits_in_the_blocks_graph_give_the_same_bits(model, request):
    """embed_forward_logits (embedding, blocks and head in one graph: a one-node ring's decode
    step) gives each sample's last-row logits bit for bit as embed_forward_rows then head do,
    on passes of one and several samples, prefill and decode rows, and refuses a chunk
    without the head."""
    source, (one_graph, two_graphs) = _twin_chunks(model, request, head=True, slots=3)
    rng = np.random.default_rng(1)
    vocab = source.config.vocab_size
    passes = [PassRows([0, 2], [0, 0], [5, 3]), PassRows([0, 2], [5, 3], [1, 1]), PassRows([2], [4], [2]),
              PassRows([1, 0, 2], [0, 6, 6], [1, 1, 1])]
    for batch in passes:
        ids = rng.integers(0, vocab, batch.rows).astype(np.int32)
        logits = one_graph.embed_forward_logits(torch.from_numpy(ids), batch)
        rows = two_graphs.embed_forward_rows(ids, batch)
        want = two_graphs.head(rows[np.cumsum(batch.counts) - 1])
        assert isinstance(logits, torch.Tensor) and logits.shape == (len(batch.slots), want.shape[1])
        assert np.array_equal(logits.numpy().view(np.uint32), want.view(np.uint32))
    no_head = source.ggml_chunk(0, one_graph.last, True, False, threads=1)
    no_head.allocate_cache(1, 16)
    with pytest.raises(ValueError, match="no embedding, blocks and head"):
        no_head.embed_forward_logits(np.array([1], np.int32), PassRows([0], [0], [1]))


def test_gemma3_split_where_a_node_holds_sliding_window_layers_alone(gemma3_gguf):
    """Gemma 3 attends globally every 6th layer (5, 11, 17): a node of layers [0, 3) reads only
    the sliding-window mask (it aborted in ggml setting the full one, which no op read). Split
    there, the two nodes compute the one-node model's logits bit for bit."""
    source = ModelSource(gemma3_gguf)
    n = source.config.n_layer
    assert not any(source.config.layer_window(i) == 0 for i in range(3))
    whole = source.ggml_chunk(0, n, True, True, threads=1)
    first = source.ggml_chunk(0, 3, True, False, threads=1)
    rest = source.ggml_chunk(3, n, False, True, threads=1)
    for c in (whole, first, rest):
        c.allocate_cache(1, 64)
    ids = np.array(source.tokenizer.encode(PROMPTS[0]), np.int32)
    for batch in (PassRows([0], [0], [len(ids)]), PassRows([0], [len(ids)], [1])):
        step = ids if batch.starts[0] == 0 else ids[-1:]
        one = whole.head(whole.embed_forward_rows(step, batch))
        two = rest.head(rest.forward_rows(first.embed_forward_rows(step, batch), batch))
        assert np.array_equal(one, two)


def test_timing_verification_passes_leaves_no_graphs_behind(source):
    """The starter times passes of 1..9 rows with the head at start (speculation's cost table):
    those graphs are a measurement's, dropped after it (Gemma 3's head alone held 28 MB of
    them), and the table is still measured."""
    from mdi.starter.speculation.costs import measure_pass_costs
    fresh = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1)
    try:
        fresh.allocate_cache(1, 64)
        costs = measure_pass_costs(fresh, 6, repeats=2)
        assert len(costs.relative) == 6 and costs.relative[0] == 1.0
        assert not fresh._graphs
    finally:
        fresh.close()


def test_a_graph_no_pass_asked_for_lately_goes_before_another_is_built(source):
    """A finished prompt's prefill shapes leave the graph cache once IDLE_LOOKUPS lookups have
    passed without them (a long served session kept 24 graphs, 50 MB of Gemma 3's); a shape
    asked for every step stays."""
    from mdi.model.ggml import chunk as ggml_chunk
    from mdi.model.ggml.built import Built
    fresh = source.ggml_chunk(0, 1, True, False, threads=1)
    try:
        fresh._graph("old prefill", lambda: Built(8))
        for _ in range(ggml_chunk.IDLE_LOOKUPS + 1):
            fresh._graph("decode", lambda: Built(8))
        assert list(fresh._graphs) == ["old prefill", "decode"]  # nothing built since: nothing dropped
        fresh._graph("new prefill", lambda: Built(8))
        assert list(fresh._graphs) == ["decode", "new prefill"]
    finally:
        fresh.close()


def test_a_q8_0_cache_on_heads_of_partial_blocks_is_one_line_before_the_weights_load(tiny_models, monkeypatch):
    """runtime.kv_type q8_0 needs each head's row to be whole blocks of 32 (the tiny llama's
    head_dim is 8): the starter says so as a ConfigError (mdi-start: `mdi: error:`, exit 2)
    before it loads its weights, as a worker answers a 400, not a traceback from its cache."""
    import subprocess

    from conftest import BIN
    from mdi.model.ggml import kv_cache
    assert kv_cache.head_dim_unfit("q8_0", 64) is None and kv_cache.head_dim_unfit("f16", 8) is None
    proc = subprocess.run([BIN + "/mdi-start", "--model", tiny_models["llama"], "--prompt", "ab", "--n-tokens", "2",
                           "--backend", "ggml", "--kv-type", "q8_0"], capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and errors[0].startswith("mdi: error:"), proc.stderr
    assert "kv_type q8_0" in errors[0] and "head_dim (8)" in errors[0], errors
    # the check comes first: it refuses the backend (select_backend, which the starter and each
    # worker ask before their budget's GGUF sizes or weights are read), with nothing measured
    from types import SimpleNamespace

    from mdi.model import backend_select
    from mdi.runconfig import ConfigError
    untouched = SimpleNamespace(head_dim=8, to_dict=None)
    with pytest.raises(ValueError, match=r"kv_type q8_0 needs head_dim \(8\)"):
        backend_select.select_backend("ggml", untouched, 0, 4, {"blk.0.attn_q.weight": "Q8_0"}, "cpu", 1, 1,
                                      kv_type="q8_0")
    # a draft model on ggml (speculation's method draft) too, named, before its weights load
    from mdi.starter.speculation.draft_model import DraftModel
    draft = SimpleNamespace(config=SimpleNamespace(n_layer=4, head_dim=8), path="drafts/tiny", quant=None,
                            source=SimpleNamespace(gguf_path="drafts/tiny/model.gguf", ggml_chunk=None))
    with pytest.raises(ConfigError, match=r"draft model drafts/tiny: runtime\.kv_type q8_0 needs head_dim \(8\)"):
        DraftModel.load(draft, 1, 64, None, "cpu", 64, ggml=SimpleNamespace(kv_type="q8_0"))
