"""The engine as serving sees it: the one face `mdi.serving` may use, and the values it hands out.

Serving (the scheduler, the API, the dashboard and metrics, a training job beside serving) holds
an `EngineFace`: admitting and stepping samples, the slots free and which one a sample takes,
the counters it shows, the adapters requests name, the training hooks, and recoveries as
`RecoveryEvent`s delivered to it. The pipeline, the starter's chunk, the ring session and the
adapter set behind it stay the engine's (mdi.starter.engine implements this face;
tests/test_engine_face.py checks that serving reaches for nothing else).
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from mdi.runconfig import NodeSpec, RunConfig
from mdi.starter.sample import Sample


@dataclass(frozen=True)
class RecoveryEvent:
    """One recovery attempt of the engine (a worker failed; the ring was re-planned, or the
    attempt failed), delivered once to each listener (`EngineFace.on_recovery`)."""
    cause: str  # the failure that started it, naming the node
    action: str  # what was done ("spare s2 takes layers [4, 8) of w1"), or "failed: why"
    at_s: float  # seconds into the run when it began
    seconds: float  # how long it took
    node: Optional[str] = None  # the node that failed, when known
    nodes: Tuple[NodeSpec, ...] = ()  # the ring after it, the starter first
    ranges: Tuple[Tuple[int, int], ...] = ()  # each node's [first, last) layers then

    @property
    def recovered(self) -> bool:
        return not self.action.startswith("failed: ")

    def to_json(self) -> Dict[str, Any]:
        """The record's and the dashboard's shape (mdi.starter.node_report.Recovery's)."""
        return {"cause": self.cause, "action": self.action, "at_s": self.at_s, "seconds": self.seconds}


@dataclass(frozen=True)
class StarterReading:
    """What the starter's own node shows on the dashboard and /metrics, read at one moment."""
    backend: Optional[str] = None  # "torch" or "ggml" (None before the chunk is loaded)
    backend_line: Optional[str] = None  # the backend and why (mdi.model.backend.BackendChoice.describe)
    cache_bytes: int = 0  # its KV cache
    bytes_sent: int = 0  # by its transport into the ring
    messages_sent: int = 0
    prefix_store: Any = None  # its prefix store's stats (mdi.model.prefix_store), None without one
    batching: Dict[str, Any] = field(default_factory=dict)  # rows and samples per forward (BatchCounter)
    # each quantized weight shape -> "kernel: why" (a torch starter's; ggml chooses none)
    kernels: Dict[str, str] = field(default_factory=dict)


class EngineFace(Protocol):
    """What serving may use of the starter's engine (mdi.starter.engine.Engine)."""
    cfg: RunConfig
    plan: Any  # the run plan (mdi.starter.planning.run_plan.RunPlan), a frozen value
    source: Any  # the model (mdi.model.source.ModelSource)
    device: str

    # --- the ring in hand ------------------------------------------------------------
    @property
    def nodes(self) -> List[NodeSpec]: ...

    @property
    def ranges(self) -> List[List[int]]: ...

    @property
    def spares(self) -> List[NodeSpec]: ...

    @property
    def n_slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    def ggml_nodes(self) -> List[str]: ...

    # --- lifecycle and generation ------------------------------------------------------
    def close(self) -> List[Any]: ...

    def abort(self) -> None: ...

    def free_cache(self) -> None: ...

    def admit(self, sample: Sample) -> None: ...

    def step(self, timeout: Optional[float] = None) -> List[Sample]: ...

    @property
    def in_flight(self) -> int: ...

    def free_slots(self) -> List[int]: ...

    def choose_slot(self, sample: Sample, free: List[int]) -> int: ...

    # --- counters ----------------------------------------------------------------------
    @property
    def busy_seconds(self) -> float: ...

    def speculation_metrics(self) -> Dict[str, Any]: ...

    def prefix_metrics(self) -> Dict[str, Any]: ...

    @property
    def prefix_budget(self) -> Optional[int]: ...

    def starter_reading(self) -> StarterReading: ...

    # --- recoveries --------------------------------------------------------------------
    def on_recovery(self, listener: Callable[[RecoveryEvent], None]) -> None: ...

    # --- adapters ----------------------------------------------------------------------
    def loaded_adapters(self) -> List[Tuple[int, str]]: ...

    def has_adapter(self, adapter: int) -> bool: ...

    def virtual_tokens(self, adapter: int) -> int: ...

    def prepare_sample(self, sample: Sample, adapter: int) -> None: ...

    def adapter_and_mixes(self, name: str) -> List[int]: ...

    def kept_adapters(self) -> Any: ...

    def add_adapter(self, name: str, path: str) -> int: ...

    def mix_adapters(self, entries: List[Tuple[int, float]],
                     evict: Optional[Callable[[List[int]], Optional[int]]] = None) -> int: ...

    def drop_mix(self, mix: int) -> None: ...

    def remove_adapter(self, name: str) -> int: ...

    # --- training beside serving ----------------------------------------------------------
    def set_training_hook(self, on_train: Optional[Callable[[Any], None]]) -> None: ...

    @property
    def run_id(self) -> Optional[int]: ...

    def send_frame(self, frame: Any) -> None: ...

    def ring_trainer(self, options: Any, pairs: Any) -> Any: ...

    def stop_training(self) -> List[str]: ...
