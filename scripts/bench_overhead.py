#!/usr/bin/env python3
"""Per-token overhead, before and after: decode speed of two source trees, alternating, one run.

The code around the model step (the starter's loop, RowBatch, the wire, the worker's compute
loop) is paid once per token at S = 1, and once per hop on a ring. This script measures what
a change to it buys where a user sees it: tokens/s of a one-node standalone decode and of a
ring of three processes (starter + 2 mdi-worker, 1 torch thread each), both at S = 1 with the
shipped model, for an older revision (`--base`, checked out with `git archive` into a
temporary folder) and for this working tree. Each measurement runs in a fresh process whose
`mdi` (and its workers') is the tree's; the trees alternate, and which goes first alternates,
so both see the same machine noise. Greedy token ids are compared between the trees (each
process picks its kernels by timing them, so ids may differ between processes of one tree).

Example:
  python scripts/bench_overhead.py --base HEAD~1 --repeats 3 --out results/bench_overhead.json
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git revision to compare this working tree with")
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    p.add_argument("--n-tokens", type=int, default=64, help="new tokens per run")
    p.add_argument("--runs", type=int, default=2, help="timed runs per measurement process (median taken)")
    p.add_argument("--repeats", type=int, default=3, help="measurement processes per tree and setup")
    p.add_argument("--setups", default="standalone,ring3", help="which of standalone,ring3")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_overhead.json"))
    p.add_argument("--child", nargs=2, metavar=("TREE", "SETUP"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- one measurement

def child(tree: str, setup: str, args: argparse.Namespace) -> Dict[str, Any]:
    """In a fresh process: `mdi` from `tree` (here and in the workers), the scripts' helpers
    from this checkout (ROOT stays behind `tree` on sys.path, so benchlib adds nothing)."""
    sys.path[:0] = [tree, ROOT, HERE]
    os.environ["PYTHONPATH"] = tree  # the mdi-worker subprocesses
    import benchlib
    import bench_peer
    import mdi
    assert os.path.dirname(os.path.abspath(mdi.__file__)) == os.path.join(os.path.abspath(tree), "mdi"), mdi.__file__
    out = {"tok_s": [], "median_gap_ms": []}  # type: Dict[str, Any]
    if setup == "standalone":
        bench_peer.mdi_decode(args.model, 1, 4)  # warm: kernels chosen, pages touched
        for _ in range(args.runs):
            m = bench_peer.mdi_decode(args.model, 1, args.n_tokens)
            out["tok_s"].append(m["decode_tokens_per_s"])
            out["median_gap_ms"].append(m["median_gap_ms"])
            out["token_ids"] = m["token_ids"]
        return out
    log_dir = tempfile.mkdtemp(prefix="mdi-ovh-")
    workers = [benchlib.WorkerProcess("worker%d" % i, 1, log_dir) for i in (1, 2)]
    try:
        for w in workers:
            w.wait_healthy(60)
        bench_peer.mdi_ring(args.model, workers, 1, 4)  # warm: weights pushed, kernels chosen
        for _ in range(args.runs):
            m = bench_peer.mdi_ring(args.model, workers, 1, args.n_tokens)
            out["tok_s"].append(m["decode_tokens_per_s"])
            out["e2e_ms_per_token"] = 1000 * m["elapsed_s"] / m["tokens"]
    finally:
        benchlib.stop_workers(workers)
        shutil.rmtree(log_dir, ignore_errors=True)
    return out


def measure(tree: str, setup: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, setup, "--model", args.model,
           "--n-tokens", str(args.n_tokens), "--runs", str(args.runs)]
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError("%s %s failed:\n%s" % (tree, setup, done.stderr[-3000:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- driver

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args)))
        return 0
    sys.path.insert(0, HERE)
    import benchlib
    import torch
    base_rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, stdout=subprocess.PIPE,
                              universal_newlines=True, check=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                              universal_newlines=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                stdout=subprocess.PIPE, universal_newlines=True).stdout.strip())
    base_dir = tempfile.mkdtemp(prefix="mdi-base-")
    subprocess.run("git archive %s mdi | tar -x -C %s" % (base_rev, base_dir), shell=True, cwd=ROOT, check=True)
    trees = {"base": base_dir, "new": ROOT}
    info = benchlib.machine_info(1)
    info["isa"] = torch.backends.cpu.get_cpu_capability()
    setups = [s for s in args.setups.split(",") if s]
    runs = {s: {"base": [], "new": []} for s in setups}  # type: Dict[str, Dict[str, List[Dict[str, Any]]]]
    t0 = time.time()
    try:
        for r in range(args.repeats):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            for setup in setups:
                for name in order:
                    m = measure(trees[name], setup, args)
                    runs[setup][name].append(m)
                    print("repeat %d %-10s %-4s tok/s %s" % (r + 1, setup, name, ", ".join("%.2f" % v for v in m["tok_s"])),
                          flush=True)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    benchlib.finish_machine_info(info)
    record = {"benchmark": "bench_overhead", "machine": info, "base": base_rev, "new": head_rev + ("+dirty" if dirty else ""),
              "args": {k: v for k, v in vars(args).items() if k != "child"},
              "method": "tok/s = decode tokens/s (first generated token excluded) at S = 1, 1 torch thread per process; "
                        "each repeat: one fresh process per tree and setup holding %d timed runs (their median), "
                        "trees alternating and the first of them alternating; ratio new/base per repeat" % args.runs,
              "runs": runs, "by_setup": {}, "seconds": round(time.time() - t0, 1)}
    rows = []
    for setup in setups:
        per = {name: [statistics.median(m["tok_s"]) for m in runs[setup][name]] for name in ("base", "new")}
        ratios = [n / b for b, n in zip(per["base"], per["new"])]
        # Greedy ids of one process: `fast` picks each shape's kernel by timing it, so two processes
        # may pick differently and round differently (even within one tree); the trees agree when
        # some process of each produced the same ids.
        seqs = {name: set(tuple(m.get("token_ids", ())) for m in runs[setup][name]) for name in ("base", "new")}
        same = setup != "standalone" or bool(seqs["base"] & seqs["new"])
        record["by_setup"][setup] = {"base_tok_s": benchlib.summarize(per["base"]), "new_tok_s": benchlib.summarize(per["new"]),
                                     "ratio_new_over_base": benchlib.summarize(ratios), "same_token_ids": same,
                                     "distinct_token_id_sequences": {k: len(v) for k, v in seqs.items()}}
        e = record["by_setup"][setup]
        rows.append([setup, benchlib.fmt_stat(e["base_tok_s"], "%.2f"), benchlib.fmt_stat(e["new_tok_s"], "%.2f"),
                     benchlib.fmt_stat(e["ratio_new_over_base"], "%.3f"), same])
    benchlib.print_table("decode tok/s at S = 1, 1 thread (%s), median [min, max] of %d repeats" % (info["isa"], args.repeats),
                         ["setup", "base " + base_rev[:8], "new " + head_rev[:8] + ("+" if dirty else ""), "new/base",
                          "same ids"], rows)
    benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
