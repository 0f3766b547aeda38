#!/usr/bin/env python
"""Each node's peak memory against what it must hold: its layers' GGUF bytes (the starter's
with the embedding and head) plus its KV cache, for one node alone and for a ring of 3 on
this machine (the issue's bound: at most 150 MB more).

One run each (memory does not depend on the machine's load): `mdi-start` with `--n-samples`
copies of a prompt of `--prompt-words` words, `--n-tokens` sampled tokens (T 0.8, top-k 40,
top-p 0.9), the nodes computing with `--backend`, 1 thread each. The starter pushes each
worker its layers (no weights path). Peak memory is each process's VmHWM.
`--serve`: the starter alone as `mdi-start --serve` instead (its defaults: 2 samples in flight,
speculation's cost table, the prefix cache), sent `--n-samples` rounds of that prompt beside a
chat request with logprobs; its peak read from /proc, its cache from /v1/mdi/state.

    python scripts/bench_node_memory.py                       # SmolLM2 Q4_1
    python scripts/bench_node_memory.py --model models/gemma3-270m
    python scripts/bench_node_memory.py --model models/gemma3-270m --serve
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, List

import benchlib  # noqa: E402  (adds the repo root to sys.path)
from benchlib import print_table  # noqa: E402

MB = 2 ** 20
ALLOWED_MB = 150  # the bound on what a node holds beyond its layers and its cache


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=benchlib.DEFAULT_MODEL)
    p.add_argument("--backend", default="ggml", choices=["auto", "ggml", "torch"], help="runtime.backend")
    p.add_argument("--n-samples", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=500)
    p.add_argument("--n-tokens", type=int, default=16)
    p.add_argument("--serve", action="store_true", help="the starter alone as a server (mdi-start --serve)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_node_memory.json"))
    return p.parse_args(argv)


def prompt(args: argparse.Namespace) -> str:
    words = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_words // 9 + 1)).split()
    return " ".join(words[:args.prompt_words])


def run(args: argparse.Namespace, nodes: List[Dict[str, Any]], tmp: str) -> Dict[str, Any]:
    cfg = benchlib.run_config_dict(args.model, nodes, args.n_tokens, 1, temperature=0.8)
    cfg["generation"].update(top_k=40, top_p=0.9)
    cfg["runtime"]["backend"] = args.backend
    path, metrics = os.path.join(tmp, "run.yaml"), os.path.join(tmp, "metrics.json")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    proc = subprocess.run([os.path.join(benchlib.BIN, "mdi-start"), "--config", path, "--n-samples",
                           str(args.n_samples), "--prompt", prompt(args),
                           "--metrics-out", metrics], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError("mdi-start failed: %s" % proc.stderr[-1500:])
    with open(metrics) as f:
        return json.load(f)


def serve(args: argparse.Namespace, source: Any, tmp: str) -> List[Dict[str, Any]]:
    """The starter alone as `mdi-start --serve`: its peak after the requests (see the doc)."""
    import requests

    from mdi.lab.cgroups import peak_rss_bytes
    port = benchlib.free_ports(2)
    cfg = benchlib.run_config_dict(args.model, [{"name": "starter", "port": port[0]}], args.n_tokens, 1)
    cfg["runtime"]["backend"] = args.backend
    cfg["serve"] = {"port": port[1]}
    path, url = os.path.join(tmp, "serve.yaml"), "http://127.0.0.1:%d" % port[1]
    with open(path, "w") as f:
        json.dump(cfg, f)
    server = benchlib.NodeProcess("server", [os.path.join(benchlib.BIN, "mdi-start"), "--config", path, "--serve"],
                                  os.path.join(tmp, "serve.log"), dict(os.environ))
    try:
        benchlib.wait_healthy(url, None, server, 600)
        bodies = [("/v1/completions", {"prompt": prompt(args), "max_tokens": args.n_tokens,
                                       "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}],
                                            "max_tokens": args.n_tokens, "logprobs": True, "top_logprobs": 3})]
        failed: List[str] = []

        def ask(route: str, body: Dict[str, Any]) -> None:
            r = requests.post(url + route, json=body, timeout=600)
            if r.status_code != 200:
                failed.append(r.text[:300])
        for _ in range(args.n_samples):
            threads = [threading.Thread(target=ask, args=b) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if failed:
            raise RuntimeError("a request failed: %s" % failed[0])
        node = requests.get(url + "/v1/mdi/state", timeout=10).json()["nodes"][0]
        peak = peak_rss_bytes(server.pid)
    finally:
        benchlib.stop_serving(server, [])
    return node_rows({"nodes": [dict(node, peak_memory_bytes=peak)]}, source, "served alone")


def node_rows(record: Dict[str, Any], source: Any, ring: str) -> List[Dict[str, Any]]:
    rows = []
    for i, node in enumerate(record["nodes"]):
        first, last = node["layers"]
        own = source.gguf_bytes(first, last, i == 0, i == 0) if source.gguf_path else None
        rows.append({"ring": ring, "node": node["name"], "layers": [first, last], "backend": node.get("backend"),
                     "peak_mb": node["peak_memory_bytes"] / MB, "cache_mb": node["cache_bytes"] / MB,
                     "gguf_mb": own / MB if own is not None else None,
                     "beyond_mb": (node["peak_memory_bytes"] - own - node["cache_bytes"]) / MB
                     if own is not None else None})
    return rows


def ring_of_three(args: argparse.Namespace, source: Any, tmp: str) -> List[Dict[str, Any]]:
    workers = [benchlib._Worker(port, os.path.join(tmp, "worker-%d.log" % port), threads=1)
               for port in benchlib.free_ports(2)]
    try:
        for w in workers:
            w.wait_ready(60)
        ports = benchlib.ports_besides(workers, 2)
        n = source.config.n_layer
        counts = [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]
        nodes = [{"name": "starter", "port": ports[0], "data_port": ports[1], "layers": counts[0]}] + \
            [{"name": "board%d" % (i + 1), "port": w.port, "layers": counts[i + 1]} for i, w in enumerate(workers)]
        return node_rows(run(args, nodes, tmp), source, "ring of 3")
    finally:
        benchlib.stop_workers(workers)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.model.source import ModelSource
    source = ModelSource(args.model)
    info = benchlib.machine_info(1)
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mdi-memory-") as tmp:
        if args.serve:
            rows += serve(args, source, tmp)
        else:
            rows += node_rows(run(args, [{"name": "starter", "port": benchlib.free_ports(1)[0]}], tmp), source,
                              "alone")
            rows += ring_of_three(args, source, tmp)
    benchlib.finish_machine_info(info)

    def mb(v: Any) -> str:
        return "-" if v is None else "%.0f" % v
    print_table("peak memory per node, MB (%s, %s, %d %s of %d words)" % (
        os.path.basename(args.model.rstrip("/")), args.backend, args.n_samples,
        "rounds of requests" if args.serve else "samples", args.prompt_words),
        ["run", "node", "layers", "backend", "peak", "GGUF", "KV cache", "beyond both", "within %d" % ALLOWED_MB],
        [[r["ring"], r["node"], "%d-%d" % tuple(r["layers"]), r["backend"], mb(r["peak_mb"]), mb(r["gguf_mb"]),
          mb(r["cache_mb"]), mb(r["beyond_mb"]),
          "-" if r["beyond_mb"] is None else ("yes" if r["beyond_mb"] <= ALLOWED_MB else "NO")] for r in rows])
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, {"machine": info, "model": args.model, "backend": args.backend,
                                    "n_samples": args.n_samples, "prompt_words": args.prompt_words,
                                    "serve": args.serve,
                                    "n_tokens": args.n_tokens, "allowed_mb": ALLOWED_MB, "nodes": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
