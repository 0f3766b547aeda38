"""The worker node: its state between runs (the weights it holds) and each run's compute loop.

Configured by the starter over HTTP (mdi.worker.app is that control plane), it then serves
the ring's data plane: a `RingEndpoint`; the compute loop pops a frame, selects that sample's
KV cache slot, runs this node's blocks and pushes the result to the next node. A worker serves
run after run without restarting; weights already loaded for the same layers are reused.
"""
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from safetensors.torch import load as safetensors_load

from mdi import __version__
from mdi.model.store import load_weights
from mdi.model.config import ModelConfig
from mdi.model.layout import expected_keys, torch_dtype
from mdi.model.source import build_chunk
from mdi.model.transformer import KVCache, ModelChunk
from mdi.ring.auth import ring_password
from mdi.ring.init_request import InitRequest, RequestError, Weights
from mdi.ring.status import NodeCache, NodeCounters, NodeMemory, StatusReply
from mdi.ring.transport import RingEndpoint, RingTimeout
from mdi.ring.wire import Frame, decode
from mdi.system.devices import resolve_compute_dtype
from mdi.system.memory import available_memory_bytes, rss_bytes, unified_memory_bytes

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT = 8.0  # seconds without any sign of the starter before a run ends


def chunk_nbytes(chunk: Optional[ModelChunk]) -> int:
    """Bytes of the weights this worker holds (the KV cache is counted apart)."""
    if chunk is None:
        return 0
    return sum(p.numel() * p.element_size() for p in chunk.parameters())


@dataclass
class LoadedWeights:
    """What the chunk in memory was built from: an /init asking for the same reuses it."""
    model: ModelConfig
    layers: List[int]
    dtype: str
    device: str  # where the chunk lives: the worker's --device, else the request's
    weights: Weights


@dataclass
class Setup:
    """One /init as this worker resolved it: the request as received plus what the worker
    derived from it (kept here, never written into the request)."""
    request: InitRequest
    compute_dtype: torch.dtype
    key: LoadedWeights


class Run:
    """One run's state on this worker: its id, data-plane endpoint and compute thread."""

    def __init__(self, request: InitRequest, chunk: ModelChunk, endpoint: RingEndpoint) -> None:
        self.request = request
        self.id = request.run_id
        self.chunk = chunk
        self.endpoint = endpoint
        self.is_last = request.data.is_last
        hb = request.heartbeat_timeout
        self.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT if hb is None else hb
        self.stopped = threading.Event()
        self.frames_done = 0
        self.compute_seconds = 0.0  # time spent in _forward: per-node step time for /metrics
        self.error = None  # type: Optional[str]
        self.thread = threading.Thread(target=self._compute_loop, name="mdi-compute", daemon=True)

    def _compute_loop(self) -> None:
        try:
            with torch.inference_mode():
                while not self.stopped.is_set():
                    try:
                        frame = self.endpoint.recv(timeout=0.1)
                    except RingTimeout:
                        continue
                    if frame.kind in ("stop", "reset"):
                        self.endpoint.send(frame)
                        if frame.kind == "stop":
                            self.endpoint.flush(timeout=5)
                            self.stopped.set()
                        continue
                    t0 = time.perf_counter()
                    out = self._forward(frame)
                    self.compute_seconds += time.perf_counter() - t0
                    self.endpoint.send(out)
                    self.frames_done += 1
        except Exception as e:  # report, never die silently
            if self.stopped.is_set():  # the run was ended under a long computation: not its failure
                log.info("compute loop ended after its run was stopped: %s", e)
            else:
                self.error = "%s: %s" % (type(e).__name__, e)
                log.exception("compute loop failed")
        finally:
            self.stopped.set()
            self.chunk.free_cache()  # a finished or failed run gives its cache memory back
            # Unbind the data port now, not at the next /init: a neighbour configured for the
            # next run must find nothing there (and retry) rather than this run's socket.
            self.endpoint.close()

    def _forward(self, frame: Frame) -> Frame:
        p = next(self.chunk.parameters())
        x = frame.tensor.to(device=p.device, dtype=self.chunk.compute_dtype or p.dtype)
        outs, row = [], 0
        for slot, start, count in zip(frame.samples, frame.start, frame.count):
            y = self.chunk.forward_blocks(x[row:row + count], slot, start)
            row += count
            # The starter needs only each sample's last position to pick the next token.
            outs.append(y[-1:] if self.is_last else y)
        return Frame(frame.kind, frame.run, frame.samples, frame.start, frame.count, torch.cat(outs))

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.endpoint.close()
        self.chunk.free_cache()


