"""Iteration-level scheduling of requests on the ring (ORCA's idea, on a recurrent pipeline).

The starter is the scheduler. A free KV cache slot goes to the waiting request whose HTTP call
holds the fewest slots, first come first served among equals (`admission`), once its token
budget (prompt + max_tokens) fits the slot's positions on every node. A sample that finishes
or is cancelled gives its slot back when its last pass returns, and the next request in the
queue is admitted at the very next step, so the ring stays full without waiting for the slowest
sample of a batch (`admission: static`, a baseline: a new batch once the last is done).

Every engine call happens on the scheduler's own thread. HTTP handler threads talk to it only
through `submit`/`cancel` (typed messages into its `Inbox`: `inbox`) and each request's event
queue (out of it): `TextEvent` pieces, then a `FinishEvent` or an `ErrorEvent` (`request`).
How the ring is sized and opened is `mdi.starter.planning.serving_plan`; the text a token adds (stop
strings) is `streaming`; what /metrics and the dashboard show is `metrics`.
"""
import collections
import logging
import random
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set

from mdi.model.sampling import SamplingParams, sample_generator
from mdi.model.source import ModelSource
from mdi.model.tokenizers import Tokenizer
from mdi.runconfig import ConfigError, RunConfig
from mdi.serving.admission import (AdapterBusy, QueueFull, SchedulerError, TooManySamples, Unavailable,
                                    next_waiting)
from mdi.serving.metrics import Stats
from mdi.serving.request import ErrorEvent, FinishEvent, Request, TextEvent
from mdi.serving.inbox import Call, Cancel, Inbox, RingState, SchedulerCall, Submit, Wake
from mdi.serving.streaming import TextStream, finish_reason_of
from mdi.starter.engine_face import EngineFace, RecoveryEvent
from mdi.starter.sample import FinishReason, Sample
from mdi.starter.planning.run_shape import serving_max_len
from mdi.starter.planning.serving_plan import open_serving_ring
from mdi.system.deep_stack import start_deep_stack_thread
from mdi.system.memory import collect_freed_memory

STEP_TIMEOUT = 0.05  # seconds an engine step waits for a frame before the scheduler looks again
IDLE_WAIT = 0.5  # seconds the idle scheduler sleeps on its inbox
REOPEN_DELAY = 5.0  # seconds between attempts to rebuild a failed ring

log = logging.getLogger(__name__)

ADAPTER_CLOSING = "its adapter is being unloaded"
DRAIN_POLL_S = 0.05  # between looks at the requests an unloading adapter still runs


