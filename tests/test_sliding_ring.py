"""Sliding-window layers keep a ring of positions on the ggml backend (mdi.model.sliding_cache):
a tiny random Gemma 3 (windows of 4 positions in layers 0 and 2) computes with rings what it
computes with every position kept, in fewer bytes, with the same bits however its passes are
cut; a pass or a slot the ring cannot serve is refused in one line; the prefix cache copies a
ring with the positions its rows hold, and the starter's index reuses a held sequence only
where the rings still hold the window before the first position computed."""
import numpy as np
import pytest

from conftest import make_tiny_model
from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.prefix_store import CacheOp, PrefixStore
from mdi.model.sliding_cache import SlidingRing, pass_rows_bound, ring_length
from mdi.model.source import ModelSource
from mdi.starter.prefix_cache import PrefixIndex

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

PASS_ROWS = 3  # a ring of 4 + 2 * 3 = 10 positions
MAX_LEN = 128
RING = 10


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return ModelSource(make_tiny_model(str(tmp_path_factory.mktemp("gemma3") / "tiny"), "gemma3"))


@pytest.fixture(scope="module")
def ids(source):
    return [int(i) for i in np.random.RandomState(1).randint(0, source.config.vocab_size, 90)]


def chunk_of(source, pass_rows, n_slots=3):
    c = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1, kv_type="f32")
    c.allocate_cache(n_slots, MAX_LEN, pass_rows)
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
    assert ring_length(c, 0, c.n_layer, MAX_LEN, PASS_ROWS) == RING
    assert ring_length(c, 1, 2, MAX_LEN, PASS_ROWS) == 0  # a global layer alone keeps every position
    assert ring_length(c, 0, c.n_layer, 10, PASS_ROWS) == 0  # a ring would save nothing
    assert pass_rows_bound(64) == 128 and pass_rows_bound(300) == 364


def test_rings_compute_what_every_position_computes_in_fewer_bytes(source, ids):
    full, ring = chunk_of(source, None), chunk_of(source, PASS_ROWS)
    assert full.cache.ring == 0 and ring.cache.ring == RING
    assert ring.cache.lengths == [RING, MAX_LEN, RING, MAX_LEN]
    assert ring.cache.nbytes == full.cache.nbytes * (RING + MAX_LEN) // (2 * MAX_LEN)
    a, b = feed(full, 0, ids, cut=3), feed(ring, 0, ids, cut=3)
    assert np.array_equal(a[:RING], b[:RING])  # before the ring goes round: the same rows, the same bits
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(np.abs(a).max()))  # after: summed in another order
    assert (a.argmax(1) == b.argmax(1)).all()


def test_with_rings_a_row_has_the_same_bits_however_the_passes_are_cut(source, ids):
    ring = chunk_of(source, PASS_ROWS)
    one, three = feed(ring, 0, ids, cut=1), feed(ring, 1, ids, cut=3)
    assert np.array_equal(one, three)
    # two samples in one pass, each against its own ring
    x = ring.embed_rows(np.array(ids[:3] + ids[:1], np.int32), None)
    y = ring.head(ring.forward_rows(x, PassRows([2, 0], [0, 90], [3, 1])))
    assert np.array_equal(y[:3], one[:3])


def test_a_pass_or_a_slot_the_ring_cannot_serve_is_refused_in_one_line(source, ids):
    ring = chunk_of(source, PASS_ROWS)
    feed(ring, 0, ids[:8], cut=8)  # from position 0 a pass may fill the ring (nothing is overwritten yet)...
    feed(ring, 0, ids[8:40], start=8, cut=3)
    x = ring.embed_rows(np.array(ids[:8], np.int32), None)
    with pytest.raises(ValueError, match="a pass of 8 rows at position 40: .* ring of 10 positions takes at most 7"):
        ring.forward_rows(x, PassRows([0], [40], [8]))  # ... not once it went round
    with pytest.raises(ValueError, match=r"slot 0 no longer holds positions \[17, 20\) in its sliding-window"):
        ring.forward_rows(x[:1], PassRows([0], [20], [1]))  # what it held there is overwritten


