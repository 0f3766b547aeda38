"""The starter's HTTP client for a worker's control plane. Every call has a timeout and every
failure is a `NodeError` naming the node (name, host:port) and what failed; its type says what
happened, so callers decide without reading the message:

    NodeUnreachable   nothing answered the connection: the worker is not running or not there
    NodeTimeout       connected, but no answer in time: the worker is hung or overloaded
    NodeError         the worker answered with an error (or another step failed)

With a shared secret every request is signed (`HmacAuth`); the secret itself is never sent.
"""
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, Iterator, Optional, Tuple, Union
from urllib.parse import unquote

from mdi.ring.auth import (CONTENT_HEADER, INSTANCE, INSTANCE_HEADER, TIME_HEADER, UNKNOWN_INSTANCE, UNSIGNED_PAYLOAD,
                           body_sha256, sign_request)
from mdi.ring.init_request import InitRequest
from mdi.ring.backend_request import BackendReply, BackendRequest
from mdi.ring.profile_request import ProfileReply, ProfileRequest
from mdi.ring.status import StatusError, StatusReply
from mdi.runconfig import NodeSpec

log = logging.getLogger(__name__)

# A worker installs an adapter's matrices in seconds: one that has not answered in this long is hung
# (an adapter load beside a hung worker had waited runtime.init_timeout, 600 s, meant for weight loads).
ADAPTER_TIMEOUT_S = 60.0
SAY_PUSH_BYTES = 256 * 2 ** 20  # weights pushed to a worker are said from this size (seconds to minutes on a board)

# requests (with urllib3 and ssl) is imported where a node is first called, not here: a starter
# with no workers never makes a call, and the import alone holds 12 MB resident.
if TYPE_CHECKING:
    import requests


