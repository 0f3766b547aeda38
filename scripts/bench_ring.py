#!/usr/bin/env python
"""Ring benchmark: per-hop overhead and recurrent-pipeline efficiency, as ratios in one run.

(a) Per-hop overhead, plain loopback, no CPU quotas: for N nodes,
        (1-sample ring per-token time - standalone per-token time) / N hops
    with per-token time = the median gap between consecutive tokens. It is split, from each
    node's compute_seconds, into the same layers computing slower once spread over several
    processes, and the time per hop when no node computes (transport and thread handoffs;
    scripts/bench_transport.py measures the transport alone). An idle control runs every
    node's part of a decode step in this one process, back to back (as standalone does) and
    each after a sleep as long as that node idles in the ring: the difference is how much
    slower the same layers compute on a CPU that has been idle, with no network at all (on
    this VM that alone explains most of the "slower compute"). Use a small model
    (--model models/nanogpt-shakespeare) to see the overhead itself: with SmolLM2 a token takes
    ~70 ms and the machine's noise is larger than the hops.
    (a token's activations cross N links per round). Repeats are interleaved: standalone,
    ring, standalone, ring, ... so slow phases of the shared machine hit both alike.
(b) Pipeline efficiency on emulated boards (cgroup v1 CPU quota per node process, the sum
    kept at the machine's cores): aggregate decode tokens/s with S = N samples in flight
    divided by N x the 1-sample decode tokens/s on the same ring; plus a sweep S = 1..2N.

The starter runs in this process (it joins its own cgroup); workers are `mdi-worker
--threads 1` subprocesses started and stopped here. Decode rates exclude prefill: see
benchlib.decode_timing / mdi.lab.report.steady_rate.

    python scripts/bench_ring.py                       # SmolLM2-135M, N = 2 and 3
    python scripts/bench_ring.py --model models/nanogpt-shakespeare --nodes 2 --tokens 64
"""
import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import benchlib
from benchlib import (DEFAULT_MODEL, CpuCgroups, WorkerProcess, cgroup_unavailable_reason, decode_timing,
                      fmt_stat, print_table, run_config_dict, stop_workers, summarize)
from mdi.lab.report import steady_rate

PROMPT = "Once upon a time"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="mdi model directory (default: %(default)s)")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3], help="ring sizes N (default: 2 3)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per sample (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default: %(default)s)")
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 2),
                   help="CPU cores shared out as quotas in (b) (default: all, %(default)s)")
    p.add_argument("--no-quota", action="store_true", help="run (b) without CPU quotas")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_ring.json"),
                   help="JSON record of every measurement (default: %(default)s)")
    return p.parse_args(argv)


def head_aware_partition(n_layer: int, n: int, head_layers: float) -> List[int]:
    """Layer counts giving every node about the same work: the starter also runs the
    embedding and the LM head, worth `head_layers` transformer layers."""
    share = (n_layer + head_layers) / n
    first = max(1, int(round(share - head_layers)))
    rest = n_layer - first
    base, extra = divmod(rest, n - 1)
    return [first] + [base + (1 if i < extra else 0) for i in range(n - 1)]


def head_cost_in_layers(model: str) -> float:
    """LM head parameters / one block's parameters (decode is memory-bound: bytes ~ time)."""
    from mdi.model.files.store import read_mdi_config
    from mdi.model.layout import expected_shapes
    config = read_mdi_config(model)
    block = sum(math.prod(s) for s in expected_shapes(config, (0, 1), False, False).values())
    head = config.vocab_size * config.n_embd
    return head / float(block)


def one_run(model: str, workers: List[WorkerProcess], counts: Optional[List[int]], n_samples: int,
            tokens: int) -> Dict[str, Any]:
    from mdi.starter import batch
    from mdi.runconfig import parse_config
    data_port = benchlib.ports_besides(workers)[0]
    nodes = [{"name": "starter", "data_port": data_port}] + [w.node() for w in workers]
    if counts:
        for node, c in zip(nodes, counts):
            node["layers"] = c
    cfg = parse_config(run_config_dict(model, nodes, tokens, threads=1), "bench_ring")
    result = batch.run(cfg, [PROMPT] * n_samples)
    times = [s.token_times for s in result.samples]
    if any(len(t) < tokens for t in times):
        raise RuntimeError("a sample stopped early (EOS); pick a prompt or model that runs %d tokens" % tokens)
    rate = steady_rate(times)
    if rate is None:
        raise RuntimeError("the samples never decoded at the same time")
    out = {"n_samples": n_samples, "token_times": times, "tokens_per_s": rate,
           "node_backends": benchlib.node_backends(result)}
    if n_samples == 1:
        out["per_token_s"] = decode_timing(times[0])["median_s"]  # robust to a neighbour's burst
        # Every node's own compute (layers, head, sampling) per token, from the metrics.
        out["compute_per_token_s"] = sum(n.compute_seconds or 0.0 for n in result.nodes) / len(times[0])
    return out


