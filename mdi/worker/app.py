"""mdi-worker's control plane (Flask, JSON only) over one `Worker`:

    GET /health, GET /status, POST /backend (which backend this worker computes a run's layers
    with: ggml or torch, auto measured here, mdi.ring.backend_request), POST /init, POST /weights
    (safetensors bytes, or a GGUF of the node's tensors for ggml, when the starter pushes them), POST /profile (time the model's blocks here, mdi.ring.profile_request), POST /probe
    (a body timed by the starter to measure the link), POST / DELETE /adapters/<id> (a LoRA's
    matrices for this worker's layers, mdi.ring.adapter_request), POST / GET / DELETE /train
    (mdi-train: the run trains a LoRA, mdi.ring.train_request; GET answers its pairs now; DELETE
    ends the training and the run serves on),
    PUT /stop (?run=ID: only that run), POST /shutdown.

With a shared secret every request must be signed with it (`Authorization: MDI-HMAC ...`, see
mdi/ring/auth.py; the secret itself never crosses the network) and is accepted once; a bad
request is answered 400 with its reason, any other failure in JSON too (never an HTML error page).
"""
import logging
import time
from typing import Any, Callable, Dict, Optional

from flask import Flask, jsonify, request

from mdi import __version__
from mdi.ring.auth import (CONTENT_HEADER, INSTANCE_HEADER, SCHEME, TIME_HEADER, UNSIGNED_PAYLOAD, AuthError,
                           RequestVerifier, body_sha256)
from mdi.ring.init_request import MAX_WEIGHTS_BYTES, SAFETENSORS_SLACK
from mdi.ring.init_request import RequestError, validate_init
from mdi.ring.backend_request import validate_backend
from mdi.ring.profile_request import MAX_PROBE_BYTES, validate_profile
from mdi.ring.body_limits import MAX_ADAPTER_BYTES, MAX_TRAIN_BYTES
from mdi.ring.wire import MAX_ADAPTER_ID
from mdi.worker.node import Worker

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 1 << 20
MAX_BODY_BYTES = MAX_WEIGHTS_BYTES + SAFETENSORS_SLACK  # the largest /weights push (the server's limit)


def admit_headers(worker: Worker) -> Optional[Callable[[str, str, Dict[str, str]], Optional[str]]]:
    """What the HTTP server checks before it reads a body (HttpServer's `admit`): with a shared
    secret, that the request is signed, from its headers alone. An unauthenticated peer then
    makes the worker store nothing (a 1 GB upload had been written to $TMPDIR before its 401).
    The application still checks everything once the body is there."""
    verifier = worker.verifier
    if verifier is None:
        return None
    content_key = CONTENT_HEADER.upper().replace("-", "_")  # as waitress keys its headers

    def admit(method: str, path: str, headers: Dict[str, str]) -> Optional[str]:
        if not path.isascii():  # no route has one: refused before its body is stored (h38: 300 MB spooled)
            return "missing or wrong token (no request of a starter has a path like %r)" % path[:64]
        content = headers.get(content_key)
        try:
            _, nonce = verifier.check_signed(method, path, headers.get("AUTHORIZATION"), content)
            if verifier.seen(nonce):
                return "missing or wrong token (replayed request)"
        except AuthError as e:
            if not e.stale or e.nonce is None:
                return "missing or wrong token (%s)" % e
            # A stale signature is the secret's: the application answers it with this node's
            # clock and instance id, with which the starter signs again. A captured one could
            # be sent again forever: each is let through once a window (its nonce spent now).
            try:
                verifier.spend(e.nonce, time.time() + verifier.window)
            except AuthError as again:
                return "missing or wrong token (%s)" % again
        # A signed header does not sign the body's length: each route's own limit, before the
        # body is stored (a replayed header had spooled 800 MB to $TMPDIR before its 401).
        route = path.partition("?")[0]
        limit = signed_body_limit(method, route, content)
        length = headers.get("CONTENT_LENGTH")
        if length is None or not length.isdigit() or int(length) > limit:
            return "missing or wrong token (a body of at most %d bytes, with its Content-Length, on %s %s)" \
                % (limit, method, route)
        return None
    return admit


