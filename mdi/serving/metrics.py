"""GET /metrics: the scheduler's counters (`Stats`), each worker's counters scraped from its
/status (`WorkerScraper`), and both in Prometheus' text format (`metrics_text`)."""
import collections
import threading
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Tuple  # noqa: F401

from mdi.runconfig import NodeSpec
from mdi.serving.streaming import FINISH_REASONS
from mdi.starter.control import ControlClient, NodeError

if TYPE_CHECKING:  # only for annotations: the scheduler imports this module
    from mdi.serving.scheduler import Scheduler  # noqa: F401

RATE_WINDOW = 10.0  # seconds of history behind tokens/s
RECENT = 256  # step times and token intervals averaged in /metrics
SCRAPE_TIMEOUT = 1.0  # seconds a worker has to answer /status during a scrape


class Stats:
    """Counters behind /metrics; written by the scheduler thread, read by HTTP threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.tokens_total = 0
        self.prompt_tokens_total = 0
        self.requests = collections.Counter()  # type: collections.Counter  # finish reason -> count
        self.token_times = collections.deque()  # type: Deque[float]
        self.starter_steps = collections.deque(maxlen=RECENT)  # type: Deque[float]
        self.starter_frames = 0
        self.starter_seconds = 0.0
        self.intervals = collections.deque(maxlen=RECENT)  # type: Deque[float]
        self.latency_sum = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def token(self, now: float, interval: Optional[float]) -> None:
        with self.lock:
            self.tokens_total += 1
            self.token_times.append(now)
            if interval is not None:
                self.intervals.append(interval)
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self.token_times and self.token_times[0] < now - RATE_WINDOW:
            self.token_times.popleft()

    def starter_step(self, seconds: float, frames: int) -> None:
        with self.lock:
            self.starter_frames += frames
            self.starter_seconds += seconds
            if frames:
                self.starter_steps.append(seconds / frames)

    def starter_busy(self, seconds: float) -> None:
        with self.lock:
            self.starter_seconds += seconds

    def request_finished(self, reason: str, prompt_tokens: int, latency: float, ttft: Optional[float]) -> None:
        with self.lock:
            self.requests[reason] += 1
            self.prompt_tokens_total += prompt_tokens
            self.latency_sum += latency
            if ttft is not None:
                self.ttft_sum += ttft
                self.ttft_count += 1

    def snapshot(self) -> Dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            self._trim(now)
            span = min(RATE_WINDOW, max(now - self.started, 1e-6))
            return {
                "tokens_per_second": len(self.token_times) / span,
                "tokens_total": self.tokens_total, "prompt_tokens_total": self.prompt_tokens_total,
                "requests": dict((r, self.requests.get(r, 0)) for r in FINISH_REASONS),
                "starter_step_seconds": _mean(self.starter_steps),
                "starter_frames": self.starter_frames, "starter_seconds": self.starter_seconds,
                "token_interval_seconds": _mean(self.intervals),
                "latency_sum": self.latency_sum, "latency_count": sum(self.requests.values()),
                "ttft_sum": self.ttft_sum, "ttft_count": self.ttft_count,
            }


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


class WorkerScraper:
    """Each node's frames and compute seconds: the starter's from `Stats`, the workers' from
    their /status (when they report `compute_seconds`). Keeps the previous scrape of every
    worker to turn its running totals into a recent step time."""

    def __init__(self, token: Optional[str]) -> None:
        self.token = token
        self._lock = threading.Lock()  # HTTP threads may scrape at once
        self._last = {}  # type: Dict[str, Tuple[int, float, Optional[float]]]  # node -> frames, seconds, step

    def node_counters(self, nodes: List[NodeSpec], snap: Dict[str, Any],
                      timeout: float = SCRAPE_TIMEOUT) -> List[Dict[str, Any]]:
        out = []
        if nodes:
            out.append({"node": nodes[0].name, "frames": snap["starter_frames"],
                        "compute_seconds": snap["starter_seconds"],
                        "step_seconds": snap["starter_step_seconds"]})
        for node in nodes[1:]:
            entry = {"node": node.name}  # type: Dict[str, Any]
            client = ControlClient(node, timeout, timeout, self.token)
            try:
                counters = client.status(timeout=timeout).counters
            except NodeError:
                entry["up"] = 0
                out.append(entry)
                continue
            finally:
                client.session.close()
            entry["up"] = 1
            entry["frames"] = counters.frames_done
            entry["compute_seconds"] = counters.compute_seconds
            entry["step_seconds"] = self._step_since_last_scrape(node.name, entry)
            out.append(entry)
        return out

    def _step_since_last_scrape(self, name: str, entry: Dict[str, Any]) -> Optional[float]:
        """Mean compute seconds per frame since the previous scrape (the previous figure when
        no frame was done since; the whole run's mean on the first scrape or a new run)."""
        frames, seconds = entry["frames"], entry["compute_seconds"]
        with self._lock:
            last = self._last.get(name)
            if last is not None and last[0] < frames and last[1] <= seconds:
                step = (seconds - last[1]) / (frames - last[0])  # type: Optional[float]
            elif last is not None and last[0] == frames:
                step = last[2]
            else:
                step = seconds / frames if frames > 0 else None
            self._last[name] = (frames, seconds, step)
        return step


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


class _Exposition:
    """Prometheus' text format, one metric family at a time."""

    def __init__(self) -> None:
        self.lines = []  # type: List[str]

    def add(self, name: str, kind: str, text: str, samples: List[Tuple[str, Any]]) -> None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return
        self.lines.append("# HELP %s %s" % (name, text))
        self.lines.append("# TYPE %s %s" % (name, kind))
        for labels, value in samples:
            self.lines.append("%s%s %s" % (name, labels, repr(float(value)) if isinstance(value, float) else value))

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def metrics_text(sched: "Scheduler", scraper: WorkerScraper) -> str:
    # Gauges first, then counters: a request is counted as finished before it leaves the
    # ring, so a scrape that shows it gone also counts it. Workers are polled last (slow).
    in_flight, queued = sched.in_flight, sched.queue_length
    snap = sched.stats.snapshot()
    nodes = scraper.node_counters(list(sched.nodes), snap)

    def per_node(key: str) -> List[Tuple[str, Any]]:
        return [('{node="%s"}' % _label(n["node"]), n.get(key)) for n in nodes]

    out = _Exposition()
    out.add("mdi_up", "gauge", "1 while the ring is up and serving.", [("", 1 if sched.serving else 0)])
    out.add("mdi_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
            [("", snap["tokens_per_second"])])
    out.add("mdi_generated_tokens_total", "counter", "Tokens generated.", [("", snap["tokens_total"])])
    out.add("mdi_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
            [("", snap["prompt_tokens_total"])])
    out.add("mdi_samples_in_flight", "gauge", "Samples holding a KV cache slot on the ring.", [("", in_flight)])
    out.add("mdi_slots", "gauge", "Samples in flight at most (KV cache slots per node).", [("", sched.slots)])
    out.add("mdi_queue_length", "gauge", "Requests waiting for a slot.", [("", queued)])
    out.add("mdi_requests_total", "counter", "Finished requests by finish reason.",
            [('{finish_reason="%s"}' % r, n) for r, n in sorted(snap["requests"].items())])
    out.add("mdi_request_duration_seconds", "summary", "Arrival to last token.",
            [("_sum", snap["latency_sum"]), ("_count", snap["latency_count"])])
    out.add("mdi_time_to_first_token_seconds", "summary", "Arrival to first token.",
            [("_sum", snap["ttft_sum"]), ("_count", snap["ttft_count"])])
    out.add("mdi_token_interval_seconds", "gauge", "Mean time between two tokens of one sample (recent).",
            [("", snap["token_interval_seconds"])])
    out.add("mdi_node_step_seconds", "gauge", "Compute seconds per frame on each node (recent mean; workers "
            "that report compute_seconds).", per_node("step_seconds"))
    out.add("mdi_node_frames_total", "counter", "Frames each node computed.", per_node("frames"))
    out.add("mdi_node_compute_seconds_total", "counter", "Seconds each node spent computing frames.",
            per_node("compute_seconds"))
    out.add("mdi_node_up", "gauge", "1 when the worker answered /status.", per_node("up"))
    return out.text()
