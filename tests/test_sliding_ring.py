"""Sliding-window layers keep a ring of positions on the ggml backend (mdi.model.sliding_cache):
a tiny random Gemma 3 (windows of 4 positions in layers 0 and 2, rings of 4 + 512 padded to 768) computes
with rings what it computes with every position kept, in fewer bytes, with the same bits
however its passes are cut; a pass or a slot the ring cannot serve is refused in one line; a
node whose layers all keep rings computes; the prefix cache copies a ring with the positions
its rows hold, and the starter's index reuses a held sequence only where the rings still hold
the window before the first position computed."""
import dataclasses

import numpy as np
import pytest

from conftest import CHARS, make_tiny_model, tiny_config
from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.prefix_store import CacheOp, PrefixStore
from mdi.model.sliding_cache import ROWS_AHEAD, SlidingRing, ring_length
from mdi.model.source import ModelSource
from mdi.starter.prefix_cache import PrefixIndex

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

MAX_LEN = 2048
RING = 768  # 4 + 512, padded to 256 as llama.cpp's SWA cache
CHUNK = 64  # runtime.prefill_chunk's default: rings kept


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A tiny Gemma 3 of 2,048 positions."""
    config = dataclasses.replace(tiny_config("gemma3"), block_size=MAX_LEN)
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3") / "long"), "gemma3", config=config)


@pytest.fixture(scope="module")
def source(path):
    return ModelSource(path)


@pytest.fixture(scope="module")
def ids(source):
    return [int(i) for i in np.random.RandomState(1).randint(0, source.config.vocab_size, 1200)]


def chunk_of(source, prefill_chunk, n_slots=3, first=0, last=None):
    c = source.ggml_chunk(first, source.config.n_layer if last is None else last, first == 0, last is None,
                          threads=1, kv_type="f32")
    c.allocate_cache(n_slots, MAX_LEN, prefill_chunk)
    return c


def feed(chunk, slot, ids, start=0, cut=1):
    """The logits after each of `ids`, fed to `slot` from position `start` in passes of `cut`."""
    out = []
    for at in range(0, len(ids), cut):
        take = ids[at:at + cut]
        y = chunk.forward_rows(chunk.embed_rows(np.array(take, np.int32), None),
                               PassRows([slot], [start + at], [len(take)]))
        out.append(chunk.head(y))
    return np.concatenate(out)


def test_the_ring_length_rule(source):
    c = source.config
    assert ring_length(c, 0, c.n_layer, MAX_LEN, CHUNK) == RING == ring_length(c, 0, c.n_layer, MAX_LEN, 512)
    assert ring_length(c, 1, 2, MAX_LEN, CHUNK) == 0  # a global layer alone keeps every position
    assert ring_length(c, 0, c.n_layer, RING, CHUNK) == 0  # a ring would save nothing
    assert ring_length(c, 0, c.n_layer, MAX_LEN, 1024) == 0  # prompt passes longer than a ubatch


def test_rings_compute_what_every_position_computes_in_fewer_bytes(source, ids):
    full, ring = chunk_of(source, None), chunk_of(source, CHUNK)
    assert full.cache.ring == 0 and ring.cache.ring == RING
    assert ring.cache.lengths == [RING, MAX_LEN, RING, MAX_LEN]
    assert ring.cache.nbytes == full.cache.nbytes * (RING + MAX_LEN) // (2 * MAX_LEN)
    a, b = feed(full, 0, ids, cut=64), feed(ring, 0, ids, cut=64)
    assert np.array_equal(a[:RING], b[:RING])  # before the ring goes round: the same rows, the same bits
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(np.abs(a).max()))  # after: summed in another order


def test_with_rings_a_row_has_the_same_bits_however_the_passes_are_cut(source, ids):
    ring = chunk_of(source, CHUNK)
    one, cut = feed(ring, 0, ids[:1000], cut=1), feed(ring, 1, ids[:1000], cut=48)  # past the ring's 768
    assert np.array_equal(one, cut)
    # two samples in one pass, each against its own ring
    x = ring.embed_rows(np.array(ids[:3] + ids[:1], np.int32), None)
    y = ring.head(ring.forward_rows(x, PassRows([2, 0], [0, 1000], [3, 1])))
    assert np.array_equal(y[:3], one[:3])


def test_a_node_whose_layers_all_keep_rings_computes(source, ids):
    """Layer 0 alone (a sliding-window layer) keeps no position whole: its graph has no rows to
    write by in full-length layers (setting that input had aborted the process)."""
    alone = chunk_of(source, CHUNK, first=0, last=1)
    assert alone.cache.lengths == [RING]
    both = chunk_of(source, None, first=0, last=1)
    x = alone.embed_rows(np.array(ids[:8], np.int32), None)
    assert np.array_equal(alone.forward_rows(x, PassRows([0], [0], [8])), both.forward_rows(x, PassRows([0], [0], [8])))


def test_a_pass_or_a_slot_the_ring_cannot_serve_is_refused_in_one_line(source, ids):
    ring = chunk_of(source, CHUNK)
    feed(ring, 0, ids[:RING], cut=RING)  # from position 0 a pass may fill the ring (nothing is overwritten yet)...
    feed(ring, 0, ids[RING:1000], start=RING, cut=64)
    x = ring.embed_rows(np.array(ids[:766], np.int32), None)
    with pytest.raises(ValueError, match="a pass of 766 rows at position 1000: .* ring of 768 positions takes at most "
                                         "765"):
        ring.forward_rows(x, PassRows([0], [1000], [766]))  # ... not once it went round
    with pytest.raises(ValueError, match=r"slot 0 no longer holds positions \[97, 100\) in its sliding-window"):
        ring.forward_rows(x[:1], PassRows([0], [100], [1]))  # what it held there is overwritten


def test_the_prefix_cache_copies_a_ring_with_the_positions_it_holds(source, ids):
    ring = chunk_of(source, CHUNK)
    cache = ring.cache
    want = feed(ring, 0, ids[:1100], cut=64)
    store = PrefixStore(cache, budget_bytes=10 * cache.range_bytes(1100))
    store.apply([CacheOp("save", 1, slot=0, length=1100)])
    assert store.stats.bytes == cache.range_bytes(1100) < 2 * 4 * 1100 * cache.row_bytes
    store.apply([CacheOp("load", 1, slot=2, length=1098)])  # the last two are fed again
    assert np.array_equal(feed(ring, 2, ids[1098:1100], start=1098), want[1098:])
    store.apply([CacheOp("load", 1, slot=1, length=300)])  # the ring holds 332..1099 only
    with pytest.raises(ValueError, match=r"slot 1 no longer holds positions \[297, 300\)"):
        feed(ring, 1, ids[300:301], start=300)
    short = chunk_of(source, CHUNK)  # a sequence that never went round: every position kept
    feed(short, 0, ids[:8], cut=8)
    kept = PrefixStore(short.cache, budget_bytes=short.cache.range_bytes(8))
    kept.apply([CacheOp("save", 1, slot=0, length=8), CacheOp("load", 1, slot=1, length=5)])
    assert np.array_equal(feed(short, 1, ids[5:8], start=5), feed(short, 0, ids[5:8], start=5))


def test_the_index_reuses_a_held_sequence_only_where_the_rings_hold_the_window_before_it():
    ring = SlidingRing(ring=300, window=4)
    seq = np.arange(1000, 1400)
    index = PrefixIndex(10000, ring)
    assert index.admit(0, seq, key=0) == 0
    index.release(0, seq, key=0)
    lost = 400 + ROWS_AHEAD + 1 - 300
    assert index.slots[0].intact_from == lost  # the rows a sample writes past what it keeps overwrote older ones
    near = np.concatenate([seq[:lost + 10], np.arange(5)])
    assert index.choose_slot([0, 1], near, key=0) == 0
    assert index.admit(0, near, key=0) == lost + 10  # its window before is held: reused
    assert [op.kind for op in index.take_ops()] == ["save"]  # (the old sequence, which the sample overwrites)
    index.release(0, near, key=0)
    assert index.slots[0].intact_from == lost  # what it reused, from the old sequence's rings
    far = np.concatenate([seq[:lost + 1], np.arange(5)])
    assert index.admit(0, far, key=0) == 0  # lost..lost+1's window reaches below what is held: computed again...
    assert [op.kind for op in index.take_ops()] == ["save"]  # ... and what the slot held is kept as an entry
    plain = PrefixIndex(10000)
    plain.admit(0, seq, key=0)
    plain.release(0, seq, key=0)
    assert plain.admit(0, far, key=0) == lost + 1  # without rings every position is held
    # A sample that never drafted wrote no rows past its sequence but the next one's: more is held.
    index.admit(1, seq, key=0, reuse=False)  # (computed whole: no position of an earlier ring's)
    index.release(1, seq, key=0, drafted=False)
    assert index.slots[1].intact_from == 400 + 1 - 300
    assert index.admit(1, far, key=0) == lost + 1


def test_a_long_run_with_rings_shifts_its_context(path, caplog):
    """Generating past its context on ggml: each shift computes its window again from position 0
    over rings that went round, whose rows still hold older positions. (This tiny model's
    greedy ids are one token over and over: ids with rings are compared on Gemma 3 270M in
    tests/test_ggml_ring.py.)"""
    from ringconfigs import parse_run_config
    from mdi.starter import batch
    caplog.set_level("INFO", logger="mdi.model.ggml.kv_cache")
    cfg = parse_run_config(path, n_tokens=5000, generation={"context_shift": True},
                           runtime={"backend": "ggml", "threads": 1})
    result = batch.run(cfg, ["To be, or not to be"])
    assert "keep %d positions a slot of %d" % (RING, MAX_LEN) in caplog.text
    assert result.samples[0].finish_reason == "length" and len(result.samples[0].token_ids) == 5000
    assert result.metrics()["context_shifts"] >= 3


def test_perplexity_windows_keep_their_rings_and_score_what_every_position_scores(path, tmp_path, caplog):
    """--perplexity's windows go in passes of a ubatch, as llama-perplexity's do, so a window
    longer than the ring keeps its sliding-window layers in rings, as llama.cpp's SWA cache
    does (one pass a window had kept every position: its --swa-full figure)."""
    from ringconfigs import parse_run_config
    from mdi.starter import perplexity
    text = tmp_path / "text.txt"
    text.write_text("".join(np.random.RandomState(2).choice(list(CHARS), 2400)))
    caplog.set_level("INFO", logger="mdi.model.ggml.kv_cache")
    scored = {}
    for backend in ("ggml", "torch"):  # torch keeps every position
        # (a prefill_chunk over 512 had the nodes keep every position too: perplexity takes 512)
        cfg = parse_run_config(path, runtime={"backend": backend, "threads": 1, "kv_type": "f32", "prefill_chunk": 700})
        scored[backend] = perplexity.run(cfg, str(text), ctx=1100, max_windows=2)
    assert "keep %d positions a slot of %d" % (RING, 1100) in caplog.text
    assert np.allclose(scored["ggml"].window_nll, scored["torch"].window_nll, rtol=1e-4), scored
