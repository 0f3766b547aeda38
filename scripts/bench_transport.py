#!/usr/bin/env python
"""The data plane alone: how long does one hop take with no model at all?

Two processes, each with a real `RingEndpoint` (receive thread -> input FIFO -> the caller ->
output FIFO -> send thread, zmq over loopback), pass one decode-sized frame back and forth.
Each round trip is two hops, so

    per-hop latency = median round-trip time / 2

This is the floor under bench_ring.py's per-hop overhead (which adds the worker's compute
loop around it) and shows how much of that overhead the transport itself is.

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
    return p.parse_args(argv)


def endpoint(name: str, bind: int, nxt: int, hidden: int):
    from mdi.transport import RingEndpoint
    from mdi.wire import decode
    ep = RingEndpoint(name, "127.0.0.1", bind, lambda parts: decode(parts, run=1, hidden=hidden, n_slots=1))
    ep.connect("127.0.0.1", nxt)
    return ep


def echo(bind: int, nxt: int, hidden: int) -> int:
    """The other end: send every frame straight back, until a stop frame."""
    ep = endpoint("echo", bind, nxt, hidden)
    print("ready", flush=True)
    while True:
        frame = ep.recv(timeout=60)
        ep.send(frame)
        if frame.kind == "stop":
            ep.flush(5)
            ep.close()
            return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.echo:
        return echo(args.echo[0], args.echo[1], args.hidden)
    import torch
    from mdi.wire import Frame
    info = benchlib.machine_info(1)
    mine, theirs = free_ports(2)
    child = subprocess.Popen([sys.executable, __file__, "--hidden", str(args.hidden), "--echo", str(theirs), str(mine)],
                             stdout=subprocess.PIPE, text=True)
    per_hop = []
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo process did not start")
        ep = endpoint("bench", mine, theirs, args.hidden)
        x = torch.randn(1, args.hidden)
        for _ in range(200):  # warm-up: connections, allocator, caches
            ep.send(Frame("decode", 1, [0], [5], [1], x))
            ep.recv(timeout=10)
        for r in range(args.repeats):
            rtts = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                ep.send(Frame("decode", 1, [0], [5], [1], x))
                ep.recv(timeout=10)
                rtts.append(time.perf_counter() - t0)
            per_hop.append(statistics.median(rtts) / 2)
            print("  run %d: %.0f us per hop (median of %d round trips / 2)" % (r + 1, per_hop[-1] * 1e6, args.rounds),
                  flush=True)
        ep.send(Frame("stop", 1))
        ep.recv(timeout=10)
        ep.flush(5)
        ep.close()
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    s = benchlib.summarize(per_hop)
    benchlib.finish_machine_info(info)
    print("\ntransport per-hop latency, %d floats float32: %s us  (%s)" % (
        args.hidden, benchlib.fmt_stat(s, "%.0f", 1e6), benchlib.note_load(info)))
    if args.out:
        benchlib.save_record(args.out, {"benchmark": "bench_transport", "args": vars(args), "machine": info,
                                        "per_hop_s": s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
