#!/usr/bin/env python
"""The data plane alone: how long does one hop take with no model at all?

Two processes, each with a real `RingEndpoint` (receive thread -> input FIFO -> the caller ->
output FIFO -> send thread, zmq over loopback), pass one decode-sized frame back and forth.
Each round trip is two hops, so

    per-hop latency = median round-trip time / 2

This is the floor under bench_ring.py's per-hop overhead (which adds the worker's compute
loop around it) and shows how much of that overhead the transport itself is. In the same run,
the same ping-pong with the caller owning the zmq sockets (same encoding and validation, no
receive/send threads or FIFOs) shows what those threads cost.

    python scripts/bench_transport.py                   # hidden 576 (SmolLM2), float32
    python scripts/bench_transport.py --hidden 128 --rounds 5000
"""
import argparse
import statistics
import subprocess
import sys
import time

import benchlib
from benchlib import free_ports


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576, help="floats per frame (default 576, SmolLM2)")
    p.add_argument("--rounds", type=int, default=2000, help="round trips timed (default 2000)")
    p.add_argument("--repeats", type=int, default=3, help="runs of --rounds each (default 3)")
    p.add_argument("--out", help="write the record as JSON here")
    p.add_argument("--echo", nargs=2, type=int, metavar=("BIND", "NEXT"), help=argparse.SUPPRESS)
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class DirectEndpoint:
    """RingEndpoint's send/recv without its threads: the caller's thread owns both sockets."""

    def __init__(self, bind: int, nxt: int, validate) -> None:
        import zmq
        ctx = zmq.Context.instance()
        self.pull, self.push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.pull.bind("tcp://127.0.0.1:%d" % bind)
        self.push.connect("tcp://127.0.0.1:%d" % nxt)
        self.validate = validate

    def send(self, frame) -> None:
        from mdi.wire import encode
        self.push.send_multipart(encode(frame), copy=False)

    def recv(self, timeout: float):
        if not self.pull.poll(int(timeout * 1000)):
            raise TimeoutError("no frame within %.0f s" % timeout)
        return self.validate(self.pull.recv_multipart(copy=False))

    def flush(self, timeout: float) -> None:
        pass  # send_multipart has handed the frame to zmq already

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=1000)


def endpoint(name: str, bind: int, nxt: int, hidden: int, direct: bool):
    from mdi.transport import RingEndpoint
    from mdi.wire import decode
    validate = lambda parts: decode(parts, run=1, hidden=hidden, n_slots=1)  # noqa: E731
    if direct:
        return DirectEndpoint(bind, nxt, validate)
    ep = RingEndpoint(name, "127.0.0.1", bind, validate)
    ep.connect("127.0.0.1", nxt)
    return ep


def echo(bind: int, nxt: int, hidden: int, direct: bool) -> int:
    """The other end: send every frame straight back, until a stop frame."""
    ep = endpoint("echo", bind, nxt, hidden, direct)
    print("ready", flush=True)
    while True:
        frame = ep.recv(timeout=60)
        ep.send(frame)
        if frame.kind == "stop":
            ep.flush(5)
            ep.close()
            return 0


def one_run(args, direct: bool) -> float:
    """Per-hop seconds: median round trip / 2 over --rounds, with a fresh echo process."""
    import torch
    from mdi.wire import Frame
    mine, theirs = free_ports(2)
    cmd = [sys.executable, __file__, "--hidden", str(args.hidden), "--echo", str(theirs), str(mine)]
    child = subprocess.Popen(cmd + (["--direct"] if direct else []), stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo process did not start")
        ep = endpoint("bench", mine, theirs, args.hidden, direct)
        x = torch.randn(1, args.hidden)
        for _ in range(200):  # warm-up: connections, allocator, caches
            ep.send(Frame("decode", 1, [0], [5], [1], x))
            ep.recv(timeout=10)
        rtts = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            ep.send(Frame("decode", 1, [0], [5], [1], x))
            ep.recv(timeout=10)
            rtts.append(time.perf_counter() - t0)
        ep.send(Frame("stop", 1))
        ep.recv(timeout=10)
        ep.flush(5)
        ep.close()
        child.wait(timeout=10)
        return statistics.median(rtts) / 2
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.echo:
        return echo(args.echo[0], args.echo[1], args.hidden, args.direct)
    info = benchlib.machine_info(1)
    threaded, direct = [], []
    for r in range(args.repeats):  # interleaved, so slow phases of the machine hit both
        threaded.append(one_run(args, direct=False))
        direct.append(one_run(args, direct=True))
        print("  run %d: RingEndpoint %.0f us per hop, caller-owned sockets %.0f us (median of %d round trips / 2)"
              % (r + 1, threaded[-1] * 1e6, direct[-1] * 1e6, args.rounds), flush=True)
    s, d = benchlib.summarize(threaded), benchlib.summarize(direct)
    ratio = benchlib.summarize([t / x for t, x in zip(threaded, direct)])
    benchlib.finish_machine_info(info)
    print("\nper-hop latency, %d floats float32: RingEndpoint %s us, caller-owned sockets %s us, ratio %s\n%s" % (
        args.hidden, benchlib.fmt_stat(s, "%.0f", 1e6), benchlib.fmt_stat(d, "%.0f", 1e6),
        benchlib.fmt_stat(ratio, "%.2f"), benchlib.note_load(info)))
    if args.out:
        benchlib.save_record(args.out, {"benchmark": "bench_transport", "args": vars(args), "machine": info,
                                        "per_hop_s": s, "direct_per_hop_s": d, "ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
