#!/usr/bin/env python
"""Recovery benchmark: what losing a board mid-run costs.

A 3-node loopback ring (starter + board1 + board2) runs S samples x T tokens; in the failure
runs board1 is SIGKILLed once a given share of all tokens has been generated. Two ways back:

  spare       a fourth worker listed under `spares:` takes board1's place and layers
  neighbours  no spare: board1's layers are split between the starter and board2

Reported per way, median [min, max] over repeats, each failure run paired with a clean run of
the same ring right before it (same processes, same load):
  - recovery time = the re-planned ring's first token - the kill (detection + re-plan +
    re-prefill; tokens whose pass was already back before the kill do not count),
    and the part of it the starter logged as the re-plan itself (`recoveries[].seconds`);
  - tokens/s (first token to last) of the run with the failure / without, as a ratio;
  - that the failure run's token ids equal the clean run's (they must).

    python scripts/bench_recovery.py                                   # SmolLM2-135M
    python scripts/bench_recovery.py --model models/nanogpt-shakespeare --tokens 128
"""
import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import benchlib
from benchlib import DEFAULT_MODEL, WorkerProcess, fmt_stat, print_table, summarize

PROMPTS = ["Once upon a time", "The capital of France is", "In the beginning"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="mdi model directory (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--samples", type=int, default=3, help="samples in flight (default 3)")
    p.add_argument("--kill-at", type=float, default=0.5, help="share of all tokens before the kill (default 0.5)")
    p.add_argument("--repeats", type=int, default=3, help="failure runs per way (default 3)")
    p.add_argument("--ways", nargs="+", default=["spare", "neighbours"], choices=["spare", "neighbours"])
    p.add_argument("--heartbeat", type=float, default=1.0, help="runtime.heartbeat_interval (default 1 s)")
    p.add_argument("--out", help="write the record as JSON here")
    return p.parse_args(argv)


def ring_config(args, workers: List[WorkerProcess], spares: List[WorkerProcess]):
    from mdi.runconfig import parse_config
    data_port = benchlib.ports_besides(workers + spares)[0]
    data = benchlib.run_config_dict(args.model, [{"name": "starter", "data_port": data_port}]
                                    + [w.node() for w in workers], args.tokens, threads=1)
    data["spares"] = [w.node() for w in spares]
    data["runtime"].update({"heartbeat_interval": args.heartbeat, "recovery_attempts": 1})
    return parse_config(data, "bench_recovery")


def timed_run(cfg, prompts: List[str], victim: Optional[WorkerProcess], kill_after: int) -> Dict[str, Any]:
    """Run once; SIGKILL `victim` after `kill_after` tokens; time every token on one clock."""
    from mdi.starter import batch
    stamps = []  # type: List[float]
    killed = []  # type: List[float]

    def on_token(sample, token):
        stamps.append(time.monotonic())
        if victim is not None and not killed and len(stamps) >= kill_after:
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed.append(time.monotonic())

    result = batch.run(cfg, prompts, on_token=on_token)
    # From the first token to the last: loading and configuring the ring are not generation.
    out = {"ids": [s.token_ids for s in result.samples], "tokens": len(stamps),
           "tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
           "node_backends": benchlib.node_backends(result)}
    if killed:
        # Tokens whose pass was already back still come right after the kill; the re-planned
        # ring's first token is the one that ends the longest silence after it.
        after = [killed[0]] + [t for t in stamps if t > killed[0]]
        gaps = [b - a for a, b in zip(after, after[1:])]
        recoveries = result.extra.get("recoveries", [])
        out["recovery_s"] = after[1 + gaps.index(max(gaps))] - killed[0] if gaps else None
        out["replan_s"] = recoveries[0]["seconds"] if recoveries else None
        out["recoveries"] = recoveries
    return out


def one_way(args, way: str, log_dir: str) -> Dict[str, Any]:
    prompts = (PROMPTS * args.samples)[:args.samples]
    kill_after = max(1, int(args.kill_at * args.samples * args.tokens))
    recovery, replan, ratio, identical = [], [], [], []
    backends = {}  # type: Dict[str, Any]
    for r in range(args.repeats):
        names = ["board1", "board2"] + (["spare1"] if way == "spare" else [])
        procs = [WorkerProcess("%s-%s-%d" % (n, way, r), 1, log_dir) for n in names]
        try:
            for w in procs:
                w.wait_healthy(60)
            workers, spares = procs[:2], procs[2:]
            cfg = ring_config(args, workers, spares)
            clean = timed_run(cfg, prompts, None, 0)
            failed = timed_run(cfg, prompts, workers[0], kill_after)
        finally:
            for w in procs:
                w.stop()
        identical.append(failed["ids"] == clean["ids"])
        backends = {"clean": clean["node_backends"], "after_failure": failed["node_backends"]}
        recovery.append(failed["recovery_s"])
        replan.append(failed["replan_s"])
        ratio.append(failed["tokens_per_s"] / clean["tokens_per_s"])
        print("  %s %d: recovery %.2f s (re-plan %.2f s), %.2f vs %.2f tokens/s, ids %s" % (
            way, r + 1, failed["recovery_s"], failed["replan_s"], failed["tokens_per_s"], clean["tokens_per_s"],
            "identical" if identical[-1] else "DIFFERENT"), flush=True)
    return {"way": way, "recovery_s": summarize(recovery), "replan_s": summarize(replan),
            "tokens_per_s_ratio": summarize(ratio), "identical": identical, "node_backends": backends}


def main(argv=None) -> int:
    args = parse_args(argv)
    info = benchlib.machine_info(1)
    print("mdi bench_recovery: %s, 3 nodes, %d samples x %d tokens, kill board1 after %d%% of tokens, "
          "heartbeat %.1f s" % (args.model, args.samples, args.tokens, args.kill_at * 100, args.heartbeat),
          flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="mdi-bench-recovery-") as log_dir:
        for way in args.ways:
            results.append(one_way(args, way, log_dir))
    benchlib.finish_machine_info(info)
    print_table("Recovery after SIGKILL of board1 (median [min, max])",
                ["way", "failure -> next token (s)", "re-plan (s)", "tokens/s failure / clean", "ids identical"],
                [[r["way"], fmt_stat(r["recovery_s"], "%.2f"), fmt_stat(r["replan_s"], "%.2f"),
                  fmt_stat(r["tokens_per_s_ratio"], "%.2f"), "%d/%d" % (sum(r["identical"]), len(r["identical"]))]
                 for r in results])
    print(benchlib.note_load(info))
    if args.out:
        benchlib.save_record(args.out, {"benchmark": "bench_recovery", "args": vars(args), "machine": info,
                                        "results": results})
    return 0 if all(all(r["identical"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
