#!/usr/bin/env python
"""Training beside serving (issue 38, Symbiosis): what a LoRA job on the serving ring costs its
streaming requests, as same-run ratios.

One `mdi-start --serve` ring (SmolLM2-135M by default: the starter and --nodes - 1 workers, each
under a CPU quota of --quota cores when cgroups allow it: emulated boards) serving with
runtime.quant_kernel: exact (the kernels training needs; idle and busy runs use the same). Each
repeat streams one greedy /v1/completions request (S = 1, --tokens tokens) on the idle ring and
one while a training job runs (POST /v1/mdi/train, started before the request and stopped by
DELETE after it), alternating which goes first. Reported: the time per token (client-side,
from the streamed chunks' arrival: (t_last - t_first) / (n - 1)) of each, the ratio idle / busy
per repeat (median [min, max]; the issue asks >= 0.8), whether the busy text equals the idle
one, and the job's tokens/s while the request streamed (its steps done meanwhile) and alone.
Record: results/bench_train_serve.json (with the CPU and its ISA).

    python scripts/bench_train_serve.py                 # 3 nodes, 0.5 core each, 3 repeats
    python scripts/bench_train_serve.py --quota 0 --repeats 5
"""
import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

import benchlib
from benchlib import BIN, DEFAULT_MODEL, NodeProcess, WorkerProcess, ports_besides, print_table, stream_completion, wait_healthy

import requests

PROMPT = "Once upon a time"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48, help="completion tokens per request (default 48)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quota", type=float, default=0.5, help="CPU cores per node (0: no quota)")
    p.add_argument("--data", default=os.path.join(benchlib.ROOT, "README.md"), help="training text (default README)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_train_serve.json"))
    return p.parse_args(argv)


def write_config(path: str, model: str, workers: List[WorkerProcess], port: int, data_port: int,
                 adapter: str) -> None:
    nodes = ["  - {name: starter, host: 127.0.0.1, port: %d, data_port: %d}" % (port, data_port)]
    nodes += ["  - {name: %s, host: 127.0.0.1, port: %d, data_port: %d}" % (w.name, w.port, w.data_port)
              for w in workers]
    # the random adapter's folder is where POST /v1/mdi/train may read data and write its adapter;
    # backend torch: a ring computing with ggml refuses training (auto had chosen ggml here)
    with open(path, "w") as f:
        f.write("model: {path: %s}\nadapters:\n  seed: %s\nnodes:\n%s\ngeneration: {temperature: 0}\n"
                "runtime: {threads: 1, quant_kernel: exact, backend: torch}\nserve: {max_in_flight: 2, max_len: 256}\n"
                % (model, adapter, "\n".join(nodes)))


