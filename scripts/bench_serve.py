#!/usr/bin/env python
"""Serving benchmarks of `mdi-start --serve` on a ring of real worker processes, as ratios in one run.

--compare batching (default; issue 16, criterion a): batched passes against the unbatched ring.
  --clients closed-loop clients (default 16, one KV slot each: serve.max_in_flight = --clients)
  each send --per-client (default 1) streaming /v1/completions requests back to back (greedy, output
  lengths drawn uniformly from [--min-tokens, --max-tokens], default 32-48, the same for both
  runs). The same trace is replayed on the same ring with runtime.max_batch auto (ceil(slots /
  nodes) samples per frame) and with max_batch 1 (every sample travels alone). Reported per
  setting: aggregate tokens/s = completion tokens / (last response end - first request sent),
  mean latency, mean TTFT, and the nodes' samples per forward (from /v1/mdi/state); and the
  ratio batched / unbatched tokens/s (the issue asks >= 2). With --repeats > 1 the settings
  alternate (a, 1, 1, a, ...), the ratio is the median [min, max] of the per-repeat ratios
  (each repeat's two runs back to back). Record: results/bench_serve_batching.json.

--compare ttft (issue 16, criterion b): time to first token of a short request while a long
  prompt (~--long-tokens tokens of repeated text, max_tokens --long-max-tokens) is being
  prefilled, against the same short request on the idle ring, for several runtime.prefill_chunk
  values (--chunks: "default" = mdi's default, "none" = one pass for the whole prompt, i.e.
  prefill_chunk = serve.max_len, the unchunked baseline). One server per chunk size (serve.max_len
  = long prompt + its max_tokens + a margin); on it, idle and loaded measurements alternate
  (idle, loaded, idle, loaded, idle, ...): loaded = send the long request, wait --delay s (its
  prefill must still be under way: checked, the long request must not have streamed a token
  when the short one is sent), send the short one, record its TTFT. Reported per chunk size:
  idle TTFT (median), loaded TTFT (median [min, max]), ratio loaded / idle (the issue asks < 2),
  and the long request's own TTFT (what chunking costs it). Record: results/bench_serve_ttft.json.

--compare policy: iteration-level admission against static batches (serve.admission). One
  request trace (Poisson arrivals at --rate requests/s, output lengths uniform in
  [--min-tokens, --max-tokens], default 8-96, greedy so both policies do the same work) is
  replayed twice on the same ring, once per policy:
    iteration  a slot freed by a finished sample takes the next queued request at the next step;
    static     a batch of up to --slots queued requests runs until its slowest sample ends.
  Each request is a streaming /v1/completions call from its own client thread. Reported per
  policy: aggregate tokens/s, mean latency, mean time to first token; and the ratios iteration /
  static. With --repeats > 1 the policies alternate (i, s, s, i, ...); the ratios are medians of
  the per-repeat ratios. Record: results/bench_serve.json.

    python scripts/bench_serve.py --repeats 3                      # batching, SmolLM2-135M, 3 nodes
    python scripts/bench_serve.py --compare ttft --repeats 2
    python scripts/bench_serve.py --compare policy                 # admission policies
    python scripts/bench_serve.py --model models/nanogpt-shakespeare --clients 4 --per-client 1
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
from typing import Any, Dict, List, Optional

import benchlib
from benchlib import DEFAULT_MODEL, BIN, NodeProcess, WorkerProcess, ports_besides, print_table, wait_healthy

import requests

PROMPTS = ["Once upon a time", "The history of the city", "In a small village", "Here is a recipe for",
           "The scientist looked at", "Dear friend,", "The rules of the game are", "Long ago, in a land"]


MODES = ("batching", "ttft", "policy")
# Per-mode defaults of the options they share (None on the command line: take these).
DEFAULTS = {"policy": {"slots": 4, "min_tokens": 8, "max_tokens": 96, "out": "bench_serve.json"},
            "batching": {"min_tokens": 32, "max_tokens": 48, "out": "bench_serve_batching.json"},
            "ttft": {"slots": 4, "out": "bench_serve_ttft.json"}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=MODES, default="batching",
                   help="what to compare: batching (max_batch auto vs 1), ttft (prefill_chunk sizes), "
                        "policy (admission iteration vs static) (default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="mdi model directory (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=3, help="ring size: the starter + N-1 workers (default: 3)")
    p.add_argument("--slots", type=int, default=None,
                   help="KV slots = serve.max_in_flight (policy: also the static batch size; default: 4; "
                        "batching: --clients; ttft: 4)")
    p.add_argument("--repeats", type=int, default=1,
                   help="replays per setting, alternating (ttft: loaded measurements per chunk size) (default: 1)")
    p.add_argument("--seed", type=int, default=1, help="seed of the trace (default: 1)")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="shortest output (default: policy 8, batching 32)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="longest output (default: policy 96, batching 48)")
    p.add_argument("--out", default=None,
                   help="JSON record (default: results/bench_serve.json, bench_serve_batching.json or "
                        "bench_serve_ttft.json by --compare)")
    g = p.add_argument_group("policy")
    g.add_argument("--requests", type=int, default=24, help="requests in the trace (default: 24)")
    g.add_argument("--rate", type=float, default=0.6, help="mean arrivals per second (default: 0.6)")
    g = p.add_argument_group("batching")
    g.add_argument("--clients", type=int, default=16, help="concurrent closed-loop clients (default: 16)")
    g.add_argument("--per-client", type=int, default=1,
                   help="requests each client sends back to back (default: 1: --clients requests at once; "
                        "the unbatched ring is slow, 2 doubles a run's ~8 minutes with --repeats 3)")
    g = p.add_argument_group("ttft")
    g.add_argument("--chunks", default="default,none,32,64,128",
                   help="runtime.prefill_chunk values, comma-separated; 'default' = mdi's default, 'none' = "
                        "no chunking (prefill_chunk = serve.max_len) (default: %(default)s)")
    g.add_argument("--long-tokens", type=int, default=2000,
                   help="tokens of the long prompt, capped by the model's context (default: 2000)")
    g.add_argument("--long-max-tokens", type=int, default=4, help="max_tokens of the long request (default: 4)")
    g.add_argument("--short-max-tokens", type=int, default=4, help="max_tokens of the short request (default: 4)")
    g.add_argument("--delay", type=float, default=0.3,
                   help="seconds between sending the long request and the short one (default: 0.3)")
    g.add_argument("--idle-repeats", type=int, default=3,
                   help="idle-ring TTFT measurements per chunk size, at least --repeats + 1 (default: 3)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.compare].items():
        if getattr(args, key) is None:
            setattr(args, key, os.path.join(benchlib.ROOT, "results", value) if key == "out" else value)
    if args.slots is None:
        args.slots = args.clients
    return args


def make_trace(args: argparse.Namespace) -> List[Dict[str, Any]]:
    rng = random.Random(args.seed)
    t, trace = 0.0, []
    for i in range(args.requests):
        trace.append({"at": round(t, 4), "prompt": PROMPTS[i % len(PROMPTS)],
                      "max_tokens": rng.randint(args.min_tokens, args.max_tokens)})
        t += rng.expovariate(args.rate)
    return trace


def write_config(path: str, model: str, workers: List[WorkerProcess], slots: int, policy: str, port: int,
                 data_port: int, max_len: int, runtime: Optional[Dict[str, Any]] = None,
                 quant: Optional[str] = None) -> None:
    """The run YAML of `mdi-start --serve`; `runtime` adds keys to the runtime section, `quant`
    is model.quant (None: the default)."""
    nodes = ["  - {name: starter, host: 127.0.0.1, port: %d, data_port: %d}" % (port, data_port)]
    nodes += ["  - {name: %s, host: 127.0.0.1, port: %d, data_port: %d}" % (w.name, w.port, w.data_port)
              for w in workers]
    rt = {"threads": 1}  # type: Dict[str, Any]
    rt.update(runtime or {})
    with open(path, "w") as f:
        f.write("model: {path: %s%s}\nnodes:\n%s\ngeneration: {temperature: 0}\nruntime: {%s}\n"
                "serve: {max_in_flight: %d, max_len: %d, admission: %s}\n"
                % (json.dumps(model), ", quant: %s" % quant if quant else "", "\n".join(nodes),
                   ", ".join("%s: %s" % kv for kv in rt.items()), slots, max_len, policy))


def stream_completion(url: str, t0: float, prompt: str, max_tokens: int) -> Dict[str, Any]:
    """One streaming greedy /v1/completions call; times relative to t0 (monotonic): sent, first
    (the first non-empty text piece), end; completion tokens (from usage) and the text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first, tokens, text = None, 0, ""
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=(10, 600)) as r:
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
        return {"error": str(e)}
    end = time.monotonic()
    return {"sent": sent - t0, "first": (first or end) - t0, "end": end - t0, "tokens": tokens, "text": text,
            "streamed": first is not None}


