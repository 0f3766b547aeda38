"""Memory planning: what a node's layers and KV cache need (what a worker can give is
`StatusReply.capacity_bytes`, from its /status), weights counted at their quantized size."""
from typing import Any, Dict, Optional, Sequence

from mdi.model.config import ModelConfig
from mdi.model.layout import QuantLayout, QuantSpec, dtype_name, format_layers, torch_kv_cache_bytes, weight_bytes
from mdi.model.source import ModelSource
from mdi.system.memory import LOAD_HEADROOM_BYTES
from mdi.runconfig import ConfigError, NodeSpec, RunConfig
from mdi.starter.planning.node_budget import NodeBudget


def node_quant(cfg: RunConfig, source: ModelSource, node: NodeSpec, layers: Sequence[int],
               with_ends: bool = False) -> Dict[str, QuantSpec]:
    """The weights `node` keeps quantized for `layers` (RunConfig.quant_of)."""
    return source.layout(layers[0], layers[1], with_ends, cfg.quant_of(node), cfg.model.group_size)


def chunk_bytes_needed(config: ModelConfig, layers: Sequence[int], n_slots: int, max_len: int,
                       dtype: Any, with_ends: bool = False, quant: Optional[QuantLayout] = None) -> int:
    """Weights plus KV cache of a node holding `layers` (half-open range); `with_ends` adds
    the starter's embedding and head. `dtype`: model.dtype's name, or a torch or numpy dtype."""
    first, last = layers
    weights = weight_bytes(config, (first, last), dtype_name(dtype), with_ends, quant)
    return weights + torch_kv_cache_bytes(config, last - first, n_slots, max_len, dtype)


MB = 1024 * 1024
# What a torch node holds beyond its budget (weights, KV cache), which no budget counts: torch
# itself, its quantized kernels measured and packed at load, its first passes' allocations.
# SmolLM2 and Gemma 3 nodes held 325-705 MB beyond their weights and KV cache on torch, 68-129 MB
# on ggml (VmHWM, December 2026), and a torch starter that --check found fitting in 240 MB and
# 320 MB was killed out of memory. --check says TIGHT where less than this is left beside a torch
# node's budget.
TORCH_BESIDE_BUDGET_BYTES = 450 * MB


def starter_free_bytes(device: str) -> Optional[int]:
    """What the starter can give its own chunk (embedding and head included) on `device`: the
    memory free there (a discrete GPU's own; else the host's, its cgroup's when limited), none
    kept back, as its own load check (check_fits_here) keeps none: a plan that keeps more than
    the check leaves out layers that fit. GPT-2 12L/384 on a 240 MiB starter: the check let 10
    layers through with 1.5 MB to spare, and they ran; the plan keeping 32 MB
    (LOAD_HEADROOM_BYTES) put 6 there and refused rings that run. Its profile, the process's
    first compute, does keep that headroom (Profiler._starter_timing)."""
    from mdi.system.memory import free_bytes_on
    return free_bytes_on(device)


def check_fits_here(budget: NodeBudget, device: str, quantized: bool, backend: str = "") -> Optional[int]:
    """Refuse, before a byte is loaded, a starter chunk whose budget (its plan's: weights, KV
    cache, adapters, a sized prefix cache, a draft model; mdi.starter.planning.node_budget) the free
    memory of `device` here (starter_free_bytes) cannot hold: a clear error, never an
    out-of-memory kill. Returns what the memory spares beside all of it but the prefix cache,
    less LOAD_HEADROOM_BYTES (None when unknown): what an "auto" prefix cache halves and a
    faster quantized kernel may take where runtime.kernel_memory allows
    (mdi.model.quantization.kernel_choice.allowance_for), and what adapters loaded while serving are
    counted against (node_budget.check_starter_adapter)."""
    free = starter_free_bytes(device)
    if free is not None and not budget.fits(free):
        raise ConfigError("starter: %s with the embedding and head need %.0f MB%s (%s) but only %.0f MB of memory is "
                          "available on %s here: %suse fewer positions or samples, or give layers to more nodes"
                          % (format_layers(*budget.layers), budget.total / MB, backend, budget.parts(), free / MB,
                             device, "" if quantized else "quantize (--quant int4), "))
    return None if free is None else free - budget.beside_prefix - LOAD_HEADROOM_BYTES
