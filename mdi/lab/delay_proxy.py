"""A userspace stand-in for `netem delay`: a TCP forwarder that delays every byte, and a way
to make its listening socket inside another network namespace."""
import ctypes
import os
import queue
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000


class DelayProxy:
    """A TCP forwarder that delivers every byte `delay_s` after it arrived, in both directions.

    It stands in for `netem delay`: the listening socket may have been made in another network
    namespace (see listen_in_netns), the outgoing connections are made from this process's.
    """

    def __init__(self, listener: socket.socket, target: Tuple[str, int], delay_s: float,
                 name: str = "proxy") -> None:
        self.listener, self.target, self.delay_s, self.name = listener, target, delay_s, name
        self._stop = threading.Event()
        self._socks: List[socket.socket] = []
        self._lock = threading.Lock()
        self.listener.settimeout(0.5)  # so the accept loop notices close()
        self._thread = threading.Thread(target=self._accept_loop, name="mdi-%s" % name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the target is down: the client sees a reset, as it would directly
                continue
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.extend([client, upstream])
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(src, q), daemon=True).start()
        threading.Thread(target=self._deliver, args=(dst, q), daemon=True).start()

    def _read(self, src: socket.socket, q: "queue.Queue") -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            q.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _deliver(self, dst: socket.socket, q: "queue.Queue") -> None:
        while not self._stop.is_set():
            try:
                due, data = q.get(timeout=0.5)
            except queue.Empty:
                continue
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)  # pass the end of stream on, after the delay too
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        socks = [self.listener]
        with self._lock:
            socks.extend(self._socks)
            self._socks = []
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        self._thread.join(timeout=2)


def listen_in_netns(netns: Optional[str], host: str, port: int) -> socket.socket:
    """A listening TCP socket bound inside a named network namespace (None: this one).

    setns() changes the namespace of the calling thread only, so a short-lived thread
    switches, creates the socket (which keeps its namespace) and ends.
    """
    if netns is None:
        return _listener(host, port)
    out: Dict[str, Any] = {}

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        target = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, "setns(%s): %s" % (netns, os.strerror(err)))
            out["sock"] = _listener(host, port)
        except BaseException as e:
            out["error"] = e
        finally:
            os.close(target)  # the thread ends here, still in `netns`: nothing else runs on it

    t = threading.Thread(target=work, name="mdi-setns", daemon=True)
    t.start()
    t.join(timeout=10)
    if "sock" not in out:
        raise out.get("error") or OSError("creating a socket in namespace %s timed out" % netns)
    return out["sock"]


def _listener(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(16)
    return s
