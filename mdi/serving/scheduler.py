"""Iteration-level scheduling of requests on the ring (ORCA's idea, on a recurrent pipeline).

The starter is the scheduler. Requests wait first-come-first-served; one is admitted as soon
as a KV cache slot is free on every node and its token budget (prompt + max_tokens) fits the
slot's positions. A sample that finishes or is cancelled gives its slot back when its last
pass returns, and the next request in the queue is admitted at the very next step, so the ring
stays full without waiting for the slowest sample of a batch. `admission: static` keeps the
old behaviour (a new batch only once the whole previous batch is done) as a baseline.

Every engine call happens on the scheduler's own thread. HTTP handler threads talk to it only
through `submit`/`cancel` (a queue into the scheduler) and each request's event queue (out of
it): ("text", str) pieces, then ("done", finish_reason) or ("error", message).
"""
import collections
import queue
import random
import threading
import time
import uuid
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple  # noqa: F401  (type comments)

import torch

from mdi.runconfig import ConfigError, RunConfig, partition
from mdi.starter.control import ControlClient, NodeError
from mdi.starter.engine import Engine
from mdi.model.layout import layer_ranges, torch_dtype
from mdi.model.source import ModelSource
from mdi.model.transformer import KVCache
from mdi.starter.pipeline import Sample
from mdi.starter.capacity import chunk_bytes_needed, worker_capacity
from mdi.starter.session import client_for
from mdi.model.sampling import SamplingParams, sample_generator
from mdi.model.tokenizers import StreamDecoder

DEFAULT_MAX_IN_FLIGHT = 16  # when serve.max_in_flight is not set (and memory allows)
DEFAULT_MAX_LEN = 2048  # positions per slot when serve.max_len is not set (capped by the context)
STEP_TIMEOUT = 0.05  # seconds an engine step waits for a frame before the scheduler looks again
IDLE_WAIT = 0.5  # seconds the idle scheduler sleeps on its inbox
REOPEN_DELAY = 5.0  # seconds between attempts to rebuild a failed ring
RATE_WINDOW = 10.0  # seconds of history behind tokens/s
RECENT = 256  # step times and token intervals averaged in /metrics
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class SchedulerError(RuntimeError):
    """A request was refused; `status` is the HTTP status to answer with."""
    status = 503


class QueueFull(SchedulerError):
    status = 429


class Unavailable(SchedulerError):
    status = 503


