#!/usr/bin/env python3
"""Start-up: seconds from `mdi-start` to the first token of a ring of 3 on this machine (the
starter and two mdi-worker processes on loopback, configs/ring3.yaml's shape), with every
measurement a node makes at start (the backends under auto, torch's kernels, threads) done
afresh or recalled.

  fresh     workers just started and an empty measurement cache ($MDI_PROFILE_CACHE): what a
            first start on a new machine costs
  repeated  the same workers, the cache the fresh start filled: a second mdi-start
  restarted  new worker processes, the same cache: a machine's next session

Each is the wall time of `mdi-start --n-tokens 1` (process start to exit: an upper bound of
the time to its first token), and the record keeps what each node computed with. Every start
prints its progress lines; the record keeps them too.

    python scripts/bench_startup.py --repeats 3 --out results/bench_startup.json
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)
from benchlib import fmt_stat, print_table, summarize  # noqa: E402

ROOT = benchlib.ROOT


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=benchlib.DEFAULT_MODEL)
    p.add_argument("--backend", default="auto", choices=["auto", "ggml", "torch"], help="runtime.backend")
    p.add_argument("--repeats", type=int, default=3, help="fresh / repeated / restarted rounds")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_startup.json"))
    return p.parse_args(argv)


def start_workers(n: int, env: Dict[str, str], log_dir: str) -> List[Any]:
    workers = [benchlib._Worker(port, os.path.join(log_dir, "worker-%d.log" % port), threads=1, env=env)
               for port in benchlib.free_ports(n)]
    for w in workers:
        w.wait_ready(60)
    return workers


def one_start(model: str, workers: List[Any], backend: str, env: Dict[str, str], tmp: str) -> Dict[str, Any]:
    ports = benchlib.ports_besides(workers, 2)
    nodes = [{"name": "starter", "port": ports[0], "data_port": ports[1]}] + \
        [{"name": "board%d" % (i + 1), "port": w.port} for i, w in enumerate(workers)]  # layers split evenly
    cfg = benchlib.run_config_dict(model, nodes, 1, 1)
    cfg["runtime"]["backend"] = backend
    path = os.path.join(tmp, "ring3.yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    metrics = os.path.join(tmp, "m.json")
    t0 = time.perf_counter()
    proc = subprocess.run([os.path.join(benchlib.BIN, "mdi-start"), "--config", path, "--prompt",
                           "The capital of France is", "--metrics-out", metrics],
                          capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError("mdi-start failed: %s" % proc.stderr[-1500:])
    with open(metrics) as f:
        record = json.load(f)
    return {"seconds": wall, "backends": [n.get("backend") for n in record["nodes"]],
            "why": [n.get("backend_line") for n in record["nodes"]],
            "log": [line for line in proc.stderr.splitlines() if line.startswith("mdi:")]}


def main(argv=None) -> int:
    args = parse_args(argv)
    info = benchlib.machine_info(1)
    rows: Dict[str, List[Dict[str, Any]]] = {"fresh": [], "repeated": [], "restarted": []}
    for r in range(args.repeats):
        cache = tempfile.mkdtemp(prefix="mdi-startup-cache-")
        tmp = tempfile.mkdtemp(prefix="mdi-startup-")
        env = dict(os.environ, MDI_PROFILE_CACHE=cache)
        try:
            workers = start_workers(2, env, tmp)
            try:
                rows["fresh"].append(one_start(args.model, workers, args.backend, env, tmp))
                rows["repeated"].append(one_start(args.model, workers, args.backend, env, tmp))
            finally:
                benchlib.stop_workers(workers)
            workers = start_workers(2, env, tmp)
            try:
                rows["restarted"].append(one_start(args.model, workers, args.backend, env, tmp))
            finally:
                benchlib.stop_workers(workers)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
        print("round %d: fresh %.1f s, repeated %.1f s, restarted %.1f s (%s)" % (
            r + 1, rows["fresh"][-1]["seconds"], rows["repeated"][-1]["seconds"], rows["restarted"][-1]["seconds"],
            ", ".join(rows["fresh"][-1]["backends"])), flush=True)
    benchlib.finish_machine_info(info)
    stats = {k: summarize([x["seconds"] for x in v]) for k, v in rows.items()}
    print_table("seconds from mdi-start to its exit after the first token (ring of 3, %s)" % args.backend,
                ["start", "seconds: median [min, max]"], [[k, fmt_stat(s)] for k, s in stats.items()])
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, {"machine": info, "backend": args.backend, "model": args.model,
                                    "seconds": stats, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