class Scheduler:
    def __init__(self, cfg: RunConfig, source: ModelSource) -> None:
        if source.tokenizer is None:
            raise ConfigError("%s: no tokenizer found for this model" % source.path)
        self.cfg, self.source = cfg, source
        self.tokenizer: Tokenizer = source.tokenizer
        self.policy = cfg.serve.admission
        self.max_queue = cfg.serve.max_queue
        self.max_len = serving_max_len(cfg, source.config.block_size)
        gen = cfg.generation
        self.params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)  # defaults for requests
        self.stats = Stats()
        self.state = RingState.STARTING
        self.slots = 0  # samples in flight at most (set when the ring is open)
        self.error: Optional[str] = None  # why the ring is down
        self.nodes: List[Any] = []  # the ring's NodeSpecs, starter first (for /metrics)
        self.ready = threading.Event()
        self.open_error: Optional[BaseException] = None
        self.engine: Optional[EngineFace] = None
        self._opening: Optional[Any] = None  # the engine being opened: stop() aborts it
        self._inbox = Inbox()
        self._waiting: Deque[Request] = collections.deque()
        self._running: Dict[int, Request] = {}  # sample index -> request
        self._queued = 0  # submitted and not yet admitted (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next_index = 0
        self._thread: Optional[threading.Thread] = None
        self._adapters: Any = None  # the last engine's AdapterSet (kept across rebuilds)
        self.closing: Set[int] = set()  # adapter ids being unloaded: requests naming them are refused
        self.job: Any = None  # the training job beside serving (mdi.serving.train_job), its last one once ended

    # --- called from other threads ---------------------------------------------------
    def start(self) -> None:
        self._thread = start_deep_stack_thread(self._main, "mdi-scheduler")  # deep: grammar masks recurse per rule

    def submit(self, reqs: Sequence[Request]) -> None:
        """Queue one call's requests (its choices and prompts), all or none."""
        if self.state != RingState.UP:
            raise self._unavailable()
        with self._lock:
            free = max(0, self.slots - len(self._running))  # a sample that takes a free slot at once waits not (h78)
            if len(reqs) > self.max_queue:
                raise TooManySamples("%d samples (prompts x n) in one request, more than the %d that may wait "
                                     "(serve.max_queue)" % (len(reqs), self.max_queue))
            if self._queued + len(reqs) > self.max_queue + free:
                raise QueueFull("%d samples (prompts x n) wait, and this request's %d would pass the %d that may "
                                "(serve.max_queue); try again later" % (self._queued, len(reqs), self.max_queue))
            self._queued += len(reqs)
        for req in reqs:
            self._inbox.put(Submit(req))

    def unload_adapter(self, ids: Callable[[], Sequence[int]], remove: Callable[[], Any], timeout: float) -> None:
        """Unload an adapter (and its mixes: `ids()`, asked at every look: a mix made while it drained
        had run on, and its removal failed the ring) failing no other request: requests naming them are
        refused, those running finish, then `remove` runs between two steps. AdapterBusy when those
        outlast `timeout`; the adapter is then served again."""
        closing: Set[int] = set()

        def remove_if_idle() -> bool:  # between two steps
            new = set(ids()) - closing
            closing.update(new)
            self._close(new)
            if any(r.adapter in closing for r in self._running.values()):
                return False
            remove()
            return True
        try:
            deadline = time.monotonic() + timeout
            while not self.between_steps(remove_if_idle, timeout):
                if time.monotonic() > deadline:
                    raise AdapterBusy("requests using it ran for more than %.0f s; try again" % timeout)
                time.sleep(DRAIN_POLL_S)
        finally:
            self._inbox.put(Call(SchedulerCall(lambda: self.closing.difference_update(closing))))

    def evict_idle(self, candidates: Sequence[int], remove: Callable[[int], Any], timeout: float) -> Optional[int]:
        """Between two steps, `remove` the first of `candidates` (adapter ids) no waiting or running request
        names, and return it (None: each is in use); one given it just before is refused at admission."""
        def pick() -> Optional[int]:
            busy = {r.adapter for r in self._waiting} | {r.adapter for r in self._running.values()}
            adapter = next((a for a in candidates if a not in busy), None)
            if adapter is not None:
                remove(adapter)
            return adapter
        return self.between_steps(pick, timeout)

    def _unavailable(self) -> Unavailable:
        return Unavailable("the ring is %s%s" % (self.state, ": %s" % self.error if self.error else ""))

    def engine_up(self) -> Any:
        """The ring's engine; Unavailable while the ring is down (being rebuilt)."""
        engine = self.engine
        if engine is None:
            raise self._unavailable()
        return engine

    def _close(self, ids: Set[int]) -> None:
        self.closing |= ids
        for req in [r for r in self._waiting if r.adapter in ids]:
            self._waiting.remove(req)
            self._dequeued()
            self._finish(req, FinishReason.ERROR, ADAPTER_CLOSING)

    def between_steps(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run `fn` on the scheduler thread between two steps (no request admitted meanwhile, the waiting
        and running ones exactly known); its result, or its exception raised here. SchedulerError (503)
        when it did not start within `timeout` (it then never runs) or did not end within `timeout` more."""
        if not self.alive:
            raise Unavailable("the scheduler has stopped")
        call = SchedulerCall(fn)
        self._inbox.put(Call(call))
        if not call.started.wait(timeout):
            with call.lock:
                if not call.started.is_set():
                    call.cancelled = True
                    raise SchedulerError("the scheduler was busy for %.0f s; try again" % timeout)
        if not call.done.wait(timeout):
            raise SchedulerError("the scheduler is still at it after %.0f s" % timeout)
        if call.error is not None:
            raise call.error
        return call.value

    def cancel(self, req: Request) -> None:
        """The client went away: drop the request from the queue or cancel its sample."""
        req.mark_cancelled()
        self._inbox.put(Cancel(req))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(Wake())
        opening = self._opening
        if opening is not None:  # its workers are told now, not once the ring is open (seconds later)
            try:
                opening.abort()
            except Exception as e:  # the opening fails on its own thread, which reports it
                log.warning("mdi: serve: aborting the ring being opened: %s", e)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def serving(self) -> bool:
        """The ring is up and the scheduler thread runs (what /health and mdi_up report)."""
        return self.state == RingState.UP and self.alive

    @property
    def queue_length(self) -> int:
        with self._lock:
            return self._queued

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (from admission: a pass briefly leaves the pipeline's table)."""
        return len(self._running)

    # --- the scheduler thread --------------------------------------------------------
    def _main(self) -> None:
        try:
            self._open()
        except BaseException as e:  # reported by the thread that waits on `ready`
            self.open_error = e
            self.state = RingState.STOPPED
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except BaseException as e:  # never leave clients waiting on a dead thread
            log.error("mdi: serve: scheduler failed: %s: %s", type(e).__name__, e)
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
                    log.info("mdi: serve: ring rebuilt; serving again")
                except Exception as e:
                    self.error = str(e)
                    log.warning("mdi: serve: cannot rebuild the ring: %s", e)
                continue
            engine = self.engine
            job = self.job if self.job is not None and self.job.active else None
            self._drain_inbox(block=not engine.in_flight and not self._waiting and job is None)
            try:
                self._admit()
                advanced = self._step(bool(engine.in_flight) or job is not None)  # the job's frames come back here
                if job is not None:  # once the next passes have left: training yields (mdi.serving.train_job)
                    job.pump(busy=bool(engine.in_flight), turn=advanced > 0 or not engine.in_flight)
            except Exception as e:  # the engine already tried to recover
                self._ring_failed(e)

    def _open(self) -> None:
        # A rebuilt ring keeps the adapters loaded at run time, under the same ids.
        kept = self._adapters
        try:
            ring = open_serving_ring(self.cfg, self.source, self.max_len, self.params, self._on_token, kept,
                                     on_engine=lambda engine: setattr(self, "_opening", engine))
        finally:
            self._opening = None
        self.slots = ring.slots
        self.engine = ring.engine
        ring.engine.set_training_hook(self._train_frame)
        self.nodes = list(ring.engine.nodes)
        ring.engine.on_recovery(self._recovered)
        self.error = None
        self.state = RingState.UP

    def _drain_inbox(self, block: bool) -> None:
        for message in self._inbox.drain(IDLE_WAIT if block else None):
            if isinstance(message, Submit):
                self._take(message.request)
            elif isinstance(message, Cancel):
                self._cancel(message.request)
            elif isinstance(message, Call):
                message.call.run()
            # a Wake only ends the wait, so that the loop sees `_stop`

    def _take(self, req: Request) -> None:
        """A submitted request: waiting for a slot, or finished at once when it cannot run."""
        if req.cancelled:
            self._finish(req, FinishReason.CANCELLED)
            self._dequeued()
        elif self.engine is None:
            self._finish(req, FinishReason.ERROR, self.error or "the ring is down")
            self._dequeued()
        elif req.adapter in self.closing:
            self._finish(req, FinishReason.ERROR, ADAPTER_CLOSING)
            self._dequeued()
        else:
            self._waiting.append(req)

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _cancel(self, req: Request) -> None:
        if req.finished:
            return
        if req.sample is not None:
            req.sample.cancelled = True  # its slot frees when the pass in flight comes back
        self._finish(req, FinishReason.CANCELLED)  # counted before the gauges drop (see metrics_text)
        if req in self._waiting:
            self._waiting.remove(req)
            self._dequeued()

    def _live_engine(self) -> EngineFace:
        """The ring's engine: requests are admitted and stepped only while the ring is up."""
        if self.engine is None:
            raise RuntimeError("the serving ring is down")
        return self.engine

    def _admit(self) -> None:
        engine = self._live_engine()
        if self.policy == "static" and engine.in_flight:
            return  # static batching: the next batch waits for the whole ring to drain
        free = engine.free_slots()
        room = self.slots - engine.in_flight
        while self._waiting and free and room > 0:
            req = next_waiting(self._waiting, self._running.values())
            self._dequeued()
            if req.cancelled:
                self._finish(req, FinishReason.CANCELLED)
                continue
            if req.adapter and not engine.has_adapter(req.adapter):
                self._finish(req, FinishReason.ERROR, "its adapter was unloaded before the request started")
                continue
            virtual = engine.virtual_tokens(req.adapter)  # a soft prompt's, before the prompt
            if virtual + len(req.prompt_ids) + req.max_tokens > self.max_len:  # the HTTP layer checks first
                self._finish(req, FinishReason.ERROR, "prompt + max_tokens exceed the %d positions of a slot" % self.max_len)
                continue
            seed = req.seed if req.seed is not None else random.getrandbits(62)
            sample = Sample.for_options(self._next_index, req.prompt_ids, req.options, sample_generator(seed, 0),
                                        slot=free[0], constraint=req.constraint)  # the request's very options
            engine.prepare_sample(sample, req.adapter)
            sample.slot = engine.choose_slot(sample, free)  # a prefix cache's: the slot its history is in
            free.remove(sample.slot)
            self._next_index += 1
            req.sample, req.text = sample, TextStream(self.tokenizer, req.stop, req.hidden_ids,
                                                      req.options.include_stop_str)
            self._running[sample.index] = req
            busy = engine.busy_seconds
            engine.admit(sample)  # prefills the prompt on the starter's layers
            self.stats.starter_busy(engine.busy_seconds - busy)
            room -= 1

    def _step(self, working: bool) -> int:
        """One engine step (idle: one that waits for nothing, where a node found failed is recovered)."""
        engine = self._live_engine()
        busy = engine.busy_seconds  # the starter's own layers, head and sampling
        advanced = engine.step(timeout=STEP_TIMEOUT if working else 0.0)  # a recovery within it calls _recovered
        if advanced:
            self.stats.starter_step(engine.busy_seconds - busy, len(advanced))
        for sample in advanced:
            if sample.done:
                req = self._running.get(sample.index)
                if req is not None:
                    self._finish(req, finish_reason_of(sample), sample.error)
                self._running.pop(sample.index, None)  # after _finish: /metrics relies on that order
        return len(advanced)

    def _recovered(self, event: RecoveryEvent) -> None:
        """The engine re-planned the ring (or tried to): the ring in hand is the event's; a
        training job's workers lost it (mdi.serving.train_job)."""
        self.nodes = list(event.nodes)
        if self.job is not None:
            self.job.on_recovery(event)

    def _train_frame(self, frame: Any) -> None:
        """A training frame back from the ring (the engine's training hook): the job's, if one runs."""
        if self.job is not None:
            self.job.on_frame(frame)

    def _on_token(self, sample: Sample, token: int) -> None:
        """Engine callback (scheduler thread): stream the new text, watch for stop strings."""
        req = self._running.get(sample.index)
        now = time.monotonic()
        times = sample.token_times
        self.stats.token(now, times[-1] - times[-2] if len(times) > 1 else None)
        if req is None or req.finished:
            return
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.first_token(now, now - req.arrived_at)
        req.completion_tokens = len(sample.token_ids)
        logprobs = sample.logprobs[-1] if sample.top_logprobs is not None else None  # this token's draw
        assert req.text is not None  # set at admission, with req.sample
        update = req.text.push(token, sample.finish_reason, logprobs)
        if update.text or update.logprobs:
            req.events.put(TextEvent(update.text, tuple(update.logprobs)))
        if update.hit_stop:
            sample.cancelled = True  # no more tokens; the slot frees when its pass returns
            self._finish(req, FinishReason.STOP)
        elif sample.done:  # a sample that failed on its own token (its grammar) says why
            self._finish(req, finish_reason_of(sample), sample.error)

    def _finish(self, req: Request, reason: FinishReason, error: Optional[str] = None) -> None:
        """Give the client its last event; the first reason given is the one that counts."""
        if req.finished:
            return
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        if req.sample is not None:
            req.completion_tokens = len(req.sample.token_ids)
        ttft = req.first_token_at - req.arrived_at if req.first_token_at is not None else None
        self.stats.request_finished(reason, len(req.prompt_ids), req.finished_at - req.arrived_at, ttft)
        if req.constraint is not None:
            self.stats.grammar_finished(req.constraint.masks, req.constraint.mask_seconds)
        req.events.put(ErrorEvent(error or "") if reason == FinishReason.ERROR else FinishEvent(reason))

    def _fail_all(self, message: str) -> None:
        for req in list(self._running.values()) + list(self._waiting):
            self._finish(req, FinishReason.ERROR, message)
        with self._lock:
            self._queued -= len(self._waiting)
        self._running, self._waiting = {}, collections.deque()

    def _ring_failed(self, cause: BaseException) -> None:
        self.error = "%s" % cause
        log.error("mdi: serve: the ring failed: %s; failing %d requests and rebuilding",
                  cause, len(self._running) + len(self._waiting))
        self.state = RingState.DOWN
        self._fail_all("the ring failed: %s" % cause)
        if self.job is not None:
            self.job.fail("the ring failed: %s" % cause)
        engine, self.engine = self.engine, None
        if engine is None:  # nothing left to abort
            return
        self._adapters = engine.kept_adapters()  # the next ring gets them all again
        try:
            engine.abort()
        except (RuntimeError, OSError) as e:  # NodeError included; the ring is broken anyway
            log.warning("mdi: serve: aborting the failed ring: %s", e)
        engine.free_cache()
        del engine  # its weights go now, before the next ring loads its own
        collect_freed_memory()

    def _shutdown(self) -> None:
        self.state = RingState.STOPPED
        self._drain_inbox(False)
        self._fail_all("the server is shutting down")
        if self.job is not None:
            self.job.fail("the server is shutting down")
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            engine.close()
        except Exception as e:
            log.warning("mdi: serve: closing the ring: %s", e)
            engine.abort()
