"""The dashboard: one page (the files in mdi/serving/web/, shipped as package data: no CDN, no
build step) that draws the ring working and talks to it, and GET /v1/mdi/state, the JSON it
polls: `metrics.Observer.snapshot()`, the same snapshot GET /metrics renders.

`mdi-start --serve` registers these routes next to the OpenAI API (`api.Routes`); a batch run
with `--dashboard [PORT]` serves them alone (`start_batch_dashboard`) while it generates,
watching the run through a `BatchMonitor`.

Security: the page and its script hold no data and no secret, so they need no token; every
data route does. With a shared secret the page asks for it once, keeps it in the tab's
sessionStorage and sends it as `Authorization: Bearer` on every request (never in a URL).
A strict Content-Security-Policy allows the page's own script and style and nothing else.
"""
import json
import logging
import os
import time
from typing import Any, Dict, Optional, Tuple

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from mdi.ring.auth import token_matches
from mdi.runconfig import ConfigError, RunConfig
from mdi.serving.metrics import Observer, Stats
from mdi.serving.prometheus import metrics_text
from mdi.serving.streaming import finish_reason_of
from mdi.serving.validation import ApiError
from mdi.starter.engine_face import EngineFace
from mdi.system.loopback import is_loopback

log = logging.getLogger(__name__)

WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")
ASSETS = {  # what GET /ui/<name> may serve, and as what
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
PUBLIC_ENDPOINTS = ("dashboard", "asset", "info")  # the page and whether it needs a token: no data
STATE_PATH = "/v1/mdi/state"
INFO_PATH = "/v1/mdi/info"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _page_headers(resp: Response) -> Response:
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.headers["Cache-Control"] = "no-cache"
    return resp


def _read(name: str) -> Optional[bytes]:
    try:
        with open(os.path.join(WEB_DIR, name), "rb") as f:
            return f.read()
    except OSError:
        return None


def page_response() -> Response:
    """GET /: the dashboard's HTML."""
    body = _read("index.html")
    if body is None:
        return Response("the dashboard's files are missing from this install (%s)\n" % WEB_DIR, status=404,
                        mimetype="text/plain")
    return _page_headers(Response(body, mimetype="text/html"))


def asset_response(name: str) -> Response:
    """GET /ui/<name>: one of the page's files (only those in ASSETS)."""
    body = _read(name) if name in ASSETS else None
    if body is None:
        return Response("no such file\n", status=404, mimetype="text/plain")
    resp = Response(body)
    resp.headers["Content-Type"] = ASSETS[name]
    return _page_headers(resp)


def info_response(token: Optional[str], mode: str) -> Response:
    """GET /v1/mdi/info (public): whether the data routes need a token, and the kind of run,
    so that the page asks for the token before its first request instead of after a 401."""
    resp = Response(json.dumps({"auth": token is not None, "mode": mode}), mimetype="application/json")
    resp.headers["Cache-Control"] = "no-store"
    return resp


def state_response(observer: Observer) -> Response:
    """GET /v1/mdi/state: the snapshot as JSON."""
    resp = Response(json.dumps(observer.snapshot()), mimetype="application/json")
    resp.headers["Cache-Control"] = "no-store"
    return resp


def metrics_response(observer: Observer) -> Response:
    """GET /metrics: the snapshot in Prometheus' text format."""
    # content_type, not mimetype: werkzeug adds a second "; charset=utf-8" to a text mimetype
    return Response(metrics_text(observer.snapshot()), content_type="text/plain; version=0.0.4; charset=utf-8")


def error_response(e: ApiError) -> Response:
    return Response(json.dumps(e.body()), status=e.status, mimetype="application/json")


def register_dashboard(app: Flask, observer: Observer, token: Optional[str], mode: str) -> None:
    """The page, its files and its data routes (/metrics too), behind the one token rule: every
    route but the page's own (PUBLIC_ENDPOINTS) needs the shared secret. Used by `--serve`
    (next to the OpenAI routes) and by a batch run's dashboard alone."""

    def check_token() -> Optional[Response]:
        if request.endpoint in PUBLIC_ENDPOINTS or token_matches(token, request.headers.get("Authorization")):
            return None
        return error_response(ApiError(401, "missing or wrong bearer token", code="invalid_api_key"))

    app.before_request(check_token)
    app.add_url_rule("/", "dashboard", page_response, methods=["GET"])
    app.add_url_rule("/ui/<name>", "asset", asset_response, methods=["GET"])
    app.add_url_rule(INFO_PATH, "info", lambda: info_response(token, mode), methods=["GET"])
    app.add_url_rule(STATE_PATH, "state", lambda: state_response(observer), methods=["GET"])
    app.add_url_rule("/metrics", "metrics", lambda: metrics_response(observer), methods=["GET"])


# --------------------------------------------------------------------------- a batch run's view

class BatchMonitor:
    """A batch run as the dashboard sees it: the attributes `metrics.Observer` reads, fed by
    the run's token callback (`on_token`) and the engine it opens (`attach`)."""

    mode = "batch"

    def __init__(self, cfg: RunConfig, n_samples: int, n_tokens: int) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.state = "starting"  # starting | running | done | failed
        self.error: Optional[str] = None
        self.engine: Optional[EngineFace] = None
        self.nodes = list(cfg.nodes)
        self.slots, self.max_len, self.queue_length = n_samples, 0, 0
        self._total = n_samples * n_tokens
        self._finished = 0
        self._busy = 0.0

    def attach(self, engine: EngineFace) -> None:
        """The run's engine, before it opens the ring."""
        self.engine = engine
        self.slots, self.max_len = engine.n_slots, engine.max_len

    @property
    def serving(self) -> bool:
        return self.state == "running"

    @property
    def in_flight(self) -> int:
        engine = self.engine
        return engine.in_flight if engine is not None else 0

    @property
    def progress(self) -> Dict[str, int]:
        return {"tokens": self.stats.tokens_total, "tokens_max": self._total, "samples": self.slots,
                "samples_done": self._finished}

    def on_token(self, sample: Any, token: int) -> None:
        """The engine's token callback (the run's thread)."""
        self.state = "running"
        now = time.monotonic()
        times = sample.token_times
        self.stats.token(now, times[-1] - times[-2] if len(times) > 1 else None)
        if self.engine is not None:
            busy = self.engine.busy_seconds
            self.stats.starter_step(max(0.0, busy - self._busy), 1)
            self._busy = busy
        if len(sample.token_ids) == 1:
            self.stats.first_token(now, times[0])
        if sample.done:
            self._finished += 1
            self.stats.request_finished(finish_reason_of(sample), len(sample.prompt_ids), times[-1], times[0])

    def finished(self, error: Optional[str] = None) -> None:
        self.state = "failed" if error else "done"
        self.error = error


def batch_dashboard_app(observer: Observer, token: Optional[str]) -> Flask:
    """A batch run's dashboard alone: the dashboard's routes plus /health, errors in the same shape."""
    app = Flask("mdi-dashboard")
    register_dashboard(app, observer, token, "batch")

    def http_error(e: HTTPException) -> Response:
        return error_response(ApiError(e.code or 500, "%s %s: %s" % (request.method, request.path, e.name)))

    def health() -> Response:
        view = observer.view
        body = {"ok": view.state in ("starting", "running", "done"), "state": view.state, "error": view.error}
        return Response(json.dumps(body), status=200 if body["ok"] else 503, mimetype="application/json")

    app.register_error_handler(HTTPException, http_error)
    app.add_url_rule("/health", "health", health, methods=["GET"])
    return app


def dashboard_address(cfg: RunConfig, port: Optional[int], host: Optional[str], insecure: bool) -> Tuple[str, int]:
    """Where a batch run's dashboard listens: `port`, else serve.port, else the starter node's
    port, on `host` (default serve.host); refused off loopback without a shared secret."""
    host = host or cfg.serve.host
    port = port if port is not None else (cfg.serve.port or cfg.starter.port)
    if not 0 < port < 65536:
        raise ConfigError("--dashboard: expected a TCP port 1-65535, got %d" % port)
    if cfg.runtime.token is None and not insecure and not is_loopback(host):
        raise ConfigError("refusing to show the dashboard on %s without a shared secret: set MDI_TOKEN or "
                          "runtime.token_file (or pass --insecure on a trusted network)" % host)
    return host, port


class BatchDashboard:
    """The dashboard of a batch run, served on threads of its own (mdi's HTTP server, as for
    --serve) until `close()`."""

    def __init__(self, cfg: RunConfig, monitor: BatchMonitor, model_id: str, host: str, port: int) -> None:
        from mdi.system.http_server import HttpServer
        self.monitor = monitor
        app = batch_dashboard_app(Observer(monitor, model_id, cfg.runtime.token), cfg.runtime.token)
        try:
            self.server = HttpServer(app, host, port, "mdi-dashboard", threads=8, max_connections=64,
                                     secret=cfg.runtime.token is not None)
        except OSError as e:
            raise RuntimeError("--dashboard: cannot listen on %s:%d: %s" % (host, port, e.strerror or e))
        self.url = "http://%s:%d/" % (host if ":" not in host else "[%s]" % host, port)
        self.server.start()

    def close(self) -> None:
        self.server.close(grace=0.5)
