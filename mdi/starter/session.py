"""The starter's view of the ring: configure every worker over HTTP, connect the data plane,
and at the end send the stop frame round and collect each node's counters."""
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from mdi.model.files.gguf_write import remove_quietly
from mdi.model.prefix_store import NodePrefixRoom
from mdi.model.source import ModelSource
from mdi.ring.adapter_request import AdapterTooLarge, adapter_body
from mdi.ring.auth import ring_password
from mdi.ring.backend_request import BackendRequest
from mdi.ring.init_request import DataPlane, InitRequest, PushedWeights, Weights
from mdi.ring.status import NodeCounters
from mdi.ring.transport import RingEndpoint, RingTimeout
from mdi.ring.wire import GENERATION_KINDS, Frame, FrameKind, decode
from mdi.starter.control import ControlClient, NodeError, NodeRegistry, NodeTimeout, NodeUnreachable, silenced
from mdi.starter.node_report import NodeReport, worker_report
from mdi.starter.planning.run_plan import RunPlan, backend_request
from mdi.starter.unread_settings import warn_unread_settings
from mdi.system.files import sha256_file
from mdi.system.parallel import run_all

log = logging.getLogger(__name__)

STATUS_TIMEOUT_MIN_S = 5.0  # a /status poll's least wait: a loaded board answers late, and two late answers end its run
STOP_TIMEOUT_S = 5.0  # an aborting start-up's stop to each worker (its heartbeat timeout ends the run otherwise)


def status_timeout(heartbeat_interval: float) -> float:
    """How long one /status poll waits: two heartbeat intervals, and never less than
    STATUS_TIMEOUT_MIN_S, so that a busy board is not taken for a hung one."""
    return max(STATUS_TIMEOUT_MIN_S, 2 * heartbeat_interval)


