"""The starter's HTTP client for a worker's control plane. Every call has a timeout and every
failure is a `NodeError` naming the node (name, host:port) and what failed."""
from typing import Any, Dict, Optional

import requests

from mdi.runconfig import NodeSpec


class NodeError(RuntimeError):
    """A node failed; `node` is its name when known (recovery replaces that node)."""

    def __init__(self, message: str, node: Optional[str] = None) -> None:
        super().__init__(message)
        self.node = node


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
        timeout = (self.connect_timeout, read_timeout or self.connect_timeout)
        try:
            r = self.session.request(method, self.base + route, timeout=timeout, **kwargs)
        except requests.exceptions.ConnectionError as e:
            raise NodeError("%s: %s failed: cannot connect (is mdi-worker running on port %d?)"
                            % (where, what, self.node.port), self.node.name) from e
        except requests.exceptions.Timeout as e:
            raise NodeError("%s: %s timed out" % (where, what), self.node.name) from e
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

    def status(self, timeout: Optional[float] = None, run_id: Optional[int] = None) -> Dict[str, Any]:
        """The worker's status; naming the current run also serves as the starter's heartbeat."""
        return self._call("GET", "/status" if run_id is None else "/status?run=%d" % run_id, timeout)

    def init(self, spec: Dict[str, Any]) -> Dict[str, Any]:
        return self._call("POST", "/init", self.init_timeout, json=spec)

    def push_weights(self, blob: bytes) -> Dict[str, Any]:
        return self._call("POST", "/weights", self.init_timeout, data=blob,
                          headers={"Content-Type": "application/octet-stream"})

    def stop(self) -> Dict[str, Any]:
        return self._call("PUT", "/stop")

    def shutdown(self) -> Dict[str, Any]:
        return self._call("POST", "/shutdown")
