"""Memory planning: what a node's layers and KV cache need (what a worker can give is
`StatusReply.capacity_bytes`, from its /status)."""
from typing import Sequence

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
