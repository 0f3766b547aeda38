"""The starter's HTTP client for a worker's control plane. Every call has a timeout and every
failure is a `NodeError` naming the node (name, host:port) and what failed; its type says what
happened, so callers decide without reading the message:

    NodeUnreachable   nothing answered the connection: the worker is not running or not there
    NodeTimeout       connected, but no answer in time: the worker is hung or overloaded
    NodeError         the worker answered with an error (or another step failed)
"""
import socket
from typing import Any, Dict, Optional

import requests
import urllib3

from mdi.ring.init_request import InitRequest
from mdi.ring.status import StatusError, StatusReply
from mdi.runconfig import NodeSpec


class NodeError(RuntimeError):
    """A node failed; `node` is its name when known (recovery replaces that node)."""

    def __init__(self, message: str, node: Optional[str] = None) -> None:
        super().__init__(message)
        self.node = node


class NodeUnreachable(NodeError):
    """The node's control port could not be reached: certain, no point asking again soon."""


class NodeTimeout(NodeError):
    """The node took the connection but did not answer in time: it may only be slow."""


def _timed_out(error: BaseException) -> bool:
    """Whether a timeout lies under `error`. requests reports a peer that stops reading our
    request body, or stops mid-reply, as a ConnectionError wrapping the socket timeout."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, urllib3.exceptions.NewConnectionError):
            continue  # no connection at all (urllib3 derives it from ConnectTimeoutError: skip it)
        # socket.timeout is TimeoutError only from Python 3.10 on: name both.
        if isinstance(e, (socket.timeout, TimeoutError, urllib3.exceptions.ReadTimeoutError)):
            return True
        todo += [a for a in e.args if isinstance(a, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return False


class ControlClient:
    def __init__(self, node: NodeSpec, connect_timeout: float = 5.0, init_timeout: float = 600.0,
                 token: Optional[str] = None) -> None:
        self.node = node
        self.base = "http://%s:%d" % (node.host, node.port)
        self.connect_timeout = connect_timeout
        self.init_timeout = init_timeout
        self.session = requests.Session()
        self.session.trust_env = False  # never route ring control traffic through a proxy
        if token:
            self.session.headers["Authorization"] = "Bearer " + token

    def _call(self, method: str, route: str, read_timeout: Optional[float] = None,
              **kwargs: Any) -> Dict[str, Any]:
        what = "%s %s" % (method, route)
        where = "node %s (%s)" % (self.node.name, self.node.address)
        read_timeout = read_timeout or self.connect_timeout
        try:
            r = self.session.request(method, self.base + route, timeout=(self.connect_timeout, read_timeout),
                                     **kwargs)
        except requests.exceptions.ConnectTimeout as e:
            # Checked first: ConnectTimeout is also a ConnectionError. Nothing took the connection.
            raise NodeUnreachable("%s: %s failed: cannot connect within %g s (is the board up and reachable?)"
                                  % (where, what, self.connect_timeout), self.node.name) from e
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
            if isinstance(e, requests.exceptions.Timeout) or _timed_out(e):
                raise NodeTimeout("%s: %s timed out (no answer within %g s)" % (where, what, read_timeout),
                                  self.node.name) from e
            raise NodeUnreachable("%s: %s failed: cannot connect (is mdi-worker running on port %d?)"
                                  % (where, what, self.node.port), self.node.name) from e
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code != 200 or not isinstance(body, dict) or not body.get("ok", True):
            reason = body.get("error") if isinstance(body, dict) else None
            raise NodeError("%s: %s failed with HTTP %d: %s"
                            % (where, what, r.status_code, reason or r.text[:200].strip()), self.node.name)
        return body

    def health(self) -> Dict[str, Any]:
        return self._call("GET", "/health")

    def status(self, timeout: Optional[float] = None, run_id: Optional[int] = None) -> StatusReply:
        """The worker's status; naming the current run also serves as the starter's heartbeat."""
        body = self._call("GET", "/status" if run_id is None else "/status?run=%d" % run_id, timeout)
        try:
            return StatusReply.from_json(body)
        except StatusError as e:
            raise NodeError("node %s (%s): bad /status reply: %s" % (self.node.name, self.node.address, e),
                            self.node.name) from None

    def init(self, request: InitRequest) -> Dict[str, Any]:
        return self._call("POST", "/init", self.init_timeout, json=request.to_json())

    def push_weights(self, blob: bytes) -> Dict[str, Any]:
        return self._call("POST", "/weights", self.init_timeout, data=blob,
                          headers={"Content-Type": "application/octet-stream"})

    def stop(self, run_id: Optional[int] = None) -> Dict[str, Any]:
        """End the worker's run; with `run_id` only if that run holds it (never another starter's)."""
        return self._call("PUT", "/stop" if run_id is None else "/stop?run=%d" % run_id)

    def shutdown(self) -> Dict[str, Any]:
        return self._call("POST", "/shutdown")
