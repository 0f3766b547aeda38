"""The KV cache a chunk's attention reads and writes: one preallocated slot per in-flight
sample, so prefill and decode are the same code path and nothing is ever recomputed."""
import torch

from mdi.model.config import ModelConfig


class KVCache:
    """Keys and values for a chunk's layers: [layers, slots, kv_heads, max_len, head_dim]."""

    def __init__(self, config: ModelConfig, n_layers: int, n_slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if max_len > config.block_size:
            raise ValueError("cache length %d exceeds the model context %d" % (max_len, config.block_size))
        shape = (n_layers, n_slots, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # (k, v) views per layer, indexed once
        self.n_slots = n_slots
        self.max_len = max_len

    @staticmethod
    def nbytes_for(config: ModelConfig, n_layers: int, n_slots: int, max_len: int, dtype: torch.dtype) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return 2 * n_layers * n_slots * config.n_kv_head * max_len * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