def signed_body_limit(method: str, path: str, content_sha256: Optional[str]) -> int:
    """The most bytes a signed request's body may hold on this route: the weights push (its body
    left unsigned, checked against the sha256 its signed /init announced) the most a node holds."""
    if content_sha256 == UNSIGNED_PAYLOAD:
        return MAX_BODY_BYTES if (method, path) == ("POST", "/weights") else 0
    if path.startswith("/adapters/"):
        return MAX_ADAPTER_BYTES
    return MAX_TRAIN_BYTES if path == "/train" else MAX_JSON_BYTES


def create_app(worker: Worker) -> Flask:
    app = Flask("mdi-worker")
    app.config["MAX_CONTENT_LENGTH"] = None  # checked per route below

    def body_json() -> Dict[str, Any]:
        if request.content_length is None or request.content_length > MAX_JSON_BYTES:
            raise RequestError("JSON body missing or larger than %d bytes" % MAX_JSON_BYTES)
        if not request.is_json:
            raise RequestError("expected Content-Type: application/json")
        try:
            data = request.get_json(silent=True)
        except RecursionError:  # nested deeper than the parser's stack: no request of ours is
            raise RequestError("body is JSON nested too deeply") from None
        if data is None:
            raise RequestError("body is not valid JSON")
        return data

    verifier = worker.verifier

    def check_signature(verifier: RequestVerifier) -> None:
        content = request.headers.get(CONTENT_HEADER)
        query = request.query_string.decode("latin-1")
        verifier.verify(request.method, request.path + ("?" + query if query else ""),
                        request.headers.get("Authorization"), content)
        if content == UNSIGNED_PAYLOAD:
            # Only the weights push leaves its body out: it is checked against the sha256
            # announced in the (signed) /init, while it streams in.
            if (request.method, request.path) != ("POST", "/weights"):
                raise AuthError("only POST /weights may leave its body unsigned")
            return
        limit = signed_body_limit(request.method, request.path, content)
        if request.content_length is not None and request.content_length > limit:
            raise AuthError("a signed body must be at most %d bytes" % limit)
        body = request.get_data(cache=True) if request.content_length else b""
        if body_sha256(body) != content:
            raise AuthError("the body does not match its signed sha256")

    @app.before_request
    def authenticate():
        if verifier is None:
            # A starter that signs has a secret this worker lacks: said now, naming the fix, not
            # found 30 s later as a ring whose links do not match (CURVE on one side only)
            if (request.headers.get("Authorization") or "").startswith(SCHEME + " "):
                return jsonify({"ok": False, "error": "missing or wrong token (this worker has no shared secret, "
                                "but the starter signs its requests: start it with --token-file or MDI_TOKEN)"}), 401
            return None
        try:
            check_signature(verifier)
        except AuthError as e:
            reply = jsonify({"ok": False, "error": "missing or wrong token (%s)" % e})
            if e.stale:  # signed with the secret, but for another time or process: say ours
                reply.headers[TIME_HEADER] = "%.3f" % time.time()
                reply.headers[INSTANCE_HEADER] = worker.instance
            return reply, 401
        return None

    @app.errorhandler(RequestError)
    def bad_request(e):
        return jsonify({"ok": False, "error": str(e)}), e.status  # 400; 409 busy; 413 too large

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
        # The starter names its run: that poll is the heartbeat keeping the run (or its /init
        # waiting for weights) alive.
        worker.heartbeat(request.args.get("run"))
        return jsonify(worker.status().to_json())

    @app.route("/init", methods=["POST"])
    def init():
        # The peer address names this run's starter when another run is refused (409).
        return jsonify(worker.init(validate_init(body_json()), request.remote_addr or "?"))

    @app.route("/backend", methods=["POST"])
    def backend():
        return jsonify(worker.choose_backend(validate_backend(body_json())).to_json())

    @app.route("/profile", methods=["POST"])
    def profile():
        return jsonify(worker.profile(validate_profile(body_json())).to_json())

    @app.route("/adapters/<int:adapter>", methods=["POST", "DELETE"])
    def adapters(adapter: int):
        if not 1 <= adapter <= MAX_ADAPTER_ID:
            raise RequestError("adapter ids are 1 to %d" % MAX_ADAPTER_ID)
        if request.method == "DELETE":
            return jsonify(worker.drop_adapter(adapter))
        worker.require_weights()  # before its body is read (3 x 200 MB bodies had raised RSS by 376 MB)
        n = request.content_length
        if n is None or not 0 < n <= MAX_ADAPTER_BYTES:
            raise RequestError("an adapter body is 1 to %d bytes of safetensors with its Content-Length"
                               % MAX_ADAPTER_BYTES)
        return jsonify(worker.load_adapter(adapter, request.get_data(cache=True)))

    @app.route("/train", methods=["POST", "GET", "DELETE"])
    def train():
        # mdi-train: the run in progress trains a LoRA (mdi.worker.training); GET: its pairs now;
        # DELETE: it stops training and goes on serving (a job beside --serve, mdi.serving.train_job)
        # Refused before anything is read or imported: torch (about 190 MB resident, kept) is
        # imported only for a run that can train, never by a stray request to a ggml worker.
        run = worker.run
        if request.method in ("GET", "DELETE"):
            if run is None or run.training is None:
                raise RequestError("this worker's run is not training")
            from mdi.worker.training import stop_training, training_pairs
            return jsonify(training_pairs(worker) if request.method == "GET" else stop_training(worker))
        if run is None or not run.holds_worker() or run.chunk is None:
            raise RequestError("no run in progress: training comes after /init")
        if run.chunk.backend != "torch":
            raise RequestError("this worker computes with %s, which cannot train (training computes on torch)"
                               % run.chunk.backend)
        n = request.content_length
        if n is None or not 0 < n <= MAX_TRAIN_BYTES:
            raise RequestError("a training body is 1 to %d bytes of safetensors with its Content-Length"
                               % MAX_TRAIN_BYTES)
        from mdi.worker.training import start_training
        return jsonify(start_training(worker, request.get_data(cache=True)))

    @app.route("/probe", methods=["POST"])
    def probe():
        # The starter times this to measure the link (round trip, bandwidth): read and dropped.
        n = request.content_length
        if n is None or n > MAX_PROBE_BYTES:
            raise RequestError("a probe body is 0 to %d bytes with its Content-Length" % MAX_PROBE_BYTES)
        return jsonify({"ok": True, "bytes": len(request.get_data(cache=False))})

    @app.route("/weights", methods=["POST"])
    def weights():
        # Checked before reading the body, so a wrong upload is refused unread; the worker
        # checks again under its lock (another /init may have come in between).
        pending = worker.pending
        if pending is None or pending.request.weights.push is None:
            raise RequestError("no /init is waiting for weights")
        n = pending.request.weights.push.nbytes
        if request.content_length != n:
            raise RequestError("Content-Length %s does not match the %d bytes announced" % (request.content_length, n))
        # Streamed to a temporary file while hashed: never buffered whole in memory.
        return jsonify(worker.receive_weights(request.stream, n))

    @app.route("/stop", methods=["PUT"])
    def stop():
        # ?run=ID ends only that run: a starter aborting its own run never ends another's.
        run = request.args.get("run")
        try:
            run_id = int(run) if run is not None else None
        except ValueError:
            raise RequestError("run must be a run id (an integer)")
        return jsonify({"ok": True, "stopped": worker.stop_run(run_id)})

    @app.route("/shutdown", methods=["POST"])
    def shutdown():
        worker.end_run()
        worker.shutdown_requested.set()
        return jsonify({"ok": True})

    return app