def job(url: str, verb: str, body: Any = None) -> Dict[str, Any]:
    r = requests.request(verb, url + "/v1/mdi/train", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError("%s /v1/mdi/train: %s %s" % (verb, r.status_code, r.text))
    return r.json()


def busy_run(url: str, tokens: int, body: Dict[str, Any]) -> Dict[str, Any]:
    """One stream while a job runs: the job started first and past its first step."""
    job(url, "POST", body)
    deadline = time.monotonic() + 600
    while job(url, "GET")["step"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the training job took no step in 600 s")
        time.sleep(0.05)
    before = job(url, "GET")
    t0 = time.monotonic()
    text, tpot = stream_completion(url, PROMPT, tokens)
    seconds = time.monotonic() - t0
    after = job(url, "GET")
    stopped = job(url, "DELETE")
    if stopped["state"] != "stopped" or after["state"] != "running":
        raise RuntimeError("the job ended on its own or failed: %s" % stopped)
    steps = after["step"] - before["step"]
    window = body["batch_size"] * body["seq_len"]
    return {"text": text, "tpot": tpot, "train_tokens_per_s_serving": steps * window / seconds,
            "train_steps_serving": steps, "alone_tokens_per_s": before["tokens_per_s"][0],
            "loss": after["loss"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.lab.random_lora import write_random_lora
    from mdi.model.source import ModelSource
    config = ModelSource(args.model).config
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-train-serve-")
    adapter = write_random_lora(os.path.join(tmp, "seed-lora"), config, seed=0, rank=4, std=0.02)
    data = os.path.join(tmp, "data.txt")
    with open(args.data, encoding="utf-8") as f, open(data, "w", encoding="utf-8") as g:
        g.write(f.read())
    cgroups = benchlib.node_cgroups("mdi_bench_train_serve", args.quota, args.nodes)
    body = {"data": data, "out": os.path.join(tmp, "trained"), "rank": args.rank, "alpha": 2.0 * args.rank,
            "steps": 1000000, "batch_size": args.batch_size, "micro_batches": args.micro_batches,
            "seq_len": args.seq_len, "lr": 1e-4, "seed": 0}
    workers, server = [], None
    idle, busy = [], []  # type: List[Dict[str, Any]], List[Dict[str, Any]]
    try:
        workers = [WorkerProcess("board%d" % i, 1, tmp, cgroups.preexec("board%d" % i) if cgroups else None)
                   for i in range(1, args.nodes)]
        for w in workers:
            w.wait_healthy(120)
        port, data_port = ports_besides(workers, 2)
        cfg = os.path.join(tmp, "serve.yaml")
        write_config(cfg, os.path.abspath(args.model), workers, port, data_port, adapter)
        server = NodeProcess("server", [os.path.join(BIN, "mdi-start"), "--config", cfg, "--serve"],
                             os.path.join(tmp, "server.log"), dict(os.environ),
                             preexec=cgroups.preexec("starter") if cgroups else None)
        url = "http://127.0.0.1:%d" % port
        wait_healthy(url, None, server, 600)
        stream_completion(url, PROMPT, args.tokens)  # warm-up: a whole request, then a one-step job
        job(url, "POST", dict(body, steps=1, out=os.path.join(tmp, "warm-up")))
        deadline = time.monotonic() + 600
        while job(url, "GET")["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        for r in range(args.repeats):
            for kind in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                if kind == "idle":
                    text, tpot = stream_completion(url, PROMPT, args.tokens)
                    idle.append({"text": text, "tpot": tpot})
                else:
                    busy.append(busy_run(url, args.tokens, body))
            print("repeat %d: TPOT idle %.1f ms, busy %.1f ms, ratio %.3f, training %.1f tokens/s while serving"
                  % (r + 1, 1e3 * idle[-1]["tpot"], 1e3 * busy[-1]["tpot"], idle[-1]["tpot"] / busy[-1]["tpot"],
                     busy[-1]["train_tokens_per_s_serving"]), file=sys.stderr)
    finally:
        benchlib.stop_serving(server, workers, cgroups)
    benchlib.finish_machine_info(info)
    ratios = [i["tpot"] / b["tpot"] for i, b in zip(idle, busy)]
    same = all(b["text"] == idle[0]["text"] for b in busy) and all(i["text"] == idle[0]["text"] for i in idle)
    record = {"model": args.model, "nodes": args.nodes, "tokens": args.tokens, "prompt": PROMPT,
              "quota_cores": args.quota if cgroups else None, "quant_kernel": "exact",
              "job": {k: v for k, v in body.items() if k not in ("data", "out", "steps")},
              "data": os.path.relpath(args.data, benchlib.ROOT),
              "tpot_idle_s": benchlib.summarize([i["tpot"] for i in idle]),
              "tpot_busy_s": benchlib.summarize([b["tpot"] for b in busy]),
              "ratio_idle_over_busy": benchlib.summarize(ratios), "target": 0.8, "texts_unchanged": same,
              "train_tokens_per_s_serving": benchlib.summarize([b["train_tokens_per_s_serving"] for b in busy]),
              "train_steps_serving": [b["train_steps_serving"] for b in busy],
              "train_tokens_per_s_first_step": benchlib.summarize([b["alone_tokens_per_s"] for b in busy]),
              "text": idle[0]["text"], "machine": info}
    print_table("S = 1 streaming on %d nodes, idle vs a LoRA job training beside it" % args.nodes,
                ["", "median [min, max]"],
                [["TPOT idle (ms)", benchlib.fmt_stat(record["tpot_idle_s"], scale=1e3)],
                 ["TPOT busy (ms)", benchlib.fmt_stat(record["tpot_busy_s"], scale=1e3)],
                 ["ratio idle / busy", benchlib.fmt_stat(record["ratio_idle_over_busy"], "%.3f")],
                 ["training tokens/s while serving", benchlib.fmt_stat(record["train_tokens_per_s_serving"])],
                 ["texts unchanged", str(same)]])
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, record)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