class RingSession:
    """One ring: the plan's nodes in ring order (the starter first) with their layers."""

    def __init__(self, plan: RunPlan, source: ModelSource, run_id: int, adapters: Any,
                 registry: NodeRegistry, host_arrays: bool = False) -> None:
        self.plan, self.cfg, self.source = plan, plan.cfg, source
        # the starter's chunk takes numpy rows (ggml's): its generation passes come back as numpy
        self.host_kinds = GENERATION_KINDS if host_arrays else ()
        self.nodes = plan.specs
        self.registry = registry  # the engine's: it closes it
        self.adapters = adapters  # mdi.starter.adapter_set.AdapterSet or None
        self.run_id = run_id
        self.workers = self.nodes[1:]
        self.clients = [self.registry.client(n) for n in self.workers]
        self.endpoint: Optional[RingEndpoint] = None
        self.init_replies: List[Dict] = [{} for _ in self.workers]
        self.backend_lines: List[Optional[str]] = [None for _ in self.workers]  # each worker's backend and why
        self.backends: List[Optional[str]] = [None for _ in self.workers]  # "ggml" or "torch" once chosen
        self.failure: Optional[NodeError] = None
        self._stopping = False  # finish() sent the stop frame
        self._answered: Dict[str, float] = {}  # node name -> when it last said it runs this run
        self._unanswered: Dict[str, float] = {}  # node name -> when a poll of it last went unanswered
        self._counters: Dict[str, NodeCounters] = {}  # node name -> its counters at the last poll
        self._watching = threading.Event()
        self._aborted = threading.Event()  # set before abort's stops: a configure still running stops its own worker
        self._configuring = threading.Condition()  # counts the configure calls in flight (abort waits for them)
        self._in_flight = 0
        self._watcher: Optional[threading.Thread] = None

    def _backend_request(self, i: int) -> BackendRequest:
        asked = backend_request(self.plan, self.source, self.plan.workers[i], bool(self.adapters))
        return dataclasses.replace(asked, run_id=self.run_id)  # another run's worker: a 409 before weights are built

    def _init_spec(self, i: int, weights: Weights, backend: str = "torch") -> InitRequest:
        node = self.workers[i]
        nxt = self.nodes[(i + 2) % len(self.nodes)]
        first, last = self.plan.workers[i].layers
        return InitRequest(
            # what it keeps quantized (pushed weights come that way)
            quant=self.plan.workers[i].quant, quant_kernel=self.cfg.runtime.quant_kernel,
            run_id=self.run_id, model=self.source.config, layers=list(self.plan.workers[i].layers),
            dtype=self.cfg.model.dtype, device=self.cfg.device_of(node),
            compute_dtype=self.cfg.model.compute_dtype,
            n_slots=self.plan.n_slots, max_len=self.plan.max_len,
            heartbeat_timeout=self.cfg.runtime.heartbeat_timeout,
            threads=self.cfg.runtime.threads or None,  # runtime.threads reaches every worker
            data=DataPlane(bind_port=node.ring_port, next_host=nxt.host, next_port=nxt.ring_port,
                           is_last=i == len(self.workers) - 1),
            weights=weights, max_batch=self.plan.max_batch, max_rows=self.plan.max_rows,
            wire_codec=self.cfg.runtime.wire_codec, fused_decode=self.cfg.runtime.fused_decode,
            prefix_cache=self.cfg.runtime.prefix_cache or None, kernel_memory=self.cfg.runtime.kernel_memory or None,
            backend=backend, kv_type=self.cfg.runtime.kv_type,
            gguf_types=self.source.gguf_types(first, last, False, False) if backend == "ggml" else {},
            repack=self.cfg.runtime.repack, prefill_weights=self.cfg.prefill_weights_of(node))

    def _configure(self, i: int) -> None:
        client, node = self.clients[i], self.workers[i]
        with self._configuring:
            if self._aborted.is_set():  # the start-up failed before this one began
                return
            self._in_flight += 1
        try:
            client.health()
            first, last = self.plan.workers[i].layers
            asked = self._backend_request(i)
            if asked.asked == "auto":  # the first time on a machine it measures (seconds): say so
                log.info("mdi: %s: choosing its backend (auto: measured once per machine, then recalled)", node.name)
            chosen = client.backend(asked)
            self.backend_lines[i] = chosen.line
            self.backends[i] = chosen.backend
            log.log(logging.INFO if asked.asked == "auto" else logging.DEBUG, "mdi: %s: backend %s", node.name,
                    chosen.line)
            warn_unread_settings(self.cfg, node, chosen.backend)
            if node.weights:
                self.init_replies[i] = client.init(self._init_spec(i, Weights(path=node.weights), chosen.backend))
            elif chosen.backend == "ggml":
                # its GGUF of its tensors, written to a file and streamed from it: the starter's
                # memory holds none of a worker's layers (a 7B model's would not fit beside its own)
                path = self.source.gguf_chunk_file(first, last)
                try:
                    def send() -> None:
                        with open(path, "rb") as f:
                            client.push_weights(f)
                    self._init_pushed(i, chosen.backend, os.path.getsize(path), sha256_file(path), send)
                finally:
                    remove_quietly(path)
            else:
                blob = self.source.chunk_bytes(first, last, self.plan.dtype, self.plan.workers[i].quant)
                self._init_pushed(i, chosen.backend, len(blob), hashlib.sha256(blob).hexdigest(),
                                  lambda: client.push_weights(blob))
            # Each adapter's matrices for this worker's layers only (new weights start with none).
            for adapter, body in self.adapters.bodies(first, last) if self.adapters else []:
                client.post_adapter(adapter, body)
        except NodeError:
            raise
        except Exception as e:  # reported by the caller, naming the node
            raise NodeError("node %s (%s): configuring failed: %s" % (node.name, node.address, e), node.name) from e
        finally:
            # Another node failed the start-up while this /init was on its way: abort's stop may
            # have reached this worker first, and the run would hold it until its heartbeat lapsed.
            if self._aborted.is_set():
                self._stop_quietly(client)
            with self._configuring:
                self._in_flight -= 1
                self._configuring.notify_all()

    def _init_pushed(self, i: int, backend: str, nbytes: int, sha256: str, send: Callable[[], Any]) -> None:
        """/init announcing pushed weights of `nbytes` and `sha256`; `send` pushes them when the
        worker asks (it may hold them from an earlier run)."""
        pushed = PushedWeights(nbytes=nbytes, sha256=sha256)
        self.init_replies[i] = self.clients[i].init(self._init_spec(i, Weights(push=pushed), backend))
        if self.init_replies[i].get("need_weights"):
            send()

    def prefix_rooms(self) -> List[NodePrefixRoom]:
        """What each worker gives the prefix cache, as its /init reply says (a budget of 0 from
        a worker that keeps none, or predates it)."""
        out = []
        for node, reply in zip(self.workers, self.init_replies):
            budget, per, pool = (reply.get("prefix_cache_bytes", 0), reply.get("prefix_token_bytes", 0),
                                 reply.get("memory_pool"))
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (budget, per)):
                raise NodeError("node %s (%s): its /init reply's prefix_cache_bytes and prefix_token_bytes are not "
                                "byte counts" % (node.name, node.address), node.name)
            if pool is not None and not (isinstance(pool, str) and 0 < len(pool) <= 64):
                raise NodeError("node %s (%s): its /init reply's memory_pool is not a name of 1-64 characters"
                                % (node.name, node.address), node.name)
            out.append(NodePrefixRoom(budget, per, pool))
        return out

    def send_adapter(self, adapter: int, adapters: Any) -> None:
        """One adapter, loaded while the ring runs, to every worker: its layers' matrices, or
        none where it leaves them alone (the id must still be known there)."""
        # Every body checked before any worker takes one, and made again to send: one body held at
        # a time (up to 256 MB each), not one per worker.
        for node in self.plan.workers:
            try:
                adapter_body(adapters.one_for_layers(adapter, *node.layers))
            except AdapterTooLarge as e:
                raise NodeError("node %s: adapter %d: %s" % (node.name, adapter, e), node.name, 413) from None
        for client, node in zip(self.clients, self.plan.workers):
            client.post_adapter(adapter, adapter_body(adapters.one_for_layers(adapter, *node.layers)))

    def drop_adapter(self, adapter: int) -> None:
        for client in self.clients:
            client.drop_adapter(adapter)

    @property
    def _started_endpoint(self) -> RingEndpoint:
        """The starter's data-plane endpoint, which start() opens."""
        if self.endpoint is None:
            raise RuntimeError("the ring is not started")
        return self.endpoint

    def start(self) -> RingEndpoint:
        """Configure all workers in parallel, then open the starter's data-plane endpoint."""
        starter = self.nodes[0]
        config = self.source.config
        token = self.cfg.runtime.token
        self.endpoint = RingEndpoint(
            "starter", starter.host, starter.ring_port,
            lambda parts: decode(parts, run=self.run_id, hidden=config.n_embd,
                                 n_slots=self.plan.n_slots, max_len=self.plan.max_len, host_kinds=self.host_kinds),
            ring_password(token, self.run_id) if token else None, codec=self.cfg.runtime.wire_codec)
        try:
            configured, left = threading.Event(), [len(self.clients)]
            if not self.clients:
                configured.set()

            def configure(i: int) -> None:
                try:
                    self._configure(i)
                finally:
                    with self._configuring:
                        left[0] -= 1
                        if not left[0]:
                            configured.set()
            try:  # a node that fails or goes silent ends the start-up at once (abort below), not at the end
                run_all([functools.partial(configure, i) for i in range(len(self.clients))]
                        + [functools.partial(self._keepalive, configured)], "mdi-configure")
            finally:
                configured.set()
            first = self.workers[0]
            self.endpoint.connect(first.host, first.ring_port)
            self._watching.set()
            self._watcher = threading.Thread(target=self._watch, name="mdi-watchdog", daemon=True)
            self._watcher.start()
            self._await_ring()
        except BaseException:
            self.abort()  # the workers' runs end and our data port is free for the next ring
            raise
        return self.endpoint

    def _keepalive(self, configured: threading.Event) -> None:
        """While the workers load or receive their weights (minutes on a board), poll each one's
        /status naming this run, a thread each: the heartbeat keeping its /init alive (it cannot see
        a push arrive; another starter may take over a silent starter's worker). A node is named as
        _watch names it: one stalled in its /init had held the start-up for all of init_timeout."""
        clients = [self.registry.fresh(n) for n in self.workers]  # not shared with the pushing threads
        try:
            run_all([functools.partial(self._keep_alive, client, configured) for client in clients], "mdi-keepalive")
        except NodeError as e:
            self.failure = e  # the first found (each thread may find one)
            raise

    def _keep_alive(self, client: ControlClient, configured: threading.Event) -> None:
        interval, misses = self.cfg.runtime.heartbeat_interval, 0
        with contextlib.closing(client):  # here: the first failure ends run_all's wait while others poll
            while not configured.wait(interval):
                try:
                    client.status(timeout=status_timeout(interval), run_id=self.run_id)
                    misses = 0
                except NodeError as e:
                    misses += 1
                    if (misses >= 2 or isinstance(e, NodeUnreachable)) and not configured.is_set():
                        raise silenced(e)

    def _await_ring(self) -> None:
        """Send a reset frame round until one comes back, before any sample enters the ring.

        Workers are configured in parallel, so a node may connect to its neighbour's port
        while the previous run's socket is still bound there (or through a proxy that still
        holds a dead connection), and what it sends on that link is lost. Frames of another
        run are dropped at every node, so once a probe of this run has come back, every link
        is between this run's sockets. Extra probes that come back later are ignored."""
        ep = self._started_endpoint
        timeout = self.cfg.runtime.ring_timeout
        deadline = time.monotonic() + timeout
        wait = 0.2
        while True:
            ep.send(Frame(FrameKind.RESET, self.run_id))
            until = min(deadline, time.monotonic() + wait)
            while time.monotonic() < until:
                self.check()  # a node the watchdog found dead ends this at once, named
                try:
                    if ep.recv(max(0.0, min(0.05, until - time.monotonic()))).kind == FrameKind.RESET:
                        return
                except RingTimeout:
                    pass
            if time.monotonic() >= deadline:
                ring = " -> ".join("%s (data %s:%d)" % (n.name, n.host, n.ring_port) for n in self.nodes)
                raise NodeError("no probe came back round the ring %s -> %s within %.0f s: a node cannot "
                                "reach its next neighbour's data port" % (ring, self.nodes[0].name, timeout))
            wait = min(2 * wait, 2.0)

    # --- failure detection -----------------------------------------------------------
    def _watch(self) -> None:
        """Poll every worker's /status: a dead, hung or failed node is named within seconds
        (this polling is also the heartbeat that tells workers the starter is alive). Each node
        from a thread of its own: polled in turn, two frozen boards (5 s a poll each) had held
        the healthy ones' heartbeat past their timeout, and they ended the run."""
        try:
            run_all([functools.partial(self._watch_node, client) for client in self.clients], "mdi-watch")
        except Exception as e:  # the first found; the other pollers end at their next turn
            self.failure = e if isinstance(e, NodeError) else NodeError("the starter's watchdog failed: %r" % e)

    def _watch_node(self, client: ControlClient) -> None:
        misses = 0
        while self._watching.is_set() and self.failure is None:
            problem = self._probe(client)
            misses = misses + 1 if problem is not None else 0
            # An unreachable node is certain; anything else (a timeout above all) gets one more chance.
            if problem is not None and (misses >= 2 or isinstance(problem, NodeUnreachable)):
                raise silenced(problem)
            time.sleep(self.cfg.runtime.heartbeat_interval)

    def _probe(self, client: ControlClient) -> Optional[NodeError]:
        where = "node %s (%s)" % (client.node.name, client.node.address)
        try:
            status = client.status(timeout=status_timeout(self.cfg.runtime.heartbeat_interval),
                                   run_id=self.run_id)
        except NodeError as e:
            if isinstance(e, (NodeTimeout, NodeUnreachable)):  # (an HTTP error is an answer)
                self._unanswered[client.node.name] = time.monotonic()
            return e
        if not self._watching.is_set():
            return None
        if status.error:
            return NodeError("%s: compute failed: %s" % (where, status.error), client.node.name)
        self._counters[client.node.name] = status.counters
        now = time.monotonic()
        if status.run_id == self.run_id and status.state == "running":
            self._answered[client.node.name] = now
        elif not self._stopping:
            # The workers time our polls: a starter paused (SIGSTOP, a stalled VM) or starved past
            # their heartbeat timeout was itself the silent one.
            answered = self._answered.get(client.node.name, now)
            silent, timeout = now - answered, self.cfg.runtime.heartbeat_timeout
            if silent > timeout and self._unanswered.get(client.node.name, 0.0) > answered:
                # polled all along, but it did not answer: it was the one stopped (frozen, starved)
                why = ("it answered no poll for %.0f s (frozen or starved?) and, past runtime.heartbeat_timeout "
                       "%.0f s, ended the run" % (silent, timeout))
            elif silent > timeout:
                why = ("this starter did not poll it for %.0f s, past runtime.heartbeat_timeout %.0f s (was the "
                       "starter paused or starved?), so it ended the run" % (silent, timeout))
            else:
                why = "restarted, or its heartbeat timeout passed?"
            return NodeError("%s: is no longer serving this run (%s)" % (where, why), client.node.name)
        return None

    def check(self) -> None:
        """Raise the first failure the watchdog found; called while waiting for frames."""
        if self.failure is not None:
            raise self.failure

    def named_failure(self, silent: BaseException) -> BaseException:
        """The ring went `silent`: the node the watchdog found, or one found dead or failed now
        (each asked once, on a client of its own), else `silent`. On a loaded machine the ring's
        timeout had come before the watchdog's next poll, and the failure named no node."""
        flooded = []
        for node in self.workers:
            if self.failure is not None:
                return self.failure
            before = self._counters.get(node.name)
            client = self.registry.fresh(node)
            try:
                problem = self._probe(client)
            finally:
                client.close()
            if self.failure is not None:  # the watchdog's verdict, reached while this probe waited
                return self.failure
            if problem is not None:
                # unanswered while the ring is silent too: lost, and recovery asks it nothing more
                # (a node frozen through both that woke for recovery's health check was kept and
                # then refused the new run, busy with the old one, while a spare stood free: h63)
                return silenced(problem)
            after = self._counters.get(node.name)
            if before is not None and after is not None and after.bad_frames > before.bad_frames:
                flooded.append("node %s (%s) dropped %d frames it could not read since its last poll (the last: %s)"
                               % (node.name, node.address, after.bad_frames - before.bad_frames, after.last_bad_frame))
        if self.failure is not None or not isinstance(silent, RingTimeout):
            return self.failure or silent
        # Alive and answering, but reading garbage between its frames (the ring may be slowed by
        # another process sending to that data port, or by a stale peer); else still in one pass.
        said = flooded or self._stuck()
        return RingTimeout("%s; %s" % (silent, "; ".join(said))) if said else silent

    def _stuck(self) -> List[str]:
        """The nodes whose last poll showed one pass computing for over half the ring's timeout."""
        out = []
        for node in self.workers:
            counters = self._counters.get(node.name)
            if counters is not None and counters.pass_seconds > self.cfg.runtime.ring_timeout / 2:
                out.append("node %s (%s) is still computing a pass it began %.0f s ago (short of memory or CPU?)"
                           % (node.name, node.address, counters.pass_seconds))
        return out

    def finish(self) -> List[NodeReport]:
        """Send the stop frame round the ring, wait for it, and gather each worker's counters.
        A node the watchdog finds dead or silent, before or meanwhile, is raised at once: the
        frame could never come back (a serving ring whose workers had died waited 30 s)."""
        self.check()
        self._stopping = True  # a worker that ended the run on the stop frame is not a failure
        ep = self._started_endpoint
        ep.send(Frame(FrameKind.STOP, self.run_id))
        deadline = time.monotonic() + self.cfg.runtime.ring_timeout
        try:
            while True:
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NodeError("the stop frame did not come back round the ring within %.0f s"
                                    % self.cfg.runtime.ring_timeout)
                try:
                    if ep.recv(min(0.25, left)).kind == FrameKind.STOP:
                        break
                except RingTimeout:
                    pass
        finally:
            self._watching.clear()
        reports = [worker_report(node.name, node.layers, client.status(), reply.get("cache_bytes", 0))
                   for node, client, reply in zip(self.plan.workers, self.clients, self.init_replies)]
        ep.close()
        return reports

    def _stop_quietly(self, client: ControlClient) -> None:
        try:
            client.stop(self.run_id, timeout=STOP_TIMEOUT_S)
        except NodeError:
            pass  # a worker that does not hear it ends the run when our heartbeat stops

    def abort(self) -> None:
        """Best effort: end the run on every worker and close our endpoint. Only this run: a
        worker that refused it (409, busy with another starter's run) keeps that run. Once:
        a failed start-up aborts, then its caller again (each stop and wait had run twice)."""
        self._watching.clear()
        with self._configuring:
            if self._aborted.is_set():
                return
            self._aborted.set()
        # at once, each bounded: a hung node must not hold the others' stop (or our exit); a node
        # found silent is told nothing (its heartbeat timeout ends its run)
        lost = self.failure.node if self.failure is not None and self.failure.silent else None
        run_all([functools.partial(self._stop_quietly, c) for c in self.clients if c.node.name != lost], "mdi-abort")
        with self._configuring:  # those still configuring stop their own worker as they end (bounded)
            self._configuring.wait_for(lambda: self._in_flight == 0, timeout=STOP_TIMEOUT_S)
        if self.endpoint is not None:
            self.endpoint.close()
