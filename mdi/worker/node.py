"""The worker node: its state between runs (the weights it holds) and each run's compute loop.

Configured by the starter over HTTP (mdi.worker.app is that control plane), it then serves
the ring's data plane: a `RingEndpoint`; the compute loop pops a frame, selects that sample's
KV cache slot, runs this node's blocks and pushes the result to the next node. A worker serves
run after run without restarting; weights already loaded for the same layers are reused.
"""
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mdi.model.backend_select import device_unusable
from mdi.model.layout import layout_to_json, torch_dtype
from mdi.model.files.model_dir import GGUF_FILE, MODEL_FILE
from mdi.model.threads import AUTO, choose_threads, usable_cpus
from mdi.model.prefix_store import budget_bytes as prefix_budget
from mdi.ring.auth import RequestVerifier, new_instance, ring_password
from mdi.ring.init_request import InitRequest, NodeBusy, RequestError, TooLarge
from mdi.ring.status import StatusReply, WorkerState
from mdi.ring.transport import RingEndpoint
from mdi.ring.wire import decode
from mdi.system.devices import resolve_compute_dtype
from mdi.system.memory import collect_freed_memory, memory_pool, release_freed_memory
from mdi.worker.adapter_intake import hold_adapter
from mdi.worker.chunk_loading import load_ggml_chunk, load_torch_chunk, loaded_weights_bytes, run_cache_bytes
from mdi.worker.measuring import Measuring
from mdi.worker.memory_budget import check_cache_fits, held_bytes, memory_limit, training_bytes
from mdi.worker.run import DEFAULT_HEARTBEAT_TIMEOUT, Run
from mdi.worker.status_report import status_reply
from mdi.worker.weight_intake import LoadedWeights, check_push_fits, models_dir_default, receive_push, weights_file

# torch is imported where a run computes with it (or /profile, an adapter or training asks for
# it): a worker whose layers compute with ggml never loads it (about 250 MB of resident memory).

log = logging.getLogger(__name__)

@dataclass
class Setup:
    """One /init as this worker resolved it: the request as received plus what the worker
    derived from it (kept here, never written into the request)."""
    request: InitRequest
    compute_dtype: Any  # torch's dtype to compute in (None: the layers compute with ggml)
    key: LoadedWeights
    peer: str = "?"  # the starter's address as this worker saw it (named when another run is refused)
    weights_file: Optional[str] = None  # weights.path resolved inside the models directory
    prefix_bytes: int = 0  # its prefix cache's budget (runtime.prefix_cache resolved here)
    backend_line: Optional[str] = None  # the backend it computes with, and why (auto's measurement)


