"""Data-plane endpoint: one persistent zmq connection from each node to the next.

A node binds a PULL socket (its previous neighbour connects to it) and connects a PUSH socket
to its next neighbour. A receive thread validates frames into an input FIFO while frames queue
up for a busy compute loop; a send thread drains an output FIFO whenever zmq cannot take a
frame at once. The compute loop never blocks on the network.

On the path of a frame through an idle node nothing hands off between threads: a compute
loop with nothing to do waits on the PULL socket itself, and a frame with nothing queued
before it goes straight into zmq's send queue (zmq's own I/O thread moves bytes in the
background either way). Each hand-off wakes a thread, which costs ~100 us per hop on a 2-CPU
machine (scripts/bench_transport.py: 227 vs 118 us per hop). zmq sockets are not thread-safe,
so each socket has exactly one user at a time, handed over as described where it happens.

With a shared secret every link runs zmq's CURVE mechanism with the run's keys
(`mdi.ring.auth.ring_keys`): the PULL socket only admits a client holding the run's client key,
the PUSH socket only talks to a server holding the run's server key, and frames are encrypted
(scripts/bench_transport.py measures what that costs per hop).
"""
import collections
from dataclasses import dataclass
import itertools
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol

import zmq

from mdi.ring.auth import allow_client, ring_keys
from mdi.ring.wire import CODECS, DEFAULT_MAX_PAYLOAD, MAX_HEADER_BYTES, Frame, FrameError, encode

log = logging.getLogger(__name__)

POLL_MS = 50
# Send flags as plain ints: pyzmq's flags are enum.IntFlag, whose | runs enum's Python code,
# cold on a hop after each graph.
_SEND_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_SEND_LAST = int(zmq.NOBLOCK)
# Dropped frames are logged one by one this many times, then summed up at most once per
# DROP_SUMMARY_S: a flood of garbage on a data port wrote 104 MB of log in 11 s, one line per frame.
DROP_LINES = 5
DROP_SUMMARY_S = 10.0
MAX_MESSAGE_BYTES = DEFAULT_MAX_PAYLOAD + MAX_HEADER_BYTES
_endpoint_ids = itertools.count()


class RingTimeout(RuntimeError):
    """No frame arrived within the wait; the message says how long and where."""


class Transport(Protocol):
    """What the starter's pipeline needs of a data plane: a ring of sockets or a local loop."""

    def send(self, frame: Frame) -> None: ...

    def recv(self, timeout: float) -> Frame: ...

    def recv_nowait(self) -> Optional[Frame]: ...

    def traffic(self) -> Dict[str, Any]: ...


@dataclass
class Deferred:
    """A frame's rows that a one-node ring computes when it takes the frame back (LocalLoop):
    frames waiting in the loop then hold no activations, only the ones being read do (a head's
    logits are 1 MB a sample on a 262k vocabulary). Taken in the order sent, so every pass and
    its cache ops run in that order, as on a ring."""
    compute: Callable[[], Any]


class LocalLoop:
    """Transport of a one-node ring: what the starter sends comes straight back (Deferred rows computed then)."""

    def __init__(self) -> None:
        self.queue: Deque[Frame] = collections.deque()

    def send(self, frame: Frame) -> None:
        self.queue.append(frame)

    def recv(self, timeout: float) -> Frame:
        if not self.queue:
            raise RingTimeout("local loop is empty")
        return self._take()

    def recv_nowait(self) -> Optional[Frame]:
        return self._take() if self.queue else None

    def _take(self) -> Frame:
        frame = self.queue.popleft()
        if isinstance(frame.tensor, Deferred):
            frame.tensor = frame.tensor.compute()
        return frame

    def traffic(self) -> Dict[str, Any]:
        return {"bytes_sent": 0, "messages_sent": 0}


