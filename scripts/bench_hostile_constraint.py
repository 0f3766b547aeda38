#!/usr/bin/env python
"""Hostile constraints beside a plain user (issue 58, finding 1): what costly token masks of
other clients cost one user's stream, as same-run ratios.

One `mdi-start --serve` ring (SmolLM2-135M by default: the starter and --nodes - 1 workers).
Each repeat times one greedy streamed /v1/completions request (--tokens tokens, the measured
user) twice, in an order that alternates per repeat:
  plain:   beside --clients requests without a constraint;
  hostile: beside --clients requests whose `regex` is among the costliest the server admits
           (DFA-growing alternations of counted wildcards: each token mask builds new lexer
           states; the first mask is cheap, later ones are not, so admission cannot see them).
The other requests are in flight (counted by /metrics) before the measured one starts, and are
cancelled after it ends. Reported: the measured stream's time per token (client side, from the
streamed chunks' arrival) in each setting, the ratio hostile / plain per repeat (median [min,
max]; the issue asks <= 1.3), whether its text is the same in both, and how the hostile
requests ended (finish reasons, errors: a sample whose mask misses the step's deadline ends).
Record: results/bench_hostile_constraint.json (with the CPU and its ISA).

    python scripts/bench_hostile_constraint.py               # 3 nodes, 4 hostile clients, 3 repeats
    python scripts/bench_hostile_constraint.py --clients 8 --repeats 5
"""
import argparse
import collections
import json
import os
import string
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import benchlib
from benchlib import BIN, DEFAULT_MODEL, NodeProcess, WorkerProcess, ports_besides, print_table, stream_completion, wait_healthy

import requests

PROMPT = "Once upon a time"


def hostile_regexes() -> List[str]:
    """Regexes the server admits (counts under its cap, a cheap first mask) whose masks grow as
    the text goes on: alternations of counted wildcards, each a lexer state set of its own."""
    letters = string.ascii_lowercase
    # ({3} instead of {2} adds more copies than the server's MAX_REPEAT_ADDED: refused since 2026-12-06)
    return ["(%s){2}" % "|".join(".{%d}%s" % (10 + 12 * i, letters[i]) for i in range(26)),
            "(%s)" % "|".join(".{%d}%s" % (10 + 20 * i, letters[i]) for i in range(26)),
            ".*a.{60}b.{60}"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--clients", type=int, default=4, help="other requests in flight (default 4)")
    p.add_argument("--tokens", type=int, default=40, help="tokens of the measured stream (default 40)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_hostile_constraint.json"))
    return p.parse_args(argv)


def write_config(path: str, model: str, workers: List[WorkerProcess], port: int, data_port: int,
                 in_flight: int) -> None:
    nodes = ["  - {name: starter, host: 127.0.0.1, port: %d, data_port: %d}" % (port, data_port)]
    nodes += ["  - {name: %s, host: 127.0.0.1, port: %d, data_port: %d}" % (w.name, w.port, w.data_port)
              for w in workers]
    with open(path, "w") as f:
        f.write("model: {path: %s}\nnodes:\n%s\ngeneration: {temperature: 0}\nruntime: {threads: 1}\n"
                "serve: {max_in_flight: %d, max_len: 1024}\n" % (model, "\n".join(nodes), in_flight))


class Others:
    """`n` long requests (plain, or each with one of the hostile regexes) streaming in threads
    until `stop()`; `ends` counts how each ended (a finish reason, or the error's first words)."""

    def __init__(self, url: str, n: int, hostile: bool) -> None:
        self.url, self.stopping = url, threading.Event()
        self.ends = collections.Counter()  # type: collections.Counter
        self.lock = threading.Lock()
        regexes = hostile_regexes()
        self.threads = [threading.Thread(target=self._run, args=(regexes[i % len(regexes)] if hostile else None,),
                                         daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, regex: Any) -> None:
        while not self.stopping.is_set():  # one ended (e.g. its mask missed the deadline): another
            body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
            if regex is not None:
                body["regex"] = regex
            end = "no end"
            try:
                with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=(10, 600)) as r:
                    if r.status_code != 200:
                        end = "refused %d: %s" % (r.status_code, r.text[:80])
                    else:
                        for line in r.iter_lines():
                            if self.stopping.is_set():
                                end = "cancelled"
                                break
                            if line.startswith(b"data: ") and line != b"data: [DONE]":
                                event = json.loads(line[6:])
                                if "error" in event:
                                    end = "error: " + " ".join(event["error"]["message"].split()[:8])
                                elif event["choices"][0].get("finish_reason"):
                                    end = event["choices"][0]["finish_reason"]
            except requests.RequestException as e:
                end = "connection: %s" % type(e).__name__
            with self.lock:
                self.ends[end] += 1
            if end.startswith("refused"):
                return

    def wait_in_flight(self, url: str, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while metric(url, "mdi_samples_in_flight") < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the other requests did not all start within %.0f s (ends: %s)"
                                   % (timeout, dict(self.ends)))
            time.sleep(0.05)

    def stop(self) -> Dict[str, int]:
        self.stopping.set()
        for t in self.threads:
            t.join(600)
        return dict(self.ends)


