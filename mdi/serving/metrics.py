"""What the starter knows about the ring, as one snapshot: GET /metrics renders it in
Prometheus' text format (`mdi.serving.prometheus.metrics_text`), GET /v1/mdi/state returns it as JSON (the dashboard
polls it), so both always show the same numbers.

- `Stats`: the scheduler's counters (tokens, requests, the starter's own frames and compute),
  written by the scheduler thread (or a batch run's token callback), read by HTTP threads.
- `NodeScraper`: each worker's typed /status (`mdi.ring.status.StatusReply`), scraped in
  parallel and cached for `SCRAPE_TTL` seconds however many clients poll.
- `Observer.snapshot()`: the whole picture: gauges, counters, every node (in the ring, replaced
  after a failure, spare) with its rates over the last `NODE_WINDOW` seconds, the recoveries
  and the last error. It reads a *view*: the serving `Scheduler`, or a batch run's
  `mdi.serving.dashboard.BatchMonitor`, which have the same attributes (see `Observer`).
"""
import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from mdi.ring.status import BatchCounter, StatusReply
from mdi.runconfig import NodeSpec, RunConfig
from mdi.serving.streaming import FINISH_REASONS
from mdi.starter.control import ControlClient, NodeError
from mdi.starter.engine_face import EngineFace, RecoveryEvent, StarterReading
from mdi.starter.sample import FinishReason
from mdi.system.cpu import cpu_info, isa_text
from mdi.system.memory import available_memory_bytes, board_memory, unified_memory_bytes

RATE_WINDOW = 10.0  # seconds of history behind tokens/s and the recent time to first token
RECENT = 256  # step times and token intervals averaged in /metrics
SCRAPE_TIMEOUT = 1.0  # seconds a worker has to answer /status during a scrape
SCRAPE_TTL = 0.5  # seconds an answer is reused: many viewers cost the workers one /status each
NODE_WINDOW = 5.0  # seconds behind each node's busy share, frames/s and step time
SNAPSHOT_VERSION = 1


