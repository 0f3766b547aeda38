"""The KV cache of a chunk computing with ggml: one slot per in-flight sample, as on torch.

Per layer, K and V are one ggml tensor each of [n_kv_head * head_dim, n_slots * max_len]: a row
per (slot, position), written by the graph with `ggml_set_rows` at the rows the pass names
(llama.cpp's layout, so flash attention reads a slot's positions as a plain view). The type is
float16 by default; q8_0 halves it again, f32 doubles it (`runtime.kv_type`, llama.cpp's -ctk / -ctv).

A slot's range of positions is also reachable as numpy bytes (`read_range` / `write_range`),
which is all the prefix cache needs: it keeps and restores a prompt's rows, whatever their type.
"""
from typing import Any, List, Optional, Tuple

import numpy as np

from mdi.model.backend import KV_GGML_TYPES
from mdi.model.ggml import lib



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


def kv_cache_bytes(config: Any, n_layers: int, n_slots: int, max_len: int, kv_type: str = "f16") -> int:
    """The cache of `n_layers` layers of `config` with `n_slots` slots of `max_len` positions."""
    return 2 * n_layers * n_slots * max_len * row_bytes(config.kv_heads * config.head_dim, kv_type)


class GgmlKVCache:
    def __init__(self, n_layers: int, n_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 kv_type: str = "f16", buffer_type: Optional[int] = None) -> None:
        gg = lib.require()
        if kv_type not in KV_GGML_TYPES:
            raise ValueError("kv_type must be one of %s, got %r" % (", ".join(KV_GGML_TYPES), kv_type))
        kv_width = kv_heads * head_dim
        self.n_layers, self.n_slots, self.max_len, self.kv_width = n_layers, n_slots, max_len, kv_width
        self.kv_type = kv_type
        self.type_id = lib.TYPE_IDS[KV_GGML_TYPES[kv_type]]
        unfit = head_dim_unfit(kv_type, head_dim)
        if unfit is not None:
            raise ValueError(unfit)
        self.row_bytes = gg.ggml_row_size(self.type_id, kv_width)
        self._ctx = lib.Context(2 * max(n_layers, 1) + 2)
        self.k: List[Any] = []
        self.v: List[Any] = []
        for i in range(n_layers):
            for side, out in (("k", self.k), ("v", self.v)):
                t = gg.ggml_new_tensor_2d(self._ctx.ptr, self.type_id, kv_width, n_slots * max_len)
                gg.ggml_set_name(t, ("cache_%s_%d" % (side, i)).encode())
                out.append(t)
        if n_layers:
            self._ctx.allocate("a KV cache of %d bytes" % self.nbytes, zeroed=True, buffer_type=buffer_type)

    @property
    def nbytes(self) -> int:
        return 2 * self.n_layers * self.n_slots * self.max_len * self.row_bytes

    def row(self, slot: int, position: int) -> int:
        return slot * self.max_len + position

    def _span(self, slot: int, length: int) -> Tuple[int, int]:
        """(offset, bytes) of a slot's first `length` positions in a layer's K or V tensor."""
        return self.row(slot, 0) * self.row_bytes, length * self.row_bytes

    def range_bytes(self, length: int) -> int:
        return 2 * self.n_layers * length * self.row_bytes

    @staticmethod
    def kept_length(kept: np.ndarray) -> int:
        return int(kept.shape[2])

    @staticmethod
    def kept_bytes(kept: np.ndarray) -> int:
        return int(kept.nbytes)

    def read_range(self, slot: int, length: int) -> np.ndarray:
        """A compact copy of slot `slot`'s positions [0, length) of every layer: [2, layers, length, row bytes]."""
        gg = lib.require()
        out = np.empty((2, self.n_layers, length, self.row_bytes), dtype=np.uint8)
        offset, n = self._span(slot, length)
        if n == 0:
            return out
        for side, tensors in enumerate((self.k, self.v)):
            for i, t in enumerate(tensors):  # through the backend: the cache may live on a GPU
                gg.ggml_backend_tensor_get(t, out[side, i].ctypes.data, offset, n)
        return out

    def write_range(self, slot: int, rows: np.ndarray, length: int) -> None:
        """Put back what read_range returned (its first `length` positions) into slot `slot`."""
        if rows.shape[:2] != (2, self.n_layers) or rows.shape[3] != self.row_bytes or rows.shape[2] < length:
            raise ValueError("cache rows of shape %s do not fit this cache" % (rows.shape,))
        gg = lib.require()
        offset, n = self._span(slot, length)
        if n == 0:
            return
        for side, tensors in enumerate((self.k, self.v)):
            for i, t in enumerate(tensors):
                part = np.ascontiguousarray(rows[side, i, :length])
                gg.ggml_backend_tensor_set(t, part.ctypes.data, offset, n)

    def free(self) -> None:
        self.k, self.v = [], []
        self._ctx.free()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass

