"""A pass's inputs on the ggml backend (mdi.model.ggml.graph_inputs): a decode step (one row a
sample) writes its inputs the short way, and computes the bits a longer pass computes for the
same rows, in global and sliding-window layers, one sample or several; a mask is written whole
each time, whatever ggml's allocator left in its memory."""
import dataclasses

import numpy as np
import pytest

from conftest import make_tiny_model, tiny_config
from mdi.model.ggml import graph_inputs, lib
from mdi.model.ggml.graph import NEG_INF
from mdi.model.ggml.graph_inputs import row_positions
from mdi.model.pass_rows import PassRows
from mdi.model.source import ModelSource

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

MAX_LEN = 96  # no ring: every position kept, so a decode row takes the short way in every layer


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Gemma 3: layers 0 and 2 see their last 4 positions, 1 and 3 every one."""
    config = dataclasses.replace(tiny_config("gemma3"), block_size=MAX_LEN)
    path = make_tiny_model(str(tmp_path_factory.mktemp("gemma3") / "short"), "gemma3", config=config)
    return ModelSource(path)


@pytest.fixture(scope="module")
def chunk(source):
    c = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1, kv_type="f32")
    c.allocate_cache(max(3, c.min_rows), MAX_LEN)
    assert c.cache.ring == 0
    return c


@pytest.fixture(scope="module")
def ids(source):
    return [int(i) for i in np.random.RandomState(3).randint(0, source.config.vocab_size, 80)]


@pytest.fixture
def general_passes(monkeypatch):
    """Counts the passes that took the general way (it alone lays out each sample's positions)."""
    calls = []

    def counted(starts, counts):
        calls.append(len(counts))
        return row_positions(starts, counts)
    monkeypatch.setattr(graph_inputs, "row_positions", counted)
    return calls


def feed(chunk, slot, ids, cut):
    """The logits after each of `ids`, fed to `slot` from position 0 in passes of `cut`."""
    out = []
    for at in range(0, len(ids), cut):
        take = ids[at:at + cut]
        out.append(chunk.head(chunk.forward_rows(chunk.embed_rows(np.array(take, np.int32), None),
                                                 PassRows([slot], [at], [len(take)]))))
    return np.concatenate(out)


def test_decode_rows_compute_what_a_longer_pass_computes(chunk, ids, general_passes):
    cut = feed(chunk, 0, ids, cut=24)
    assert general_passes
    # Samples side by side, a row each, as many as the chunk's fewest rows (a float32 matrix's
    # product takes 2 on x86): every pass goes the short way, activations in, then token ids.
    n = max(2, chunk.min_rows)
    slots = list(range(n))
    rows = []
    del general_passes[:]
    for at, token in enumerate(ids):
        x = chunk.embed_rows(np.array([token] * n, np.int32), None)
        rows.append(chunk.head(chunk.forward_rows(x, PassRows(slots, [at] * n, [1] * n))))
    assert not general_passes
    for sample in range(n):  # past the 4-position window too: its band slides with each row
        assert np.array_equal(np.stack([r[sample] for r in rows]), cut)
    # the starter's one-graph step (embedding, blocks and head), over the positions just written
    last = chunk.embed_forward_logits(np.array([ids[40]] * n, np.int32), PassRows(slots, [40] * n, [1] * n))
    assert not general_passes
    assert all(np.array_equal(last[sample], cut[40]) for sample in range(n))


def test_a_mask_is_written_whole_over_what_the_allocator_left(chunk, ids):
    feed(chunk, 0, ids[:30], cut=1)
    g = next(b for b in chunk._graphs.values() if "mask_local_0" in b.inputs and "mask_0" in b.inputs)
    rng = np.random.RandomState(0)
    for first, end in [(0, 30), (26, 30), (0, 1), (5, 5), (-3, 2)]:
        for name in ("mask_0", "mask_local_0"):
            view = lib.host_view(g.inputs[name])
            view[:] = rng.standard_normal(view.size).astype(np.float16)  # another node's intermediates
            g.fill_band(name, first, end, NEG_INF)
            grid = view.reshape(-1, int(g.inputs[name].contents.ne[0]))
            cols = np.arange(grid.shape[1])
            want = np.where((cols >= max(first, 0)) & (cols < end), np.float16(0), NEG_INF)
            assert (grid == want).all(), (name, first, end)
