#!/usr/bin/env python
"""What LoRA adapters cost a serving ring (issue 24), as same-run ratios.

One `mdi-start --serve` ring (SmolLM2-135M by default: the starter and --nodes - 1 workers,
each under a CPU quota of --quota cores when cgroups allow it, else plain processes) with
--adapters random rank---rank LoRAs over every linear layer (mdi.lab.random_lora: real shapes,
random values). --requests concurrent greedy /v1/completions (--tokens each) are sent twice
per repeat, back to back and in alternating order: all on the base model, then spread evenly
over the adapters ("model": name). Reported: aggregate tokens/s of each (completion tokens /
time from the first request to the last answer), the ratio adapters / base per repeat (median
[min, max]; the issue asks >= 0.8), and each worker's adapter bytes from /status against the
adapters' bytes for its own layers (each node holds only those). Record: results/bench_adapters.json.

    python scripts/bench_adapters.py                       # 4 adapters of rank 16, 8 requests, 3 nodes
    python scripts/bench_adapters.py --repeats 5 --quota 0  # no CPU quotas
    python scripts/bench_adapters.py --backend ggml --out results/bench_adapters_ggml.json
"""
import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import benchlib
from benchlib import BIN, DEFAULT_MODEL, NodeProcess, WorkerProcess, ports_besides, print_table, wait_healthy

import requests

PROMPTS = ["Once upon a time", "The history of the city", "In a small village", "Here is a recipe for",
           "The best way to learn", "Yesterday I went", "The old man said", "Scientists have found"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--adapters", type=int, default=4, help="random LoRA adapters (default 4)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=8, help="concurrent requests per run (default 8)")
    p.add_argument("--tokens", type=int, default=32, help="completion tokens per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quota", type=float, default=0.5, help="CPU cores per node (0: no quota)")
    p.add_argument("--backend", default="auto", choices=["auto", "ggml", "torch"],
                   help="runtime.backend of every node (default auto)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_adapters.json"))
    return p.parse_args(argv)


def write_config(path: str, model: str, workers: List[WorkerProcess], port: int, data_port: int,
                 adapters: Dict[str, str], slots: int, backend: str = "auto") -> None:
    nodes = ["  - {name: starter, host: 127.0.0.1, port: %d, data_port: %d}" % (port, data_port)]
    nodes += ["  - {name: %s, host: 127.0.0.1, port: %d, data_port: %d}" % (w.name, w.port, w.data_port)
              for w in workers]
    listed = "\n".join("  %s: %s" % (name, p) for name, p in adapters.items())
    with open(path, "w") as f:
        f.write("model: {path: %s}\nadapters:\n%s\nnodes:\n%s\ngeneration: {temperature: 0}\n"
                "runtime: {threads: 1, quant_kernel: fast, backend: %s}\nserve: {max_in_flight: %d, max_len: 256}\n"
                % (model, listed, "\n".join(nodes), backend, slots))


def complete(url: str, model: Optional[str], prompt: str, tokens: int, out: Dict[str, Any]) -> None:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
    if model is not None:
        body["model"] = model
    sent = time.monotonic()
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    out.update(sent=sent, end=time.monotonic(), tokens=r.json()["usage"]["completion_tokens"])