class NodeError(RuntimeError):
    """A node failed; `node` is its name when known (recovery replaces that node); `status` is
    the HTTP status the worker answered with, when it answered (413: it cannot hold what was
    sent; 409: busy), so --serve can pass a refusal on as the client's own (`node_refusal`)."""

    def __init__(self, message: str, node: Optional[str] = None, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.node = node
        self.status = status
        self.silent = False  # found silent by a ring's watchdog: lost (`silenced`)


class NodeUnreachable(NodeError):
    """The node's control port could not be reached: certain, no point asking again soon."""


class NodeTimeout(NodeError):
    """The node took the connection but did not answer in time: it may only be slow."""


def silenced(problem: NodeError) -> NodeError:
    """`problem`, as a ring's watchdog names it, marked `silent` where its node did not answer
    (unreachable, or unanswered twice): a certain loss, which recovery asks nothing more (a
    hung node had cost a stop and a health check of 5 s each after it was named)."""
    problem.silent = isinstance(problem, (NodeTimeout, NodeUnreachable))
    return problem


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and every exception under it (args, __cause__, __context__), once each. A failed
    connection (NewConnectionError) is yielded but not looked into: nothing was sent on it."""
    import urllib3

    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if not isinstance(e, urllib3.exceptions.NewConnectionError):
            todo += [a for a in e.args if isinstance(a, BaseException)]
            todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def _timed_out(error: BaseException) -> bool:
    """Whether a timeout lies under `error`. requests reports a peer that stops reading our
    request body, or stops mid-reply, as a ConnectionError wrapping the socket timeout.
    urllib3 derives "connection refused" (NewConnectionError) from its connect timeout: not one."""
    import urllib3

    # socket.timeout is TimeoutError only from Python 3.10 on: name both.
    return any(isinstance(e, (socket.timeout, TimeoutError, urllib3.exceptions.ReadTimeoutError))
               and not isinstance(e, urllib3.exceptions.NewConnectionError) for e in _causes(error))


def _dropped(error: BaseException) -> bool:
    """Whether `error` is a kept-alive connection the worker closed (it closes idle ones) just
    as a request went out on it: nothing was processed, so asking again is safe."""
    import urllib3

    causes = list(_causes(error))
    if any(isinstance(e, urllib3.exceptions.NewConnectionError) for e in causes):
        return False
    return any(isinstance(e, (ConnectionResetError, BrokenPipeError)) or type(e).__name__ == "RemoteDisconnected"
               for e in causes)


class HmacAuth:
    """Signs each request with the shared secret (mdi/ring/auth.py: method, path and query,
    the body's sha256, time, nonce, the worker process it is for), which never leaves this
    process. A body that is not bytes (a file or a stream), or one whose request says so in
    its X-MDI-Content-SHA256 header, goes unsigned, which only POST /weights may do: its sha256
    is announced in the signed /init. `offset` (seconds added to our clock) and `instance` are
    learnt from a worker's 401 to a request signed for another time or process: a request
    with its body in hand goes again at once, signed anew (a streamed one: ControlClient._call).
    One per worker; requests takes any such callable as `auth`."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.offset = 0.0
        self.instance = UNKNOWN_INSTANCE  # the worker process's id, once it has said it

    def learn(self, r: "requests.Response") -> bool:
        """Take the worker's clock and instance id from its 401 (True: the request may go again)."""
        stamp, instance = r.headers.get(TIME_HEADER), r.headers.get(INSTANCE_HEADER, "")
        if r.status_code != 401 or not stamp:
            return False
        try:
            self.offset = float(stamp) - time.time()
        except ValueError:
            return False
        if INSTANCE.match(instance):
            self.instance = instance
        return True

    def __call__(self, r: "requests.PreparedRequest") -> "requests.PreparedRequest":
        self._sign(r)
        r.register_hook("response", self._again)
        return r

    def _again(self, r: "requests.Response", **kwargs: Any) -> "requests.Response":
        """requests' response hook (as its digest auth answers a challenge): a request whose
        body is in hand goes again, once, signed with what the worker's 401 said."""
        sent = r.request
        if getattr(sent, "mdi_again", False) or not (sent.body is None or isinstance(sent.body, (bytes, str))) \
                or not self.learn(r):
            return r
        r.content  # read, so that the connection can carry the next request
        r.close()
        again = sent.copy()
        again.mdi_again = True  # type: ignore[attr-defined]
        self._sign(again)
        answer = r.connection.send(again, **kwargs)
        answer.history.append(r)
        answer.request = again
        return answer

    def _sign(self, r: "requests.PreparedRequest") -> None:
        body = r.body
        if r.headers.get(CONTENT_HEADER) == UNSIGNED_PAYLOAD:
            content = UNSIGNED_PAYLOAD
        elif body is None or isinstance(body, (bytes, str)):
            content = body_sha256(body.encode("utf-8") if isinstance(body, str) else body)
        else:
            content = UNSIGNED_PAYLOAD
        path, _, query = (r.path_url or "/").partition("?")
        signed_path = unquote(path) + ("?" + query if query else "")
        r.headers[CONTENT_HEADER] = content
        r.headers["Authorization"] = sign_request(self.token, r.method or "GET", signed_path, content,
                                                  now=time.time() + self.offset, instance=self.instance)


class ControlClient:
    def __init__(self, node: NodeSpec, connect_timeout: float = 5.0, init_timeout: float = 600.0,
                 token: Optional[str] = None) -> None:
        import requests

        self.node = node
        self.base = "http://%s:%d" % (node.host, node.port)
        self.connect_timeout = connect_timeout
        self.init_timeout = init_timeout
        self.session = requests.Session()
        self.session.trust_env = False  # never route ring control traffic through a proxy
        self.auth = HmacAuth(token) if token else None
        self.session.auth = self.auth

    def _call(self, method: str, route: str, read_timeout: Optional[float] = None,
              **kwargs: Any) -> Dict[str, Any]:
        read_timeout = read_timeout or self.connect_timeout
        # A request goes out a second time only where the worker cannot have acted on the
        # first: it closed the kept-alive connection as the request went out (GET and PUT
        # only), or it refused the request's time stamp or instance id (then signed with the
        # worker's: HmacAuth's hook sends a body in hand again itself, a streamed file goes again here).
        r = self._send(method, route, read_timeout, method in ("GET", "PUT"), **kwargs)
        auth, data = self.auth, kwargs.get("data")
        if r is not None and auth is not None and hasattr(data, "seek") and auth.learn(r):
            r = None  # it goes again, signed as the worker said
        if r is None:
            if data is not None and hasattr(data, "seek"):
                data.seek(0)  # a streamed file goes again from its start
            r = self._send(method, route, read_timeout, False, **kwargs)
            assert r is not None  # not retry_dropped: _send answers or raises
        try:
            body = r.json()
        except ValueError:
            body = None
        # A worker answers every request with a JSON object, its errors too: anything else is
        # another server (a wrong port), said so with its body's start on one line (an HTML page
        # spans many), whatever its status (one answering every path with 200 and a page, too).
        reason = None if isinstance(body, dict) else \
            "the server there is not an mdi-worker (wrong port?): %s" % " ".join(r.text[:120].split())
        if reason is not None or r.status_code != 200 or not body.get("ok", True):
            raise NodeError("node %s (%s): %s %s failed with HTTP %d: %s"
                            % (self.node.name, self.node.address, method, route, r.status_code,
                               reason or body.get("error") or "no reason given"), self.node.name, r.status_code)
        return body

    def _send(self, method: str, route: str, read_timeout: float, retry_dropped: bool,
              **kwargs: Any) -> Optional["requests.Response"]:
        """The worker's answer; None when it closed the connection under a request that may go
        again (`retry_dropped`); a NodeError subclass saying what happened otherwise."""
        import requests

        what = "%s %s" % (method, route)
        where = "node %s (%s)" % (self.node.name, self.node.address)
        try:
            return self.session.request(method, self.base + route, timeout=(self.connect_timeout, read_timeout),
                                        **kwargs)
        except requests.exceptions.ConnectTimeout as e:
            # Checked first: ConnectTimeout is also a ConnectionError. Nothing took the connection.
            raise NodeUnreachable("%s: %s failed: cannot connect within %g s (is the board up and reachable?)"
                                  % (where, what, self.connect_timeout), self.node.name) from e
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
            if isinstance(e, requests.exceptions.Timeout) or _timed_out(e):
                raise NodeTimeout("%s: %s timed out (no answer within %g s)" % (where, what, read_timeout),
                                  self.node.name) from e
            if retry_dropped and _dropped(e):
                return None
            if any(isinstance(c, socket.gaierror) or type(c).__name__ == "NameResolutionError" for c in _causes(e)):
                raise NodeUnreachable("%s: %s failed: cannot resolve the host name %r (a typo in its address?)"
                                      % (where, what, self.node.host), self.node.name) from e
            raise NodeUnreachable("%s: %s failed: cannot connect (is mdi-worker running on port %d?)"
                                  % (where, what, self.node.port), self.node.name) from e
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as e:
            # The answer began and broke off (the worker ended mid-reply: its body is short or
            # garbled). Not certain death: the watchdog asks again, recovery asks whether it lives.
            raise NodeError("%s: %s failed: its answer broke off (%s; did mdi-worker end?)"
                            % (where, what, type(e).__name__), self.node.name) from e

    def health(self) -> Dict[str, Any]:
        return self._call("GET", "/health")

    def close(self) -> None:
        """Close the kept-alive connections (a later call opens new ones)."""
        self.session.close()

    def status(self, timeout: Optional[float] = None, run_id: Optional[int] = None) -> StatusReply:
        """The worker's status; naming the current run also serves as the starter's heartbeat."""
        body = self._call("GET", "/status" if run_id is None else "/status?run=%d" % run_id, timeout)
        try:
            return StatusReply.from_json(body)
        except StatusError as e:
            raise NodeError("node %s (%s): bad /status reply: %s" % (self.node.name, self.node.address, e),
                            self.node.name) from None

    def backend(self, request: BackendRequest) -> BackendReply:
        """Which backend the worker computes the asked layers with (auto: measured there, once
        per machine and shape; a slow board gets init_timeout, as a load would)."""
        body = self._call("POST", "/backend", self.init_timeout, json=request.to_json())
        try:
            return BackendReply.from_json(body)
        except ValueError as e:
            raise NodeError("node %s (%s): bad /backend reply: %s" % (self.node.name, self.node.address, e),
                            self.node.name) from None

    def init(self, request: InitRequest) -> Dict[str, Any]:
        return self._call("POST", "/init", self.init_timeout, json=request.to_json())

    def push_weights(self, payload: Union[bytes, BinaryIO]) -> Dict[str, Any]:
        """The weights announced in /init: bytes, or a file opened to read, streamed from it.
        Unsigned: the worker checks the bytes against the sha256 announced in /init. Said before
        and after: a board's GB over its link is minutes of a start-up that was silent."""
        try:
            nbytes = len(payload) if isinstance(payload, (bytes, bytearray)) else os.fstat(payload.fileno()).st_size
        except (OSError, ValueError, AttributeError):  # (a stream with no file under it: not said)
            nbytes = 0
        say = log.info if nbytes >= SAY_PUSH_BYTES else log.debug  # (a small model's start-up stays quiet)
        say("mdi: %s: sending its weights, %.1f MB", self.node.name, nbytes / 1e6)
        t0 = time.perf_counter()
        reply = self._call("POST", "/weights", self.init_timeout, data=payload,
                           headers={"Content-Type": "application/octet-stream", CONTENT_HEADER: UNSIGNED_PAYLOAD})
        say("mdi: %s: weights sent in %.1f s", self.node.name, time.perf_counter() - t0)
        return reply

    def profile(self, request: ProfileRequest) -> ProfileReply:
        """How fast the worker runs the model's blocks (a few seconds of timing there; a slow
        board gets init_timeout, as a load would)."""
        body = self._call("POST", "/profile", self.init_timeout, json=request.to_json())
        try:
            return ProfileReply.from_json(body)
        except ValueError as e:
            raise NodeError("node %s (%s): bad /profile reply: %s" % (self.node.name, self.node.address, e),
                            self.node.name) from None

    def post_adapter(self, adapter: int, body: bytes) -> Dict[str, Any]:
        """A LoRA's matrices for this worker's layers (mdi.ring.adapter_request)."""
        return self._call("POST", "/adapters/%d" % adapter, min(self.init_timeout, ADAPTER_TIMEOUT_S), data=body,
                          headers={"Content-Type": "application/octet-stream"})

    def post_train(self, body: bytes) -> Dict[str, Any]:
        """Make the worker's run a training run (mdi.ring.train_request)."""
        return self._call("POST", "/train", self.init_timeout, data=body,
                          headers={"Content-Type": "application/octet-stream"})

    def train_pairs(self) -> Dict[str, Any]:
        """The LoRA pairs the worker trains, as they are now (GET /train)."""
        return self._call("GET", "/train", self.init_timeout)

    def stop_train(self) -> Dict[str, Any]:
        """The worker's run stops training and drops its LoRA and optimizer state (DELETE /train)."""
        return self._call("DELETE", "/train")

    def drop_adapter(self, adapter: int) -> Dict[str, Any]:
        return self._call("DELETE", "/adapters/%d" % adapter)

    def probe(self, nbytes: int) -> float:
        """Seconds to send `nbytes` to the worker and hear back (POST /probe): the link's round
        trip with nbytes 0, plus the transfer with more."""
        t0 = time.perf_counter()
        self._call("POST", "/probe", data=bytes(nbytes), headers={"Content-Type": "application/octet-stream"})
        return time.perf_counter() - t0

    def stop(self, run_id: Optional[int] = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """End the worker's run; with `run_id` only if that run holds it (never another starter's)."""
        return self._call("PUT", "/stop" if run_id is None else "/stop?run=%d" % run_id, timeout)

    def shutdown(self) -> Dict[str, Any]:
        return self._call("POST", "/shutdown")


class NodeRegistry:
    """A run's control clients: one per node (its HTTP connections kept alive across the run's
    calls), made on first use and closed with the run. Built from the run config's timeouts and
    token once, so the planner, recovery, the check and the ring session need only this.

    A client is not shared between threads that talk to the same node at once (a requests
    Session is not thread-safe): such a thread takes its own with `fresh` and closes it."""

    def __init__(self, connect_timeout: float, init_timeout: float, token: Optional[str]) -> None:
        self.connect_timeout, self.init_timeout, self.token = connect_timeout, init_timeout, token
        self._clients: Dict[Tuple[str, str, int], ControlClient] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, cfg: Any) -> "NodeRegistry":
        rt = cfg.runtime
        return cls(rt.connect_timeout, rt.init_timeout, rt.token)

    def client(self, node: NodeSpec) -> ControlClient:
        key = (node.name, node.host, node.port)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = self.fresh(node)
            return client

    def fresh(self, node: NodeSpec) -> ControlClient:
        return ControlClient(node, self.connect_timeout, self.init_timeout, self.token)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def health_problem(registry: NodeRegistry, node: NodeSpec) -> Optional[NodeError]:
    """Why `node` does not answer /health (None: it does)."""
    try:
        registry.client(node).health()
        return None
    except NodeError as e:
        return e


def answers(registry: NodeRegistry, node: NodeSpec) -> bool:
    """Whether `node` answers /health now."""
    return health_problem(registry, node) is None
