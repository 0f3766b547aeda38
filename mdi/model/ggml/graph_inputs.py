"""A pass's inputs written into its graph: its rows (token ids or activations), their
positions, the cache rows their keys and values go to, each sample's masks and the rows the
head reads.

A decode step (one row a sample, no ring, no padding) takes a short way: plain Python numbers
written through the inputs' host views, and each mask as one band of visible columns. It
writes the same values as the general way; the difference is time. A step's Python runs right
after its graph has streamed the weights through the CPU's caches, where each numpy call
costs microseconds: on SmolLM2 (1 thread) a chunk's Python before its graph took about 140 us
a token beside a 6 ms graph the general way, about half that the short way."""
import itertools
from typing import Any, List, Sequence

import numpy as np

from mdi.model.ggml.built import Built
from mdi.model.ggml.graph import ModelTraits, PassShape, fill_masks
from mdi.model.ggml.kv_cache import GgmlKVCache


def row_positions(starts: Sequence[int], counts: Sequence[int]) -> List[np.ndarray]:
    """Each sample's row positions (int32), from its start and row count."""
    return [np.arange(s, s + c, dtype=np.int32) for s, c in zip(starts, counts)]


def write_inputs(g: Built, shape: PassShape, cache: GgmlKVCache, traits: ModelTraits, starts: Sequence[int],
                 counts: Sequence[int], values: np.ndarray, embedded: bool, head_rows: int) -> None:
    """The inputs of `g`, a graph of pass `shape` (its last sample's rows padded to the chunk's
    fewest: the last row again, at its own position, which computes and writes the same bits)
    over `values` (token ids where `embedded`, else activations [rows, n_embd]) of the samples
    that start at `starts` with `counts` rows; `head_rows`: the head reads each sample's last
    row (the last again up to that many), 0 without a head."""
    slots = [s.slot for s in shape.samples]
    rows = len(values)
    pad = shape.rows - rows
    rings, cache_rows = None, None  # type: Any, Any
    full = "kv_rows" in g.inputs  # (a chunk whose layers all keep rings has none)
    if pad == 0 and rows == len(counts) and not cache.ring:  # a decode step: one number a sample
        positions: Sequence[Any] = [(start,) for start in starts]
        flat: Any = starts
        if full:
            cache_rows = [cache.row(slot, start) for slot, start in zip(slots, starts)]
    else:
        positions = arrays = row_positions(starts, counts)
        if pad > 0:
            arrays[-1] = np.concatenate([arrays[-1], np.repeat(arrays[-1][-1:], pad)])
            values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)])
        rings = cache.write_rings(slots, starts, arrays, traits.config.sliding_window or 0)
        if rings is not None:
            g.set("kv_rows_ring", rings[0])
        flat = np.concatenate(arrays)
        if full:
            cache_rows = cache.full_rows(slots, arrays)
    g.set("ids" if embedded else "x", values)
    if traits.family.positions == "rope" or embedded:  # (learned ones are read only where it embeds)
        g.set("pos", flat)
    if cache_rows is not None:
        g.set("kv_rows", cache_rows)
    fill_masks(g, shape, positions, traits, rings[1] if rings is not None else None)
    if head_rows:
        last: List[int] = [end - 1 for end in itertools.accumulate(counts)]
        g.set("head_rows", last + last[-1:] * (head_rows - len(last)))
