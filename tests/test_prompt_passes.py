"""The passes a ring with a ggml node cuts a prompt into (mdi.starter.prompt_passes): ggml's
flash attention computes a sample's rows with another kernel from TILED_ROWS rows a pass, so a
prompt row keeps its bits only if every pass that carries it falls on the side llama.cpp's
ubatch would. The rules, for every window, position and chunk; then on ggml itself: the rows
and greedy ids of a long prompt, however it is chunked, batched or taken from the prefix cache,
are those of the prompt in one pass (and llama.cpp's, scripts/compare_llama_text.py), with the
weights as stored and with runtime.prefill_weights auto's dequantized product (which starts
at TILED_ROWS rows, as the cuts do)."""
import numpy as np
import pytest

from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.starter.prompt_passes import REPACK_ROWS, TILED_ROWS, UBATCH, next_pass_rows, reusable_positions
from test_ggml_backend import chunk, source  # noqa: F401  (its fixtures: SmolLM2 whole on ggml, 4 slots)

CHUNKS = (1, 7, 16, 63, 64, 66, 100, 130, 512, 4096)
WINDOWS = list(range(1, 200)) + [511, 512, 513, 530, 575, 576, 577, 600, 1023, 1024, 1025, 1100, 1600]


def cuts(window, fed, chunk):
    out = []
    while fed < window:
        rows = next_pass_rows(window, fed, chunk)
        out.append((fed, rows))
        fed += rows
    return out


def check_cuts(window, passes, chunk):
    for start, rows in passes:
        ub = start // UBATCH * UBATCH
        ub_rows = min(window, ub + UBATCH) - ub
        assert rows >= 1 and start + rows <= ub + ub_rows, "a pass never crosses a ubatch: %r" % (passes,)
        if ub_rows >= TILED_ROWS:  # llama.cpp's tiled kernel: every pass must carry TILED_ROWS rows
            assert rows >= TILED_ROWS and (start - ub) % REPACK_ROWS == 0, (window, chunk, passes)
            assert rows < max(TILED_ROWS, chunk) + TILED_ROWS, (window, chunk, passes)
        else:  # llama.cpp's one-row kernel
            assert rows <= chunk, (window, chunk, passes)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_prompt_is_cut_as_llama_cpp_s_ubatches_compute_its_rows(chunk):
    for window in WINDOWS:
        passes = cuts(window, 0, chunk)
        assert sum(r for _, r in passes) == window
        check_cuts(window, passes, chunk)


@pytest.mark.parametrize("chunk", (16, 64, 100))
def test_a_prefix_cache_hit_moves_back_to_where_a_cold_prompt_s_passes_could_start(chunk):
    for window in WINDOWS:
        for cached in range(0, window):
            start = reusable_positions(window, cached)
            assert 0 <= start <= cached
            assert cached - start < TILED_ROWS + REPACK_ROWS  # a few rows computed again, never the prompt
            check_cuts(window, cuts(window, start, chunk), chunk)
        if 2 * TILED_ROWS <= window <= UBATCH:
            assert reusable_positions(window, TILED_ROWS) == TILED_ROWS  # a hit that leaves a pass's worth stays


# --- on ggml --------------------------------------------------------------------------------

ggml_only = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))
TEXT = ("The history of the lighthouse begins in antiquity. In the harbour of Alexandria stood the Pharos, one of "
        "the seven wonders of the ancient world, whose fire guided sailors for centuries. Later, the Romans built "
        "towers along the coasts of their empire, from Dover to Ostia. In the middle ages monks kept lights burning "
        "on dangerous headlands, and by the eighteenth century engineers such as John Smeaton had learned to build "
        "towers that could stand against the fiercest storms of the Atlantic. Smeaton's tower on the Eddystone rocks "
        "used interlocking granite blocks and a lime mortar that set under water. The next great change came with "
        "the lens invented by Augustin Fresnel, which")


@pytest.fixture(params=["quantized", "auto"])
def prefill(request, chunk, monkeypatch):  # noqa: F811
    """The chunk's runtime.prefill_weights: as stored, or auto with a measured rule forced (BF16
    from 16 rows, whatever this CPU measures), which auto takes from TILED_ROWS rows."""
    from mdi.model.ggml import dequant_rows
    if request.param == "auto":
        monkeypatch.setattr(dequant_rows, "measure_rule", lambda *a: dequant_rows.DequantRule(lib.TYPE_IDS["BF16"], 16))
    chunk.set_prefill_weights(request.param)
    assert chunk.dequantized_from == (TILED_ROWS if request.param == "auto" else None)
    yield request.param
    chunk.set_prefill_weights("quantized")


def rows_in_passes(chunk, ids, passes, slot=0):
    out = []
    for start, rows in passes:
        x = chunk.embed_rows(np.array(ids[start:start + rows], np.int32), None)
        out.append(np.array(chunk.forward_rows(x, PassRows([slot], [start], [rows]))))
    return np.concatenate(out)


