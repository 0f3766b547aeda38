#!/usr/bin/env python
"""The data plane alone: how long does one hop take with no model at all?

Two processes pass one decode-sized frame back and forth over loopback zmq; each round trip
is two hops, so per-hop latency = median round-trip time / 2. Three endpoints, interleaved in
one run so that slow phases of the machine hit all alike:

  ring     mdi's `RingEndpoint`: an idle node receives and sends on its own thread, the
           receive/send threads take over only while frames queue up
  curve    the same with a shared secret: zmq CURVE, every frame encrypted and authenticated
           (keys derived from the secret and the run, mdi/ring/auth.py)
  handoff  every frame through a receive thread -> input FIFO -> the caller -> output FIFO ->
           send thread (mdi's first design, and MDI-LLM's)
  direct   the caller owns the zmq sockets, no threads at all: the floor

All use the same encoding and validation. This is the floor under bench_ring.py's
per-hop overhead, which adds the node's own work around it. `curve / ring` is what encryption
costs per hop, as a ratio within each repeat.

    python scripts/bench_transport.py                   # hidden 576 (SmolLM2), float32
    python scripts/bench_transport.py --hidden 128 --rounds 5000
    python scripts/bench_transport.py --variants ring curve --hidden 73728   # a 128-position prefill
"""
import argparse
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List  # noqa: F401  (type comments)

import benchlib
from benchlib import free_ports

VARIANTS = ("ring", "curve", "handoff", "direct")
BENCH_SECRET = "bench-transport-secret"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576, help="floats per frame (default 576, SmolLM2)")
    p.add_argument("--rounds", type=int, default=2000, help="round trips timed (default 2000)")
    p.add_argument("--repeats", type=int, default=3, help="runs of --rounds each, per endpoint (default 3)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="endpoints to compare (default: all; ratios need ring for curve, direct for the rest)")
    p.add_argument("--out", help="write the record as JSON here")
    p.add_argument("--echo", nargs=3, metavar=("BIND", "NEXT", "VARIANT"), help=argparse.SUPPRESS)
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
        from mdi.ring.wire import encode
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


class HandoffEndpoint(DirectEndpoint):
    """Every frame through a receive thread and a send thread, each owning one socket."""

    def __init__(self, bind: int, nxt: int, validate) -> None:
        super().__init__(bind, nxt, validate)
        self.inbox, self.outbox = queue.SimpleQueue(), queue.SimpleQueue()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._receive, self._send)]
        for t in self.threads:
            t.start()

    def _receive(self) -> None:
        while not self.stop.is_set():
            if self.pull.poll(50):
                self.inbox.put(self.validate(self.pull.recv_multipart(copy=False)))

    def _send(self) -> None:
        while not self.stop.is_set():
            try:
                DirectEndpoint.send(self, self.outbox.get(timeout=0.05))
            except queue.Empty:
                pass

    def send(self, frame) -> None:
        self.outbox.put(frame)

    def recv(self, timeout: float):
        return self.inbox.get(timeout=timeout)

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush(5)
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2)
        super().close()


def endpoint(name: str, bind: int, nxt: int, hidden: int, variant: str):
    from mdi.ring.auth import ring_password
    from mdi.ring.transport import RingEndpoint
    from mdi.ring.wire import decode
    validate = lambda parts: decode(parts, run=1, hidden=hidden, n_slots=1)  # noqa: E731
    if variant not in ("ring", "curve"):
        return (DirectEndpoint if variant == "direct" else HandoffEndpoint)(bind, nxt, validate)
    password = ring_password(BENCH_SECRET, 1) if variant == "curve" else None
    ep = RingEndpoint(name, "127.0.0.1", bind, validate, password)
    ep.connect("127.0.0.1", nxt)
    return ep


def echo(bind: int, nxt: int, hidden: int, variant: str) -> int:
    """The other end: send every frame straight back, until a stop frame."""
    ep = endpoint("echo", bind, nxt, hidden, variant)
    print("ready", flush=True)
    while True:
        frame = ep.recv(timeout=60)
        ep.send(frame)
        if frame.kind == "stop":
            ep.flush(5)
            ep.close()
            return 0


def one_run(args, variant: str) -> float:
    """Per-hop seconds: median round trip / 2 over --rounds, with a fresh echo process."""
    import torch
    from mdi.ring.wire import Frame
    mine, theirs = free_ports(2)
    cmd = [sys.executable, __file__, "--hidden", str(args.hidden), "--echo", str(theirs), str(mine), variant]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo process did not start")
        ep = endpoint("bench", mine, theirs, args.hidden, variant)
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
        return echo(int(args.echo[0]), int(args.echo[1]), args.hidden, args.echo[2])
    variants = [v for v in VARIANTS if v in args.variants]
    info = benchlib.machine_info(1)
    per_hop = {v: [] for v in variants}  # type: Dict[str, List[float]]
    for r in range(args.repeats):  # interleaved, so slow phases of the machine hit all alike
        for v in variants:
            per_hop[v].append(one_run(args, v))
        print("  run %d: %s (us per hop, median of %d round trips / 2)" % (
            r + 1, ", ".join("%s %.0f" % (v, per_hop[v][-1] * 1e6) for v in variants), args.rounds), flush=True)
    stats = {v: benchlib.summarize(per_hop[v]) for v in variants}

    def ratio(v: str, base: str) -> Any:
        if base not in per_hop:
            return None
        return benchlib.summarize([x / d for x, d in zip(per_hop[v], per_hop[base])])

    ratios = {v: ratio(v, "direct") for v in variants}
    curve_cost = ratio("curve", "ring") if "curve" in per_hop else None
    benchlib.finish_machine_info(info)
    benchlib.print_table("per-hop latency, %d floats float32 (median [min, max] of %d)" % (args.hidden, args.repeats),
                         ["endpoint", "us per hop", "/ direct"],
                         [[v, benchlib.fmt_stat(stats[v], "%.0f", 1e6),
                           benchlib.fmt_stat(ratios[v], "%.2f") if ratios[v] else "-"] for v in variants])
    if curve_cost:
        print("CURVE (encrypted) / ring (plain), same repeat: %s" % benchlib.fmt_stat(curve_cost, "%.2f"))
    print(benchlib.note_load(info))
    if args.out:
        benchlib.save_record(args.out, {"benchmark": "bench_transport", "args": vars(args), "machine": info,
                                        "per_hop_s": stats, "ratio_to_direct": ratios,
                                        "curve_over_ring": curve_cost})
    return 0


if __name__ == "__main__":
    sys.exit(main())