class Worker:
    def __init__(self, host: str, port: int, device: Optional[str] = None,
                 max_memory: Optional[int] = None, token: Optional[str] = None) -> None:
        self.host, self.port = host, port
        self.token = token
        self.last_contact = time.monotonic()
        self.device_override = device
        self.max_memory = max_memory
        # Held by /init, /weights and ending a run; taken once per call (the helpers named
        # _locked expect it held). /status never takes it: it must answer during a long load.
        self.lock = threading.Lock()
        self.run = None  # type: Optional[Run]
        self.pending = None  # type: Optional[Setup]  # /init waiting for pushed weights
        self.loaded = None  # type: Optional[LoadedWeights]  # what `chunk` holds
        self.chunk = None  # type: Optional[ModelChunk]
        self.runs_served = 0
        self.loading = False
        self.shutdown_requested = threading.Event()
        threading.Thread(target=self._watch_starter, name="mdi-heartbeat", daemon=True).start()

    def touch(self) -> None:
        self.last_contact = time.monotonic()

    def _watch_starter(self) -> None:
        """End a run whose starter went silent (it died or lost the network): the caches are
        freed and the worker waits for the next /init instead of serving a dead ring."""
        frames_seen = 0
        while not self.shutdown_requested.wait(0.5):
            run = self.run
            if run is None or run.stopped.is_set():
                continue
            if run.endpoint.frames_received != frames_seen:
                frames_seen = run.endpoint.frames_received
                self.touch()
            silent = time.monotonic() - self.last_contact
            if silent > run.heartbeat_timeout:
                log.warning("starter silent for %.1f s: ending run %d", silent, run.id)
                self.end_run(run)

    # --- run lifecycle ---------------------------------------------------------------
    def end_run(self, only: Optional[Run] = None) -> None:
        """End the current run (or only `only`, if it is still the current one)."""
        with self.lock:
            if only is not None and self.run is not only:
                return
            self._end_run_locked()

    def _end_run_locked(self) -> None:
        if self.run is not None:
            self.run.stop()
            self.run = None
        self.pending = None

    def init(self, request: InitRequest) -> Dict[str, Any]:
        with self.lock:
            self.loading = True
            try:
                return self._init_locked(request)
            finally:
                self.loading = False

    def _init_locked(self, request: InitRequest) -> Dict[str, Any]:
        self._end_run_locked()
        config = request.model
        first, last = request.layers
        if not 0 <= first < last <= config.n_layer:
            raise RequestError("layers [%d, %d) outside the model's %d layers" % (first, last, config.n_layer))
        dtype = torch_dtype(request.dtype)
        device = self.device_override or request.device
        asked = request.compute_dtype
        compute, note = resolve_compute_dtype(device, dtype, torch_dtype(asked) if asked else None)
        if note:
            log.warning(note)
        cache_bytes = KVCache.nbytes_for(config, last - first, request.n_slots, request.max_len, compute)
        self._check_budget(request, cache_bytes)
        setup = Setup(request, compute, LoadedWeights(config, [first, last], request.dtype, device, request.weights))
        if self.chunk is not None and self.loaded == setup.key:
            self._start_run_locked(setup)
            return {"ok": True, "need_weights": False, "cache_bytes": cache_bytes}
        self.chunk, self.loaded = None, None  # free old weights before loading new ones
        if request.weights.path is not None:
            try:
                weights = load_weights(request.weights.path, (first, last), False, False, dtype)
            except (OSError, ValueError) as e:
                raise RequestError("cannot load weights: %s" % e)
            self._load_locked(setup, weights)
            return {"ok": True, "need_weights": False, "cache_bytes": cache_bytes}
        self.pending = setup
        return {"ok": True, "need_weights": True, "cache_bytes": cache_bytes}

    def receive_weights(self, data: bytes) -> Dict[str, Any]:
        with self.lock:
            self.loading = True
            try:
                return self._receive_weights_locked(data)
            finally:
                self.loading = False

    def _receive_weights_locked(self, data: bytes) -> Dict[str, Any]:
        setup = self.pending
        if setup is None or setup.request.weights.push is None:
            raise RequestError("no /init is waiting for weights")
        announced = setup.request.weights.push
        if len(data) != announced.nbytes:
            raise RequestError("weights have %d bytes, /init announced %d" % (len(data), announced.nbytes))
        if hashlib.sha256(data).hexdigest() != announced.sha256:
            raise RequestError("weights sha256 does not match the one announced in /init")
        try:
            weights = safetensors_load(data)
        except Exception as e:
            raise RequestError("weights are not valid safetensors: %s" % e)
        self._load_locked(setup, weights)
        self.pending = None
        return {"ok": True}

    def _load_locked(self, setup: Setup, weights: Dict[str, torch.Tensor]) -> None:
        key = setup.key
        config = key.model
        first, last = key.layers
        want = set(expected_keys(config, (first, last), False, False))
        if set(weights) != want:
            missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
            raise RequestError("weights do not match layers [%d, %d): missing %s, unexpected %s"
                               % (first, last, missing[:3], extra[:3]))
        try:
            self.chunk = build_chunk(config, weights, first, last, False, False, torch_dtype(key.dtype), key.device)
        except ValueError as e:
            raise RequestError(str(e))
        self.loaded = key
        self._start_run_locked(setup)

    def _check_budget(self, request: InitRequest, cache_bytes: int) -> None:
        budget = request.cache_budget_bytes
        if budget is not None and cache_bytes > budget:
            raise RequestError("KV cache needs %d bytes, over the budget of %d" % (cache_bytes, budget))
        limit = self.max_memory
        if limit is None:
            avail = available_memory_bytes()
            limit = avail + rss_bytes() if avail is not None else None
        if limit is not None and cache_bytes > limit:
            raise RequestError("KV cache of %d bytes does not fit in %d bytes of memory" % (cache_bytes, limit))

    def _start_run_locked(self, setup: Setup) -> None:
        chunk = self.chunk
        request = setup.request
        compute = setup.compute_dtype
        chunk.compute_dtype = compute if compute != next(chunk.parameters()).dtype else None
        try:
            chunk.allocate_cache(request.n_slots, request.max_len)
        except (RuntimeError, ValueError) as e:
            raise RequestError("cannot allocate the KV cache: %s" % e)
        data = request.data
        config = chunk.config
        run_id, n_slots, max_len = request.run_id, request.n_slots, request.max_len
        password = ring_password(self.token, run_id) if self.token else None
        try:
            endpoint = RingEndpoint(
                "worker:%d" % self.port, self.host, data.bind_port,
                lambda parts: decode(parts, run=run_id, hidden=config.n_embd, n_slots=n_slots, max_len=max_len),
                password)
        except RuntimeError as e:
            chunk.free_cache()
            raise RequestError(str(e))
        endpoint.connect(data.next_host, data.next_port)
        self.run = Run(request, chunk, endpoint)
        self.touch()
        self.run.thread.start()
        self.runs_served += 1

    # --- reporting -------------------------------------------------------------------
    def status(self) -> StatusReply:
        # No lock: /status must answer while /init holds it to load weights for minutes.
        run, chunk, loaded = self.run, self.chunk, self.loaded
        if self.loading or self.pending is not None:
            state = "loading"
        elif run is not None and not run.stopped.is_set():
            state = "running"
        else:
            state = "idle"  # the counters, if any, are the last run's
        cache = chunk.cache if chunk is not None else None
        reply = StatusReply(
            state=state, version=__version__, port=self.port,
            layers=list(loaded.layers) if loaded else None,
            device=loaded.device if loaded else (self.device_override or "cpu"),
            run_id=run.id if run else None, runs_served=self.runs_served, threads=torch.get_num_threads(),
            # Peaks count CUDA allocations too: on a Jetson they live in the same RAM (mdi.system.memory).
            memory=NodeMemory(rss_bytes(), unified_memory_bytes(peak=True), available_bytes=available_memory_bytes(),
                              max_memory_bytes=self.max_memory, chunk_bytes=chunk_nbytes(chunk)),
            cache=NodeCache(cache.n_slots, cache.max_len, cache.nbytes) if cache else NodeCache(),
            error=run.error if run else None)
        if run is not None:
            ep = run.endpoint
            reply.counters = NodeCounters(frames_received=ep.frames_received, frames_done=run.frames_done,
                                          compute_seconds=round(run.compute_seconds, 6), bad_frames=ep.bad_frames,
                                          last_bad_frame=ep.last_error, **ep.traffic())
        return reply