class Stats:
    """Counters behind /metrics; written by the scheduler thread, read by HTTP threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.tokens_total = 0
        self.prompt_tokens_total = 0
        self.requests: collections.Counter = collections.Counter()  # finish reason -> count
        self.token_times: Deque[float] = collections.deque()
        self.starter_steps: Deque[float] = collections.deque(maxlen=RECENT)
        self.starter_frames = 0
        self.starter_seconds = 0.0
        self.intervals: Deque[Tuple[float, float]] = collections.deque(maxlen=RECENT)  # (when, interval)
        self.first_tokens: Deque[Tuple[float, float]] = collections.deque(maxlen=RECENT)  # (when, ttft)
        self.latency_sum = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.grammar = {"requests": 0, "masks": 0, "mask_seconds": 0.0}  # structured outputs' cost

    def token(self, now: float, interval: Optional[float]) -> None:
        with self.lock:
            self.tokens_total += 1
            self.token_times.append(now)
            if interval is not None:
                self.intervals.append((now, interval))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self.token_times and self.token_times[0] < now - RATE_WINDOW:
            self.token_times.popleft()

    def first_token(self, now: float, ttft: float) -> None:
        """A request's first token came out `ttft` seconds after it arrived (the live chart;
        the TTFT summary counts it when the request finishes)."""
        with self.lock:
            self.first_tokens.append((now, ttft))

    def starter_step(self, seconds: float, frames: int) -> None:
        with self.lock:
            self.starter_frames += frames
            self.starter_seconds += seconds
            if frames:
                self.starter_steps.append(seconds / frames)

    def starter_busy(self, seconds: float) -> None:
        with self.lock:
            self.starter_seconds += seconds

    def request_finished(self, reason: FinishReason, prompt_tokens: int, latency: float, ttft: Optional[float]) -> None:
        with self.lock:
            self.requests[reason] += 1
            self.prompt_tokens_total += prompt_tokens
            self.latency_sum += latency
            if ttft is not None:
                self.ttft_sum += ttft
                self.ttft_count += 1

    def grammar_finished(self, masks: int, seconds: float) -> None:
        """A constrained request ended: its token masks and the time they took (mdi.model.constraints.constraint)."""
        with self.lock:
            self.grammar["requests"] += 1
            self.grammar["masks"] += masks
            self.grammar["mask_seconds"] += seconds

    def snapshot(self) -> Dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            self._trim(now)
            span = min(RATE_WINDOW, max(now - self.started, 1e-6))
            # An idle server reports no recent interval or TTFT rather than its last busy values.
            recent_ttft = [t for at, t in self.first_tokens if at >= now - RATE_WINDOW]
            recent_intervals = [t for at, t in self.intervals if at >= now - RATE_WINDOW]
            return {
                "tokens_per_second": len(self.token_times) / span,
                "tokens_total": self.tokens_total, "prompt_tokens_total": self.prompt_tokens_total,
                "requests": dict((r, self.requests.get(r, 0)) for r in FINISH_REASONS),
                "starter_step_seconds": _mean(self.starter_steps),
                "starter_frames": self.starter_frames, "starter_seconds": self.starter_seconds,
                "token_interval_seconds": _mean(recent_intervals),
                "ttft_recent_seconds": _mean(recent_ttft),
                "latency_sum": self.latency_sum, "latency_count": sum(self.requests.values()),
                "ttft_sum": self.ttft_sum, "ttft_count": self.ttft_count,
                "uptime_seconds": now - self.started, "grammar": dict(self.grammar),
            }


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


class NodeScraper:
    """Workers' /status replies, fetched in parallel and kept `SCRAPE_TTL` seconds. A node that
    did not answer is asked again at the next scrape: one slow moment (a spare loading its
    layers on a busy board) must not show it down after it answers again."""

    def __init__(self, token: Optional[str], timeout: float = SCRAPE_TIMEOUT) -> None:
        self.token, self.timeout = token, timeout
        self._lock = threading.Lock()
        self._cache: Dict[str, Tuple[float, StatusReply]] = {}  # address -> (when, its answer)

    def scrape(self, nodes: Sequence[NodeSpec]) -> Dict[str, Tuple[Optional[StatusReply], Optional[str]]]:
        """address -> (its /status, or None and why it did not answer)."""
        now = time.monotonic()
        out: Dict[str, Tuple[Optional[StatusReply], Optional[str]]] = {}
        todo: List[NodeSpec] = []
        with self._lock:
            for node in nodes:
                hit = self._cache.get(node.address)
                if hit is not None and now - hit[0] < SCRAPE_TTL:
                    out[node.address] = (hit[1], None)
                elif node.address not in (n.address for n in todo):
                    todo.append(node)
        if todo:
            results: Dict[str, Tuple[Optional[StatusReply], Optional[str]]] = {}
            threads = [threading.Thread(target=self._one, args=(node, results), daemon=True) for node in todo]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.timeout * 3)
            now = time.monotonic()
            with self._lock:
                for node in todo:
                    result = results.get(node.address, (None, "no answer within %.1f s" % self.timeout))
                    if result[0] is not None:
                        self._cache[node.address] = (now, result[0])
                    else:
                        self._cache.pop(node.address, None)
                    out[node.address] = result
        return out

    def _one(self, node: NodeSpec, results: Dict[str, Tuple[Optional[StatusReply], Optional[str]]]) -> None:
        client = ControlClient(node, self.timeout, self.timeout, self.token)
        try:
            results[node.address] = (client.status(timeout=self.timeout), None)
        except NodeError as e:
            results[node.address] = (None, str(e))
        finally:
            client.close()


class _Rates:
    """A node's busy share, frames/s and compute seconds per frame over the last NODE_WINDOW
    seconds, from its running totals (frames done, compute seconds)."""

    def __init__(self) -> None:
        self.points: Deque[Tuple[float, int, float]] = collections.deque()
        self.step: Optional[float] = None
        self.busy: Optional[float] = None
        self.fps: Optional[float] = None

    def add(self, now: float, frames: int, seconds: float) -> None:
        if self.points and (frames < self.points[-1][1] or seconds < self.points[-1][2]):
            self.points.clear()  # a new run: its counters started again from zero
        if self.points and now - self.points[-1][0] < 0.05:
            return  # the same (cached) reading
        self.points.append((now, frames, seconds))
        while len(self.points) > 2 and self.points[1][0] <= now - NODE_WINDOW:
            self.points.popleft()
        t0, f0, s0 = self.points[0]
        if now - t0 > 0.2:
            self.busy = min(1.0, max(0.0, (seconds - s0) / (now - t0)))
            self.fps = (frames - f0) / (now - t0)
            if frames > f0:
                self.step = (seconds - s0) / (frames - f0)
        if self.step is None and frames > 0:
            self.step = seconds / frames  # the run's mean until a window has passed


def _layers(layers: Optional[Sequence[int]]) -> Optional[List[int]]:
    """A node's half-open range [first, last) as the JSON pair [first, last]: the same numbers
    as the worker's /status and the metrics file (mdi.model.layout.layer_span shows them)."""
    return [int(layers[0]), int(layers[1])] if layers else None


