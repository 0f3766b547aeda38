"""One node's line in a run's metrics record (`nodes` of --metrics-out, mdi-bench's CSV), and a
recovery's: typed values built in one place each, written as the JSON the record always had.

A batch run and a perplexity run report the same nodes the same way: the starter's own
counters (`starter_report`), each worker's from its last /status (`worker_report`, gathered by
the ring session when the stop frame came back), and every node of the ring listed even when
a failed run has no counters from it (`ring_reports`)."""
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from mdi.ring.status import StatusReply
from mdi.system.memory import unified_memory_bytes


def starter_kernels(backend: Optional[str]) -> Optional[Dict[str, str]]:
    """The starter's quantized kernels, each weight shape's "kernel: why"
    (kernel_choice.chosen_by_weight): a torch starter's; None on ggml, which chooses none and
    never loads torch to say so."""
    if backend != "torch":
        return None
    from mdi.model.quantization import kernel_choice
    return kernel_choice.chosen_by_weight()


@dataclass
class NodeReport:
    name: str
    layers: List[int]  # half-open [first, last), as /status shows them
    # None where not measured (a worker of a run that failed before its counters were read):
    peak_memory_bytes: Optional[int] = None  # with CUDA allocations (a Jetson's GPU memory is its RAM)
    cache_bytes: Optional[int] = None  # its KV cache
    compute_seconds: Optional[float] = None  # its own work: blocks (and the starter's head, sampling)
    threads: Optional[int] = None  # threads it computed with
    kernels: Optional[Dict[str, str]] = None  # each quantized weight shape -> "kernel: why"
    traffic: Dict[str, Any] = field(default_factory=dict)  # bytes and messages sent (RingEndpoint.traffic)
    batching: Dict[str, Any] = field(default_factory=dict)  # rows and samples per forward (BatchCounter)
    # speculation: stale passes dropped unrun here (workers), or the starter's drafting counters
    speculation: Dict[str, Any] = field(default_factory=dict)
    # its prefix cache's store (mdi.model.prefix_store.PrefixStats), the starter's with its index's counters
    prefix_cache: Dict[str, Any] = field(default_factory=dict)
    backend: Optional[str] = None  # what it computed with: "ggml" or "torch" (mdi.model.backend)
    backend_line: Optional[str] = None  # ... and why, in one line (auto's measurement)

    def to_json(self) -> Dict[str, Any]:
        """The record's entry: the measured fields, traffic and batching keys at the top level."""
        out = {k: v for k, v in asdict(self).items()
               if k not in ("traffic", "batching", "speculation", "prefix_cache") and v is not None}
        for key in ("speculation", "prefix_cache"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        out.update(self.traffic)
        out.update(self.batching)
        return out


def worker_report(name: str, layers: Sequence[int], status: StatusReply, cache_bytes: int) -> NodeReport:
    """A worker's counters from its /status after the run (`cache_bytes`: its /init reply's)."""
    c = status.counters
    return NodeReport(name, list(layers), status.memory.peak_rss_bytes, cache_bytes, c.compute_seconds,
                      status.threads, status.kernels,
                      {"bytes_sent": c.bytes_sent, "messages_sent": c.messages_sent,
                       "bytes_sent_by_kind": c.bytes_sent_by_kind, "messages_sent_by_kind": c.messages_sent_by_kind},
                      c.batching.metrics(),
                      {"passes_cancelled": c.passes_cancelled, "rows_cancelled": c.rows_cancelled},
                      asdict(status.prefix) if status.prefix.budget_bytes else {}, status.backend, status.backend_line)


def starter_report(engine: Any, compute_seconds: float) -> NodeReport:
    """The starter's own line: `engine` is the run's mdi.starter.engine.Engine (its chunk, its
    pipeline's transport and batching)."""
    chunk, pipeline = engine.chunk, engine.pipeline
    cache = chunk.cache if chunk is not None else None
    return NodeReport(engine.plan.nodes[0].name, list(engine.plan.nodes[0].layers), unified_memory_bytes(peak=True),
                      cache.nbytes if cache is not None else 0, round(compute_seconds, 6),
                      kernels=starter_kernels(chunk.backend if chunk is not None else None),
                      traffic=pipeline.transport.traffic() if pipeline is not None else {},
                      batching=pipeline.batching.metrics() if pipeline is not None else {},
                      speculation=pipeline.speculation_metrics() if pipeline is not None else {},
                      prefix_cache=pipeline.prefix_metrics() if pipeline is not None else {},
                      backend=chunk.backend if chunk is not None else None,
                      backend_line=backend_line(engine), threads=_threads(chunk))


def _threads(chunk: Any) -> Optional[int]:
    """The threads the starter's chunk computes with: ggml's own, else torch's (loaded then)."""
    if chunk is None:
        return None
    if chunk.backend == "ggml":
        return int(chunk.threads)
    import torch
    return torch.get_num_threads()


def backend_line(engine: Any) -> Optional[str]:
    """The starter's backend and why, and on ggml what runtime.prefill_weights does there."""
    chunk, choice = engine.chunk, engine.backend_choice
    if choice is None:
        return None
    line = choice.describe()
    return chunk.with_prefill_rule(line) if chunk is not None and chunk.backend == "ggml" else line


def node_backends(engine: Any) -> Dict[str, Optional[str]]:
    """What each node of the engine's open ring computes with ("ggml", "torch"; None: not yet chosen)."""
    out = {engine.nodes[0].name: engine.chunk.backend if engine.chunk is not None else None}
    if engine.ring is not None:
        out.update((n.name, b) for n, b in zip(engine.ring.workers, engine.ring.backends))
    return out


def ring_reports(engine: Any, starter: NodeReport, workers: Sequence[NodeReport]) -> List[NodeReport]:
    """Every node of the engine's ring in order: a worker the run got no counters from is listed
    with its layers alone."""
    got = {r.name: r for r in workers}
    return [starter] + [got.get(n.name) or NodeReport(n.name, list(n.layers)) for n in engine.plan.workers]


@dataclass
class Recovery:
    """One recovery of a run (the record's `recoveries`, the dashboard's)."""
    cause: str  # the failure that started it, naming the node
    action: str  # what was done ("spare s2 takes layers [4, 8) of w1"), or "failed: why"
    at_s: float  # seconds into the run when it began
    seconds: float  # how long it took

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)
