"""How many random blocks a node times, and what timing them holds: sizes only, so that a node
computing with ggml plans its profile without importing torch (mdi.model.block_timing times
torch's blocks; mdi.timing.ggml_profile ggml's)."""
from typing import Dict, Optional

from mdi.model.config import ModelConfig
from mdi.model.layout import QuantLayout, QuantSpec, torch_kv_cache_bytes, weight_bytes
from mdi.model.timing_loop import PROFILE_LAYERS
from mdi.system.devices import last_level_cache_bytes

# ... and as many more as it takes for their weights to span this many times the device's
# last-level cache: two small blocks stay in it and time 1.3-1.5x faster than a node holding
# real layers runs them (GPT-2 12L/384 float32 on a 32 MB L3: 0.54 ms per block for two,
# 0.78-0.84 for 4 to 12).
COLD_CACHE_FACTOR = 2


def repeated_layout(quant: Optional[QuantLayout], n_blocks: int) -> Dict[str, QuantSpec]:
    """`quant` (which names blocks 0 and 1, and maybe the ends) for `n_blocks` blocks: block j
    quantized as block j % PROFILE_LAYERS."""
    out: Dict[str, QuantSpec] = {}
    for name, spec in (quant or {}).items():
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 2 and parts[1].isdigit():
            for j in range(int(parts[1]), n_blocks, PROFILE_LAYERS):
                out[".".join(["blocks", str(j)] + parts[2:])] = spec
        else:
            out[name] = spec
    return out


def profile_bytes(config: ModelConfig, n_blocks: int, dtype: str, quant: Optional[QuantLayout], rows: int,
                  positions: int) -> int:
    """What timing `n_blocks` random blocks holds: their weights and a KV cache of `rows` slots."""
    return (weight_bytes(config, (0, n_blocks), dtype, quant=repeated_layout(quant, n_blocks))
            + torch_kv_cache_bytes(config, n_blocks, rows, positions, dtype))


def profile_blocks(config: ModelConfig, dtype: str, quant: Optional[QuantLayout], device: str,
                   free_bytes: Optional[int] = None, rows: int = 1, positions: int = 1) -> int:
    """How many random blocks a node times: enough to span COLD_CACHE_FACTOR x its last-level
    cache, at least PROFILE_LAYERS, at most the model's, and fewer where `free_bytes` cannot
    hold them with their cache (`profile_bytes`; never fewer than PROFILE_LAYERS: the caller
    refuses when even those do not fit)."""
    floor = min(PROFILE_LAYERS, config.n_layer)
    block = max(1, weight_bytes(config, (0, floor), dtype, quant=quant) // floor)
    n = min(config.n_layer, max(floor, -(-COLD_CACHE_FACTOR * last_level_cache_bytes(device) // block)))
    while n > floor and free_bytes is not None and profile_bytes(config, n, dtype, quant, rows, positions) > free_bytes:
        n -= 1
    return n