class RingView(Protocol):
    """What an `Observer` reads: the serving `Scheduler` or a batch run's
    `mdi.serving.dashboard.BatchMonitor`. A batch monitor also has `mode` ("batch") and
    `progress` (tokens and samples done), read when present."""

    @property
    def cfg(self) -> RunConfig: ...

    @property
    def stats(self) -> Stats: ...

    @property
    def state(self) -> str: ...  # the scheduler's starting | up | down | stopped, a batch's starting | running | done | failed

    @property
    def serving(self) -> bool: ...

    @property
    def error(self) -> Optional[str]: ...  # why the ring is down, or the run failed

    @property
    def slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def queue_length(self) -> int: ...

    @property
    def nodes(self) -> Sequence[NodeSpec]: ...  # the ring's, starter first

    @property
    def engine(self) -> Optional[EngineFace]: ...  # the open engine, or None while the ring is down


class Observer:
    """Builds snapshots of a view (`RingView`). Keeps what one snapshot cannot see: nodes that
    left the ring, recoveries of earlier engines, the last error."""

    MAX_RECOVERIES = 100

    def __init__(self, view: RingView, model_id: str, token: Optional[str]) -> None:
        self.view, self.model_id = view, model_id
        self.scraper = NodeScraper(token)
        self._lock = threading.Lock()
        self._rates: Dict[Tuple[str, Any], _Rates] = {}
        self._seen: collections.OrderedDict = collections.OrderedDict()  # name -> (NodeSpec, layers)
        self._recoveries: List[Dict[str, Any]] = []
        self._engine_seen: Any = None  # the engine whose recoveries come here (on_recovery)
        self._last_error: Optional[Dict[str, Any]] = None
        # a training job's report as clients see it (files relative to the models folder: TrainControl.shown)
        self.job_report: Callable[[Any], Dict[str, Any]] = lambda job: job.report()

    def _rate(self, key: Tuple[str, Any], now: float, frames: Optional[int], seconds: Optional[float]) -> _Rates:
        with self._lock:
            rates = self._rates.setdefault(key, _Rates())
            if frames is not None and seconds is not None:
                rates.add(now, frames, seconds)
            return rates

    def _note_error(self, message: Optional[str], where: str) -> None:
        if message and (self._last_error is None or self._last_error["message"] != message):
            self._last_error = {"message": message, "where": where, "time": time.time()}

    def snapshot(self) -> Dict[str, Any]:
        view = self.view
        # Gauges first, then counters: a request is counted as finished before it leaves the
        # ring, so a snapshot that shows it gone also counts it. Workers are polled last (slow).
        in_flight, queued = view.in_flight, view.queue_length
        stats = view.stats.snapshot()
        engine = view.engine
        cfg = view.cfg
        ring = list(engine.nodes) if engine is not None else list(view.nodes or cfg.nodes)
        ranges = list(engine.ranges) if engine is not None else []
        spares = list(engine.spares) if engine is not None else list(cfg.spares)
        spares = [s for s in spares if s.name not in {n.name for n in ring}]  # (a down ring lists the one it took)
        self._track_recoveries(engine)
        with self._lock:
            # every node configured is known from the first snapshot: one lost before any listed
            # it (a spare dying as it takes over, a second worker lost at once) stays listed, down
            for node in list(cfg.nodes) + list(cfg.spares):
                self._seen.setdefault(node.name, (node, None))
            for i, node in enumerate(ring):
                self._seen[node.name] = (node, ranges[i] if i < len(ranges) else None)
            listed = {n.name for n in ring} | {n.name for n in spares}  # a rebuilt ring's spare was replaced before
            gone = [(spec, layers) for name, (spec, layers) in self._seen.items() if name not in listed]
        scraped = self.scraper.scrape(ring[1:] + [spec for spec, _ in gone] + spares)
        now = time.monotonic()

        nodes: List[Dict[str, Any]] = []
        if ring:
            nodes.append(self._starter(ring[0], ranges[0] if ranges else None, engine, stats, now))
        for i, node in enumerate(ring[1:], 1):
            nodes.append(self._worker(node, "worker", i, ranges[i] if i < len(ranges) else None,
                                      scraped.get(node.address), engine, now))
        for spec, layers in gone:
            nodes.append(self._worker(spec, "replaced", None, layers, scraped.get(spec.address), engine, now))
        for spec in spares:
            nodes.append(self._worker(spec, "spare", None, None, scraped.get(spec.address), engine, now))

        self._note_error(view.error, "ring")
        with self._lock:
            recoveries = list(self._recoveries)
            last_error = dict(self._last_error) if self._last_error else None
        snap = {
            "version": SNAPSHOT_VERSION, "mode": getattr(view, "mode", "serve"), "model": self.model_id,
            "time": time.time(), "state": view.state, "serving": bool(view.serving), "error": view.error,
            "last_error": last_error,
            "slots": view.slots, "max_len": view.max_len, "in_flight": in_flight, "queue_length": queued,
            "nodes": nodes, "recoveries": recoveries,
            # speculative decoding's counters on this ring (mdi.starter.speculation.SpecCounters)
            "speculation": engine.speculation_metrics() if engine is not None else {},
            # the prefix cache's index counters and the starter's store (mdi.starter.prefix_cache)
            "prefix_cache": engine.prefix_metrics() if engine is not None else {},
        }
        snap.update((k, v) for k, v in stats.items() if not k.startswith("starter_"))
        progress = getattr(view, "progress", None)
        if progress is not None:
            snap["progress"] = progress
        job = getattr(view, "job", None)  # a training job beside serving (mdi.serving.train_job)
        if job is not None:
            snap["training"] = self.job_report(job)
        return snap

    def _track_recoveries(self, engine: Optional[EngineFace]) -> None:
        """Listen to each engine's recoveries once (its earlier ones come at once)."""
        with self._lock:
            if engine is None or engine is self._engine_seen:
                return
            self._engine_seen = engine
        engine.on_recovery(self._recovered)

    def _recovered(self, event: RecoveryEvent) -> None:
        with self._lock:  # (the node it lost is listed: snapshot knows every node configured)
            self._recoveries.append(event.to_json())
            self._note_error(event.cause, "recovery")
            del self._recoveries[:-self.MAX_RECOVERIES]

    def _dtypes(self) -> Tuple[str, Optional[str]]:
        cfg = self.view.cfg
        return cfg.model.dtype, cfg.model.compute_dtype

    def _starter(self, node: NodeSpec, layers: Optional[Sequence[int]], engine: Optional[EngineFace],
                 stats: Dict[str, Any], now: float) -> Dict[str, Any]:
        dtype, compute = self._dtypes()
        frames, seconds = stats["starter_frames"], stats["starter_seconds"]
        rates = self._rate((node.name, "starter"), now, frames, seconds)
        used = unified_memory_bytes()
        avail = available_memory_bytes()
        board = board_memory()
        starter = engine.starter_reading() if engine is not None else StarterReading(batching=BatchCounter().metrics())
        return {
            "name": node.name, "host": node.host, "port": node.port, "role": "starter", "position": 0,
            "state": "up", "reachable": True, "worker_state": None,
            "device": engine.device if engine is not None else self.view.cfg.device_of(node),
            "dtype": dtype, "compute_dtype": compute, "layers": _layers(layers),
            "frames": frames, "compute_seconds": seconds, "step_seconds": stats["starter_step_seconds"],
            "busy_share": rates.busy, "frames_per_second": rates.fps,
            "memory_used_bytes": used, "memory_limit_bytes": used + avail if avail is not None else None,
            "board_memory_used_bytes": board["used_bytes"], "board_memory_total_bytes": board["total_bytes"],
            "board_memory_source": board["source"],
            "cache_bytes": starter.cache_bytes,
            "bytes_sent": starter.bytes_sent, "messages_sent": starter.messages_sent,
            "error": None,
            "kernels": starter.kernels,  # each quantized weight shape -> "kernel: why"
            "cpu": isa_text(cpu_info()),
            # what its layers compute with, and why (mdi.model.backend)
            "backend": starter.backend, "backend_line": starter.backend_line,
            **_prefix_fields(starter.prefix_store), **starter.batching,
        }

    def _worker(self, node: NodeSpec, role: str, position: Optional[int], layers: Optional[Sequence[int]],
                scraped: Optional[Tuple[Optional[StatusReply], Optional[str]]], engine: Optional[EngineFace],
                now: float) -> Dict[str, Any]:
        status, problem = scraped if scraped is not None else (None, "not scraped")
        dtype, compute = self._dtypes()
        state = {"worker": "up", "replaced": "replaced", "spare": "spare"}[role]
        if role == "worker" and status is None:
            state = "down"
        entry: Dict[str, Any] = {
            "name": node.name, "host": node.host, "port": node.port, "role": role, "position": position,
            "state": state, "reachable": status is not None,
            "worker_state": status.state if status is not None else None,
            "device": status.device if status is not None else self.view.cfg.device_of(node),
            "dtype": dtype if role != "spare" else None, "compute_dtype": compute if role != "spare" else None,
            "layers": _layers(layers), "error": problem if status is None else status.error,
        }
        if status is None:
            if role == "worker":
                self._note_error(problem, node.name)
            return entry
        self._note_error(status.error, node.name)
        mem, c = status.memory, status.counters
        in_this_ring = role == "worker" and engine is not None and status.state == "running"
        frames, seconds = (c.frames_done, c.compute_seconds) if in_this_ring else (None, None)
        rates = self._rate((node.name, status.run_id), now, frames, seconds)
        used = mem.unified_bytes if mem.unified_bytes is not None else mem.rss_bytes  # older workers: RSS
        limit = mem.max_memory_bytes or (used + mem.available_bytes if mem.available_bytes is not None else None)
        entry.update({
            "frames": c.frames_done, "compute_seconds": c.compute_seconds,
            "step_seconds": rates.step if in_this_ring else None,
            "busy_share": rates.busy if in_this_ring else None,
            "frames_per_second": rates.fps if in_this_ring else None,
            "memory_used_bytes": used, "memory_limit_bytes": limit,
            "board_memory_used_bytes": mem.board_used_bytes, "board_memory_total_bytes": mem.board_total_bytes,
            "board_memory_source": mem.board_source,
            "cache_bytes": status.cache.bytes, "bytes_sent": c.bytes_sent, "messages_sent": c.messages_sent,
            "passes_cancelled": c.passes_cancelled, "rows_cancelled": c.rows_cancelled,
            "kernels": status.kernels, "cpu": status.cpu,
            # a spare's status names the backend of the last run it served: what it is asked for instead
            **({"backend": status.backend, "backend_line": status.backend_line} if role == "worker" else
               {"backend": self.view.cfg.backend_of(node), "backend_line": None}),
            **c.batching.metrics(),
            **_prefix_fields(status.prefix if in_this_ring else None),
        })
        return entry


def _prefix_fields(stats: Any) -> Dict[str, Any]:
    """A node's prefix cache store (mdi.model.prefix_store.PrefixStats) as its snapshot entry's fields."""
    if stats is None:
        return {"prefix_cache_budget_bytes": 0, "prefix_cache_bytes": 0, "prefix_cache_entries": 0,
                "prefix_cache_bytes_dropped": 0}
    return {"prefix_cache_budget_bytes": stats.budget_bytes, "prefix_cache_bytes": stats.bytes,
            "prefix_cache_entries": stats.entries, "prefix_cache_bytes_dropped": stats.bytes_dropped}
