"""The HTTP server under the worker's control plane and `mdi-start --serve`: waitress, a
production pure-Python WSGI server, with bounded connections and idle timeouts.

waitress reads every request on one event-loop thread and hands only complete requests to
its worker threads, so a connection that sends nothing (or its headers a byte at a time)
costs a file descriptor, never a thread. File descriptors are bounded too: at most
`max_connections` connections are kept (fewer when the open-file limit is low: a reserve stays
free for the model's files, zmq's sockets and logs). When a new connection arrives and all are
taken, one with no request running is closed to make room: first those that never sent a
whole request, then the one idle longest; any connection idle for `idle_timeout` seconds is
closed anyway. So idle connections cannot starve the control plane: a real client's
connection is accepted at once and the request it sends right away is served. (werkzeug's
development server starts a thread per connection and has no timeouts: 1100 idle
connections against a worker limited to 1024 open files blocked every new run.)

    server = HttpServer(app, host, port, threads=8)   # listening on return (OSError if it cannot)
    server.start()                                    # serves on a thread of its own
    server.close(grace=1.0)                           # lets running requests finish, then stops
"""
import heapq
import json
import logging
import resource
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional

from mdi.system.loopback import foreign_host, from_page, is_loopback

log = logging.getLogger(__name__)

FD_RESERVE = 128  # open files kept free for everything but HTTP connections
# A chunked body's chunk-size line or trailer longer than this is refused (400): waitress keeps
# and re-joins such a line until its end comes, so one that never ends cost memory without
# bound and CPU growing with it (4 connections: 92% of a core, 156 MB).
MAX_CHUNK_LINE = 4096
BURST = 8  # connections accepted past the limit before the idlest ones have been closed


