"""The worker's GET /status reply (contract): built by the worker, parsed once by the starter.

The starter reads it for its heartbeat (is the node still serving this run, did its compute
fail), for memory planning (what the node can hold), for the metrics (traffic and compute
counters) and for `--check`. Parsing checks every field's type, so a wrong or hostile reply
is one clear error naming the field, never a KeyError deep in the starter.
"""
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional, Union, get_args, get_origin, get_type_hints  # 3.8+

from mdi.model.prefix_store import PrefixStats
from mdi.system.str_enum import StrEnum


class WorkerState(StrEnum):
    """What a worker is doing; the value is what /status says (a str: compares and serializes as one)."""
    IDLE = "idle"  # between runs (holding the last run's weights, maybe)
    LOADING = "loading"  # an /init is loading weights, or waiting for pushed ones
    RUNNING = "running"  # serving a run's frames


class StatusError(ValueError):
    """A /status reply that does not have the expected shape; the message names the field."""


@dataclass
class NodeMemory:
    rss_bytes: int = 0
    peak_rss_bytes: int = 0  # with CUDA allocations: on a Jetson they live in the same RAM
    available_bytes: Optional[int] = None  # free on its device (MemAvailable, a discrete GPU's own); None: unknown
    max_memory_bytes: Optional[int] = None  # the worker's --max-memory
    chunk_bytes: int = 0  # the weights it holds now
    adapter_bytes: int = 0  # the low-rank adapters' A/B matrices for its layers
    training_bytes: int = 0  # a training job's LoRA pairs and optimizer state (POST /train)
    unified_bytes: Optional[int] = None  # RSS + CUDA allocations now (a Jetson's GPU memory is its RAM)
    board_used_bytes: Optional[int] = None  # the board's RAM in use (mdi.system.memory.board_memory)
    board_total_bytes: Optional[int] = None
    board_source: Optional[str] = None  # "tegrastats" (Jetson: CPU + GPU) or "meminfo"
    capacity_bytes: Optional[int] = None  # what it can give a run's weights and cache now (its own rule)


@dataclass
class NodeCache:
    slots: int = 0
    max_len: int = 0
    bytes: int = 0


@dataclass
class BatchCounter:
    """How much batching one node's forwards got: token rows and samples per forward."""
    forwards: int = 0
    rows: int = 0
    samples: int = 0
    max_rows: int = 0
    max_samples: int = 0

    def add(self, rows: int, samples: int) -> None:
        self.forwards += 1
        self.rows += rows
        self.samples += samples
        self.max_rows = max(self.max_rows, rows)
        self.max_samples = max(self.max_samples, samples)

    def metrics(self) -> Dict[str, Any]:
        """The keys of a node's entry in the metrics record (--metrics-out, mdi-bench's CSV)."""
        n = self.forwards
        return {"forwards": n,
                "rows_per_forward_mean": round(self.rows / n, 3) if n else None,
                "rows_per_forward_max": self.max_rows,
                "samples_per_forward_mean": round(self.samples / n, 3) if n else None,
                "samples_per_forward_max": self.max_samples}


@dataclass
class NodeCounters:
    """Data-plane and compute counters of the worker's current (or, when idle, last) run."""
    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_sent_by_kind: Dict[str, int] = field(default_factory=dict)
    messages_sent_by_kind: Dict[str, int] = field(default_factory=dict)
    frames_received: int = 0
    frames_done: int = 0
    compute_seconds: float = 0.0  # time in its own layers: its busy time
    bad_frames: int = 0
    last_bad_frame: Optional[str] = None
    batching: BatchCounter = field(default_factory=BatchCounter)
    passes_cancelled: int = 0  # stale speculative passes it dropped unrun (a later epoch came)
    rows_cancelled: int = 0
    pass_seconds: float = 0.0  # how long the pass it is computing now has run (0: none)


@dataclass
class StatusReply:
    state: WorkerState
    version: str
    port: int
    device: str
    layers: Optional[List[int]] = None  # half-open range of the weights it holds
    run_id: Optional[int] = None  # the current run, or the last one when idle
    runs_served: int = 0
    threads: Optional[int] = None  # torch threads it computes with
    memory: NodeMemory = field(default_factory=NodeMemory)
    cache: NodeCache = field(default_factory=NodeCache)
    counters: NodeCounters = field(default_factory=NodeCounters)
    error: Optional[str] = None  # why its run's compute failed
    # each quantized weight shape of its layers -> "kernel: why" (mdi.model.quantization.kernel_choice.chosen)
    kernels: Dict[str, str] = field(default_factory=dict)
    cpu: Optional[str] = None  # its CPU as mdi.system.cpu.isa_text says it: which kernels win there
    kernels_here: List[str] = field(default_factory=list)  # what runtime.quant_kernel fast may try on its device
    prefix: PrefixStats = field(default_factory=PrefixStats)  # its prefix cache (mdi.model.prefix_store)
    # what its layers compute with (mdi.model.backend): "ggml" or "torch", with the one line
    # saying why (auto's measurement); None while it holds no weights
    backend: Optional[str] = None
    backend_line: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "StatusReply":
        return _parse(cls, data, "status")

    def capacity_bytes(self) -> Optional[int]:
        """Bytes the worker can give a run's chunk and cache, as the worker itself counts them
        (mdi.worker.memory_budget: one rule for its /status, its loads and its KV cache); None: unknown."""
        return self.memory.capacity_bytes


_NESTED = {"memory": NodeMemory, "cache": NodeCache, "counters": NodeCounters, "batching": BatchCounter,
           "prefix": PrefixStats}


def _parse(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise StatusError("%s: expected an object, got %s" % (where, type(data).__name__))
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in data:
            continue  # an older worker may not send every field: the default stands
        key = "%s.%s" % (where, f.name)
        if f.name in _NESTED:
            values[f.name] = _parse(_NESTED[f.name], data[f.name], key)
        else:
            values[f.name] = _check(key, hints[f.name], data[f.name])
    if cls is StatusReply:
        for required in ("state", "version", "port", "device"):
            if required not in values:
                raise StatusError("%s.%s: missing" % (where, required))
    return cls(**values)


def _check(key: str, kind: Any, value: Any) -> Any:
    """`value` against a field's type: int, float, str, List[X], Dict[K, V], Optional[...]."""
    if get_origin(kind) is Union:  # Optional[X]
        if value is None:
            return None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value)
        except ValueError:
            raise StatusError("%s: expected one of %s, got %r" % (key, ", ".join(m.value for m in kind), value))
    origin, args = get_origin(kind), get_args(kind)
    if origin is list:
        ok = isinstance(value, list) and all(_is(args[0], v) for v in value)
    elif origin is dict:
        ok = isinstance(value, dict) and all(_is(args[0], k) and _is(args[1], v) for k, v in value.items())
    else:
        ok = _is(kind, value)
    if not ok:
        raise StatusError("%s: unexpected value %r" % (key, value))
    return value


def _is(kind: type, value: Any) -> bool:
    if isinstance(value, bool):  # JSON true is not a number
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