class Client(threading.Thread):
    """Sends one trace item at its arrival time."""

    def __init__(self, url: str, t0: float, item: Dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.t0, self.item = url, t0, item
        self.record = {}  # type: Dict[str, Any]

    def run(self) -> None:
        delay = self.t0 + self.item["at"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self.record = stream_completion(self.url, self.t0, self.item["prompt"], self.item["max_tokens"])


class ClosedLoopClient(threading.Thread):
    """Sends its items one after the other, each as soon as the previous one is answered."""

    def __init__(self, url: str, t0: float, items: List[Dict[str, Any]]) -> None:
        super().__init__(daemon=True)
        self.url, self.t0, self.items = url, t0, items
        self.records = []  # type: List[Dict[str, Any]]

    def run(self) -> None:
        delay = self.t0 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for item in self.items:
            record = stream_completion(self.url, self.t0, item["prompt"], item["max_tokens"])
            self.records.append(record)
            if "error" in record:
                return


def summarize_records(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    bad = [r for r in records if "error" in r or not r]
    if bad:
        raise RuntimeError("%d requests failed: %s" % (len(bad), bad[0]))
    span = max(r["end"] for r in records) - min(r["sent"] for r in records)
    return {"tokens": sum(r["tokens"] for r in records), "seconds": span,
            "tokens_per_s": sum(r["tokens"] for r in records) / span,
            "mean_latency_s": statistics.mean(r["end"] - r["sent"] for r in records),
            "mean_ttft_s": statistics.mean(r["first"] - r["sent"] for r in records),
            "requests": records}


def replay(url: str, trace: List[Dict[str, Any]]) -> Dict[str, Any]:
    t0 = time.monotonic() + 0.5
    clients = [Client(url, t0, item) for item in trace]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=1800)
    return summarize_records([c.record for c in clients])


class Server:
    """`mdi-start --serve` on the ring of `workers`, with the YAML write_config makes; stopped
    with SIGTERM to its own PID (it closes the ring and exits)."""

    def __init__(self, args, label: str, workers: List[WorkerProcess], tmp: str, max_len: int, slots: int,
                 policy: str = "iteration", runtime: Optional[Dict[str, Any]] = None) -> None:
        port, data_port = ports_besides(workers, 2)
        cfg = os.path.join(tmp, "%s.yaml" % label)
        write_config(cfg, os.path.abspath(args.model), workers, slots, policy, port, data_port, max_len, runtime,
                     getattr(args, "quant", None))
        self.proc = NodeProcess("server (%s)" % label, [os.path.join(BIN, "mdi-start"), "--config", cfg, "--serve"],
                                os.path.join(tmp, "server-%s.log" % label), dict(os.environ))
        self.url = "http://127.0.0.1:%d" % port

    def __enter__(self) -> "Server":
        try:
            wait_healthy(self.url, None, self.proc, 300)
            requests.post(self.url + "/v1/completions", json={"prompt": "Warm up", "max_tokens": 4}, timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.alive():
            self.proc.proc.terminate()  # mdi-start --serve closes the ring and exits on SIGTERM
        self.proc.stop(grace=60.0)

    def batching_stats(self) -> List[Dict[str, Any]]:
        """Each node's samples and rows per forward over this server's run (GET /v1/mdi/state)."""
        try:
            nodes = requests.get(self.url + "/v1/mdi/state", timeout=30).json().get("nodes", [])
        except (requests.RequestException, ValueError):
            return []
        keys = ("name", "role", "backend", "frames", "compute_seconds", "forwards", "rows_per_forward_mean",
                "rows_per_forward_max", "samples_per_forward_mean", "samples_per_forward_max")
        return [{k: n.get(k) for k in keys} for n in nodes if n.get("role") in ("starter", "worker")]


def with_workers(args, body):
    """Start the ring's workers, run body(workers, tmp), stop them; returns (body's value, machine info)."""
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    workers = [WorkerProcess("board%d" % i, 1, tmp) for i in range(1, args.nodes)]
    try:
        for w in workers:
            w.wait_healthy(120)
        result = body(workers, tmp)
    finally:
        for w in workers:
            w.stop()
    benchlib.finish_machine_info(info)
    return result, info


def model_name(args) -> str:
    return os.path.basename(os.path.normpath(args.model))


# --------------------------------------------------------------------------- --compare policy

def run_policy(args, policy: str, workers: List[WorkerProcess], trace, tmp: str, max_len: int) -> Dict[str, Any]:
    with Server(args, policy, workers, tmp, max_len, args.slots, policy=policy) as server:
        result = replay(server.url, trace)
        result["policy"] = policy
        result["loadavg_end"] = list(os.getloadavg())
        return result


def main_policy(args) -> int:
    if args.requests < 1 or args.rate <= 0:
        print("bench_serve: bad arguments", file=sys.stderr)
        return 2
    trace = make_trace(args)
    from mdi.model.source import ModelSource
    source = ModelSource(args.model)
    longest = max(len(source.tokenizer.encode(p)) for p in PROMPTS)
    max_len = min(source.config.block_size, longest + args.max_tokens + 8)
    runs = {"iteration": [], "static": []}  # type: Dict[str, List[Dict[str, Any]]]

    def body(workers, tmp):
        order = []
        for r in range(args.repeats):
            order += ["iteration", "static"] if r % 2 == 0 else ["static", "iteration"]
        for policy in order:
            print("replaying %d requests with %s admission ..." % (len(trace), policy), flush=True)
            runs[policy].append(run_policy(args, policy, workers, trace, tmp, max_len))

    _, info = with_workers(args, body)

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
                   model_name(args)),
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


# --------------------------------------------------------------------------- --compare batching

BATCHING = (("batched", "auto"), ("unbatched", 1))  # label, runtime.max_batch


def make_client_traces(args) -> List[List[Dict[str, Any]]]:
    """Each client's requests, in the order it sends them (the same for every setting)."""
    rng = random.Random(args.seed)
    return [[{"prompt": PROMPTS[(c * args.per_client + j) % len(PROMPTS)],
              "max_tokens": rng.randint(args.min_tokens, args.max_tokens)} for j in range(args.per_client)]
            for c in range(args.clients)]


def run_batching(args, label: str, max_batch: Any, workers, traces, tmp: str, max_len: int) -> Dict[str, Any]:
    with Server(args, label, workers, tmp, max_len, args.slots, runtime={"max_batch": max_batch}) as server:
        t0 = time.monotonic() + 0.5
        clients = [ClosedLoopClient(server.url, t0, items) for items in traces]
        for c in clients:
            c.start()
        for c in clients:
            c.join(timeout=1800)
        result = summarize_records([r for c in clients for r in c.records] +
                                   [{"error": "client %d did not finish" % n} for n, c in enumerate(clients)
                                    if len(c.records) != len(c.items)])
        result.update({"setting": label, "max_batch": max_batch, "nodes_batching": server.batching_stats(),
                       "loadavg_end": list(os.getloadavg())})
        return result


def main_batching(args) -> int:
    if args.clients < 1 or args.per_client < 1:
        print("bench_serve: bad arguments", file=sys.stderr)
        return 2
    if args.slots < args.clients:
        print("bench_serve: note: %d clients share %d slots: some requests queue" % (args.clients, args.slots))
    traces = make_client_traces(args)
    from mdi.model.source import ModelSource
    source = ModelSource(args.model)
    longest = max(len(source.tokenizer.encode(p)) for p in PROMPTS)
    max_len = min(source.config.block_size, longest + args.max_tokens + 8)
    runs = {label: [] for label, _ in BATCHING}  # type: Dict[str, List[Dict[str, Any]]]
    n_requests = args.clients * args.per_client

    def body(workers, tmp):
        for r in range(args.repeats):
            for label, max_batch in (BATCHING if r % 2 == 0 else BATCHING[::-1]):
                print("repeat %d/%d: %d clients x %d requests, max_batch %s (%s) ..."
                      % (r + 1, args.repeats, args.clients, args.per_client, max_batch, label), flush=True)
                res = run_batching(args, label, max_batch, workers, traces, tmp, max_len)
                print("    %.2f tokens/s, %d tokens in %.1f s" % (res["tokens_per_s"], res["tokens"], res["seconds"]),
                      flush=True)
                runs[label].append(res)

    _, info = with_workers(args, body)

    keys = ("tokens_per_s", "mean_latency_s", "mean_ttft_s")
    stats = {label: {k: benchlib.summarize([r[k] for r in rs]) for k in keys} for label, rs in runs.items()}
    pairs = list(zip(runs["batched"], runs["unbatched"]))  # each repeat's two runs were back to back
    ratios = {k: benchlib.summarize([b[k] / u[k] for b, u in pairs]) for k in keys}
    same = all(a["text"] == b["text"] for a, b in zip(runs["batched"][0]["requests"], runs["unbatched"][0]["requests"]))

    def spf(run):  # mean samples per forward over the workers (the starter's first forwards are prefills)
        vals = [n["samples_per_forward_mean"] for n in run["nodes_batching"]
                if n.get("role") == "worker" and n.get("samples_per_forward_mean") is not None]
        return "%.2f" % statistics.mean(vals) if vals else "n/a"

    rows = [[label, mb, benchlib.fmt_stat(stats[label]["tokens_per_s"], "%.2f"),
             benchlib.fmt_stat(stats[label]["mean_latency_s"], "%.2f"),
             benchlib.fmt_stat(stats[label]["mean_ttft_s"], "%.2f"), runs[label][0]["tokens"], spf(runs[label][0])]
            for label, mb in BATCHING]
    print_table("%d clients x %d requests back to back, %d-%d tokens, %d slots, %d nodes, %s, %d repeat(s): "
                "median [min, max]" % (args.clients, args.per_client, args.min_tokens, args.max_tokens,
                                       args.slots, args.nodes, model_name(args), args.repeats),
                ["setting", "max_batch", "tokens/s", "mean latency s", "mean TTFT s", "tokens",
                 "samples/fwd (workers)"], rows)
    if len(pairs) > 1:
        print_table("per repeat (pairs run back to back)",
                    ["repeat", "tokens/s b / u", "ratio", "latency s b / u", "TTFT s b / u"],
                    [[n + 1, "%.2f / %.2f" % (b["tokens_per_s"], u["tokens_per_s"]),
                      "x%.2f" % (b["tokens_per_s"] / u["tokens_per_s"]),
                      "%.2f / %.2f" % (b["mean_latency_s"], u["mean_latency_s"]),
                      "%.2f / %.2f" % (b["mean_ttft_s"], u["mean_ttft_s"])] for n, (b, u) in enumerate(pairs)])
    r = ratios["tokens_per_s"]
    print("batched / unbatched tokens/s: x%.2f [%.2f, %.2f] (median [min, max] of %d paired ratios; criterion >= 2: %s); "
          "mean latency x%.2f, mean TTFT x%.2f; identical texts: %s"
          % (r["median"], r["min"], r["max"], len(pairs), "met" if r["median"] >= 2 else "NOT met",
             ratios["mean_latency_s"]["median"], ratios["mean_ttft_s"]["median"], same))
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, {"args": vars(args), "machine": info, "requests": n_requests, "max_len": max_len,
                                    "client_traces": traces, "stats": stats, "ratios_batched_over_unbatched": ratios,
                                    "criterion_ratio_ge_2": r["median"] >= 2, "identical_texts": same, "runs": runs})
    return 0


# --------------------------------------------------------------------------- --compare ttft

LONG_TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
             "father had taught him, and lit the lamp that guided the fishing boats home through the fog. ")