@ggml_only
def test_a_prompt_s_rows_keep_their_bits_in_the_passes_cut_for_ggml(source, chunk, prefill):  # noqa: F811
    ids = source.tokenizer.encode(TEXT)
    n = len(ids)
    assert TILED_ROWS * 2 < n < 256
    whole = rows_in_passes(chunk, ids, [(0, n)])
    if prefill == "auto":  # the dequantized product ran: its rows are not the quantized one's
        chunk.set_prefill_weights("quantized")
        assert not np.array_equal(rows_in_passes(chunk, ids, [(0, n)]), whole)
        chunk.set_prefill_weights("auto")
    for c in (1, 16, 64, 100):
        assert np.array_equal(rows_in_passes(chunk, ids, cuts(n, 0, c)), whole), c
    # A prompt shorter than TILED_ROWS: its passes of any size keep the one-row kernel and the
    # weights as stored (auto's product starts at TILED_ROWS rows, where the cuts do)
    short = rows_in_passes(chunk, ids[:40], [(0, 40)], slot=2)
    for c in (7, 16):
        assert np.array_equal(rows_in_passes(chunk, ids[:40], cuts(40, 0, c), slot=2), short), c
    # What the cuts avoid: a pass of fewer than TILED_ROWS rows of this prompt computes other bits
    naive = rows_in_passes(chunk, ids, [(0, n - 9), (n - 9, 9)])
    assert np.array_equal(naive[:n - 9], whole[:n - 9]) and not np.array_equal(naive[n - 9:], whole[n - 9:])
    # A prefix-cache hit of all but the last token (slot 1 holds the prompt's rows from a pass of its own)
    start = reusable_positions(n, n - 1)
    rows_in_passes(chunk, ids, [(0, n)], slot=1)
    again = rows_in_passes(chunk, ids, cuts(n, start, 64), slot=1)
    assert np.array_equal(again, whole[start:])


@ggml_only
def test_greedy_ids_of_a_long_prompt_do_not_depend_on_chunks_batching_or_the_prefix_cache(source, chunk,  # noqa: F811
                                                                                          prefill):
    from mdi.model.sampling import SamplingParams, sample_generator
    from mdi.ring.transport import LocalLoop
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import Sample
    long = source.tokenizer.encode(TEXT)
    short = [source.tokenizer.encode(p) for p in ("Once upon a time", "def fibonacci(n):")]

    def run(prefill_chunk, others=(), prefix=False, repeat=1):
        pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None,
                        PipelineSettings(max_batch=3, prefill_chunk=prefill_chunk, ggml_cuts=True))
        if prefix:
            pipe.enable_prefix_cache(10 ** 4, 10 ** 9)
        for r in range(repeat):
            samples = [Sample(i, "", p, 10, sample_generator(0, i)) for i, p in enumerate([long] + list(others))]
            pipe.run(samples)
        return samples[0].token_ids, samples[0].cached_tokens

    want, _ = run(len(long))
    assert run(16)[0] == want
    assert run(64)[0] == want
    assert run(64, others=short)[0] == want  # two short prompts share the long one's frames
    ids, cached = run(64, prefix=True, repeat=2)  # the second run starts from the first one's positions
    assert cached > 0 and ids == want


def test_a_prompt_s_longer_pass_still_shares_its_frame_with_decode_rows():
    """A cut longer than what is left of `prefill_chunk` after the decode rows goes with them
    (a frame of its own would cost every node another forward), and two prompts' cuts are
    never shortened to share a frame: the second waits for the next one."""
    from conftest import tiny_model
    from mdi.model.sampling import SamplingParams, sample_generator
    from mdi.ring.transport import LocalLoop
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import Sample
    chunk = tiny_model("llama")
    chunk.allocate_cache(3, 128)
    later = [Sample(1, "", [i % 90 + 1 for i in range(100)], 2, sample_generator(0, 1)),
             Sample(2, "", [i % 90 + 1 for i in range(70)], 2, sample_generator(0, 2))]

    def arrive(sample, token):  # two prompts arrive as the first sample's first token is drawn
        while later:
            pipe.admit(later.pop())
    pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None,
                    PipelineSettings(max_batch=3, prefill_chunk=64, ggml_cuts=True), on_token=arrive)
    sent = []
    send = pipe.transport.send
    pipe.transport.send = lambda frame: (sent.append(list(frame.count)), send(frame))
    pipe.admit(Sample(0, "", [5, 6, 7], 4, sample_generator(0, 0)))
    pipe.step()
    # its prompt; then its decode row leads (shortest first) and each prompt goes in one cut
    # of its own (64 + 6 and 64 + 36 merged)
    assert sent[:3] == [[3], [1, 70], [100]]


