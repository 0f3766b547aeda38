"""The data-plane endpoint on its own: nothing lost, nothing reordered, whichever thread
holds each socket (the compute loop when idle, the receive/send threads when busy)."""
import random
import time

import msgpack
import pytest
import torch
import zmq

from conftest import free_ports
from mdi.ring.transport import RingEndpoint
from mdi.ring.wire import INT8_BLOCK, Frame, decode, encode, quantize_int8_blocks

HIDDEN = 8


def endpoint(name, bind_port, next_port):
    ep = RingEndpoint(name, "127.0.0.1", bind_port,
                      lambda parts: decode(parts, run=7, hidden=HIDDEN, n_slots=4, max_len=1 << 20))
    ep.connect("127.0.0.1", next_port)
    return ep


def pusher(port):
    """A third party's socket sending to an endpoint's port."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("tcp://127.0.0.1:%d" % port)
    return sock


def numbered(i):
    """A decode frame whose position is its sequence number and whose tensor repeats it."""
    return Frame("decode", 7, [i % 4], [i], [1], torch.full((1, HIDDEN), float(i)))


def check(frame, i):
    assert (frame.start[0], frame.samples[0]) == (i, i % 4)
    assert torch.equal(frame.tensor, torch.full((1, HIDDEN), float(i)))


def test_frames_arrive_in_order_whether_the_receiver_waits_or_computes():
    a_port, b_port = free_ports(2)
    a, b = endpoint("a", a_port, b_port), endpoint("b", b_port, a_port)
    # A third party sends malformed messages to b in between: dropped and counted, never delivered.
    intruder = pusher(b_port)
    rng = random.Random(3)
    try:
        sent = got = bad = 0
        total = 3000
        while got < total:
            # Bursts pile frames up while b "computes" (the receive thread takes them) and
            # gaps leave b waiting on the socket itself; both must keep the order.
            for _ in range(min(rng.choice([0, 1, 1, 5, 40]), total - sent)):
                a.send(numbered(sent))
                sent += 1
            if rng.random() < 0.05:
                intruder.send_multipart([msgpack.packb({"v": 1, "kind": "decode"}), b"x"])
                bad += 1
            if sent > got:
                check(b.recv(timeout=10), got)
                got += 1
                if rng.random() < 0.3:
                    time.sleep(rng.choice([0.0002, 0.002]))
        assert b.frames_received == total
        deadline = time.monotonic() + 10
        while b.bad_frames < bad and time.monotonic() < deadline:
            time.sleep(0.01)  # the last intruder messages may still be on their way
        assert b.bad_frames == bad and "header" in b.last_error
        assert a.flush(5) and a.messages_sent == total
    finally:
        intruder.close(linger=0)
        a.close()
        b.close()


def test_a_blocked_link_hands_frames_to_the_send_thread_in_order_and_send_never_blocks():
    a_port, b_port = free_ports(2)
    a = RingEndpoint("a", "127.0.0.1", a_port, lambda parts: decode(parts, run=7))
    a.connect("127.0.0.1", b_port)  # nobody listens there yet: zmq queues, then would block
    b = None
    try:
        total = 2500  # more than zmq's send queue holds (high-water mark 1000)
        for i in range(total):
            a.send(numbered(i))
        assert not a.flush(0.2)  # frames wait in the outbox: the link is blocked
        b = RingEndpoint("b", "127.0.0.1", b_port,
                         lambda parts: decode(parts, run=7, hidden=HIDDEN, n_slots=4, max_len=1 << 20))
        b.connect("127.0.0.1", a_port)
        for i in range(total):
            check(b.recv(timeout=10), i)
        assert a.flush(10)
        for i in range(total, total + 50):  # the link is free again: straight to zmq
            a.send(numbered(i))
            check(b.recv(timeout=10), i)
        assert a.messages_sent == total + 50
    finally:
        a.close()
        if b is not None:
            b.close()


def test_recv_times_out_naming_the_node():
    a_port, b_port = free_ports(2)
    a = endpoint("starter", a_port, b_port)
    try:
        t0 = time.monotonic()
        try:
            a.recv(timeout=0.3)
        except RuntimeError as e:
            assert "starter" in str(e)
        else:
            raise AssertionError("recv returned without a frame")
        assert time.monotonic() - t0 >= 0.25
    finally:
        a.close()


def test_int8_endpoints_pass_frames_within_the_codecs_tolerance():
    """The sender encodes with its own codec; the receiver reads the codec from the header."""
    a_port, b_port = free_ports(2)
    hidden = 100  # a short last block in every row
    a = RingEndpoint("a", "127.0.0.1", a_port, lambda parts: decode(parts, run=7), codec="int8")
    b = RingEndpoint("b", "127.0.0.1", b_port, lambda parts: decode(parts, run=7, hidden=hidden, n_slots=4),
                     codec="int8")
    a.connect("127.0.0.1", b_port)
    b.connect("127.0.0.1", a_port)
    try:
        assert (a.codec, b.codec) == ("int8", "int8")
        x = torch.randn(5, hidden) * 4
        x[1, :32] = 0
        frame = Frame("prefill", 7, [0, 3], [0, 9], [2, 3], x)
        a.send(frame)
        got = b.recv(timeout=10)
        assert (got.samples, got.start, got.count) == ([0, 3], [0, 9], [2, 3])
        assert got.tensor.dtype == torch.float32 and got.tensor.shape == (5, hidden)
        _, scales = quantize_int8_blocks(x)
        half_scale = scales.float().repeat_interleave(INT8_BLOCK, dim=1)[:, :hidden] / 2
        assert ((got.tensor - x).abs() <= half_scale + x.abs() * 2 ** -11).all()
        assert (got.tensor[1, :32] == 0).all() and not torch.equal(got.tensor, x)
        assert a.flush(5) and a.bytes_sent == sum(len(p) for p in encode(frame, "int8"))
        assert a.bytes_sent < 5 * hidden * 4 / 3  # int8 + scales, not float32
    finally:
        a.close()
        b.close()


def test_a_compute_loop_reading_ahead_loses_and_reorders_nothing():
    """A worker's loop: wait for a frame, read ahead what waits behind it (recv_nowait), compute.
    A read-ahead right after a frame that had nothing behind it skips its poll; what arrives
    then comes with the next call, in order, whether frames trickle or pile up."""
    a_port, b_port = free_ports(2)
    a, b = endpoint("a", a_port, b_port), endpoint("b", b_port, a_port)
    rng = random.Random(5)
    try:
        sent = got = 0
        total = 1500
        while got < total:
            for _ in range(min(rng.choice([1, 1, 2, 8]), total - sent)):
                a.send(numbered(sent))
                sent += 1
            if sent == got:
                continue
            frames = [b.recv(timeout=10)]
            if rng.random() < 0.3:
                time.sleep(0.001)  # frames still in flight arrive meanwhile, behind the one taken
            while len(frames) < 4:
                more = b.recv_nowait()
                if more is None:
                    break
                frames.append(more)
            for frame in frames:
                check(frame, got)
                got += 1
        assert b.recv_nowait() is None and b.frames_received == total
    finally:
        a.close()
        b.close()


def test_an_unknown_codec_is_refused_before_binding():
    with pytest.raises(ValueError, match="unknown data-plane codec 'int4'"):
        RingEndpoint("a", "127.0.0.1", free_ports(1)[0], lambda parts: decode(parts), codec="int4")


def test_a_flood_of_garbage_is_refused_in_a_few_lines_naming_its_sender(caplog):
    """One log line per dropped frame let a flood of garbage write 104 MB of log in 11 s; the
    lines named no sender. Real frames still pass between the garbage."""
    from mdi.ring import transport
    a_port, b_port = free_ports(2)
    a = endpoint("board1", a_port, b_port)
    b = endpoint("board2", b_port, a_port)
    junk = pusher(b_port)
    try:
        for _ in range(200):
            junk.send_multipart([b"not msgpack", b""])
        a.send(numbered(1))
        with caplog.at_level("WARNING", logger="mdi.ring.transport"):
            got, deadline = None, time.monotonic() + 60
            while got is None or b.bad_frames < 200:  # each call reads what waits, dropping the garbage
                assert time.monotonic() < deadline, b.bad_frames
                got = b.recv_nowait() or got
                time.sleep(0.01)
        check(got, 1)
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert transport.DROP_LINES <= len(lines) <= transport.DROP_LINES + 2, lines  # (+ a summary per 10 s)
        assert all("from 127.0.0.1" in line for line in lines), lines
        with caplog.at_level("WARNING", logger="mdi.ring.transport"):
            b.close()  # what was not counted in a line yet is, as the endpoint closes
        assert "(200 in all; the last: " in caplog.records[-1].getMessage(), caplog.records[-1].getMessage()
    finally:
        junk.close(0)
        a.close()
        b.close()


def test_a_message_of_many_parts_is_dropped_unkept_and_recv_0_takes_what_waits():
    a_port, b_port = free_ports(2)
    a, b = endpoint("a", a_port, b_port), endpoint("b", b_port, a_port)
    intruder = pusher(b_port)
    try:
        header, payload = encode(numbered(0))
        # A valid frame's two parts followed by 20,000 empty ones: dropped as one bad frame
        # (its extra parts drained, not held), and the ring's next frame still comes through.
        intruder.send_multipart([header, payload] + [b""] * 20000)
        a.send(numbered(1))
        check(b.recv(timeout=10), 1)
        assert b.bad_frames == 1 and "got 20002" in b.last_error
        # recv(0) looks at the socket once: a frame waiting there is taken, not a timeout.
        a.send(numbered(2))
        deadline = time.monotonic() + 10
        while not b._readable(10) and time.monotonic() < deadline:
            pass
        check(b.recv(0.0), 2)
        assert b.recv_nowait() is None
    finally:
        intruder.close(linger=0)
        a.close()
        b.close()