def start_workers(n: int, log_dir: str, cgroups: Optional[CpuCgroups]) -> List[WorkerProcess]:
    workers = []
    for i in range(n):
        name = "board%d" % (i + 1)
        preexec = cgroups.preexec(name) if cgroups is not None else None
        workers.append(WorkerProcess(name, 1, log_dir, preexec))
    for w in workers:
        w.wait_healthy(60)
    return workers


def node_steps(model: str, counts: List[int]) -> List[Callable[[int], Any]]:
    """Each node's part of one decode step (the starter's with its embedding and LM head),
    loaded in this process, as functions of the position."""
    import torch
    from mdi.model.source import ModelSource, build_chunk
    source = ModelSource(model)
    config = source.config
    steps, first = [], 0
    for k, count in enumerate(counts):
        ends = k == 0
        weights = source.weights(first, first + count, ends, ends, torch.float32)
        chunk = build_chunk(config, weights, first, first + count, ends, ends, torch.float32, "cpu")
        chunk.allocate_cache(1, min(config.block_size, 64))
        hidden = torch.randn(1, config.n_embd)
        if ends:
            steps.append(lambda p, c=chunk: c.head(c.forward_blocks(c.embed(torch.tensor([1]), p), 0, p)))
        else:
            steps.append(lambda p, c=chunk, x=hidden: c.forward_blocks(x, 0, p))
        first += count
    return steps


def idle_control(steps: List[Callable[[int], Any]], ring_per_token_s: float, rounds: int) -> float:
    """Seconds per token by which the nodes' layers (`node_steps`) compute slower after idling
    as long as they idle in the ring, in one process without any network (see the docstring)."""
    import torch
    hot = [[] for _ in steps]  # type: List[List[float]]
    idle = [[] for _ in steps]  # type: List[List[float]]

    def timed(step: Callable[[int], Any], pos: int) -> float:
        t0 = time.perf_counter()
        step(pos)
        return time.perf_counter() - t0

    with torch.inference_mode():
        for r in range(rounds + 3):  # the first 3 rounds warm caches and the allocator
            back_to_back = [timed(step, r % 64) for step in steps]
            after_idle = []
            for step, busy in zip(steps, back_to_back):
                time.sleep(max(0.0, ring_per_token_s - busy))  # the other nodes and the hops work
                after_idle.append(timed(step, r % 64))
            if r >= 3:
                for k in range(len(steps)):
                    hot[k].append(back_to_back[k])
                    idle[k].append(after_idle[k])
    return sum(statistics.median(i) - statistics.median(h) for h, i in zip(hot, idle))


def hop_overhead(args, n: int, counts: List[int], log_dir: str) -> Dict[str, Any]:
    workers = start_workers(n - 1, log_dir, None)
    try:
        one_run(args.model, workers, counts, 1, 4)  # load weights once; later runs reuse them
        alone, ring = [], []
        for _ in range(args.repeats):
            alone.append(one_run(args.model, [], None, 1, args.tokens))
            ring.append(one_run(args.model, workers, counts, 1, args.tokens))
    finally:
        for w in workers:
            w.stop()
    per_hop = [(r["per_token_s"] - a["per_token_s"]) / n for r, a in zip(ring, alone)]
    # Split the overhead: the same layers computing slower when spread over processes (cold
    # caches, CPUs woken from idle) vs the time between computations (transport, handoffs).
    slower = [(r["compute_per_token_s"] - a["compute_per_token_s"]) / n for r, a in zip(ring, alone)]
    between = [(r["per_token_s"] - r["compute_per_token_s"]) / n for r in ring]
    ring_token = statistics.median(r["per_token_s"] for r in ring)
    steps = node_steps(args.model, counts)
    control = [idle_control(steps, ring_token, args.tokens) / n for _ in range(args.repeats)]
    return {"nodes": n, "partition": counts,
            "standalone_per_token_s": summarize([a["per_token_s"] for a in alone]),
            "ring_per_token_s": summarize([r["per_token_s"] for r in ring]),
            "per_hop_overhead_s": summarize(per_hop),
            "compute_slowdown_per_hop_s": summarize(slower), "between_compute_per_hop_s": summarize(between),
            "idle_control_per_hop_s": summarize(control),
            "node_backends": ring[-1]["node_backends"], "standalone_backends": alone[-1]["node_backends"]}


