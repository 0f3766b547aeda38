"""What one node needs in memory for a run: one sum, built with the run's plan, that every check reads.

`--check` (mdi.starter.planning.preflight), serving's slot count (serving_plan.plan_slots), recovery's
fit check (recovery.replan), the engine's load check (capacity.check_fits_here) and the
planner's costs (node_speeds.Profiler) each used to sum a node's needs their own way: serving
and recovery left out the adapters, the engine the prefix cache, the profiler the draft model,
so serving and recovery admitted rings that `--check` refused. The complete sum was `--check`'s:
weights + KV cache + the adapters' matrices of its layers + a sized prefix cache + (the starter)
a draft model's weights and cache. `RunMemory` holds the run's parts of it (one per run, made
before any node is timed); `NodeBudget` is one node's, and `RunPlan.budgets` holds the ring's.

What a node can give (its limit) is read where it is checked, when it is checked: a worker's
/status capacity, the starter's free memory (capacity.starter_free_bytes).
"""
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple

from mdi.model.config import ModelConfig
from mdi.model.layout import QuantSpec, dtype_name, torch_kv_cache_bytes, weight_bytes
from mdi.runconfig import RunConfig
from mdi.starter.adapter_set import StarterTooLarge, adapter_layer_bytes
from mdi.system.memory import LOAD_HEADROOM_BYTES



class DraftSizes(Protocol):
    """What a budget reads of a draft model (speculation.draft_model.DraftSource, which imports
    capacity, which imports this module: named by its shape, not imported)."""

    def bytes_needed(self, n_slots: int, max_len: int, dtype: str) -> int: ...

MB = 1024 * 1024


