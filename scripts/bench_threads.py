#!/usr/bin/env python
"""Does `runtime.threads` reach the workers? Per-token time of a 3-node ring whose workers were
started WITHOUT --threads, against one whose workers got `--threads 1`, in the same run.

Both rings use `runtime.threads: 1`; since /init carries it, a worker that was given no
--threads of its own computes with one thread too, and the two rings should run alike. Before,
such workers kept torch's default (every core) and three processes fought over two cores
(207 vs 87 ms/token measured on this machine). Repeats alternate the two rings so slow phases of
the shared machine hit both alike; the figure is the median gap between consecutive tokens.

    python scripts/bench_threads.py                    # SmolLM2-135M, 5 repeats of 32 tokens
"""
import argparse
import os
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Optional

import benchlib
from benchlib import DEFAULT_MODEL, WorkerProcess, decode_timing, fmt_stat, print_table, run_config_dict, summarize

PROMPT = "The capital of France is"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="prepared mdi model directory (default SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per run (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each ring (default 5)")
    p.add_argument("--samples", type=int, default=1, help="samples in flight (default 1)")
    p.add_argument("--quant", default="none", help="model.quant (default none: float32; auto: a GGUF's blocks)")
    p.add_argument("--kernel", default="fast", help="runtime.quant_kernel (default fast)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_threads.json"))
    args = p.parse_args(argv)
    if args.tokens < 3 or args.repeats < 1 or args.samples < 1:
        p.error("need --tokens >= 3, --repeats >= 1 and --samples >= 1")
    return args


def per_token(args: argparse.Namespace, workers: List[WorkerProcess], tokens: int) -> Dict[str, Any]:
    from mdi.runconfig import parse_config
    from mdi.starter import batch
    nodes = [{"name": "starter", "data_port": benchlib.ports_besides(workers)[0]}] + [w.node() for w in workers]
    d = run_config_dict(args.model, nodes, tokens, threads=1)
    d["model"]["quant"] = args.quant
    d["runtime"]["quant_kernel"] = args.kernel
    result = batch.run(parse_config(d, "bench_threads"), [PROMPT] * args.samples)
    return {"per_token_s": statistics.median(decode_timing(s.token_times)["median_s"] for s in result.samples),
            "worker_threads": [n.threads for n in result.nodes[1:]]}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(1)  # the starter, as mdi-start does with runtime.threads: 1
    info = benchlib.machine_info(1)
    log_dir = tempfile.mkdtemp(prefix="bench-threads-")
    rings = {"no --threads": [WorkerProcess("plain%d" % i, None, log_dir) for i in (1, 2)],
             "--threads 1": [WorkerProcess("one%d" % i, 1, log_dir) for i in (1, 2)]}
    runs = {name: [] for name in rings}  # type: Dict[str, List[Dict[str, Any]]]
    try:
        for workers in rings.values():
            for w in workers:
                w.wait_healthy(60)
        for name, workers in rings.items():
            per_token(args, workers, 4)  # weights pushed and caches warm before timing
        for r in range(args.repeats):
            for name, workers in rings.items():
                runs[name].append(per_token(args, workers, args.tokens))
            print("repeat %d/%d: %s" % (r + 1, args.repeats, ", ".join(
                "%s %.1f ms" % (n, 1000 * runs[n][-1]["per_token_s"]) for n in rings)), file=sys.stderr)
    finally:
        for workers in rings.values():
            for w in workers:
                w.stop()
    stats = {name: summarize([x["per_token_s"] for x in rs]) for name, rs in runs.items()}
    ratios = [a["per_token_s"] / b["per_token_s"] for a, b in zip(runs["no --threads"], runs["--threads 1"])]
    benchlib.finish_machine_info(info)
    record = {"model": args.model, "tokens": args.tokens, "repeats": args.repeats, "samples": args.samples,
              "quant": args.quant, "quant_kernel": args.kernel, "machine": info,
              "per_token_s": stats, "ratio_no_flag_vs_threads_1": summarize(ratios),
              "worker_threads": {n: rs[-1]["worker_threads"] for n, rs in runs.items()}, "runs": runs}
    benchlib.save_record(args.out, record)
    print_table("ring3 per-token time, runtime.threads: 1 (%d repeats)" % args.repeats,
                ["workers started", "ms/token (median, spread)", "worker threads"],
                [[n, fmt_stat(stats[n], "%.1f", 1000), record["worker_threads"][n]] for n in rings])
    print("ratio (no --threads / --threads 1): median %.2f (min %.2f, max %.2f); wrote %s"
          % (statistics.median(ratios), min(ratios), max(ratios), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
