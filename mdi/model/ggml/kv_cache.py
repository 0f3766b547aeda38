"""The KV cache of a chunk computing with ggml: one slot per in-flight sample, as on torch.

Per layer, K and V are one ggml tensor each of [n_kv_head * head_dim, n_slots * length]: a row
per (slot, position), written by the graph with `ggml_set_rows` at the rows the pass names
(llama.cpp's layout, so flash attention reads a slot's positions as a plain view). A layer's
length is the slot's `max_len` positions, or, in a sliding-window layer, a ring of fewer
(mdi.model.sliding_cache) whose rows hold the positions `cells` notes. The type is float16 by
default; q8_0 halves it again, f32 doubles it (`runtime.kv_type`, llama.cpp's -ctk / -ctv).

A slot's positions are also reachable as numpy bytes (`read_range` / `write_range`), which is
all the prefix cache needs: it keeps and restores a prompt's rows, whatever their type.
"""
from dataclasses import dataclass
import logging
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from mdi.model.backend import KV_GGML_TYPES
from mdi.model.ggml import lib
from mdi.model.sliding_cache import ring_length

log = logging.getLogger(__name__)

EMPTY = -1  # a ring row that holds no position


def row_bytes(kv_width: int, kv_type: str) -> int:
    """Bytes of one position's keys (or values) of one layer: gguf's type table, no binding
    needed (a starter plans a ggml worker's memory without loading ggml)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[KV_GGML_TYPES[kv_type]]]
    return kv_width // block * size


def head_dim_unfit(kv_type: str, head_dim: int) -> Optional[str]:
    """Why a cache of `kv_type` cannot hold heads of `head_dim` (None: it can): attention views
    each head's row, so it must be whole blocks of the type. Asked before any weight is loaded."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block = GGML_QUANT_SIZES[GGMLQuantizationType[KV_GGML_TYPES[kv_type]]][0]
    if head_dim % block:
        return "kv_type %s needs head_dim (%d) to be whole blocks of %d; use kv_type f16" % (kv_type, head_dim, block)
    return None


def layer_lengths(config: Any, first: int, last: int, max_len: int, prefill_chunk: Optional[int]) -> List[int]:
    """Positions a slot keeps in each of layers [first, last): `max_len`, or the ring of a
    sliding-window layer (sliding_cache.ring_length, for a run of `prefill_chunk` tokens a
    prompt pass; None: no rings, a measurement's cache)."""
    ring = ring_length(config, first, last, max_len, prefill_chunk) if prefill_chunk is not None else 0
    return [ring if ring and config.layer_window(i) else max_len for i in range(first, last)]


def kv_cache_bytes(config: Any, first: int, last: int, n_slots: int, max_len: int, kv_type: str = "f16",
                   prefill_chunk: Optional[int] = None) -> int:
    """The cache of layers [first, last) of `config` with `n_slots` slots of `max_len` positions
    (its rings: layer_lengths)."""
    lengths = layer_lengths(config, first, last, max_len, prefill_chunk)
    return 2 * n_slots * sum(lengths) * row_bytes(config.kv_heads * config.head_dim, kv_type)


@dataclass
class KeptRows:
    """A compact copy of a slot's first `length` positions (the prefix cache's entry): the
    full-length layers' rows [2, layers, length, row bytes], and the rings' [2, layers, rows,
    row bytes] with the position each row holds (`cells`; none without rings)."""
    length: int
    full: np.ndarray
    ring: np.ndarray
    cells: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.full.nbytes + self.ring.nbytes + self.cells.nbytes)