def connection_cap(wanted: int, threads: int) -> int:
    """`wanted`, lowered so that connections never exhaust the process's open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft - FD_RESERVE - threads - BURST))


# (method, path?query, headers as waitress keys them: "AUTHORIZATION", "X_MDI_CONTENT_SHA256")
# -> None to read the body, or why the request is refused (401) before a byte of it is read.
Admit = Callable[[str, str, Dict[str, str]], Optional[str]]
# (why, its HTTP status: 401 or 403, or waitress's own 400 / 413) -> the refusal's JSON body
# (default: the worker's {"ok": false, "error": why}).
Refusal = Callable[[str, int], Dict[str, Any]]
# headers (as Admit's) -> why any request is refused (403) before the application sees it, or None
Guard = Callable[[Dict[str, str]], Optional[str]]


def _server_class(admit: Optional[Admit] = None, refusal: Optional[Refusal] = None, guard: Optional[Guard] = None):
    from waitress.channel import HTTPChannel
    from waitress.parser import HTTPRequestParser
    from waitress.receiver import ChunkedReceiver
    from waitress.server import TcpWSGIServer
    from waitress.utilities import BadRequest, Error

    class JsonError(Error):
        """An error the server answers itself, in JSON as the applications answer theirs."""

        def to_response(self, ident=None):
            body = json.dumps(refusal(self.body, self.code) if refusal is not None
                              else {"ok": False, "error": self.body}).encode()
            return "%d %s" % (self.code, self.reason), [("Content-Type", "application/json")], body

    class Unauthorized(JsonError):
        code = 401
        reason = "Unauthorized"

    class Forbidden(JsonError):
        code = 403
        reason = "Forbidden"

    def as_json(error: Error) -> Error:
        """waitress's own refusals (a body past max_body: 413, a malformed request: 400) in JSON."""
        if isinstance(error, JsonError):
            return error
        answer = JsonError(str(error.body))
        answer.code, answer.reason = error.code, error.reason
        return answer

    class BoundedChunks(ChunkedReceiver):
        error: Any  # waitress's attribute, declared for mypy (which cannot infer it in a class inside a function)

        def received(self, s: bytes) -> int:
            consumed = super().received(s)
            if max(len(self.control_line), len(self.trailer)) > MAX_CHUNK_LINE and not self.error:
                self.error = BadRequest("a chunk-size line or trailer longer than %d bytes" % MAX_CHUNK_LINE)
                self.all_chunks_received = self.completed = True
            return consumed

    class Parser(HTTPRequestParser):
        """waitress stores a body (in a temporary file past 1 MB) before the application
        sees its request: a body is read only once `admit` has passed the headers."""

        chunked: bool  # waitress's, declared as in BoundedChunks
        error: Any
        body_rcv: Any
        content_length: int

        def parse_header(self, header_plus: bytes) -> None:
            super().parse_header(header_plus)
            if self.chunked:
                self.body_rcv = BoundedChunks(self.body_rcv.buf)
            forbidden = guard(self.headers) if guard is not None else None  # every request, body or none
            if forbidden is not None:
                self._refuse(Forbidden(forbidden))
            if admit is None or forbidden is not None or not (self.content_length > 0 or self.chunked):
                return
            why = admit(self.command, self.path + ("?" + self.query if self.query else ""), self.headers)
            if why is not None:
                self._refuse(Unauthorized(why))

        def received(self, data: bytes) -> int:
            consumed = super().received(data)
            if self.error is not None:
                self.error = as_json(self.error)
            return consumed

        def _refuse(self, error: Error) -> None:
            self.error = error
            self.completed, self.body_rcv, self.content_length, self.chunked = True, None, 0, False
            self.connection_close = True  # the body's bytes then go nowhere

    class Channel(HTTPChannel):
        parser_class = Parser
        served = False  # has completed a request: closed after those that never did

        def service(self) -> None:
            self.served = True
            super().service()

    class EvictingServer(TcpWSGIServer):
        """waitress stops accepting at its connection limit, which leaves a real client queued
        behind idle connections until they time out; this one closes the idlest instead
        (first those that never sent a whole request)."""

        channel_class = Channel
        next_channel_cleanup: float  # waitress's, declared as in BoundedChunks

        def readable(self) -> bool:
            now = time.time()
            if now >= self.next_channel_cleanup:
                self.next_channel_cleanup = now + self.adj.cleanup_interval
                self.maintenance(now)  # closes connections idle for channel_timeout
            if not self.accepting:
                return False
            excess = len(self.active_channels) + 1 - self.adj.connection_limit
            if excess > 0:
                idle = [c for c in self.active_channels.values() if not c.requests and not c.will_close]
                for channel in heapq.nsmallest(excess, idle, key=lambda c: (c.served, c.total_outbufs_len > 0,
                                                                              c.last_activity)):
                    channel.will_close = True  # closed in this turn of the loop (it is writable)
            return len(self.active_channels) < self.adj.connection_limit + BURST

    return EvictingServer


