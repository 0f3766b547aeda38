"""`mdi-start --serve`'s process: open the ring, serve the routes (`api`) until SIGINT/SIGTERM,
then close the ring and the HTTP server."""
import logging
import os
import signal
import time
from typing import Dict, List, Optional

from mdi.model.quantization.kernel_report import summary
from mdi.model.source import ModelSource
from mdi.ring.auth import token_matches
from mdi.runconfig import ConfigError, RunConfig
from mdi.serving.api import MAX_BODY_BYTES, create_app
from mdi.serving.prompts import ChatTemplate
from mdi.serving.scheduler import Scheduler
from mdi.serving.validation import ApiError
from mdi.system.http_server import Admit
from mdi.system.interrupt import Interrupted
from mdi.system.loopback import is_loopback

log = logging.getLogger(__name__)

# The error codes of the refusals the HTTP server answers before the app (waitress's 400 and
# 413 have none)
REFUSAL_CODES = {401: "invalid_api_key", 403: "forbidden_host"}


def default_model_id(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    return os.path.splitext(name)[0] if name.endswith((".gguf", ".pt")) else name


def admit_bearer(token: Optional[str]) -> Optional[Admit]:
    """With a shared secret, the bearer token checked from the headers alone, before a byte of
    the body is read (HttpServer's `admit`, as the worker does it): a client without the token
    makes the server store nothing (it had read up to 16 MiB per request, to a temporary file,
    before the route answered 401) and its connection is closed. The routes that need no token
    (the dashboard's page) take no body; Flask still checks every request (`dashboard`)."""
    if token is None:
        return None

    def admit(method: str, path: str, headers: Dict[str, str]) -> Optional[str]:
        return None if token_matches(token, headers.get("AUTHORIZATION")) else "missing or wrong bearer token"
    return admit


def serve(cfg: RunConfig, host: Optional[str] = None, port: Optional[int] = None, insecure: bool = False) -> int:
    """Open the ring, then serve until SIGINT/SIGTERM. Raises ConfigError (bad settings) or
    RuntimeError (the ring cannot be opened); returns the exit code otherwise."""
    host = host or cfg.serve.host
    port = port if port is not None else (cfg.serve.port or cfg.starter.port)
    if cfg.runtime.token is None and not insecure and not is_loopback(host):
        raise ConfigError("refusing to serve on %s without a shared secret: set MDI_TOKEN or runtime.token_file "
                          "(or pass --insecure on a trusted network)" % host)
    return _serve(cfg, host, port)


def _serve(cfg: RunConfig, host: str, port: int) -> int:
    from mdi.system.http_server import HttpServer
    if cfg.generation.context_shift:  # (read and ignored without a word)
        log.warning("mdi: generation.context_shift is for batch runs: a served request's max_tokens is held to what "
                    "its slot has left after the prompt, so its window never rolls")
    source = ModelSource(cfg.model.path)
    sched = Scheduler(cfg, source)
    model_id = cfg.serve.model_name or default_model_id(cfg.model.path)
    template = ChatTemplate.of_config(sched.tokenizer, cfg.serve.chat_template)  # a bad file: refused before the ring
    app = create_app(sched, model_id, cfg.runtime.token, template)
    # A request holds a thread while it waits for a slot and while it streams: enough for
    # every slot and every queued request, plus a few for /health, /metrics and the dashboard.
    threads = (cfg.serve.max_in_flight or 16) + cfg.serve.max_queue + 8
    try:
        server = HttpServer(app, host, port, "mdi-http", threads=threads, max_connections=max(256, 2 * threads),
                            max_body_bytes=16 * MAX_BODY_BYTES,  # past 1 MiB the routes answer 413 themselves
                            client_gone=True, admit=admit_bearer(cfg.runtime.token),
                            refusal=lambda why, status: ApiError(status, why, code=REFUSAL_CODES.get(status)).body(),
                            secret=cfg.runtime.token is not None)
    except OSError as e:
        raise RuntimeError("cannot listen on %s:%d: %s" % (host, port, e.strerror or e))
    # A plain flag, polled: a handler that sets a threading.Event deadlocks when the signal lands
    # while the main thread holds that Event's lock inside its own wait (seen: a server that
    # ignored SIGTERM for good, its main thread blocked in Event.set under Event.wait).
    stop: List[int] = []  # the signal that asked: SIGTERM, or SIGHUP (a closed terminal) where not ignored (nohup)
    hangup = signal.getsignal(signal.SIGHUP)
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, _: stop.append(signum))
        if hangup is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, lambda signum, _: stop.append(signum))
    except ValueError:  # not the main thread (embedded use): stop with KeyboardInterrupt only
        previous = None
    server.start()
    code, serving = 0, False
    try:
        sched.start()
        deadline = time.monotonic() + cfg.runtime.init_timeout + 60
        while not sched.ready.wait(0.5):
            if stop:  # (below, stop() aborts the ring being opened: its workers are told at once)
                raise Interrupted(stop[0])
            if time.monotonic() > deadline:
                raise RuntimeError("the ring did not open within %.0f s" % (cfg.runtime.init_timeout + 60))
        if sched.open_error is not None:
            raise sched.open_error
        engine = sched.engine
        prefix = engine.prefix_budget if engine is not None else None
        print("mdi-start serving %s on http://%s:%d: %d samples in flight x %d positions, %d nodes, %s admission, "
              "prefix cache %s" % (model_id, host, port, sched.slots, sched.max_len, len(sched.nodes), sched.policy,
                                   "of %d positions" % prefix if prefix is not None else "off"), flush=True)
        kernels = engine.starter_reading().kernels if engine is not None else {}
        if kernels:  # as a batch run's summary says it; the workers' are in /metrics and /v1/mdi/state
            print("mdi: quantized kernels (runtime.quant_kernel %s): %s %s; every node's: /metrics, /v1/mdi/state"
                  % (cfg.runtime.quant_kernel, sched.nodes[0].name, summary(kernels)), flush=True)
        serving = True
        while not stop:
            time.sleep(0.5)
            if not stop and not sched.alive:
                log.error("mdi: serve: the scheduler stopped: %s", sched.error or "see the log above")
                code = 1
                break
    except KeyboardInterrupt:
        if not serving:  # a start-up cut short is an interruption (130); a server stopped is done (0)
            raise
    finally:
        # requests still waiting or streaming end with an error event; a start-up cut short waits
        # little: stop() told the workers of a ring being opened, and a measurement still running
        # (seconds, on a fresh board) ends with the process
        sched.stop(timeout=30.0 if serving else 3.0)
        server.close(grace=2.0)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGHUP, hangup)
    return code
