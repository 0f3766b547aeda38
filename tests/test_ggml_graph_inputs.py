"""A pass's inputs on the ggml backend (mdi.model.ggml.graph_inputs): a decode step (one row a
sample) writes its inputs the short way, and computes the bits a longer pass computes for the
same rows, in global and sliding-window layers, one sample or several; a mask is written whole
each time, whatever ggml's allocator left in its memory."""
import dataclasses

import numpy as np
import pytest

from conftest import make_tiny_model, tiny_config
from mdi.model.ggml import lib
from mdi.model.ggml.graph import NEG_INF
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
    c.allocate_cache(3, MAX_LEN)
    assert c.cache.ring == 0
    return c


@pytest.fixture(scope="module")
def ids(source):
    return [int(i) for i in np.random.RandomState(3).randint(0, source.config.vocab_size, 80)]


def feed(chunk, slot, ids, cut):
    """The logits after each of `ids`, fed to `slot` from position 0 in passes of `cut`."""
    out = []
    for at in range(0, len(ids), cut):
        take = ids[at:at + cut]
        out.append(chunk.head(chunk.forward_rows(chunk.embed_rows(np.array(take, np.int32), None),
                                                 PassRows([slot], [at], [len(take)]))))
    return np.concatenate(out)


def test_a_decode_row_computes_what_a_longer_pass_computes(chunk, ids):
    one, cut = feed(chunk, 0, ids, cut=1), feed(chunk, 1, ids, cut=24)
    assert np.array_equal(one, cut)  # past the 4-position window too: its band slides with each row
    # the starter's one-graph step (embedding, blocks and head), two samples in one pass
    feed(chunk, 2, ids[:40], cut=40)
    last = chunk.embed_forward_logits(np.array([ids[40], ids[50]], np.int32), PassRows([2, 0], [40, 50], [1, 1]))
    assert np.array_equal(last[1], one[50])
    assert np.array_equal(last[0], feed(chunk, 1, ids[:41], cut=41)[40])


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
