#!/usr/bin/env python
"""Serving benchmark: iteration-level admission against static batches, as ratios in one run.

One request trace (Poisson arrivals at --rate requests/s, output lengths drawn uniformly from
[--min-tokens, --max-tokens], greedy so both policies do exactly the same work) is replayed
against `mdi-start --serve` twice on the same ring, once per admission policy of the YAML's
`serve.admission`:
  iteration  a slot freed by a finished sample takes the next queued request at the next step;
  static     a batch of up to --slots queued requests runs until its slowest sample ends.
Each request is a streaming /v1/completions call from its own client thread.

Reported per policy: aggregate tokens/s = completion tokens / (last response end - first
request sent), mean latency (request sent -> last token), mean time to first token; and the
ratios iteration / static. With --repeats > 1 the policies alternate (i, s, s, i, ...) so slow
phases of the shared machine hit both alike; the ratios are medians of the per-repeat ratios
(each repeat's two runs are back to back), the table shows the medians of each policy.

    python scripts/bench_serve.py                                  # SmolLM2-135M, 3 nodes
    python scripts/bench_serve.py --model models/nanogpt-shakespeare --rate 4 --requests 40
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import benchlib
from benchlib import DEFAULT_MODEL, BIN, NodeProcess, WorkerProcess, ports_besides, print_table, wait_healthy

import requests

PROMPTS = ["Once upon a time", "The history of the city", "In a small village", "Here is a recipe for",
           "The scientist looked at", "Dear friend,", "The rules of the game are", "Long ago, in a land"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="mdi model directory (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=3, help="ring size: the starter + N-1 workers (default: 3)")
    p.add_argument("--slots", type=int, default=4, help="samples in flight = static batch size (default: 4)")
    p.add_argument("--requests", type=int, default=24, help="requests in the trace (default: 24)")
    p.add_argument("--rate", type=float, default=0.6, help="mean arrivals per second (default: 0.6)")
    p.add_argument("--min-tokens", type=int, default=8, help="shortest output (default: 8)")
    p.add_argument("--max-tokens", type=int, default=96, help="longest output (default: 96)")
    p.add_argument("--repeats", type=int, default=1, help="replays per policy, alternating (default: 1)")
    p.add_argument("--seed", type=int, default=1, help="seed of the trace (default: 1)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_serve.json"),
                   help="JSON record of every request (default: %(default)s)")
    return p.parse_args(argv)


def make_trace(args: argparse.Namespace) -> List[Dict[str, Any]]:
    rng = random.Random(args.seed)
    t, trace = 0.0, []
    for i in range(args.requests):
        trace.append({"at": round(t, 4), "prompt": PROMPTS[i % len(PROMPTS)],
                      "max_tokens": rng.randint(args.min_tokens, args.max_tokens)})
        t += rng.expovariate(args.rate)
    return trace


def write_config(path: str, model: str, workers: List[WorkerProcess], slots: int, policy: str, port: int,
                 data_port: int, max_len: int) -> None:
    nodes = ["  - {name: starter, host: 127.0.0.1, port: %d, data_port: %d}" % (port, data_port)]
    nodes += ["  - {name: %s, host: 127.0.0.1, port: %d, data_port: %d}" % (w.name, w.port, w.data_port)
              for w in workers]
    with open(path, "w") as f:
        f.write("model: {path: %s}\nnodes:\n%s\ngeneration: {temperature: 0}\nruntime: {threads: 1}\n"
                "serve: {max_in_flight: %d, max_len: %d, admission: %s}\n"
                % (json.dumps(model), "\n".join(nodes), slots, max_len, policy))


class Client(threading.Thread):
    def __init__(self, url: str, t0: float, item: Dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.t0, self.item = url, t0, item
        self.record = {}  # type: Dict[str, Any]

    def run(self) -> None:
        delay = self.t0 + self.item["at"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        body = {"prompt": self.item["prompt"], "max_tokens": self.item["max_tokens"], "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        sent = time.monotonic()
        first, tokens, text = None, 0, ""
        try:
            with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=(10, 600)) as r:
                r.raise_for_status()
                buf = b""
                for chunk in r.iter_content(chunk_size=None):
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        data = json.loads(event[6:].decode("utf-8"))
                        if data.get("choices") and data["choices"][0]["text"]:
                            first = first or time.monotonic()
                            text += data["choices"][0]["text"]
                        if data.get("usage"):
                            tokens = data["usage"]["completion_tokens"]
        except (requests.RequestException, ValueError) as e:
            self.record = {"error": str(e)}
            return
        end = time.monotonic()
        self.record = {"sent": sent - self.t0, "first": (first or end) - self.t0, "end": end - self.t0,
                       "tokens": tokens, "text": text}


def replay(url: str, trace: List[Dict[str, Any]]) -> Dict[str, Any]:
    t0 = time.monotonic() + 0.5
    clients = [Client(url, t0, item) for item in trace]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=1800)
    records = [c.record for c in clients]
    bad = [r for r in records if "error" in r or not r]
    if bad:
        raise RuntimeError("%d requests failed: %s" % (len(bad), bad[0]))
    span = max(r["end"] for r in records) - min(r["sent"] for r in records)
    return {"tokens": sum(r["tokens"] for r in records), "seconds": span,
            "tokens_per_s": sum(r["tokens"] for r in records) / span,
            "mean_latency_s": statistics.mean(r["end"] - r["sent"] for r in records),
            "mean_ttft_s": statistics.mean(r["first"] - r["sent"] for r in records),
            "requests": records}


def run_policy(args, policy: str, workers: List[WorkerProcess], trace, tmp: str, max_len: int) -> Dict[str, Any]:
    port, data_port = ports_besides(workers, 2)
    cfg = os.path.join(tmp, "%s.yaml" % policy)
    write_config(cfg, os.path.abspath(args.model), workers, args.slots, policy, port, data_port, max_len)
    server = NodeProcess("server (%s)" % policy, [os.path.join(BIN, "mdi-start"), "--config", cfg, "--serve"],
                         os.path.join(tmp, "server-%s.log" % policy), dict(os.environ))
    url = "http://127.0.0.1:%d" % port
    try:
        wait_healthy(url, None, server, 300)
        requests.post(url + "/v1/completions", json={"prompt": "Warm up", "max_tokens": 4}, timeout=120)
        result = replay(url, trace)
        result["policy"] = policy
        result["loadavg_end"] = list(os.getloadavg())
        return result
    finally:
        if server.alive():
            server.proc.terminate()  # mdi-start --serve closes the ring and exits on SIGTERM
        server.stop(grace=60.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nodes < 1 or args.slots < 1 or args.requests < 1 or args.rate <= 0 or \
            not 1 <= args.min_tokens <= args.max_tokens:
        print("bench_serve: bad arguments", file=sys.stderr)
        return 2
    trace = make_trace(args)
    from mdi.model.source import ModelSource
    source = ModelSource(args.model)
    longest = max(len(source.tokenizer.encode(p)) for p in PROMPTS)
    max_len = min(source.config.block_size, longest + args.max_tokens + 8)
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    workers = [WorkerProcess("board%d" % i, 1, tmp) for i in range(1, args.nodes)]
    runs = {"iteration": [], "static": []}  # type: Dict[str, List[Dict[str, Any]]]
    try:
        for w in workers:
            w.wait_healthy(120)
        order = []
        for r in range(args.repeats):
            order += ["iteration", "static"] if r % 2 == 0 else ["static", "iteration"]
        for policy in order:
            print("replaying %d requests with %s admission ..." % (len(trace), policy), flush=True)
            runs[policy].append(run_policy(args, policy, workers, trace, tmp, max_len))
    finally:
        for w in workers:
            w.stop()
    benchlib.finish_machine_info(info)

    keys = ("tokens_per_s", "mean_latency_s", "mean_ttft_s")
    med = {p: {k: statistics.median(r[k] for r in rs) for k in keys} for p, rs in runs.items()}
    # Ratios of runs adjacent in time (one pair per repeat), then their median: the machine's
    # other tenants change its speed from minute to minute, a pair sees about the same machine.
    pairs = list(zip(runs["iteration"], runs["static"]))
    ratios = {k: statistics.median(i[k] / s[k] for i, s in pairs) for k in keys}
    same = all(a["text"] == b["text"] for a, b in zip(runs["iteration"][0]["requests"], runs["static"][0]["requests"]))
    rows = [[p, "%.1f" % med[p]["tokens_per_s"], "%.2f" % med[p]["mean_latency_s"], "%.2f" % med[p]["mean_ttft_s"],
             runs[p][0]["tokens"]] for p in ("iteration", "static")]
    print_table("%d requests, Poisson %.2f/s, %d-%d tokens, %d slots, %d nodes, %s"
                % (args.requests, args.rate, args.min_tokens, args.max_tokens, args.slots, args.nodes,
                   os.path.basename(os.path.normpath(args.model))),
                ["admission", "tokens/s", "mean latency s", "mean TTFT s", "tokens"], rows)
    if len(pairs) > 1:
        print_table("per repeat (pairs run back to back)", ["repeat", "tokens/s i / s", "latency s i / s",
                                                             "TTFT s i / s"],
                    [[n + 1] + ["%.2f / %.2f" % (i[k], s[k]) for k in keys] for n, (i, s) in enumerate(pairs)])
    print("iteration / static (median of %d paired ratios): tokens/s x%.2f, mean latency x%.2f, mean TTFT x%.2f; "
          "identical texts: %s" % (len(pairs), ratios["tokens_per_s"], ratios["mean_latency_s"],
                                   ratios["mean_ttft_s"], same))
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, {"args": vars(args), "machine": info, "trace": trace, "median": med,
                                    "ratios": ratios, "identical_texts": same, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