SHORT_PROMPT = "Once upon a time"


def long_prompt(tokenizer, target: int) -> str:
    """Repeated text of at most `target` tokens (as many whole repeats as fit, then words)."""
    text = ""
    while len(tokenizer.encode(text + LONG_TEXT)) <= target:
        text += LONG_TEXT
    for word in LONG_TEXT.split(" "):
        if len(tokenizer.encode(text + word + " ")) > target:
            break
        text += word + " "
    return text


def parse_chunks(spec: str) -> List[Any]:
    out = []  # type: List[Any]
    for item in spec.split(","):
        item = item.strip()
        if item in ("default", "none"):
            out.append(item)
        elif item:
            value = int(item)
            if value < 1:
                raise ValueError("prefill_chunk must be >= 1")
            out.append(value)
    if not out:
        raise ValueError("no chunk sizes")
    return out


def measure_loaded(url: str, long_text: str, args) -> Dict[str, Any]:
    """The long request, then after --delay the short one; both records and whether the long
    prompt's prefill was still under way when the short request was sent."""
    t0 = time.monotonic()
    long_client = Client(url, t0, {"at": 0.0, "prompt": long_text, "max_tokens": args.long_max_tokens})
    long_client.start()
    time.sleep(args.delay)
    short = stream_completion(url, t0, SHORT_PROMPT, args.short_max_tokens)
    long_client.join(timeout=1800)
    long = long_client.record
    for name, rec in (("short", short), ("long", long)):
        if not rec or "error" in rec:
            raise RuntimeError("the %s request failed: %s" % (name, rec))
    return {"short_ttft_s": short["first"] - short["sent"], "long_ttft_s": long["first"] - long["sent"],
            "long_latency_s": long["end"] - long["sent"], "short_sent_after_s": short["sent"] - long["sent"],
            # The long request's first token marks the end of its prefill.
            "prefill_under_way": long["first"] > short["sent"],
            "short_done_before_long_first_token": short["end"] < long["first"],
            "short": short, "long": long}