def efficiency(args, n: int, counts: List[int], log_dir: str) -> Dict[str, Any]:
    quota = None if args.no_quota else args.cores / n
    cgroups = None
    if quota is not None:
        cgroups = CpuCgroups("mdi_bench_ring")
        for i in range(n):
            name = "starter" if i == 0 else "board%d" % i
            cgroups.create(name)
            cgroups.set_quota(name, quota)
        cgroups.join("starter")
    workers = []
    try:
        workers = start_workers(n - 1, log_dir, cgroups)
        backends = one_run(args.model, workers, counts, 1, 4)["node_backends"]  # warm-up: weights loaded everywhere
        sweep = {}  # type: Dict[int, List[float]]
        for _ in range(args.repeats):
            for s in range(1, 2 * n + 1):
                sweep.setdefault(s, []).append(one_run(args.model, workers, counts, s, args.tokens)["tokens_per_s"])
    finally:
        stop_workers(workers, cgroups)
    ratios = [sn / (n * s1) for sn, s1 in zip(sweep[n], sweep[1])]
    return {"nodes": n, "partition": counts, "quota_cores_per_node": quota, "node_backends": backends,
            "tokens_per_s_by_samples": {str(s): summarize(v) for s, v in sweep.items()},
            "efficiency": summarize(ratios)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.model.files.store import read_mdi_config
    n_layer = read_mdi_config(args.model).n_layer
    head = head_cost_in_layers(args.model)
    info = benchlib.machine_info(1)
    why_no_quota = "disabled by --no-quota" if args.no_quota else cgroup_unavailable_reason()
    if why_no_quota:
        args.no_quota = True
        print("CPU quotas off: %s; (b) runs on plain shared cores" % why_no_quota)
    log_dir = tempfile.mkdtemp(prefix="mdi-bench-ring-")
    hops, effs = [], []
    t0 = time.time()
    for n in args.nodes:
        counts = head_aware_partition(n_layer, n, head)
        print("N = %d, partition %s (the LM head counts as %.1f layers) ..." % (n, counts, head), flush=True)
        hops.append(hop_overhead(args, n, counts, log_dir))
        effs.append(efficiency(args, n, counts, log_dir))
    benchlib.finish_machine_info(info)

    print_table("(a) per-hop overhead, 1 sample, plain loopback (median [min, max] of %d)" % args.repeats,
                ["N", "partition", "standalone ms/token", "ring ms/token", "overhead us/hop",
                 "of which slower compute", "not computing us/hop", "idle control us/hop"],
                [[h["nodes"], "+".join(map(str, h["partition"])),
                  fmt_stat(h["standalone_per_token_s"], "%.2f", 1e3), fmt_stat(h["ring_per_token_s"], "%.2f", 1e3),
                  fmt_stat(h["per_hop_overhead_s"], "%.0f", 1e6), fmt_stat(h["compute_slowdown_per_hop_s"], "%.0f", 1e6),
                  fmt_stat(h["between_compute_per_hop_s"], "%.0f", 1e6),
                  fmt_stat(h["idle_control_per_hop_s"], "%.0f", 1e6)] for h in hops])
    rows = []
    for e in effs:
        by = e["tokens_per_s_by_samples"]
        rows.append([e["nodes"], "%.2f" % e["quota_cores_per_node"] if e["quota_cores_per_node"] else "none",
                     " ".join("S%s=%.1f" % (s, by[s]["median"]) for s in sorted(by, key=int)),
                     fmt_stat(e["efficiency"], "%.2f")])
    print_table("(b) pipeline efficiency = tok/s(S=N) / (N x tok/s(S=1)), CPU quota per node",
                ["N", "cores/node", "aggregate decode tok/s by samples in flight", "efficiency"], rows)
    print(benchlib.note_load(info))
    print("took %.0f s" % (time.time() - t0))
    benchlib.save_record(args.out, {"benchmark": "bench_ring", "model": args.model, "tokens": args.tokens,
                                    "repeats": args.repeats, "machine": info, "hop_overhead": hops,
                                    "efficiency": effs, "cpu_quota": not args.no_quota})
    return 0


if __name__ == "__main__":
    sys.exit(main())