def run_once(url: str, models: List[Optional[str]], tokens: int) -> float:
    """Aggregate tokens/s of one request per entry of `models`, all sent at once."""
    records = [{} for _ in models]  # type: List[Dict[str, Any]]
    threads = [threading.Thread(target=complete, args=(url, m, PROMPTS[i % len(PROMPTS)], tokens, records[i]))
               for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    if any("tokens" not in r for r in records):
        raise RuntimeError("a request failed (see the server log)")
    return sum(r["tokens"] for r in records) / (max(r["end"] for r in records) - min(r["sent"] for r in records))


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.lab.random_lora import write_random_lora
    from mdi.model.adapters.adapter_files import load_adapter
    from mdi.model.layout import balanced, layer_ranges, layer_span
    from mdi.model.source import ModelSource
    config = ModelSource(args.model).config
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-adapters-")
    paths = {"lora%d" % i: write_random_lora(os.path.join(tmp, "lora%d" % i), config, seed=i, rank=args.rank,
                                             std=0.02)
             for i in range(args.adapters)}
    cgroups = benchlib.node_cgroups("mdi_bench_adapters", args.quota, args.nodes)
    workers, server = [], None
    ratios, base_runs, lora_runs = [], [], []
    try:
        workers = [WorkerProcess("board%d" % i, 1, tmp, cgroups.preexec("board%d" % i) if cgroups else None)
                   for i in range(1, args.nodes)]
        for w in workers:
            w.wait_healthy(120)
        port, data_port = ports_besides(workers, 2)
        cfg = os.path.join(tmp, "serve.yaml")
        write_config(cfg, os.path.abspath(args.model), workers, port, data_port, paths, args.requests, args.backend)
        server = NodeProcess("server", [os.path.join(BIN, "mdi-start"), "--config", cfg, "--serve"],
                             os.path.join(tmp, "server.log"), dict(os.environ),
                             preexec=cgroups.preexec("starter") if cgroups else None)
        url = "http://127.0.0.1:%d" % port
        wait_healthy(url, None, server, 600)
        names = list(paths)
        spread = [names[i % len(names)] for i in range(args.requests)]
        run_once(url, [None] * 2, 8)  # warm-up
        run_once(url, spread[:len(names)], 8)
        for r in range(args.repeats):
            order = ("base", "lora") if r % 2 == 0 else ("lora", "base")
            got = {}
            for kind in order:
                got[kind] = run_once(url, [None] * args.requests if kind == "base" else spread, args.tokens)
            base_runs.append(got["base"])
            lora_runs.append(got["lora"])
            ratios.append(got["lora"] / got["base"])
            print("repeat %d: base %.1f tok/s, %d adapters %.1f tok/s, ratio %.3f"
                  % (r + 1, got["base"], len(names), got["lora"], ratios[-1]), file=sys.stderr)
        held = [requests.get("http://127.0.0.1:%d/status" % w.port, timeout=30).json()["memory"] for w in workers]
    finally:
        benchlib.stop_serving(server, workers, cgroups)
    benchlib.finish_machine_info(info)
    ranges = layer_ranges(balanced(config.n_layer, args.nodes))
    loaded = [load_adapter(p, config, n) for n, p in paths.items()]
    memory = []
    for w, m, (first, last) in zip(workers, held, ranges[1:]):
        want = sum(a.nbytes(a.for_layers(first, last)) for a in loaded)
        memory.append({"node": w.name, "layers": [first, last], "adapter_bytes": m["adapter_bytes"],
                       "expected_bytes": want, "chunk_bytes": m["chunk_bytes"]})
    record = {"model": args.model, "backend": args.backend, "nodes": args.nodes, "adapters": len(paths), "rank": args.rank,
              "requests": args.requests, "tokens": args.tokens, "quota_cores": args.quota if cgroups else None,
              "base_tokens_per_s": benchlib.summarize(base_runs), "adapters_tokens_per_s": benchlib.summarize(lora_runs),
              "ratio": benchlib.summarize(ratios), "memory": memory, "machine": info,
              "all_adapters_bytes": sum(a.nbytes() for a in loaded)}
    print_table("%d requests, %d rank-%d adapters vs the base (%d nodes)" % (args.requests, len(paths), args.rank,
                                                                              args.nodes),
                ["", "tokens/s (median [min, max])"],
                [["base", benchlib.fmt_stat(record["base_tokens_per_s"])],
                 ["%d adapters" % len(paths), benchlib.fmt_stat(record["adapters_tokens_per_s"])],
                 ["ratio", benchlib.fmt_stat(record["ratio"], "%.3f")]])
    print_table("adapter memory per worker", ["node", "layers", "adapter MB", "its layers' share MB", "weights MB"],
                [[m["node"], layer_span(*m["layers"]), "%.2f" % (m["adapter_bytes"] / 2 ** 20),
                  "%.2f" % (m["expected_bytes"] / 2 ** 20), "%.1f" % (m["chunk_bytes"] / 2 ** 20)] for m in memory])
    benchlib.save_record(args.out, record)
    print("wrote %s" % args.out)
    return 0 if statistics.median(ratios) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
