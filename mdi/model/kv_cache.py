"""The KV cache a chunk's attention reads and writes: one preallocated slot per in-flight
sample, so prefill and decode are the same code path and nothing is ever recomputed."""
from typing import Tuple

import torch

from mdi.model.config import ModelConfig
from mdi.model.layout import torch_kv_cache_bytes


class KVCache:
    """Keys and values for a chunk's layers: [layers, slots, kv_heads, max_len, head_dim]."""

    def __init__(self, config: ModelConfig, n_layers: int, n_slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if max_len > config.block_size:
            raise ValueError("cache length %d exceeds the model context %d" % (max_len, config.block_size))
        shape = (n_layers, n_slots, config.kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # (k, v) views per layer, indexed once
        self.n_slots = n_slots
        self.max_len = max_len

    nbytes_for = staticmethod(torch_kv_cache_bytes)  # (its home is layout's, which needs no torch)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    # --- a slot's positions, for the prefix cache (the ggml cache answers the same three calls)
    def range_bytes(self, length: int) -> int:
        """Bytes of `length` positions of one slot, every layer's keys and values."""
        return 2 * length * self.k[:, 0, :, :1].numel() * self.k.element_size()

    def read_range(self, slot: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """A compact copy of slot `slot`'s positions [0, length): (k, v) [layers, kv_heads, length, head_dim]."""
        return self.k[:, slot, :, :length].clone(), self.v[:, slot, :, :length].clone()

    def write_range(self, slot: int, kept: Tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        """The first `length` positions of what read_range returned, back into slot `slot`."""
        k, v = kept
        self.k[:, slot, :, :length].copy_(k[:, :, :length])
        self.v[:, slot, :, :length].copy_(v[:, :, :length])

    @staticmethod
    def kept_length(kept: Tuple[torch.Tensor, torch.Tensor]) -> int:
        return int(kept[0].shape[2])

    @staticmethod
    def kept_bytes(kept: Tuple[torch.Tensor, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in kept)