class Worker(Measuring):
    def __init__(self, host: str, port: int, device: Optional[str] = None,
                 max_memory: Optional[int] = None, token: Optional[str] = None,
                 models_dir: Optional[str] = None, threads: Optional[int] = None) -> None:
        self.host, self.port = host, port
        self.token = token
        self.instance = new_instance()  # signed control requests must name it (mdi.ring.auth)
        # one for the HTTP server's header check and the app's: a nonce spent is seen by both
        self.verifier = RequestVerifier(token, self.instance) if token else None
        self.last_contact = time.monotonic()
        self.device_override = device
        self.max_memory = max_memory
        # weights.path in /init must resolve inside this directory (symlinks followed first).
        self.models_dir = os.path.realpath(models_dir or models_dir_default())
        self.threads_override = threads  # --threads: wins over the run's runtime.threads
        self.threads = threads  # what torch was last told; None: torch's default
        # Held by /init, /weights and ending a run; taken once per call (the helpers named
        # _locked expect it held). /status never takes it: it must answer during a long load.
        self.lock = threading.Lock()
        self.run: Optional[Run] = None
        self.pending: Optional[Setup] = None  # /init waiting for pushed weights
        # Runs their starter stopped before their /init came (it aborted a failed start-up while
        # the /init was on its way): that /init is refused, not held until its heartbeat lapses.
        self.stopped_runs: deque = deque(maxlen=64)
        self.loaded: Optional[LoadedWeights] = None  # what `chunk` holds
        self.chunk: Optional[Any] = None  # ModelChunk (torch) or GgmlChunk
        self.backend_line: Optional[str] = None  # what the chunk computes with, and why
        self.chosen: Optional[Tuple[List[int], str, str]] = None  # the last POST /backend: (layers, backend, why)
        self.runs_served = 0
        self.loading = False
        self.shutdown_requested = threading.Event()
        threading.Thread(target=self._watch_starter, name="mdi-heartbeat", daemon=True).start()

    def touch(self) -> None:
        self.last_contact = time.monotonic()

    def heartbeat(self, run_id: Optional[str]) -> None:
        """GET /status?run=ID: a sign of life from the starter of the run, or of the /init
        waiting for its weights, that holds this worker (a push can take minutes and the HTTP
        server may hand it over only once all of it has arrived)."""
        run, pending = self.run, self.pending
        held = [str(run.id)] if run is not None else []
        held += [str(pending.request.run_id)] if pending is not None else []
        if run_id is not None and run_id in held:
            self.touch()

    def _watch_starter(self) -> None:
        """End a run whose starter went silent (it died or lost the network): the caches are
        freed and the worker waits for the next /init instead of serving a dead ring. An /init
        whose weights never came is dropped the same way."""
        frames_seen = [0]
        while not self.shutdown_requested.wait(0.5):
            pending = self.pending
            if pending is not None:
                self._drop_if_silent(pending)
            # In a call of its own: no local of this loop keeps an ended run (and its weights)
            # alive while the next /init loads new ones.
            self._check_silence(frames_seen)

    def _check_silence(self, frames_seen: List[int]) -> None:
        run = self.run
        if run is None or run.stopped.is_set():
            return
        if run.endpoint.frames_received != frames_seen[0]:
            frames_seen[0] = run.endpoint.frames_received
            self.touch()
        silent = time.monotonic() - self.last_contact
        if silent > run.heartbeat_timeout:
            log.warning("starter silent for %.1f s: ending run %d", silent, run.id)
            self.end_run(run)

    def _drop_if_silent(self, pending: Setup) -> None:
        hb = pending.request.heartbeat_timeout
        silent = time.monotonic() - self.last_contact
        # A push in progress holds the lock (and touches the heartbeat): never dropped under it.
        if silent > (DEFAULT_HEARTBEAT_TIMEOUT if hb is None else hb) and self.lock.acquire(blocking=False):
            try:
                if self.pending is pending:
                    log.warning("starter %s silent for %.1f s: dropping run %d, whose weights never came",
                                pending.peer, silent, pending.request.run_id)
                    self.pending = None
            finally:
                self.lock.release()

    # --- run lifecycle ---------------------------------------------------------------
    def end_run(self, only: Optional[Run] = None) -> None:
        """End the current run (or only `only`, if it is still the current one)."""
        with self.lock:
            if only is not None and self.run is not only:
                return
            self._end_run_locked()

    def stop_run(self, run_id: Optional[int] = None) -> bool:
        """PUT /stop: end the current run (and any /init waiting for weights); with `run_id`,
        only if that is the run, so a starter ending its own failed run never ends another's."""
        with self.lock:
            if run_id is not None:
                current = [s.id for s in (self.run,) if s is not None]
                current += [p.request.run_id for p in (self.pending,) if p is not None]
                if run_id not in current:
                    self.stopped_runs.append(run_id)
                    return False
            self._end_run_locked()
            return True

    def _end_run_locked(self) -> None:
        if self.run is not None:
            self.run.stop()
            self.run = None
        self.pending = None

    def init(self, request: InitRequest, peer: str = "?") -> Dict[str, Any]:
        self._check_device(request.device)
        with self.lock:
            if request.run_id in self.stopped_runs:
                raise RequestError("run %d was stopped by its starter before this /init came" % request.run_id)
            self.check_holder(request.run_id, peer)
            self.loading = True
            try:
                return self._init_locked(request, peer)
            finally:
                self.loading = False

    def _check_device(self, asked: str) -> None:
        why = device_unusable(self.device_override or asked)  # by torch or by ggml
        if why is not None:
            raise RequestError(why)

    def require_weights(self) -> None:
        """RequestError where no weights are loaded: an adapter joins a node's layers (asked
        before its body is read too: bodies of hundreds of MB had been read only to be refused)."""
        if self.chunk is None:
            raise RequestError("no weights loaded: an adapter comes after /init")

    def load_adapter(self, adapter: int, body: bytes) -> Dict[str, Any]:
        """POST /adapters/<id>: a low-rank adapter's A/B matrices for this worker's layers, as
        safetensors ("<layer>.lora_A" [r, in], "<layer>.lora_B" [out, r], scale folded in).
        It joins the weights held now, run in progress or not (a sample names it per frame),
        and goes with them: new weights (another /init) start with no adapter."""
        with self.lock:
            self.require_weights()
            # the prefix cache's budget is half the spare, "so kernels and adapters keep the other half"
            prefix = self.run.prefix.stats.budget_bytes if self.run is not None and self.run.prefix is not None else 0
            return hold_adapter(self.chunk, adapter, body, self._held_bytes() + prefix,
                                *self._memory_limit(self.loaded.device if self.loaded else "cpu"))

    def drop_adapter(self, adapter: int) -> Dict[str, Any]:
        with self.lock:
            if self.chunk is not None:
                self.chunk.drop_adapter(adapter)
            release_freed_memory()  # an adapter's matrices are many small tensors: back to the OS
            return {"ok": True, "adapter": adapter}

    def check_holder(self, run_id: int, peer: str, taking_over: bool = True) -> None:
        """Refuse (409) an /init of another run while a live run, or an /init waiting for its
        weights, holds this worker; its starter's heartbeat lapsing releases it. It only reads:
        /backend asks without the lock (a starter learns at once, before it builds weights)."""
        run, pending = self.run, self.pending
        if run is not None and run.holds_worker():
            holder, by, timeout = run.id, run.peer, run.heartbeat_timeout
        elif pending is not None:
            hb = pending.request.heartbeat_timeout
            holder, by, timeout = pending.request.run_id, pending.peer, DEFAULT_HEARTBEAT_TIMEOUT if hb is None else hb
        else:
            return
        if holder == run_id:
            return  # its own starter configuring it again
        silent = time.monotonic() - self.last_contact
        if silent <= timeout:
            raise NodeBusy("busy with run %d of the starter at %s (heard from %.1f s ago); it is free once that "
                           "run ends, or after %g s without a sign of its starter" % (holder, by, silent, timeout))
        if taking_over:
            log.warning("run %d (from %s) takes over from run %d of %s, silent for %.1f s", run_id, peer, holder, by,
                        silent)

    def _init_locked(self, request: InitRequest, peer: str) -> Dict[str, Any]:
        self._end_run_locked()
        config = request.model
        first, last = request.layers
        if not 0 <= first < last <= config.n_layer:
            raise RequestError("layers [%d, %d) outside the model's %d layers" % (first, last, config.n_layer))
        device = self.device_override or request.device
        backend, line = request.backend, None
        if backend == "auto":  # a starter that did not ask POST /backend first
            choice = self._select_backend("auto", config, request.layers, request.gguf_types, device, request.threads,
                                          request.max_batch, False, request.dtype, layout_to_json(request.quant),
                                          request.quant_kernel, request.kv_type,
                                          prefill_weights=request.prefill_weights,
                                          prefill_chunk=request.prefill_chunk, repack=request.repack,
                                          compute_dtype=request.compute_dtype)
            backend, line = choice.backend, choice.describe()
            if request.weights.push is not None and backend != "torch":
                raise RequestError("backend auto chose %s here, but the push announced is torch's weights: ask POST "
                                   "/backend first, then /init with the backend it names" % backend)
        compute = None
        if backend == "torch":
            asked = request.compute_dtype
            compute, note = resolve_compute_dtype(device, torch_dtype(request.dtype), torch_dtype(asked) if asked else None)
            if note:
                log.warning(note)
        cache_bytes, token_bytes = run_cache_bytes(request, backend, compute)
        check_cache_fits(request, cache_bytes, *self._memory_limit(device))
        key = LoadedWeights(config, [first, last], request.dtype, device, request.weights,
                            layout_to_json(request.quant), request.quant_kernel, backend, request.kv_type,
                            request.repack)
        if line is None and self.chosen is not None and self.chosen[:2] == (list(request.layers), backend):
            line = self.chosen[2]  # POST /backend chose it just before
        setup = Setup(request, compute, key, peer, backend_line=line or "%s (asked)" % backend)
        if request.weights.path is not None:
            setup.weights_file = weights_file(self.models_dir, request.weights.path,
                                              GGUF_FILE if backend == "ggml" else MODEL_FILE)
        try:
            setup.prefix_bytes = prefix_budget(request.prefix_cache, self._spare_bytes(setup))
        except ValueError as e:
            raise TooLarge("runtime.prefix_cache: %s" % e)
        reply = {"ok": True, "need_weights": False, "cache_bytes": cache_bytes, "prefix_cache_bytes": setup.prefix_bytes,
                 "prefix_token_bytes": token_bytes, "memory_pool": memory_pool(), "backend": backend,
                 "backend_line": setup.backend_line}
        if self.chunk is not None and self.loaded == setup.key:
            self.backend_line = setup.backend_line  # the same weights, chosen again (and why)
            self._start_run_locked(setup)
            return reply
        if request.weights.push is not None:
            # Refused here, before a byte of the push is read (the weights held now are freed first).
            check_push_fits(request.weights.push.nbytes, cache_bytes, *self._memory_limit(device))
        self._drop_chunk_locked()  # free old weights before loading new ones
        if setup.weights_file is not None:
            if not os.path.isfile(setup.weights_file):
                raise RequestError("cannot load weights: weights file %s does not exist" % setup.weights_file)
            need = loaded_weights_bytes(setup.request, setup.key)
            limit, what = self._memory_limit(device)
            if limit is not None and need + cache_bytes > limit:
                raise TooLarge("layers [%d, %d) need %d bytes of weights plus a KV cache of %d bytes, over this "
                               "worker's limit of %d bytes (%s)" % (first, last, need, cache_bytes, limit, what))
            self._load_locked(setup, setup.weights_file, exact=False)
            return reply
        self.pending = setup
        self.touch()  # the heartbeat of an /init waiting for its weights starts now
        return dict(reply, need_weights=True)

    def _drop_chunk_locked(self) -> None:
        """Let go of the weights held now and hand their memory back to the OS at once. The
        next weights are loaded by another HTTP thread, in another glibc arena: memory freed
        but kept in this one is not reused there, and a board near its limit was OOM-killed
        loading a new split beside the last one (seen under a memory cgroup)."""
        self.chunk, self.loaded = None, None
        collect_freed_memory()

    def _memory_limit(self, device: str) -> Tuple[Optional[int], str]:
        """(bytes, what) this worker may give a run on `device` (memory_budget.memory_limit)."""
        return memory_limit(self.max_memory, device, self._held_bytes())

    def _held_bytes(self) -> int:
        """Weights, adapters, KV cache, and a training job's pairs and optimizer state."""
        return held_bytes(self.chunk) + training_bytes(self.run)

    def _spare_bytes(self, setup: Setup) -> Optional[int]:
        """What this worker's memory spares beside the weights and KV cache its run was planned
        with (room a faster kernel or the prefix cache may take), None when unknown."""
        limit, _ = self._memory_limit(setup.key.device)
        if limit is None:
            return None
        cache_bytes, _ = run_cache_bytes(setup.request, setup.key.backend, setup.compute_dtype)
        return limit - loaded_weights_bytes(setup.request, setup.key) - cache_bytes

    def receive_weights(self, stream: Any, nbytes: int) -> Dict[str, Any]:
        """POST /weights: the body read from `stream` (`nbytes` long) goes to a temporary file
        while it is hashed, then the chunk is read from that file: memory holds the weights
        once, whatever the announced size. Any failure, an aborted push included, drops the
        waiting /init: the worker is idle again."""
        with self.lock:
            self.loading = True
            try:
                return self._receive_weights_locked(stream, nbytes)
            finally:
                self.loading = False

    def _receive_weights_locked(self, stream: Any, nbytes: int) -> Dict[str, Any]:
        setup = self.pending
        if setup is None or setup.request.weights.push is None:
            raise RequestError("no /init is waiting for weights")
        try:
            receive_push(stream, nbytes, setup.request.weights.push,
                         lambda path: self._load_locked(setup, path, exact=True), self.touch,
                         ".gguf" if setup.key.backend == "ggml" else ".safetensors")
        except BaseException:
            self.pending = None  # the worker is idle again, not stuck in `loading`
            raise
        self.pending = None
        return {"ok": True}

    def _load_locked(self, setup: Setup, fn: str, exact: bool) -> None:
        key, request = setup.key, setup.request
        if key.backend == "ggml":
            threads = self.threads_override or request.threads
            self.chunk = load_ggml_chunk(key, fn, threads if isinstance(threads, int) else usable_cpus())
        else:
            self._set_threads(request)  # kernels are measured with the threads the run will use
            spare = self._spare_bytes(setup)  # less what the prefix cache may take
            self.chunk = load_torch_chunk(key, request.quant, fn, exact, request.kernel_memory,
                                          None if spare is None else spare - setup.prefix_bytes)
        self.loaded = key
        self.backend_line = setup.backend_line
        self._start_run_locked(setup)

    def _start_run_locked(self, setup: Setup) -> None:
        chunk = self.chunk
        assert chunk is not None  # both callers hold loaded weights here (a kept chunk or a fresh load)
        request = setup.request
        # A run starts with no adapter, weights kept or not: its starter sends its own (ids are
        # per run, and a kept chunk's last adapters may mean something else now; ggml frees their buffers).
        chunk.clear_adapters() if chunk.backend == "ggml" else chunk.lora.adapters.clear()
        if chunk.backend == "torch":
            compute = setup.compute_dtype
            chunk.compute_dtype = compute if compute != next(chunk.parameters()).dtype else None
            chunk.fused_decode = request.fused_decode  # per run: a kept chunk may have run the other way
        try:
            chunk.allocate_cache(request.n_slots, request.max_len, request.prefill_chunk)
        except (RuntimeError, ValueError, MemoryError) as e:  # ggml says MemoryError
            raise RequestError("cannot allocate the KV cache: %s" % e)
        data = request.data
        config = chunk.config
        run_id, n_slots, max_len = request.run_id, request.n_slots, request.max_len
        password = ring_password(self.token, run_id) if self.token else None
        try:
            endpoint = RingEndpoint(
                "worker:%d" % self.port, self.host, data.bind_port,
                lambda parts: decode(parts, run=run_id, hidden=config.n_embd, n_slots=n_slots, max_len=max_len,
                                     adapters=chunk.lora.adapters),
                password, codec=request.wire_codec)
        except RuntimeError as e:
            chunk.free_cache()
            raise RequestError(str(e))
        try:
            endpoint.connect(data.next_host, data.next_port)
            threads = self._set_threads(request, chunk)
            if chunk.backend == "ggml":  # per run, after the threads: what it measures is theirs
                chunk.set_prefill_weights(request.prefill_weights)
                self.backend_line = chunk.with_prefill_rule(setup.backend_line)
            self.run = Run(request, chunk, endpoint, setup.peer, threads, setup.prefix_bytes)
        except BaseException as e:  # no run holds them: free the data port and the cache now
            endpoint.close()
            chunk.free_cache()
            raise RequestError(str(e)) if isinstance(e, RuntimeError) else e
        self.touch()
        self.run.thread.start()
        self.runs_served += 1

    def _set_threads(self, request: Any, chunk: Optional[Any] = None) -> Optional[int]:
        """The run's runtime.threads, unless this worker was started with its own --threads.
        "auto": the count whose passes through `chunk` are fastest here (timed before the run
        starts); with no chunk to time (a /profile), what torch has now."""
        threads = self.threads_override or request.threads
        if threads == AUTO:
            if chunk is None:
                return None
            choice = choose_threads(chunk, request.max_batch)
            log.info("mdi: worker %d: threads: auto chose %s", self.port, choice.describe())
            threads = choice.threads
        if threads:
            if chunk is not None and chunk.backend == "ggml":
                chunk.set_threads(threads)
            else:
                import torch
                torch.set_num_threads(threads)
            self.threads = threads
        return threads

    # --- reporting -------------------------------------------------------------------
    def status(self) -> StatusReply:
        # No lock: /status must answer while /init holds it to load weights for minutes.
        run, chunk, loaded = self.run, self.chunk, self.loaded
        if self.loading or self.pending is not None:
            state = WorkerState.LOADING
        elif run is not None and not run.stopped.is_set():
            state = WorkerState.RUNNING
        else:
            state = WorkerState.IDLE  # the counters, if any, are the last run's
        device = loaded.device if loaded else (self.device_override or "cpu")
        return status_reply(state, self.port, self.runs_served, self.threads or _torch_threads(), run, chunk,
                            list(loaded.layers) if loaded else None, device, self.max_memory,
                            self._memory_limit(device)[0], self.backend_line)


def _torch_threads() -> int:
    """torch's thread count where it is loaded, else this machine's CPUs (what ggml would take)."""
    import sys
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else usable_cpus()
