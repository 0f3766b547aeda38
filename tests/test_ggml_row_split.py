"""Passes of a few rows multiplied row by row where that is measured cheaper (mdi.model.ggml.
row_split): the results keep every bit, and what was measured is remembered per machine."""
import logging

import numpy as np
import pytest

from mdi.model.ggml import lib
from mdi.model.ggml import row_split
from mdi.model.pass_rows import PassRows
from mdi.model.source import ModelSource

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

SIZES = range(1, row_split.MAX_SPLIT_ROWS + 1)


def _chunk(source, monkeypatch, split_all):
    """The whole model as one ggml chunk, its measured choice replaced: every eligible matrix
    split at every size (split_all), or none."""
    import mdi.model.ggml.chunk as chunk_module
    chosen = {}

    def choose(cpu, weights, groups):
        chosen.update({n: frozenset(range(2, row_split.MAX_SPLIT_ROWS + 1)) if split_all else frozenset()
                       for names in groups for n in names})
        return dict(chosen)

    monkeypatch.setattr(chunk_module, "split_sizes", choose)
    c = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1)
    c.allocate_cache(2, 128)
    return c, chosen


def _passes(chunk, width, rng):
    """Each pass size's blocks output and logits, from the same context (a 20-token prefill)."""
    prefill = rng.standard_normal((20, width)).astype(np.float32)
    chunk.forward_rows(prefill, PassRows([0], [0], [20]))
    out = {}
    for n in SIZES:
        x = rng.standard_normal((n, width)).astype(np.float32)
        y = chunk.forward_rows(x, PassRows([0], [20], [n]))
        out[n] = (y, chunk.head(y))
    return out


def test_multiplying_row_by_row_changes_no_bit(smollm2_dir, monkeypatch):
    source = ModelSource(smollm2_dir)
    plain, none = _chunk(source, monkeypatch, split_all=False)
    split, every = _chunk(source, monkeypatch, split_all=True)
    assert every and not any(none.values())
    assert "token_embd.weight" in every  # the tied head is split too
    width = source.config.n_embd
    a = _passes(plain, width, np.random.default_rng(3))
    b = _passes(split, width, np.random.default_rng(3))
    for n in SIZES:
        assert np.array_equal(a[n][0], b[n][0]), n
        assert np.array_equal(a[n][1], b[n][1]), n
    # and the split chunk did multiply row by row: its graphs hold a product per row
    gg = lib.require()
    nodes = {name: {key[1].rows: gg.ggml_graph_n_nodes(g.graph) for key, g in c._graphs.items() if key[0] == "blocks"}
             for name, c in (("plain", plain), ("split", split))}
    assert nodes["split"][3] > nodes["plain"][3]
    assert nodes["split"][1] == nodes["plain"][1]
    plain.close()
    split.close()


def test_the_measured_choice_is_remembered_per_machine(smollm2_dir, monkeypatch):
    source = ModelSource(smollm2_dir)
    c = source.ggml_chunk(0, 2, False, False, threads=1)
    groups = [["blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight"],
              ["blk.0.attn_output.weight"]]
    monkeypatch.setattr(row_split, "_measured", {})
    first = row_split.split_sizes(c.compute_backend, c.tensors, groups)
    assert set(first) == {n for g in groups for n in g}
    assert len({first[n] for n in groups[0]}) == 1  # a group shares one measurement
    assert all(s <= set(range(2, row_split.MAX_SPLIT_ROWS + 1)) for s in first.values())

    def never(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(row_split, "_measured", {})  # a new process: only the cache file knows
    monkeypatch.setattr(row_split, "_measure", never)
    assert row_split.split_sizes(c.compute_backend, c.tensors, groups) == first
    c.close()


def test_a_second_node_waits_for_the_first_nodes_measurement_and_recalls_it(smollm2_dir, monkeypatch, tmp_path,
                                                                             caplog):
    """Nodes starting side by side on one machine: the second does not time the same matrices
    beside the first (each would time the other's load); it waits and recalls the result."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path))  # nothing measured here yet
    monkeypatch.setattr(row_split, "_measured", {})
    source = ModelSource(smollm2_dir)
    c = source.ggml_chunk(0, 1, False, False, threads=1)
    groups = [["blk.0.attn_q.weight", "blk.0.ffn_up.weight"]]
    inside, decided, release, measured = threading.Event(), threading.Event(), threading.Event(), []

    def slow_measure(backend, probe):
        measured.append(threading.current_thread().name)
        (decided if inside.is_set() else inside).set()
        assert release.wait(60)
        return frozenset([2])

    class Waiting(logging.Handler):  # the second node is waiting for the lock (it says so once)
        def emit(self, record):
            if "waiting for another process" in record.getMessage():
                decided.set()

    monkeypatch.setattr(row_split, "_measure", slow_measure)
    handler, logger = Waiting(), logging.getLogger("mdi")
    caplog.set_level(logging.INFO, logger="mdi")
    logger.addHandler(handler)
    try:
        with ThreadPoolExecutor(2) as pool:  # a thread holds the file's lock as a process would
            first = pool.submit(row_split.split_sizes, c.compute_backend, c.tensors, groups)
            assert inside.wait(60)
            second = pool.submit(row_split.split_sizes, c.compute_backend, c.tensors, groups)
            assert decided.wait(60)  # measuring beside the first, or waiting for it
            release.set()
            assert first.result(60) == second.result(60) == {n: frozenset([2]) for n in groups[0]}
        assert len(measured) == 1, measured
    finally:
        release.set()
        logger.removeHandler(handler)
        c.close()
