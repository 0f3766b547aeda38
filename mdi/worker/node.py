"""mdi-worker: starts blank, is configured by the starter over HTTP, then serves the ring.

Control plane (Flask, JSON only): GET /health, GET /status, POST /init, POST /weights
(safetensors bytes when the starter pushes them), PUT /stop, POST /shutdown.
Data plane: a `RingEndpoint`; the compute loop pops a frame, selects that sample's KV cache
slot, runs this node's blocks and pushes the result to the next node. A worker serves run
after run without restarting; weights already loaded for the same layers are reused.
"""
import hashlib
import logging
import threading
import time
from typing import Any, Dict, Optional

import torch
from flask import Flask, jsonify, request
from safetensors.torch import load as safetensors_load

from mdi import __version__
from mdi.ring.auth import ring_password, token_matches
from mdi.model.checkpoints import load_weights
from mdi.model.layout import expected_keys, torch_dtype
from mdi.system.devices import resolve_compute_dtype
from mdi.model.source import build_chunk
from mdi.model.config import ModelConfig
from mdi.model.transformer import KVCache, ModelChunk
from mdi.ring.transport import RingTimeout
from mdi.system.memory import available_memory_bytes, rss_bytes, unified_memory_bytes
from mdi.ring.transport import RingEndpoint
from mdi.ring.wire import Frame, decode
from mdi.ring import init_request as schema

log = logging.getLogger("mdi.worker")

MAX_JSON_BYTES = 1 << 20
DEFAULT_HEARTBEAT_TIMEOUT = 8.0  # seconds without any sign of the starter before a run ends


def chunk_nbytes(chunk: Optional[ModelChunk]) -> int:
    """Bytes of the weights this worker holds (the KV cache is counted apart)."""
    if chunk is None:
        return 0
    return sum(p.numel() * p.element_size() for p in chunk.parameters())