def measure_idle(url: str, args) -> float:
    rec = stream_completion(url, time.monotonic(), SHORT_PROMPT, args.short_max_tokens)
    if "error" in rec:
        raise RuntimeError("the short request failed: %s" % rec["error"])
    return rec["first"] - rec["sent"]


def main_ttft(args) -> int:
    try:
        chunks = parse_chunks(args.chunks)
    except ValueError as e:
        print("bench_serve: --chunks: %s" % e, file=sys.stderr)
        return 2
    if args.repeats < 1 or args.long_tokens < 2 or args.delay < 0:
        print("bench_serve: bad arguments", file=sys.stderr)
        return 2
    from mdi.model.source import ModelSource
    from mdi.runconfig import DEFAULT_PREFILL_CHUNK
    source = ModelSource(args.model)
    tok = source.tokenizer
    block = source.config.block_size
    margin = 8
    target = min(args.long_tokens, block - args.long_max_tokens - margin)
    text = long_prompt(tok, target)
    n_long = len(tok.encode(text))
    max_len = min(block, n_long + args.long_max_tokens + margin)
    if n_long < args.long_tokens:
        print("bench_serve: note: the long prompt has %d tokens (asked %d; context %d)" % (n_long, args.long_tokens, block))
    n_idle = max(args.idle_repeats, args.repeats + 1)
    results = []  # type: List[Dict[str, Any]]

    def value(chunk):
        return {"default": DEFAULT_PREFILL_CHUNK, "none": max_len}.get(chunk, chunk)

    def body(workers, tmp):
        for chunk in chunks:
            runtime = {} if chunk == "default" else {"prefill_chunk": value(chunk)}
            label = "chunk-%s" % chunk
            print("prefill_chunk %s (%d): %d idle and %d loaded measurements, long prompt %d tokens ..."
                  % (chunk, value(chunk), n_idle, args.repeats, n_long), flush=True)
            idle, loaded = [], []  # type: List[float], List[Dict[str, Any]]
            with Server(args, label, workers, tmp, max_len, args.slots, runtime=runtime) as server:
                for i in range(n_idle):  # idle, loaded, idle, loaded, ..., idle
                    idle.append(measure_idle(server.url, args))
                    if i < args.repeats:
                        rec = measure_loaded(server.url, text, args)
                        loaded.append(rec)
                        print("    idle %.3f s, loaded %.3f s (long request's TTFT %.2f s%s)"
                              % (idle[-1], rec["short_ttft_s"], rec["long_ttft_s"],
                                 "" if rec["prefill_under_way"] else "; ITS PREFILL HAD ENDED: invalid"), flush=True)
                nodes = server.batching_stats()
            valid = [r for r in loaded if r["prefill_under_way"]]
            idle_med = statistics.median(idle)
            results.append({
                "chunk": chunk, "prefill_chunk": value(chunk),
                "idle_ttft_s": benchlib.summarize(idle),
                "loaded_ttft_s": benchlib.summarize([r["short_ttft_s"] for r in valid]),
                "ratio_loaded_over_idle": benchlib.summarize([r["short_ttft_s"] / idle_med for r in valid]),
                "long_ttft_s": benchlib.summarize([r["long_ttft_s"] for r in loaded]),
                "invalid_loaded": len(loaded) - len(valid), "loaded": loaded, "nodes_batching": nodes,
                "loadavg_end": list(os.getloadavg())})

    _, info = with_workers(args, body)

    rows = []
    for res in results:
        ratio = res["ratio_loaded_over_idle"]
        rows.append(["%s (%d)" % (res["chunk"], res["prefill_chunk"]) if isinstance(res["chunk"], str) else res["chunk"],
                     "%.3f" % res["idle_ttft_s"]["median"], benchlib.fmt_stat(res["loaded_ttft_s"], "%.3f"),
                     benchlib.fmt_stat(ratio, "%.2f"),
                     ("yes" if ratio["median"] < 2 else "no") if ratio["median"] is not None else "n/a",
                     benchlib.fmt_stat(res["long_ttft_s"], "%.2f"),
                     "%d" % res["invalid_loaded"] if res["invalid_loaded"] else ""])
    print_table("short request (%r, %d tokens) alone vs %.2f s after a %d-token prompt; %d slots, %d nodes, %s; "
                "TTFT median [min, max]" % (SHORT_PROMPT, args.short_max_tokens, args.delay, n_long, args.slots,
                                            args.nodes, model_name(args)),
                ["prefill_chunk", "idle TTFT s", "loaded TTFT s", "loaded / idle", "< 2x", "long prompt TTFT s",
                 "invalid"], rows)
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, {"args": vars(args), "machine": info, "long_prompt_tokens": n_long,
                                    "max_len": max_len, "default_prefill_chunk": DEFAULT_PREFILL_CHUNK,
                                    "long_prompt": text, "results": results})
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nodes < 1 or args.slots < 1 or args.repeats < 1 or \
            (args.compare != "ttft" and not 1 <= args.min_tokens <= args.max_tokens):
        print("bench_serve: bad arguments", file=sys.stderr)
        return 2
    return {"policy": main_policy, "batching": main_batching, "ttft": main_ttft}[args.compare](args)


if __name__ == "__main__":
    sys.exit(main())