@dataclass(frozen=True)
class NodeBudget:
    """One node's memory need for its layers and the plan's slots, by part."""
    node: str
    layers: Tuple[int, int]  # half-open
    weights: int  # its layers' weights as stored (quantized); the starter's with the embedding and head
    kv_per_slot: int  # one KV cache slot of the plan's positions for its layers
    slots: int
    adapters: int = 0  # the adapters' matrices of its layers (configured, or held when the ring was planned)
    prefix_reserve: int = 0  # runtime.prefix_cache when it names a size ("auto" takes what is spare after)
    draft_weights: int = 0  # the starter: generation.speculation's draft model
    draft_per_slot: int = 0  # and its cache slot per slot

    @property
    def per_slot(self) -> int:
        return self.kv_per_slot + self.draft_per_slot

    @property
    def fixed(self) -> int:
        """What it holds whatever the slots."""
        return self.weights + self.adapters + self.prefix_reserve + self.draft_weights

    @property
    def kv(self) -> int:
        return self.kv_per_slot * self.slots

    @property
    def draft(self) -> int:
        return self.draft_weights + self.draft_per_slot * self.slots

    @property
    def total(self) -> int:
        return self.fixed + self.per_slot * self.slots

    @property
    def beside_prefix(self) -> int:
        """All but the prefix cache: what a node's spare memory (and an "auto" prefix cache,
        half of it) is measured beside (mdi.model.prefix_store.budget_bytes)."""
        return self.total - self.prefix_reserve

    def fits(self, limit: Optional[int]) -> bool:
        """Whether it fits in `limit` bytes (None: unknown, not checked)."""
        return limit is None or self.total <= limit

    def slots_that_fit(self, limit: Optional[int], most: int) -> int:
        """The slots (at most `most`) whose total fits in `limit`; 0 when not even its fixed part
        and one slot do; `most` when the limit is unknown."""
        if limit is None or self.per_slot <= 0:
            return most if limit is None or self.fixed <= limit else 0
        return int(max(0, min(most, (limit - self.fixed) // self.per_slot)))

    def with_slots(self, slots: int) -> "NodeBudget":
        return dataclasses.replace(self, slots=slots)

    def with_adapters(self, per_layer: Sequence[int]) -> "NodeBudget":
        return dataclasses.replace(self, adapters=sum(per_layer[self.layers[0]:self.layers[1]]))

    def on_ggml(self, weights: int, kv_per_slot: int) -> "NodeBudget":
        """The same node holding its layers on ggml: the GGUF's tensors as stored, ggml's cache."""
        return dataclasses.replace(self, weights=weights, kv_per_slot=kv_per_slot)

    def parts(self) -> str:
        """One line's list of what it sums, for errors and --check."""
        out = ["weights %.1f MB" % (self.weights / MB), "KV cache %.1f MB" % (self.kv / MB)]
        for what, nbytes in (("adapters", self.adapters), ("prefix cache", self.prefix_reserve),
                             ("draft model", self.draft)):
            if nbytes:
                out.append("%s %.1f MB" % (what, nbytes / MB))
        return " + ".join(out)


@dataclass(frozen=True)
class RunMemory:
    """The run's parts of every node's budget, besides its layers: made once per run (before
    the planner times anything, which counts the same parts per layer)."""
    config: ModelConfig
    max_len: int
    dtype: Any  # model.dtype: the weights', by name (a torch dtype is read as its name)
    adapter_bytes: Tuple[int, ...]  # the adapters' matrices per layer of the model
    prefix_reserve: int = 0
    draft_weights: int = 0
    draft_per_slot: int = 0
    kv_dtype: Any = None  # the KV cache's (torch keeps it in the dtype it computes in: kv_cache_dtype); None: dtype

    def __post_init__(self) -> None:
        if len(self.adapter_bytes) != self.config.n_layer:
            object.__setattr__(self, "adapter_bytes", tuple(self.adapter_bytes) + (0,) * (
                self.config.n_layer - len(self.adapter_bytes)))

    def budget(self, node: str, layers: Sequence[int], quant: Dict[str, QuantSpec], slots: int,
               starter: bool) -> NodeBudget:
        """`node`'s budget for `layers` (half-open) kept quantized as `quant` (the starter's with
        its embedding and head, and the draft model)."""
        first, last = int(layers[0]), int(layers[1])
        return NodeBudget(
            node, (first, last), weight_bytes(self.config, (first, last), dtype_name(self.dtype), starter, quant),
            torch_kv_cache_bytes(self.config, last - first, 1, self.max_len, self.kv_dtype or self.dtype), slots,
            sum(self.adapter_bytes[first:last]), self.prefix_reserve,
            self.draft_weights if starter else 0, self.draft_per_slot if starter else 0)

    def layer_bytes(self, layer: int, quant: Dict[str, QuantSpec], slots: int) -> int:
        """One layer's share of a budget (weights, its KV cache slots, its adapters): the
        planner's per-layer cost; its fixed cost is `fixed_bytes`'s."""
        return self.budget("", (layer, layer + 1), quant, slots, False).total - self.prefix_reserve

    def fixed_bytes(self, ends_quant: Dict[str, QuantSpec], slots: int, starter: bool) -> int:
        """What a node holds with no layer: the prefix reserve, and the starter's embedding,
        head and draft model."""
        return self.budget("", (0, 0), ends_quant, slots, starter).total

    def with_adapters(self, per_layer: Sequence[int]) -> "RunMemory":
        return dataclasses.replace(self, adapter_bytes=tuple(per_layer))


def prefix_reserve(cfg: RunConfig) -> int:
    """Bytes every node keeps for its prefix cache beside its weights and KV cache when
    runtime.prefix_cache names a size (every budget counts them); "auto" takes what is left after."""
    setting = cfg.runtime.prefix_cache
    return setting if isinstance(setting, int) and not isinstance(setting, bool) else 0


def run_memory(cfg: RunConfig, config: ModelConfig, max_len: int, dtype: str,
               draft: Optional[DraftSizes] = None, adapters: Any = None) -> RunMemory:
    """The run's budget parts: the configured adapters' matrices per layer (or those of
    `adapters`, an AdapterSet a rebuilt serving ring keeps: what its nodes will hold), a sized
    prefix cache, and a draft model's weights and cache slot."""
    per_layer = adapters.layer_bytes() if adapters is not None else adapter_layer_bytes(cfg.adapters, config)
    weights = draft.bytes_needed(0, max_len, dtype) if draft is not None else 0
    per_slot = draft.bytes_needed(1, max_len, dtype) - weights if draft is not None else 0
    return RunMemory(config, max_len, dtype, tuple(per_layer), prefix_reserve(cfg), weights, per_slot,
                     kv_cache_dtype(dtype, cfg.model.compute_dtype, cfg.model.device))


def kv_cache_dtype(dtype: Any, compute_dtype: Optional[str], device: str) -> str:
    """The dtype a torch node keeps its KV cache in, by name: the one it computes in
    (ModelChunk.activation_dtype), model.compute_dtype where set (float32 for float16 weights:
    twice the cache), and float32 on a CPU whose torch has no arithmetic in the half type
    (torch 2.0's float16: mdi.system.devices.resolve_compute_dtype), as this process's torch
    says; where torch is not loaded here (a ggml starter) the weights' type is taken."""
    name = compute_dtype or dtype_name(dtype)
    if name in ("float16", "bfloat16") and not device.startswith("cuda") and "torch" in sys.modules:
        import torch
        from mdi.system.devices import cpu_computes
        if not cpu_computes(getattr(torch, name)):
            return "float32"
    return name


def check_starter_adapter(name: str, nbytes: int, budget: NodeBudget, spare: Optional[int], prefix_bytes: int,
                          held: int, free_now: Optional[int]) -> None:
    """Refuse (StarterTooLarge: a 413) an adapter or mix of `nbytes` on the starter's layers that
    its memory limit has no room for. The limit is what the starter had when it loaded: `spare`
    is what that left beside its budget (capacity.check_fits_here; None: unknown), of which
    the prefix cache took `prefix_bytes`; `held` is what the adapters it holds now take, of
    which its budget counted `budget.adapters`. Checked against the memory free now as well
    (`free_now`): kernels and other processes take some of it too."""
    if spare is not None:
        since = max(0, held - budget.adapters)
        room = spare - prefix_bytes - since
        if nbytes > room:
            raise StarterTooLarge(
                "starter: adapter %s needs %.1f MB, over the %.1f MB its memory limit leaves beside its budget (%s), "
                "its prefix cache (%.1f MB) and the adapters loaded since (%.1f MB)" % (
                    name, nbytes / MB, max(0, room) / MB, budget.parts(), prefix_bytes / MB, since / MB))
    if free_now is not None and nbytes > free_now - LOAD_HEADROOM_BYTES:
        # the workers check their own (Worker.load_adapter); a mix is a full adapter too
        raise StarterTooLarge("starter: adapter %s needs %.1f MB, which has %.1f MB free beside the %d MB a run needs"
                              % (name, nbytes / MB, free_now / MB, LOAD_HEADROOM_BYTES >> 20))
