"""Memory planning: what a node's layers and KV cache need, and what a worker can give."""
from typing import Optional, Sequence

import torch

from mdi.model.config import ModelConfig
from mdi.model.layout import dtype_name, weight_bytes
from mdi.model.transformer import KVCache


def chunk_bytes_needed(config: ModelConfig, layers: Sequence[int], n_slots: int, max_len: int,
                       dtype: torch.dtype, with_ends: bool = False) -> int:
    """Weights plus KV cache of a node holding `layers` (half-open range); `with_ends` adds
    the starter's embedding and head."""
    first, last = layers
    weights = weight_bytes(config, (first, last), dtype_name(dtype), with_ends)
    return weights + KVCache.nbytes_for(config, last - first, n_slots, max_len, dtype)


def worker_capacity(status: dict) -> Optional[int]:
    """Bytes a worker can give to a chunk: its --max-memory if set, else the memory the OS
    has available plus what its current weights and cache already hold (freed on /init)."""
    mem = status.get("memory", {})
    held = mem.get("chunk_bytes", 0) + status.get("cache", {}).get("bytes", 0)
    if mem.get("max_memory_bytes"):
        return mem["max_memory_bytes"]
    if mem.get("available_bytes") is None:
        return None
    return mem["available_bytes"] + held