def test_a_hit_reuses_only_positions_computed_as_the_cold_prompt_computes_them():
    """A prompt row keeps the bits of the pass that computed it: the start of a prompt under
    TILED_ROWS tokens (passes below TILED_ROWS rows, the one-row kernel) is not reused by a
    longer prompt (tiled passes), nor the start of a long prompt by a short one; an answer's
    rows are, as a conversation's (the exception "Determinism" states); without ggml's cuts
    every shared position is."""
    from mdi.starter.prefix_cache import PrefixIndex
    from mdi.starter.prompt_passes import ANSWER, ONE_ROW, TILED, cold_kinds
    assert list(cold_kinds(5)) == [ONE_ROW] * 5 and set(cold_kinds(TILED_ROWS)) == {TILED}
    assert list(cold_kinds(UBATCH + 3)) == [TILED] * UBATCH + [ONE_ROW] * 3
    short, long = list(range(1, 21)), list(range(1, 11)) + list(range(100, 200))
    for cuts, want in ((True, 0), (False, 10)):
        for first, then in ((short, long), (long, short)):
            index = PrefixIndex(10 ** 4)
            index.admit(0, first, 0, ggml_cuts=cuts)
            index.release(0, first + [7, 8], 0)
            assert index.admit(0, then, 0, ggml_cuts=cuts) == want  # the slot's own sequence
            index.release(0, then, 0)
            # a short prompt of the first one's start: its entry's positions where they were
            # computed as short ones (else what the slot holds: `then`'s first 10), from a
            # multiple of REPACK_ROWS on ggml (its re-laid weights multiply rows in groups of 4)
            assert index.admit(0, first[:15] + [5], 0, ggml_cuts=cuts) == ((8 if first is long else 12) if cuts else 15)
    index = PrefixIndex(10 ** 4)  # a slot holding more of a prompt is no better where its rows differ
    for slot, prompt in ((0, long), (1, long[:20])):
        index.admit(slot, prompt, 0, ggml_cuts=True)
        index.release(slot, prompt, 0)
    assert index.choose_slot([0, 1], long[:25], 0, ggml_cuts=True) == 1
    assert index.choose_slot([0, 1], long[:25], 0) == 0
    index = PrefixIndex(10 ** 4)
    index.admit(0, long, 0, ggml_cuts=True)
    index.release(0, long + [9] * 40, 0)  # the answer: 40 rows a decode step each
    turn = long + [9] * 40 + list(range(300, 400))
    assert index.admit(0, turn, 0, ggml_cuts=True) == reusable_positions(len(turn), len(long) + 40)
    assert index.slots == {} and list(index._running[0].kinds[:len(long)]) == [TILED] * len(long)
    index.release(0, turn, 0, False)  # a context shift computed it again: nothing said of how
    assert index.slots[0].kinds is None and ANSWER == 2


@ggml_only
def test_a_long_prompt_after_a_short_one_with_its_start_gives_its_cold_ids(source, chunk):  # noqa: F811
    """Served, a short prompt then a long one that starts like it (a chat's template, a
    nonce): the long one's greedy ids are those of its cold run, and it reused nothing."""
    from mdi.model.sampling import SamplingParams, sample_generator
    from mdi.ring.transport import LocalLoop
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import Sample
    start = source.tokenizer.encode("[3f9a1c] Notes on the ring:")
    long = start + source.tokenizer.encode(TEXT)
    pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None,
                    PipelineSettings(max_batch=1, prefill_chunk=64, ggml_cuts=True))
    cold = Sample(0, "", long, 12, sample_generator(0, 0))
    pipe.run([cold])
    pipe.enable_prefix_cache(10 ** 4, 10 ** 9)
    pipe.run([Sample(1, "", start + source.tokenizer.encode(" x"), 4, sample_generator(0, 1))])
    again = Sample(1, "", long, 12, sample_generator(0, 2))  # into the short one's slot
    pipe.run([again])
    assert again.cached_tokens == 0 and again.token_ids == cold.token_ids


@ggml_only
def test_a_short_prompt_resumed_from_a_hit_keeps_its_rows_on_re_laid_weights(gemma3_gguf):
    """Gemma 3's Q4_K matrices, re-laid by ggml (runtime.repack, the default), multiply a pass's
    rows in groups of REPACK_ROWS from its start: a 16-token prompt's last row computed alone
    (15 positions from the prefix cache) parted from its cold text; resumed where
    reusable_positions says, a multiple of REPACK_ROWS in, its rows keep their bits."""
    from mdi.model.source import ModelSource
    source = ModelSource(gemma3_gguf)
    chunk = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1)
    if not chunk.weights.repacked:
        pytest.skip("ggml re-lays no matrix of this GGUF on this CPU")
    chunk.allocate_cache(3, 64)
    ids = source.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")[:16]
    n = len(ids)
    assert n == 16
    whole = rows_in_passes(chunk, ids, [(0, n)], slot=0)
    start = reusable_positions(n, n - 1)
    assert start % REPACK_ROWS == 0 and start < n - 1
    rows_in_passes(chunk, ids, [(0, n)], slot=1)  # the cached rows, as the cold prompt computed them
    assert np.array_equal(rows_in_passes(chunk, ids, [(start, n - start)], slot=1), whole[start:])
    rows_in_passes(chunk, ids, [(0, n)], slot=2)
    alone = rows_in_passes(chunk, ids, [(n - 1, 1)], slot=2)  # what a hit of 15 had computed
    assert not np.array_equal(alone, whole[n - 1:])
    chunk.close()