class RingEndpoint:
    """One node's data plane. send/recv/flush are for one caller thread: the compute loop.
    `password`: the run's data-plane secret (`ring_password`), which only seeds the run's CURVE
    keys and is never sent; None: no authentication, no encryption. `codec`: how this node encodes
    the activations it sends (`mdi.ring.wire.CODECS`); receivers read it from each frame's header."""

    def __init__(self, name: str, bind_host: str, bind_port: int,
                 validate: Callable[[List[zmq.Frame]], Frame], password: Optional[str] = None,
                 codec: str = "raw") -> None:
        if codec not in CODECS:
            raise ValueError("%s: unknown data-plane codec %r (known: %s)" % (name, codec, ", ".join(CODECS)))
        self.name = name
        self.codec = codec
        self.validate = validate
        self.password = password
        self.ctx: zmq.Context = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        # zmq drops larger message *parts* itself; a message of many parts is buffered whole by libzmq
        # before any is read (only CURVE, with a token, keeps strangers from sending one)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.keys = None
        self._zap_domain = "mdi-ring-%d" % next(_endpoint_ids)
        if password is not None:
            # CURVE: only nodes that derived this run's keys may connect; frames are encrypted.
            if not zmq.has("curve"):
                self.pull.close(linger=0)
                raise RuntimeError("%s: this libzmq has no CURVE support, so the data plane cannot be "
                                   "authenticated (install pyzmq from its wheel, which bundles it)" % name)
            self.keys = ring_keys(password)
            allow_client(self.ctx, self._zap_domain, self.keys.client_public)
            self.pull.zap_domain = self._zap_domain.encode()
            self.pull.curve_server = True
            self.pull.curve_secretkey = self.keys.server_secret
            self.pull.curve_publickey = self.keys.server_public
        try:
            self._bind(bind_host, bind_port)
        except RuntimeError:
            if self.keys is not None:
                allow_client(self.ctx, self._zap_domain, None)
            raise
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.bytes_sent = 0
        self.messages_sent = 0
        self.bytes_by_kind: Dict[str, int] = {}
        self.messages_by_kind: Dict[str, int] = {}
        self.frames_received = 0
        self.bad_frames = 0
        self.last_error: Optional[str] = None
        self._unsaid_drops = 0  # dropped since the last line about them
        self._drops_said_at = 0.0
        self._stop = threading.Event()
        # Receiving: the PULL socket belongs to whoever holds _pull_lock. The compute loop
        # lends it (sets _lent) when it finds frames queued up behind the one it took, so the
        # receive thread validates them while it computes; it takes the socket back by clearing
        # _lent and waking the receive thread's poll through an inproc pair.
        self._pull_lock = threading.Lock()
        self._pull_poller = zmq.Poller()
        self._pull_poller.register(self.pull, zmq.POLLIN)
        self._lent = threading.Event()
        # Set when recv found the socket empty behind the frame it returned, so the caller's
        # read-ahead (recv_nowait) skips a poll that would find nothing: one poll costs a decode
        # hop 13 us of cold Python. Cleared by that recv_nowait and by the next send or recv.
        self._drained = False
        wake = "inproc://mdi-wake-%d" % next(_endpoint_ids)
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        # Sending: the send thread uses the PUSH socket only while frames wait in the outbox
        # (_queued > _left, each counter written by one side); otherwise the compute loop does.
        self._push: Optional[zmq.Socket] = None
        self._queued = 0  # frames put in the outbox (by the compute loop)
        self._left = 0  # outbox frames handed to zmq (by the send thread)
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
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            push.curve_secretkey = self.keys.client_secret
            push.curve_publickey = self.keys.client_public
            push.curve_serverkey = self.keys.server_public
        try:
            push.connect("tcp://%s:%d" % (host, port))
        except zmq.ZMQError as e:
            push.close(linger=0)
            raise RuntimeError("%s: cannot connect to the next node at %s:%d: %s" % (self.name, host, port, e))
        self._push = push
        self._sender.start()

    # --- called by the compute loop --------------------------------------------------
    def send(self, frame: Frame) -> None:
        """Queue a frame for the next node; never blocks. With nothing queued before it and
        room in zmq's queue it is handed to zmq here, else to the send thread."""
        self._drained = False  # (recv_nowait's skip is for the call right after a recv only)
        if self._push is not None and self._queued == self._left:
            header, payload = encode(frame, self.codec)
            try:
                # send_multipart's loop in two calls: zmq queues a message's later parts
                # whenever it took its first, so only the first can raise Again
                self._push.send(header, _SEND_MORE, copy=False)
                self._push.send(payload, _SEND_LAST, copy=False)
                self._count(frame.kind, len(header) + len(payload))
                return
            except zmq.Again:  # zmq's queue is full: the neighbour is slow or gone
                pass
        self._queued += 1
        self.outbox.put(frame)

    def recv(self, timeout: float) -> Frame:
        """The next valid frame; RingTimeout after `timeout` seconds without one."""
        self._drained = False
        if not self.inbox.empty():  # the receive thread has been filling it (only this thread takes)
            return self.inbox.get_nowait()
        return self._recv_from_socket(timeout)

    def recv_nowait(self) -> Optional[Frame]:
        """A valid frame that is already here, else None at once (a compute loop gathering
        the frames queued behind the one it took, to run them in one forward). Called right
        after a recv that found nothing behind its frame, before any send or recv, it returns
        None without looking: what arrives meanwhile comes with the next call."""
        if not self.inbox.empty():
            return self.inbox.get_nowait()
        if self._drained:  # recv found nothing behind the frame it returned just now: no poll again
            self._drained = False
            return None
        # Lent: the receive thread reads the socket and puts what comes into the inbox.
        if self._lent.is_set() or not self._pull_lock.acquire(blocking=False):
            return None
        try:
            while self._readable(0):
                frame = self._read_frame()
                if frame is not None:
                    return frame
            return None
        finally:
            self._pull_lock.release()

    def _recv_from_socket(self, timeout: float) -> Frame:
        deadline = time.monotonic() + timeout
        if self._lent.is_set():
            self._lent.clear()
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # wake-ups are already waiting for the receive thread
        if not self._pull_lock.acquire(timeout=timeout):
            raise RingTimeout("%s: the receive thread did not hand the socket back in %.1f s" % (self.name, timeout))
        try:
            if not self.inbox.empty():
                return self.inbox.get_nowait()  # taken by the receive thread before it let go
            polled = False
            while True:
                remaining = deadline - time.monotonic()
                # recv(0) still looks once: a frame waiting on the socket is taken, not a RingTimeout
                if (remaining <= 0 and polled) or not self._readable(max(0, math.ceil(remaining * 1000))):
                    raise RingTimeout("%s: no frame received for %.1f s" % (self.name, timeout))
                polled = True
                frame = self._read_frame()
                if frame is not None:
                    if self._readable(0):
                        # More frames wait already: the node is saturated, so the receive
                        # thread validates them into the inbox while the caller computes.
                        self._lent.set()
                    else:  # a recv_nowait right after this (the caller reading ahead) finds nothing
                        self._drained = True
                    return frame
        finally:
            self._pull_lock.release()

    def _readable(self, timeout_ms: int) -> bool:
        """Whether a message waits on the PULL socket (within timeout_ms); the caller holds it.
        One poller kept, where socket.poll builds one each call."""
        return bool(self._pull_poller.poll(timeout_ms))

    def flush(self, timeout: float) -> bool:
        """Wait until every queued frame has left; False if that took longer than timeout."""
        deadline = time.monotonic() + timeout
        while self._left < self._queued and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._left >= self._queued

    def close(self) -> None:
        if self._unsaid_drops:  # a burst's drops past the first lines, never counted in a line yet
            log.warning("%s: dropped %d more frames (%d in all; the last: %s)", self.name, self._unsaid_drops,
                        self.bad_frames, self.last_error)
            self._unsaid_drops = 0
        self._stop.set()
        for t in (self._receiver, self._sender):
            if t.is_alive():
                t.join(timeout=2)
        # Closing a socket under a thread that is using it would crash libzmq: wait (briefly)
        # for a compute loop still waiting on the PULL socket to let go of it.
        holding = self._pull_lock.acquire(timeout=2)
        for sock in (self.pull, self._push, self._wake_rx, self._wake_tx):
            if sock is not None:
                sock.close(linger=0)
        if holding:
            self._pull_lock.release()
        if self.keys is not None:
            allow_client(self.ctx, self._zap_domain, None)

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

    def _read_frame(self) -> Optional[Frame]:
        """Receive and validate one message (the caller holds the socket); None if dropped."""
        # recv_multipart's loop, asking each part whether more follow (the frame knows; pyzmq's
        # recv_multipart asks the socket through Python code, twice a message)
        part = self.pull.recv(copy=False)
        parts = [part]
        extra = 0
        while part.more:
            part = self.pull.recv(copy=False)
            if len(parts) < 2:
                parts.append(part)
            else:  # a frame has 2 parts: the rest are drained unkept (a million empty parts had held 245 MB)
                extra += 1
        try:
            if extra:
                raise FrameError("expected 2 parts (header, payload), got %d" % (2 + extra))
            frame = self.validate(parts)
        except FrameError as e:
            self._dropped(parts, e)
            return None
        self.frames_received += 1
        return frame

    def dropped_after_decode(self, why: str) -> None:
        """A frame the wire admitted but this node's compute loop cannot use: logged as a drop."""
        self._dropped([], FrameError(why), "the ring")  # (its message parts are gone: no address to name)

    def _dropped(self, parts: List[zmq.Frame], e: FrameError, sender: Optional[str] = None) -> None:
        self.bad_frames += 1
        self.last_error = str(e)
        try:  # the sender's address, as zmq saw the connection
            peer = sender or str(parts[0].get("Peer-Address"))
        except (zmq.ZMQError, AttributeError, IndexError):
            peer = "an unknown peer"
        now = time.monotonic()
        if self.bad_frames <= DROP_LINES:
            log.warning("%s: dropped a frame from %s: %s", self.name, peer, e)
            self._drops_said_at = now
            return
        self._unsaid_drops += 1
        if now - self._drops_said_at >= DROP_SUMMARY_S:
            log.warning("%s: dropped %d more frames in %.0f s (%d in all; the last from %s: %s)", self.name,
                        self._unsaid_drops, now - self._drops_said_at, self.bad_frames, peer, e)
            self._unsaid_drops, self._drops_said_at = 0, now

    # --- threads ---------------------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            if not self._lent.wait(POLL_MS / 1000.0):
                continue
            with self._pull_lock:
                while self._lent.is_set() and not self._stop.is_set():
                    ready = dict(poller.poll(POLL_MS))
                    if self._wake_rx in ready:
                        while self._wake_rx.poll(0):
                            self._wake_rx.recv()
                    if self.pull in ready:
                        frame = self._read_frame()
                        if frame is not None:
                            self.inbox.put(frame)

    def _send_loop(self) -> None:
        push = self._push
        assert push is not None  # connect() sets the PUSH socket before it starts this thread
        while not self._stop.is_set():
            try:
                frame = self.outbox.get(timeout=POLL_MS / 1000.0)
            except queue.Empty:
                continue
            parts = encode(frame, self.codec)
            while not self._stop.is_set():
                # Bounded wait so a vanished neighbour cannot wedge this thread forever.
                if push.poll(POLL_MS, zmq.POLLOUT):
                    push.send_multipart(parts, copy=False)
                    self._count(frame.kind, sum(len(p) for p in parts))
                    break
            self._left += 1