class GgmlKVCache(lib.Freed):
    def __init__(self, n_slots: int, max_len: int, kv_heads: int, head_dim: int, lengths: Sequence[int],
                 kv_type: str = "f16", buffer_type: Optional[int] = None) -> None:
        """`lengths`: positions a slot keeps in each layer (layer_lengths): `max_len`, or a ring."""
        gg = lib.require()
        if kv_type not in KV_GGML_TYPES:
            raise ValueError("kv_type must be one of %s, got %r" % (", ".join(KV_GGML_TYPES), kv_type))
        kv_width = kv_heads * head_dim
        self.n_layers, self.n_slots, self.max_len, self.kv_width = len(lengths), n_slots, max_len, kv_width
        self.lengths = list(lengths)
        rings = {n for n in self.lengths if n != max_len}
        if len(rings) > 1 or any(n > max_len for n in rings):
            raise ValueError("layer lengths %s: each must be %d or one ring shorter" % (self.lengths, max_len))
        self.ring = rings.pop() if rings else 0  # positions a ring holds per slot (0: no ring)
        # the position each ring row of each slot holds (EMPTY: none), as the passes wrote them
        self.cells = np.full((n_slots, self.ring), EMPTY, dtype=np.int64)
        self.kv_type = kv_type
        self.type_id = lib.TYPE_IDS[KV_GGML_TYPES[kv_type]]
        unfit = head_dim_unfit(kv_type, head_dim)
        if unfit is not None:
            raise ValueError(unfit)
        self.row_bytes = gg.ggml_row_size(self.type_id, kv_width)
        self._ctx = lib.Context(2 * max(self.n_layers, 1) + 2)
        self.k: List[Any] = []
        self.v: List[Any] = []
        for i, length in enumerate(self.lengths):
            for side, out in (("k", self.k), ("v", self.v)):
                t = gg.ggml_new_tensor_2d(self._ctx.ptr, self.type_id, kv_width, n_slots * length)
                gg.ggml_set_name(t, ("cache_%s_%d" % (side, i)).encode())
                out.append(t)
        if self.n_layers:
            self._ctx.allocate("a KV cache of %d bytes" % self.nbytes, zeroed=True, buffer_type=buffer_type)
        if self.ring:
            log.info("mdi: sliding-window layers keep %d positions a slot of %d", self.ring, max_len)

    @property
    def nbytes(self) -> int:
        return 2 * self.n_slots * sum(self.lengths) * self.row_bytes

    def is_ring(self, layer: int) -> bool:
        """Whether the chunk's `layer`-th layer keeps a ring (not every position)."""
        return self.lengths[layer] != self.max_len

    def row(self, slot: int, position: int) -> int:
        return slot * self.max_len + position

    def full_rows(self, slots: Sequence[int], row_positions: Sequence[np.ndarray]) -> np.ndarray:
        """Where a pass's rows go in the layers that keep every position (its samples' slots and rows' positions)."""
        return np.concatenate([self.row(s, 0) + p.astype(np.int64) for s, p in zip(slots, row_positions)])

    def write_rings(self, slots: Sequence[int], starts: Sequence[int], row_positions: Sequence[np.ndarray],
                    window: int) -> Optional[Tuple[np.ndarray, List[np.ndarray]]]:
        """Where a pass's rows go in the rings (its samples' `slots`, first positions and each
        row's position), noted here as written, and the position each ring row of each sample's
        slot then holds (what its sliding-window masks read); None without rings. A sample's
        window before its first row must still be there, and its rows must not write over a
        position one of them attends to."""
        if not self.ring:
            return None
        for slot, start, p in zip(slots, starts, row_positions):
            count = int(p[-1]) + 1 - start
            if self.missing(slot, max(0, start - window + 1), start):
                raise ValueError("slot %d no longer holds positions [%d, %d) in its sliding-window layers (a ring of "
                                 "%d positions)" % (slot, max(0, start - window + 1), start, self.ring))
            if count > self.ring - window + 1 and start + count > self.ring:
                raise ValueError("a pass of %d rows at position %d: the sliding-window layers' ring of %d positions "
                                 "takes at most %d rows a pass" % (count, start, self.ring, self.ring - window + 1))
        rows = [slot * self.ring + p.astype(np.int64) % self.ring for slot, p in zip(slots, row_positions)]
        for slot, p in zip(slots, row_positions):  # in order: a padded pass repeats its last position
            self.cells[slot, p % self.ring] = p
        return np.concatenate(rows), [self.cells[slot] for slot in slots]

    def missing(self, slot: int, first: int, end: int) -> bool:
        """Whether slot `slot`'s rings lack any of positions [first, end)."""
        if not self.ring or end <= first:
            return False
        want = np.arange(first, end, dtype=np.int64)
        return len(want) > self.ring or not np.array_equal(self.cells[slot, want % self.ring], want)

    def range_bytes(self, length: int) -> int:
        return 2 * sum(min(length, n) for n in self.lengths) * self.row_bytes + (8 * min(length, self.ring))

    @staticmethod
    def kept_length(kept: KeptRows) -> int:
        return kept.length

    @staticmethod
    def kept_bytes(kept: KeptRows) -> int:
        return kept.nbytes

    def _layers(self, ring: bool) -> List[int]:
        return [i for i in range(self.n_layers) if self.is_ring(i) == ring]

    def _copy(self, slot: int, rows: int, layers: List[int], out: Optional[np.ndarray], per_slot: int) -> np.ndarray:
        """Slot `slot`'s first `rows` rows of `layers` (into a new array; `out` given: from it)."""
        gg = lib.require()
        reading = out is None
        if out is None:
            out = np.empty((2, len(layers), rows, self.row_bytes), dtype=np.uint8)
        offset, n = slot * per_slot * self.row_bytes, rows * self.row_bytes
        if n == 0:
            return out
        for side, tensors in enumerate((self.k, self.v)):
            for j, i in enumerate(layers):  # through the backend: the cache may live on a GPU
                if reading:
                    gg.ggml_backend_tensor_get(tensors[i], out[side, j].ctypes.data, offset, n)
                else:
                    part = np.ascontiguousarray(out[side, j, :rows])
                    gg.ggml_backend_tensor_set(tensors[i], part.ctypes.data, offset, n)
        return out

    def read_range(self, slot: int, length: int) -> KeptRows:
        """A compact copy of slot `slot`'s positions [0, length) of every layer (of a ring: its
        rows that hold any, with the positions they hold)."""
        rows = min(length, self.ring)
        cells = self.cells[slot, :rows].copy()
        cells[cells >= length] = EMPTY
        return KeptRows(length, self._copy(slot, length, self._layers(False), None, self.max_len),
                        self._copy(slot, rows, self._layers(True), None, self.ring), cells)

    def write_range(self, slot: int, kept: KeptRows, length: int) -> None:
        """Put back what read_range returned (its first `length` positions) into slot `slot`."""
        full, ring = self._layers(False), self._layers(True)
        if kept.full.shape[:2] != (2, len(full)) or kept.ring.shape[:2] != (2, len(ring)) \
                or kept.full.shape[3:] != (self.row_bytes,) or kept.length < length:
            raise ValueError("cache rows of shape %s do not fit this cache" % (kept.full.shape,))
        self._copy(slot, length, full, kept.full, self.max_len)
        if ring:
            rows = kept.ring.shape[2]
            self._copy(slot, rows, ring, kept.ring, self.ring)
            self.cells[slot] = EMPTY
            cells = kept.cells.copy()
            cells[cells >= length] = EMPTY
            self.cells[slot, :rows] = cells

    def free(self) -> None:
        self.k, self.v = [], []
        self._ctx.free()
