"""Data-plane endpoint: one persistent zmq connection from each node to the next.

A node binds a PULL socket (its previous neighbour connects to it) and connects a PUSH socket
to its next neighbour. A receive thread validates frames into an input FIFO; a send thread
drains an output FIFO. The compute loop only touches the two FIFOs, so it never blocks on the
network. Each zmq socket is used by exactly one thread (zmq sockets are not thread-safe).
"""
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import zmq

from .auth import plain_authenticator
from .pipeline import RingTimeout
from .wire import DEFAULT_MAX_PAYLOAD, MAX_HEADER_BYTES, Frame, FrameError, encode

log = logging.getLogger("mdi.transport")

POLL_MS = 50
MAX_MESSAGE_BYTES = DEFAULT_MAX_PAYLOAD + MAX_HEADER_BYTES


class RingEndpoint:
    def __init__(self, name: str, bind_host: str, bind_port: int,
                 validate: Callable[[List[zmq.Frame]], Frame], password: Optional[str] = None) -> None:
        self.name = name
        self.validate = validate
        self.password = password
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # zmq drops larger messages itself
        if password is not None:
            # zmq PLAIN handshake: only peers that know this run's password may connect.
            plain_authenticator(self.ctx).configure_plain(domain="*", passwords={"mdi": password})
            self.pull.plain_server = True
        self._bind(bind_host, bind_port)
        self.inbox = queue.Queue()  # type: queue.Queue
        self.outbox = queue.Queue()  # type: queue.Queue
        self.bytes_sent = 0
        self.messages_sent = 0
        self.bytes_by_kind = {}  # type: Dict[str, int]
        self.messages_by_kind = {}  # type: Dict[str, int]
        self.frames_received = 0
        self.bad_frames = 0
        self.last_error = None  # type: Optional[str]
        self._next = None  # type: Optional[str]
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._receiver = threading.Thread(target=self._receive_loop, name=name + "-recv", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name=name + "-send", daemon=True)
        self._receiver.start()

    def _bind(self, host: str, port: int, patience: float = 3.0) -> None:
        # zmq closes sockets asynchronously, so the previous run's socket on this port may
        # still be going away: retry briefly instead of failing the run.
        deadline = time.monotonic() + patience
        while True:
            try:
                self.pull.bind("tcp://%s:%d" % (host, port))
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    self.pull.close(linger=0)
                    raise RuntimeError("%s: cannot bind data port %s:%d: %s" % (self.name, host, port, e))
                time.sleep(0.05)

    def connect(self, host: str, port: int) -> None:
        """Start sending to the next node (zmq reconnects by itself if it restarts)."""
        self._next = "tcp://%s:%d" % (host, port)
        self._sender.start()

    # --- called by the compute loop --------------------------------------------------
    def send(self, frame: Frame) -> None:
        self.outbox.put(frame)

    def recv(self, timeout: float) -> Frame:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise RingTimeout("%s: no frame received for %.1f s" % (self.name, timeout))

    def flush(self, timeout: float) -> bool:
        """Wait until every queued frame has left; False if that took longer than timeout."""
        deadline = time.monotonic() + timeout
        while self.outbox.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.outbox.unfinished_tasks

    def close(self) -> None:
        self._stop.set()
        for t in (self._receiver, self._sender):
            if t.is_alive():
                t.join(timeout=2)
        self.pull.close(linger=0)

    def _count(self, kind: str, nbytes: int) -> None:
        self.messages_sent += 1
        self.bytes_sent += nbytes
        self.messages_by_kind[kind] = self.messages_by_kind.get(kind, 0) + 1
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes

    def traffic(self) -> Dict[str, Any]:
        """Counters for the metrics record."""
        return {"bytes_sent": self.bytes_sent, "messages_sent": self.messages_sent,
                "bytes_sent_by_kind": dict(self.bytes_by_kind),
                "messages_sent_by_kind": dict(self.messages_by_kind)}

    # --- threads ---------------------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            parts = self.pull.recv_multipart(copy=False)
            try:
                frame = self.validate(parts)
            except FrameError as e:
                self.bad_frames += 1
                self.last_error = str(e)
                log.warning("%s: dropped a frame: %s", self.name, e)
                continue
            self.frames_received += 1
            self.inbox.put(frame)

    def _send_loop(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if self.password is not None:
            push.plain_username = b"mdi"
            push.plain_password = self.password.encode()
        push.connect(self._next)
        try:
            while not self._stop.is_set():
                try:
                    frame = self.outbox.get(timeout=POLL_MS / 1000.0)
                except queue.Empty:
                    continue
                parts = encode(frame)
                while not self._stop.is_set():
                    # Bounded wait so a vanished neighbour cannot wedge this thread forever.
                    if push.poll(POLL_MS, zmq.POLLOUT):
                        push.send_multipart(parts, copy=False)
                        self._count(frame.kind, sum(len(p) for p in parts))
                        break
                self.outbox.task_done()
        finally:
            push.close(linger=0)