def metric(url: str, name: str) -> float:
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError("/metrics has no %s" % name)


def main(argv=None) -> int:
    args = parse_args(argv)
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-hostile-")
    workers, server = [], None
    runs = {"plain": [], "hostile": []}  # type: Dict[str, List[Dict[str, Any]]]
    try:
        workers = [WorkerProcess("board%d" % i, 1, tmp) for i in range(1, args.nodes)]
        for w in workers:
            w.wait_healthy(120)
        port, data_port = ports_besides(workers, 2)
        cfg = os.path.join(tmp, "serve.yaml")
        write_config(cfg, os.path.abspath(args.model), workers, port, data_port, args.clients + 1)
        server = NodeProcess("server", [os.path.join(BIN, "mdi-start"), "--config", cfg, "--serve"],
                             os.path.join(tmp, "server.log"), dict(os.environ))
        url = "http://127.0.0.1:%d" % port
        wait_healthy(url, None, server, 600)
        stream_completion(url, PROMPT, args.tokens)  # warm-up
        for r in range(args.repeats):
            for kind in (("plain", "hostile") if r % 2 == 0 else ("hostile", "plain")):
                others = Others(url, args.clients, kind == "hostile")
                try:
                    others.wait_in_flight(url, args.clients)
                    text, tpot = stream_completion(url, PROMPT, args.tokens)
                finally:
                    ends = others.stop()
                runs[kind].append({"text": text, "tpot": tpot, "others_ended": ends})
            print("repeat %d: TPOT beside plain %.1f ms, beside hostile %.1f ms, ratio %.3f; hostile ends %s"
                  % (r + 1, 1e3 * runs["plain"][-1]["tpot"], 1e3 * runs["hostile"][-1]["tpot"],
                     runs["hostile"][-1]["tpot"] / runs["plain"][-1]["tpot"], runs["hostile"][-1]["others_ended"]),
                  file=sys.stderr)
    finally:
        benchlib.stop_serving(server, workers)
    benchlib.finish_machine_info(info)
    ratios = [h["tpot"] / p["tpot"] for p, h in zip(runs["plain"], runs["hostile"])]
    texts = {x["text"] for rs in runs.values() for x in rs}
    record = {"model": args.model, "nodes": args.nodes, "clients": args.clients, "tokens": args.tokens,
              "prompt": PROMPT, "hostile_regexes": hostile_regexes(),
              "tpot_beside_plain_s": benchlib.summarize([p["tpot"] for p in runs["plain"]]),
              "tpot_beside_hostile_s": benchlib.summarize([h["tpot"] for h in runs["hostile"]]),
              "ratio_hostile_over_plain": benchlib.summarize(ratios), "target": 1.3,
              "text_unchanged": len(texts) == 1, "hostile_ends": [h["others_ended"] for h in runs["hostile"]],
              "machine": info}
    print_table("S = 1 stream on %d nodes beside %d other requests" % (args.nodes, args.clients),
                ["", "median [min, max]"],
                [["TPOT beside plain (ms)", benchlib.fmt_stat(record["tpot_beside_plain_s"], scale=1e3)],
                 ["TPOT beside hostile (ms)", benchlib.fmt_stat(record["tpot_beside_hostile_s"], scale=1e3)],
                 ["ratio hostile / plain", benchlib.fmt_stat(record["ratio_hostile_over_plain"], "%.3f")],
                 ["text unchanged", str(record["text_unchanged"])]])
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, record)
    return 0 if record["text_unchanged"] else 1


if __name__ == "__main__":
    sys.exit(main())