class Run:
    """One run's state on this worker: its id, data-plane endpoint and compute thread."""

    def __init__(self, spec: Dict[str, Any], chunk: ModelChunk, endpoint: RingEndpoint) -> None:
        self.spec = spec
        self.id = spec["run_id"]
        self.chunk = chunk
        self.endpoint = endpoint
        self.is_last = spec["data"]["is_last"]
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
        self.lock = threading.RLock()
        self.run = None  # type: Optional[Run]
        self.pending = None  # type: Optional[Dict[str, Any]]  # /init waiting for pushed weights
        self.loaded = None  # type: Optional[Dict[str, Any]]  # key of the weights in `chunk`
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
            if silent > run.spec.get("heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT):
                log.warning("starter silent for %.1f s: ending run %d", silent, run.id)
                self.end_run(run)

    # --- run lifecycle ---------------------------------------------------------------
    def end_run(self, only: Optional[Run] = None) -> None:
        """End the current run (or only `only`, if it is still the current one)."""
        with self.lock:
            if only is not None and self.run is not only:
                return
            if self.run is not None:
                self.run.stop()
                self.run = None
            self.pending = None

    def init(self, spec: Dict[str, Any]) -> Dict[str, Any]:
        with self.lock:
            self.loading = True
            try:
                return self._init(spec)
            finally:
                self.loading = False

    def _init(self, spec: Dict[str, Any]) -> Dict[str, Any]:
        with self.lock:
            self.end_run()
            config = ModelConfig.from_dict(spec["model"])
            first, last = spec["layers"]
            if not 0 <= first < last <= config.n_layer:
                raise schema.RequestError("layers [%d, %d) outside the model's %d layers" % (first, last, config.n_layer))
            dtype = torch_dtype(spec["dtype"])
            device = self.device_override or spec["device"]
            asked = spec.get("compute_dtype")
            compute, note = resolve_compute_dtype(device, dtype, torch_dtype(asked) if asked else None)
            if note:
                log.warning(note)
            spec = dict(spec, _compute_dtype=compute)
            cache_bytes = KVCache.nbytes_for(config, last - first, spec["n_slots"], spec["max_len"], compute)
            self._check_budget(spec, cache_bytes)
            key = {"model": spec["model"], "layers": [first, last], "dtype": spec["dtype"], "device": device,
                   "weights": spec["weights"]}
            if self.chunk is not None and self.loaded == key:
                self._start_run(spec)
                return {"ok": True, "need_weights": False, "cache_bytes": cache_bytes}
            self.chunk, self.loaded = None, None  # free old weights before loading new ones
            if "path" in spec["weights"]:
                try:
                    weights = load_weights(spec["weights"]["path"], (first, last), False, False, dtype)
                except (OSError, ValueError) as e:
                    raise schema.RequestError("cannot load weights: %s" % e)
                self._load(spec, weights, key)
                return {"ok": True, "need_weights": False, "cache_bytes": cache_bytes}
            self.pending = dict(spec, _key=key)
            return {"ok": True, "need_weights": True, "cache_bytes": cache_bytes}

    def receive_weights(self, data: bytes) -> Dict[str, Any]:
        with self.lock:
            self.loading = True
            try:
                return self._receive_weights(data)
            finally:
                self.loading = False

    def _receive_weights(self, data: bytes) -> Dict[str, Any]:
        with self.lock:
            spec = self.pending
            if spec is None:
                raise schema.RequestError("no /init is waiting for weights")
            announced = spec["weights"]["push"]
            if len(data) != announced["nbytes"]:
                raise schema.RequestError("weights have %d bytes, /init announced %d" % (len(data), announced["nbytes"]))
            if hashlib.sha256(data).hexdigest() != announced["sha256"]:
                raise schema.RequestError("weights sha256 does not match the one announced in /init")
            try:
                weights = safetensors_load(data)
            except Exception as e:
                raise schema.RequestError("weights are not valid safetensors: %s" % e)
            self._load(spec, weights, spec["_key"])
            self.pending = None
            return {"ok": True}

    def _load(self, spec: Dict[str, Any], weights: Dict[str, torch.Tensor], key: Dict[str, Any]) -> None:
        config = ModelConfig.from_dict(spec["model"])
        first, last = spec["layers"]
        want = set(expected_keys(config, (first, last), False, False))
        if set(weights) != want:
            missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
            raise schema.RequestError("weights do not match layers [%d, %d): missing %s, unexpected %s"
                                      % (first, last, missing[:3], extra[:3]))
        try:
            self.chunk = build_chunk(config, weights, first, last, False, False,
                                     torch_dtype(spec["dtype"]), key["device"])
        except ValueError as e:
            raise schema.RequestError(str(e))
        self.loaded = key
        self._start_run(spec)

    def _check_budget(self, spec: Dict[str, Any], cache_bytes: int) -> None:
        budget = spec.get("cache_budget_bytes")
        if budget is not None and cache_bytes > budget:
            raise schema.RequestError("KV cache needs %d bytes, over the budget of %d" % (cache_bytes, budget))
        limit = self.max_memory
        if limit is None:
            avail = available_memory_bytes()
            limit = avail + rss_bytes() if avail is not None else None
        if limit is not None and cache_bytes > limit:
            raise schema.RequestError("KV cache of %d bytes does not fit in %d bytes of memory" % (cache_bytes, limit))

    def _start_run(self, spec: Dict[str, Any]) -> None:
        chunk = self.chunk
        compute = spec["_compute_dtype"]
        chunk.compute_dtype = compute if compute != next(chunk.parameters()).dtype else None
        try:
            chunk.allocate_cache(spec["n_slots"], spec["max_len"])
        except (RuntimeError, ValueError) as e:
            raise schema.RequestError("cannot allocate the KV cache: %s" % e)
        data = spec["data"]
        config = chunk.config
        run_id, n_slots, max_len = spec["run_id"], spec["n_slots"], spec["max_len"]
        password = ring_password(self.token, run_id) if self.token else None
        try:
            endpoint = RingEndpoint(
                "worker:%d" % self.port, self.host, data["bind_port"],
                lambda parts: decode(parts, run=run_id, hidden=config.n_embd, n_slots=n_slots, max_len=max_len),
                password)
        except RuntimeError as e:
            chunk.free_cache()
            raise schema.RequestError(str(e))
        endpoint.connect(data["next_host"], data["next_port"])
        self.run = Run(spec, chunk, endpoint)
        self.touch()
        self.run.thread.start()
        self.runs_served += 1

    # --- reporting -------------------------------------------------------------------
    def status(self) -> Dict[str, Any]:
        # No lock: /status must answer while /init holds it to load weights for minutes.
        run, chunk, loaded = self.run, self.chunk, self.loaded
        if self.loading or self.pending is not None:
            state = "loading"
        elif run is not None:
            state = "stopped" if run.stopped.is_set() else "running"
        else:
            state = "idle"
        cache = chunk.cache if chunk is not None else None
        out = {
            "state": state, "version": __version__, "port": self.port,
            "layers": loaded["layers"] if loaded else None,
            "device": loaded["device"] if loaded else (self.device_override or "cpu"),
            "run_id": run.id if run else None, "runs_served": self.runs_served,
            # Peaks count CUDA allocations too: on a Jetson they live in the same RAM (mdi.tegra).
            "memory": {"rss_bytes": rss_bytes(), "peak_rss_bytes": unified_memory_bytes(peak=True),
                       "available_bytes": available_memory_bytes(), "max_memory_bytes": self.max_memory,
                       "chunk_bytes": chunk_nbytes(chunk)},
            "cache": {"slots": cache.n_slots if cache else 0, "max_len": cache.max_len if cache else 0,
                      "bytes": cache.nbytes if cache else 0},
            "counters": {}, "error": run.error if run else None,
        }
        if run is not None:
            ep = run.endpoint
            out["counters"] = dict(ep.traffic(), frames_received=ep.frames_received,
                                   frames_done=run.frames_done, compute_seconds=round(run.compute_seconds, 6),
                                   bad_frames=ep.bad_frames,
                                   last_bad_frame=ep.last_error)
        return out


def create_app(worker: Worker) -> Flask:
    app = Flask("mdi-worker")
    app.config["MAX_CONTENT_LENGTH"] = None  # checked per route below

    def body_json() -> Dict[str, Any]:
        if request.content_length is None or request.content_length > MAX_JSON_BYTES:
            raise schema.RequestError("JSON body missing or larger than %d bytes" % MAX_JSON_BYTES)
        if not request.is_json:
            raise schema.RequestError("expected Content-Type: application/json")
        data = request.get_json(silent=True)
        if data is None:
            raise schema.RequestError("body is not valid JSON")
        return data

    @app.before_request
    def authenticate():
        if not token_matches(worker.token, request.headers.get("Authorization")):
            return jsonify({"ok": False, "error": "missing or wrong token"}), 401
        return None

    @app.errorhandler(schema.RequestError)
    def bad_request(e):
        return jsonify({"ok": False, "error": str(e)}), 400

    @app.errorhandler(Exception)
    def failed(e):
        # Answer every failure in JSON with its reason; HTTP errors keep their own status.
        code = getattr(e, "code", None)
        if isinstance(code, int):
            return jsonify({"ok": False, "error": "%s" % getattr(e, "description", e)}), code
        log.exception("request failed")
        return jsonify({"ok": False, "error": "%s: %s" % (type(e).__name__, e)}), 500

    @app.route("/health", methods=["GET"])
    def health():
        return jsonify({"ok": True, "version": __version__})

    @app.route("/status", methods=["GET"])
    def status():
        # The starter's watchdog names its run: that poll is the heartbeat keeping the run alive.
        run = worker.run
        if run is not None and request.args.get("run") == str(run.id):
            worker.touch()
        return jsonify(worker.status())

    @app.route("/init", methods=["POST"])
    def init():
        spec = schema.validate_init(body_json())
        return jsonify(worker.init(spec))

    @app.route("/weights", methods=["POST"])
    def weights():
        pending = worker.pending
        if pending is None:
            raise schema.RequestError("no /init is waiting for weights")
        n = pending["weights"]["push"]["nbytes"]
        if request.content_length != n:
            raise schema.RequestError("Content-Length %s does not match the %d bytes announced" % (request.content_length, n))
        return jsonify(worker.receive_weights(request.get_data(cache=False)))

    @app.route("/stop", methods=["PUT"])
    def stop():
        worker.end_run()
        return jsonify({"ok": True})

    @app.route("/shutdown", methods=["POST"])
    def shutdown():
        worker.end_run()
        worker.shutdown_requested.set()
        return jsonify({"ok": True})

    return app