class HttpServer:
    """One listening socket served by waitress on a thread; see the module's docstring.

    Every write leaves at once (server-sent events: each token when it is generated).
    client_gone: fill `environ["waitress.client_disconnected"]` (waitress checks for a closed
    connection while a request runs, which needs it to read ahead one request).
    pages: False for a server no web page has reason to call (a worker's control plane): a
    request a browser marks as a page's is refused (403); on a loopback address without a
    shared secret (`secret`), one naming another Host is too (`_guard`).
    """

    def __init__(self, app: Callable, host: str, port: int, name: str = "http", threads: int = 8,
                 max_connections: int = 128, idle_timeout: int = 30, max_body_bytes: int = 1 << 30,
                 client_gone: bool = False, admit: Optional[Admit] = None, refusal: Optional[Refusal] = None,
                 pages: bool = True, secret: bool = False) -> None:
        from waitress.adjustments import Adjustments
        from waitress.task import ThreadedTaskDispatcher
        self.name = name
        try:
            adj = Adjustments(
                host=host, port=port, threads=threads, ident="mdi",
                connection_limit=connection_cap(max_connections, threads),
                channel_timeout=idle_timeout, cleanup_interval=max(1, min(5, idle_timeout // 2)),
                backlog=1024, asyncore_use_poll=True,  # select() fails on descriptors past 1023
                max_request_body_size=max_body_bytes,
                channel_request_lookahead=1 if client_gone else 0, log_socket_errors=False)
        except ValueError as e:  # an address that does not resolve
            raise OSError("%s (%s)" % (e, host)) from None
        adj.send_bytes = 1  # flush each write at once: waitress's default, a deprecated option
        # One address (as the development server did): IPv4 first when a name has both.
        listen = sorted(adj.listen, key=lambda info: info[0] != socket.AF_INET)[0]
        dispatcher = ThreadedTaskDispatcher()
        dispatcher.set_thread_count(threads)
        self._map: dict = {}
        try:
            server_class = _server_class(admit, refusal, _guard(host, pages, secret))
            self.server = server_class(app, map=self._map, dispatcher=dispatcher, adj=adj, sockinfo=listen)
        except BaseException:
            dispatcher.shutdown(timeout=1)
            raise
        self.host, self.port = self.server.effective_host, int(self.server.effective_port)
        self.connection_limit = adj.connection_limit
        self._state = "new"  # new -> running -> draining -> closed; only the loop thread acts on it
        self._drain_until = 0.0
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "HttpServer":
        self._state = "running"
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def close(self, grace: float = 1.0) -> None:
        """Stop accepting, give running requests `grace` seconds to finish and their answers
        to leave, then close every connection and stop the threads."""
        if self._thread is None:
            self._close_all()
            return
        if self._state == "running":
            self._drain_until = time.monotonic() + grace
            self._state = "draining"
            try:
                self.server.pull_trigger()  # wake the loop
            except OSError:
                pass  # the loop saw "draining" first, finished and closed the trigger: nothing to wake
        self._thread.join(grace + 10)

    # --- the loop thread ------------------------------------------------------------------
    def _loop(self) -> None:
        from waitress import wasyncore
        server = self.server
        try:
            while self._state == "running":
                wasyncore.loop(timeout=1.0, use_poll=True, map=self._map, count=1)
            server.accepting = False
            server.del_channel(self._map)  # the listening socket: no new connections
            server.socket.close()
            while time.monotonic() < self._drain_until and self._busy():
                wasyncore.loop(timeout=0.05, use_poll=True, map=self._map, count=1)
        except Exception:
            log.exception("%s: the HTTP server loop failed", self.name)
        finally:
            self._close_all()

    def _busy(self) -> bool:
        return any(c.requests or c.total_outbufs_len for c in list(self.server.active_channels.values()))

    def _close_all(self) -> None:
        for obj in list(self._map.values()):
            try:
                if obj is self.server.trigger:
                    continue
                if obj is self.server:
                    obj.socket.close()
                    obj.del_channel(self._map)
                else:
                    obj.handle_close()  # wakes a request thread waiting to write to it
            except Exception:  # closing anyway
                pass
        try:
            self.server.trigger.close()
        except Exception:
            pass
        self._state = "closed"
        self.server.task_dispatcher.shutdown(cancel_pending=True, timeout=5)

    def __enter__(self) -> "HttpServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _guard(host: str, pages: bool, secret: bool) -> Optional[Guard]:
    """What keeps a web page on this machine out (mdi.system.loopback): on a loopback address
    without a secret (which a page cannot know), requests that name another Host (DNS
    rebinding); with `pages` False (a server no page calls), any request a browser marks as a page's."""
    check_host = is_loopback(host) and not secret
    if not check_host and pages:
        return None

    def guard(headers: Dict[str, str]) -> Optional[str]:
        why = foreign_host(headers.get("HOST")) if check_host else None
        return why if why is not None or pages else from_page(headers)
    return guard