def test_the_prefix_cache_copies_a_ring_with_the_positions_it_holds(source, ids):
    ring = chunk_of(source, PASS_ROWS)
    cache = ring.cache
    want = feed(ring, 0, ids, cut=3)
    store = PrefixStore(cache, budget_bytes=10 * cache.range_bytes(90))
    store.apply([CacheOp("save", 1, slot=0, length=90)])
    assert store.stats.bytes == cache.range_bytes(90) < 2 * 4 * 90 * cache.row_bytes
    store.apply([CacheOp("load", 1, slot=2, length=88)])  # the last two are fed again
    assert np.array_equal(feed(ring, 2, ids[88:], start=88), want[88:])
    store.apply([CacheOp("load", 1, slot=1, length=60)])  # the ring holds 80..89 only
    with pytest.raises(ValueError, match=r"slot 1 no longer holds positions \[57, 60\)"):
        feed(ring, 1, ids[60:61], start=60)
    short = chunk_of(source, PASS_ROWS)  # a sequence that never went round: every position kept
    feed(short, 0, ids[:8], cut=8)
    kept = PrefixStore(short.cache, budget_bytes=short.cache.range_bytes(8))
    kept.apply([CacheOp("save", 1, slot=0, length=8), CacheOp("load", 1, slot=1, length=5)])
    assert np.array_equal(feed(short, 1, ids[5:8], start=5), feed(short, 0, ids[5:8], start=5))


def test_the_index_reuses_a_held_sequence_only_where_the_rings_hold_the_window_before_it():
    ring = SlidingRing(ring=30, window=4, pass_rows=8)
    seq = np.arange(100, 200)
    index = PrefixIndex(10000, ring)
    assert index.admit(0, seq, key=0) == 0
    index.release(0, seq, key=0)
    assert index.slots[0].intact_from == 100 + 8 - 1 - 30  # the rows past it overwrote older ones
    near = np.concatenate([seq[:90], np.arange(5)])
    assert index.choose_slot([0, 1], near, key=0) == 0
    assert index.admit(0, near, key=0) == 90  # 87..89 are held: reused
    assert [op.kind for op in index.take_ops()] == ["save"]  # (the old sequence, which the sample overwrites)
    index.release(0, near, key=0)
    assert index.slots[0].intact_from == 77  # what it reused, from the old sequence's rings
    far = np.concatenate([seq[:70], np.arange(5)])
    assert index.admit(0, far, key=0) == 0  # 67..69 are gone: computed again...
    assert [op.kind for op in index.take_ops()] == ["save"]  # ... and what the slot held is kept as an entry
    plain = PrefixIndex(10000)
    plain.admit(0, seq, key=0)
    plain.release(0, seq, key=0)
    assert plain.admit(0, far, key=0) == 70  # without rings every position is held


def test_a_long_run_with_rings_shifts_its_context(tmp_path, caplog):
    """A tiny Gemma 3 of 1,024 positions (rings of 4 + 2 x 128 = 260 at prefill_chunk 64)
    generating past its context on ggml: each shift computes its window again from position 0
    over rings that went round several times, whose rows still hold older positions. (This
    model's greedy ids are one token over and over: the ids with and without rings are
    compared on Gemma 3 270M in tests/test_ggml_ring.py.)"""
    import dataclasses
    from conftest import CHARS, save_test_model, tiny_config, tiny_model
    from mdi.model.tokenizers import char_tokenizer
    from ringconfigs import parse_run_config
    from mdi.starter import batch
    config = dataclasses.replace(tiny_config("gemma3"), block_size=1024)
    model = tiny_model("gemma3", config=config)
    path = str(tmp_path / "long")
    save_test_model(path, model.config, model.state_dict(), "tests/test_sliding_ring.py")
    char_tokenizer(CHARS).save(path)
    caplog.set_level("INFO", logger="mdi.model.ggml.kv_cache")
    cfg = parse_run_config(path, n_tokens=2500, generation={"context_shift": True},
                           runtime={"backend": "ggml", "threads": 1, "prefill_chunk": 64})
    result = batch.run(cfg, ["To be, or not to be"])
    assert "keep 260 positions a slot of 1024" in caplog.text
    assert result.samples[0].finish_reason == "length" and len(result.samples[0].token_ids) == 2500
    assert result.metrics()["context_shifts"] >= 3