class Request:
    """One generation request as the scheduler sees it. Built on an HTTP thread; after
    `submit` only the scheduler thread touches it, except `cancel()` and `next_event()`."""

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                 seed: Optional[int] = None, stop: Sequence[str] = ()) -> None:
        self.id = uuid.uuid4().hex[:24]
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.max_tokens = int(max_tokens)
        self.params = params
        self.seed = seed
        self.stop = [s for s in stop if s]
        self.created = int(time.time())
        self.arrived = time.monotonic()
        self.admitted = None  # type: Optional[float]
        self.first_token = None  # type: Optional[float]
        self.finished = None  # type: Optional[float]
        self.finish_reason = None  # type: Optional[str]  # stop | length | cancelled | error
        self.completion_tokens = 0
        self.sample = None  # type: Optional[Sample]
        self.decoder = None  # type: Optional[StreamDecoder]
        self.pending = ""  # decoded text held back: it may be the start of a stop string
        self.closed = False  # the client has its final event (scheduler thread only)
        self.events = queue.Queue()  # type: queue.Queue
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def usage(self) -> Dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt_ids) + self.completion_tokens}

    def next_event(self, timeout: float) -> Optional[Tuple[str, Any]]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class Stats:
    """Counters behind /metrics; written by the scheduler thread, read by HTTP threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.tokens_total = 0
        self.prompt_tokens_total = 0
        self.requests = collections.Counter()  # type: collections.Counter
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

    def finished(self, req: Request) -> None:
        with self.lock:
            self.requests[req.finish_reason] += 1
            self.prompt_tokens_total += len(req.prompt_ids)
            self.latency_sum += req.finished - req.arrived
            if req.first_token is not None:
                self.ttft_sum += req.first_token - req.arrived
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


def resolve_max_len(cfg: RunConfig, block_size: int) -> int:
    asked = cfg.serve.max_len
    if asked is None:
        return min(block_size, DEFAULT_MAX_LEN)
    if asked > block_size:
        raise ConfigError("%s: serve.max_len: %d is longer than the model's context of %d tokens"
                          % (cfg.source, asked, block_size))
    return asked


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(text), len(s) - 1), best, -1):
            if s.startswith(text[-k:]):
                best = k
                break
    return best


class Scheduler:
    def __init__(self, cfg: RunConfig, source: ModelSource, log: Callable[[str], None] = print) -> None:
        if source.tokenizer is None:
            raise ConfigError("%s: no tokenizer found for this model" % source.path)
        self.cfg, self.source, self.log = cfg, source, log
        self.tokenizer = source.tokenizer
        self.policy = cfg.serve.admission
        self.max_queue = cfg.serve.max_queue
        self.max_len = resolve_max_len(cfg, source.config.block_size)
        gen = cfg.generation
        self.params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)  # defaults for requests
        self.stats = Stats()
        self.state = "starting"  # starting | up | down | stopped
        self.slots = 0  # samples in flight at most (set when the ring is open)
        self.error = None  # type: Optional[str]  # why the ring is down
        self.nodes = []  # type: List[Any]  # the ring's NodeSpecs, starter first (for /metrics)
        self.ready = threading.Event()
        self.open_error = None  # type: Optional[BaseException]
        self.engine = None  # type: Optional[Engine]
        self._inbox = queue.Queue()  # type: queue.Queue
        self._waiting = collections.deque()  # type: Deque[Request]
        self._running = {}  # type: Dict[int, Request]  # sample index -> request
        self._queued = 0  # submitted and not yet admitted (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next_index = 0
        self._recoveries_seen = 0
        self._thread = None  # type: Optional[threading.Thread]
        self._scraped = {}  # type: Dict[str, Tuple[int, float, Optional[float]]]  # node -> last scrape

    # --- called from other threads ---------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="mdi-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        if self.state != "up":
            raise Unavailable("the ring is %s%s" % (self.state, ": %s" % self.error if self.error else ""))
        with self._lock:
            if self._queued >= self.max_queue:
                raise QueueFull("%d requests are already waiting; try again later" % self._queued)
            self._queued += 1
        self._inbox.put(("submit", req))

    def cancel(self, req: Request) -> None:
        """The client went away: drop the request from the queue or cancel its sample."""
        req._cancel.set()
        self._inbox.put(("cancel", req))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_length(self) -> int:
        with self._lock:
            return self._queued

    @property
    def in_flight(self) -> int:
        """Requests admitted to the ring and not finished: counted from admission, so a first
        token already streamed is always counted (a pass is briefly out of the pipeline's
        table while its token is handled)."""
        return len(self._running)

    # --- the scheduler thread --------------------------------------------------------
    def _main(self) -> None:
        try:
            self._open()
        except BaseException as e:  # reported by the thread that waits on `ready`
            self.open_error = e
            self.state = "stopped"
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except BaseException as e:  # never leave clients waiting on a dead thread
            self.log("mdi: serve: scheduler failed: %s: %s" % (type(e).__name__, e))
            self._fail_all("scheduler failed: %s" % e)
            raise
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.engine is None:
                if self._stop.wait(REOPEN_DELAY):
                    break
                self._drain_inbox(False)
                try:
                    self._open()
                    self.log("mdi: serve: ring rebuilt; serving again")
                except Exception as e:
                    self.error = str(e)
                    self.log("mdi: serve: cannot rebuild the ring: %s" % e)
                continue
            pipe = self.engine.pipeline
            self._drain_inbox(block=not pipe.active and not self._waiting)
            try:
                self._admit()
                if pipe.active:
                    self._step()
            except Exception as e:  # the engine already tried to recover
                self._ring_failed(e)

    def _open(self) -> None:
        cfg = self.cfg
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        config = self.source.config
        nodes = list(cfg.nodes)
        ranges = layer_ranges(partition(config.n_layer, nodes, cfg.source))
        slots = self._plan_slots(nodes, ranges)
        engine = Engine(cfg, self.source, slots, self.max_len, self.params, self.log, self._on_token)
        try:
            engine.open()
            reported = self._reported_slots(engine)
        except BaseException:
            engine.abort()
            raise
        self.slots = min([slots] + reported)
        self.engine = engine
        self.nodes = list(engine.nodes)
        self._recoveries_seen = len(engine.recoveries)
        self.error = None
        self.state = "up"

    def _plan_slots(self, nodes: List[Any], ranges: List[List[int]]) -> int:
        """serve.max_in_flight (default DEFAULT_MAX_IN_FLIGHT), lowered to the slots of
        `max_len` positions that fit in every node's memory next to its weights."""
        from mdi.system.memory import available_memory_bytes
        asked = self.cfg.serve.max_in_flight
        limit = asked or DEFAULT_MAX_IN_FLIGHT
        config = self.source.config
        dtype = torch_dtype(self.cfg.model.dtype)
        for i, (node, layers) in enumerate(zip(nodes, ranges)):
            capacity = available_memory_bytes() if i == 0 else worker_capacity(client_for(self.cfg, node).status())
            if capacity is None:
                continue
            weights = chunk_bytes_needed(config, layers, 0, self.max_len, dtype, with_ends=i == 0)
            per_slot = KVCache.nbytes_for(config, layers[1] - layers[0], 1, self.max_len, dtype)
            fit = (capacity - weights) // per_slot if per_slot > 0 else limit
            if fit < 1:
                raise ConfigError("node %s: %.0f MB of memory cannot hold its layers and one KV cache slot of "
                                  "%d positions; lower serve.max_len" % (node.name, capacity / 2 ** 20, self.max_len))
            if fit < limit:
                if asked:
                    self.log("mdi: serve: max_in_flight %d lowered to %d: node %s has memory for %d slots of "
                             "%d positions" % (asked, fit, node.name, fit, self.max_len))
                limit = int(fit)
        return limit

    def _reported_slots(self, engine: Engine) -> List[int]:
        """The KV slots each worker says it allocated (what bounds the samples in flight)."""
        slots = []
        for node in engine.nodes[1:]:
            cache = client_for(self.cfg, node).status().get("cache", {})
            if cache.get("max_len", self.max_len) < self.max_len:
                raise NodeError("node %s allocated %s positions per slot, not %d"
                                % (node.name, cache.get("max_len"), self.max_len), node.name)
            slots.append(int(cache.get("slots", 0)))
        if slots and min(slots) < 1:
            raise NodeError("a worker reports no KV cache slot")
        return slots

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req = item
            if kind == "submit":
                if req.cancelled:
                    self._close(req, "cancelled")
                    self._dequeued()
                elif self.engine is None:
                    self._close(req, "error", self.error or "the ring is down")
                    self._dequeued()
                else:
                    self._waiting.append(req)
            elif kind == "cancel":
                self._cancel(req)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _cancel(self, req: Request) -> None:
        if req.closed:
            return
        if req.sample is not None:
            req.sample.cancelled = True  # its slot frees when the pass in flight comes back
        self._close(req, "cancelled")  # counted before the gauges drop (see serve.metrics_text)
        if req in self._waiting:
            self._waiting.remove(req)
            self._dequeued()

    def _admit(self) -> None:
        pipe = self.engine.pipeline
        if self.policy == "static" and pipe.active:
            return  # static batching: the next batch waits for the whole ring to drain
        free = pipe.free_slots
        room = self.slots - len(pipe.active)
        while self._waiting and free and room > 0:
            req = self._waiting.popleft()
            self._dequeued()
            if req.cancelled:
                self._close(req, "cancelled")
                continue
            if len(req.prompt_ids) + req.max_tokens > self.max_len:  # the HTTP layer checks first
                self._close(req, "error", "prompt + max_tokens exceed the %d positions of a slot" % self.max_len)
                continue
            seed = req.seed if req.seed is not None else random.getrandbits(62)
            sample = Sample(self._next_index, "", list(req.prompt_ids), req.max_tokens,
                            sample_generator(seed, 0), slot=free.pop(0), params=req.params)
            self._next_index += 1
            req.sample, req.decoder = sample, StreamDecoder(self.tokenizer)
            req.admitted = time.monotonic()
            self._running[sample.index] = req
            busy = pipe.compute_seconds
            self.engine.admit(sample)
            self.stats.starter_busy(pipe.compute_seconds - busy)
            room -= 1

    def _step(self) -> None:
        engine = self.engine
        busy = engine.pipeline.compute_seconds  # the starter's own layers, head and sampling
        advanced = engine.step(timeout=STEP_TIMEOUT)
        if len(engine.recoveries) != self._recoveries_seen:  # the engine rebuilt the ring
            self._recoveries_seen = len(engine.recoveries)
            self.nodes = list(engine.nodes)
        if advanced:
            self.stats.starter_step(engine.pipeline.compute_seconds - busy, len(advanced))
        for sample in advanced:
            if sample.done:
                req = self._running.get(sample.index)
                if req is not None and not req.closed:
                    self._close(req, "stop" if sample.finish_reason == "eos" else sample.finish_reason)
                self._running.pop(sample.index, None)  # after _close: /metrics relies on that order

    def _on_token(self, sample: Sample, token: int) -> None:
        """Engine callback (scheduler thread): stream the new text, watch for stop strings."""
        req = self._running.get(sample.index)
        now = time.monotonic()
        times = sample.token_times
        self.stats.token(now, times[-1] - times[-2] if len(times) > 1 else None)
        if req is None or req.closed:
            return
        if req.first_token is None:
            req.first_token = now
        req.completion_tokens = len(sample.token_ids)
        piece = "" if sample.finish_reason == "eos" else req.decoder.push(token)
        if sample.done:
            piece += req.decoder.flush()
        text = req.pending + piece
        req.pending = ""
        if req.stop:
            cuts = [i for i in (text.find(s) for s in req.stop) if i >= 0]
            if cuts:
                if min(cuts):
                    req.events.put(("text", text[:min(cuts)]))
                sample.cancelled = True  # no more tokens; the slot frees when its pass returns
                self._close(req, "stop")
                return
            if not sample.done:
                keep = held_back(text, req.stop)
                if keep:
                    text, req.pending = text[:len(text) - keep], text[len(text) - keep:]
        if text:
            req.events.put(("text", text))
        if sample.done:
            self._close(req, "stop" if sample.finish_reason == "eos" else "length")

    def _close(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        if req.closed:
            return
        req.closed = True
        req.finish_reason = reason
        req.finished = time.monotonic()
        if req.sample is not None:
            req.completion_tokens = len(req.sample.token_ids)
        self.stats.finished(req)
        req.events.put(("error", error) if reason == "error" else ("done", reason))

    def _fail_all(self, message: str) -> None:
        for req in list(self._running.values()) + list(self._waiting):
            self._close(req, "error", message)
        with self._lock:
            self._queued -= len(self._waiting)
        self._running, self._waiting = {}, collections.deque()

    def _ring_failed(self, cause: BaseException) -> None:
        self.error = "%s" % cause
        self.log("mdi: serve: the ring failed: %s; failing %d requests and rebuilding"
                 % (cause, len(self._running) + len(self._waiting)))
        self.state = "down"
        self._fail_all("the ring failed: %s" % cause)
        engine, self.engine = self.engine, None
        try:
            engine.abort()
        except Exception:
            pass
        if engine.chunk is not None:
            engine.chunk.free_cache()

    def _shutdown(self) -> None:
        self.state = "stopped"
        self._drain_inbox(False)
        self._fail_all("the server is shutting down")
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            engine.close()
        except Exception as e:
            self.log("mdi: serve: closing the ring: %s" % e)
            engine.abort()

    # --- /metrics (HTTP threads) -----------------------------------------------------
    def node_counters(self, timeout: float = 1.0) -> List[Dict[str, Any]]:
        """Each node's name, frames handled and compute seconds (workers: from /status, when
        they report `compute_seconds`; the starter: measured here)."""
        snap = self.stats.snapshot()
        nodes = list(self.nodes)
        out = []
        if nodes:
            out.append({"node": nodes[0].name, "frames": snap["starter_frames"],
                        "compute_seconds": snap["starter_seconds"],
                        "step_seconds": snap["starter_step_seconds"]})
        for node in nodes[1:]:
            entry = {"node": node.name}  # type: Dict[str, Any]
            client = ControlClient(node, timeout, timeout, self.cfg.runtime.token)
            try:
                counters = client.status(timeout=timeout).get("counters") or {}
            except NodeError:
                entry["up"] = 0
                out.append(entry)
                continue
            finally:
                client.session.close()
            entry["up"] = 1
            if "frames_done" in counters:
                entry["frames"] = counters["frames_done"]
            if isinstance(counters.get("compute_seconds"), (int, float)) and "frames" in entry:
                entry["compute_seconds"] = counters["compute_seconds"]
                entry["step_seconds"] = self._step_since_last_scrape(node.name, entry)
            out.append(entry)
        return out

    def _step_since_last_scrape(self, name: str, entry: Dict[str, Any]) -> Optional[float]:
        """Mean compute seconds per frame since the previous scrape (the previous figure when
        no frame was done since; the whole run's mean on the first scrape or a new run)."""
        frames, seconds = entry["frames"], entry["compute_seconds"]
        with self._lock:
            last = self._scraped.get(name)
            if last is not None and last[0] < frames and last[1] <= seconds:
                step = (seconds - last[1]) / (frames - last[0])  # type: Optional[float]
            elif last is not None and last[0] == frames:
                step = last[2]
            else:
                step = seconds / frames if frames > 0 else None
            self._scraped[name] = (frames, seconds, step)
        return step
