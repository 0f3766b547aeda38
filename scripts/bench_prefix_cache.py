#!/usr/bin/env python
"""Multi-turn chats on `mdi-start --serve` with the prefix cache against the same chats computed
whole (issue 36): time to first token per turn, and every turn's text compared, in one run.

A conversation: turn 1 sends a document (README.md prose, ~--doc-tokens tokens) and a question;
turns 2..--turns ask short questions; each answer (greedy, --answer-tokens tokens) goes back into
the history, so the prompt grows past 1,500 tokens by turn 8. One server (runtime.prefix_cache
auto) on a ring of --nodes processes (the starter and workers, 1 thread each, loopback). Each
repeat runs the conversation twice, with a marker of its own at its start (nothing of an earlier
repeat is reused): first with the cache ("on"), then with every request's `cache_prompt: false`
("off", llama.cpp's field: the whole prompt computed), which therefore cannot profit from the
"on" run. --concurrent N runs N conversations at once (distinct markers), on then off, for the
claim that cache hits do not starve other requests.

--memory SIZE instead: the memory claim. Twice on fresh workers, with runtime.prefix_cache off and
SIZE: --memory-conversations distinct 2-turn conversations one after another (more than the
budget holds, so entries are evicted), then each node's peak RSS (VmHWM of its process); the
difference on each node must stay within SIZE. Record: results/bench_prefix_cache_memory.json.

Reported: per turn the median TTFT on and off and their ratio, the ratio at the last turn (the
issue asks <= 0.1 at turn 8), cached tokens per turn, whether every text matched, and the
nodes' prefix cache bytes. Record: results/bench_prefix_cache.json.

    python scripts/bench_prefix_cache.py                      # SmolLM2-135M, ring3, 1 conversation
    python scripts/bench_prefix_cache.py --concurrent 8 --repeats 1
"""
import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from typing import Any, Dict, List

import requests

import benchlib
from bench_serve import Server, with_workers
from benchlib import DEFAULT_MODEL, ROOT, print_table
from mdi.runconfig import parse_prefix_cache

QUESTIONS = ["What is the main idea of that text?", "Which commands does it mention?",
             "Who would use this, and why?", "What does the ring do?", "What are the tests like?",
             "Name one thing it measures.", "Say it again in one sentence.", "What should I try first?",
             "And after that?", "Anything else?"]


def document(n_words: int) -> str:
    """README.md's prose (no code blocks or tables), its first `n_words` words."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = re.sub(r"```.*?```", " ", f.read(), flags=re.S)
    words = [w for line in text.splitlines() if not line.startswith("|") for w in line.split()]
    return " ".join(words[:n_words])


def stream_chat(url: str, messages: List[Dict[str, str]], max_tokens: int, cache: bool) -> Dict[str, Any]:
    """One streaming greedy chat request: TTFT (first non-empty content), text, cached tokens."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache}
    sent = time.monotonic()
    first, text, usage = None, "", {}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=(10, 900)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:].decode("utf-8"))
            if data.get("choices") and data["choices"][0]["delta"].get("content"):
                first = first or time.monotonic()
                text += data["choices"][0]["delta"]["content"]
            if data.get("usage"):
                usage = data["usage"]
    end = time.monotonic()
    return {"ttft_s": (first or end) - sent, "seconds": end - sent, "text": text,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def conversation(url: str, marker: str, doc: str, args, cache: bool) -> List[Dict[str, Any]]:
    messages = [{"role": "system", "content": "%s. You answer questions about a text." % marker}]
    turns = []
    for t in range(args.turns):
        question = QUESTIONS[(t - 1) % len(QUESTIONS)] if t else "Here is a text:\n\n%s\n\nWhat is it about?" % doc
        messages.append({"role": "user", "content": question})
        turn = stream_chat(url, messages, args.answer_tokens, cache)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn["text"]})
    return turns


def run_together(url: str, markers: List[str], doc: str, args, cache: bool) -> List[List[Dict[str, Any]]]:
    out: List[Any] = [None] * len(markers)
    errors: List[BaseException] = []

    def talk(i: int) -> None:
        try:
            out[i] = conversation(url, markers[i], doc, args, cache)
        except BaseException as e:  # reported after the join
            errors.append(e)
    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(markers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(3600)
    if errors:
        raise RuntimeError("a conversation failed: %s" % errors[0])
    return out


def node_cache(url: str) -> List[Dict[str, Any]]:
    nodes = requests.get(url + "/v1/mdi/state", timeout=30).json().get("nodes", [])
    return [{k: n.get(k) for k in ("name", "prefix_cache_bytes", "prefix_cache_budget_bytes", "prefix_cache_entries",
                                   "memory_used_bytes", "cache_bytes", "backend", "backend_line")}
            for n in nodes if n.get("role") in ("starter", "worker")]


def peak_rss(pid: int) -> int:
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM for pid %d" % pid)


def memory_claim(args, doc: str) -> int:
    """Peak RSS per node with the prefix cache off and at --memory, the same conversations."""
    size = parse_prefix_cache("--memory", args.memory)
    args.turns = 2
    settings = {}
    for setting in (0, size):
        def body(workers, tmp):
            with Server(args, "memory", workers, tmp, 2048, 2, runtime={"prefix_cache": setting}) as server:
                for i in range(args.memory_conversations):
                    conversation(server.url, "Conversation %d" % i, doc, args, True)
                nodes = node_cache(server.url)
                peaks = [peak_rss(server.proc.pid)] + [peak_rss(w.pid) for w in workers]
            return peaks, nodes
        (peaks, nodes), info = with_workers(args, body)
        settings[setting] = {"peak_rss_bytes": peaks, "nodes": nodes, "machine": info}
        print("prefix_cache %s: peak RSS per node %s MB" % (setting, [round(p / 2 ** 20, 1) for p in peaks]),
              flush=True)
    extra = [b - a for a, b in zip(settings[0]["peak_rss_bytes"], settings[size]["peak_rss_bytes"])]
    within = all(e <= size for e in extra)
    print("peak RSS with the cache - without, per node: %s MB (budget %.0f MB per node): %s"
          % ([round(e / 2 ** 20, 1) for e in extra], size / 2 ** 20, "within" if within else "OVER"))
    record = {"benchmark": "prefix_cache_memory", "args": vars(args), "budget_bytes": size,
              "off": settings[0], "on": settings[size], "extra_peak_rss_bytes": extra, "within_budget": within}
    out = args.out.replace(".json", "_memory.json") if args.out.endswith("bench_prefix_cache.json") else args.out
    benchlib.save_record(out, record)
    print("record: %s" % out)
    return 0 if within else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=1000, help="about this many tokens of document in turn 1")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--concurrent", type=int, default=1, help="conversations at once")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--memory", metavar="SIZE", help="measure peak RSS per node with this prefix cache budget "
                                                    "against none instead (e.g. 32MB)")
    p.add_argument("--memory-conversations", type=int, default=12)
    p.add_argument("--quant", help="model.quant (default: the model's own; none: float32 weights and compute)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_prefix_cache.json"))
    args = p.parse_args()
    doc = document(int(args.doc_tokens * 0.75))  # ~1.3 tokens per English word
    if args.memory:
        return memory_claim(args, doc)

    def body(workers, tmp):
        repeats = []
        with Server(args, "prefix", workers, tmp, 2048, max(2, args.concurrent),
                    runtime={"prefix_cache": "auto"}) as server:
            for r in range(args.repeats):
                markers = ["Conversation %d.%d" % (r, i) for i in range(args.concurrent)]
                on = run_together(server.url, markers, doc, args, True)
                off = run_together(server.url, markers, doc, args, False)
                repeats.append({"on": on, "off": off})
                last = [c[-1] for c in on]
                print("repeat %d: last turn TTFT on %.2f s, off %.2f s (prompt %s tokens, %s cached)"
                      % (r + 1, statistics.median(t["ttft_s"] for t in last),
                         statistics.median(c[-1]["ttft_s"] for c in off), last[0]["prompt_tokens"],
                         last[0]["cached_tokens"]), flush=True)
            nodes = node_cache(server.url)
        return repeats, nodes

    (repeats, nodes), info = with_workers(args, body)
    rows, per_turn = [], []
    for t in range(args.turns):
        on = [c[t]["ttft_s"] for rep in repeats for c in rep["on"]]
        off = [c[t]["ttft_s"] for rep in repeats for c in rep["off"]]
        ratios = [a / b for rep in repeats for a, b in zip([c[t]["ttft_s"] for c in rep["on"]],
                                                           [c[t]["ttft_s"] for c in rep["off"]])]
        same = all(a[t]["text"] == b[t]["text"] for rep in repeats for a, b in zip(rep["on"], rep["off"]))
        entry = {"turn": t + 1, "prompt_tokens": repeats[0]["on"][0][t]["prompt_tokens"],
                 "cached_tokens": repeats[0]["on"][0][t]["cached_tokens"],
                 "ttft_on_s": benchlib.summarize(on), "ttft_off_s": benchlib.summarize(off),
                 "ratio_on_over_off": benchlib.summarize(ratios), "texts_identical": same}
        per_turn.append(entry)
        rows.append([t + 1, entry["prompt_tokens"], entry["cached_tokens"], benchlib.fmt_stat(entry["ttft_on_s"], "%.2f"),
                     benchlib.fmt_stat(entry["ttft_off_s"], "%.2f"), benchlib.fmt_stat(entry["ratio_on_over_off"], "%.3f"),
                     "yes" if same else "NO"])
    print_table("TTFT per turn, %d conversation(s) at once, %d repeats (s: median [min, max])"
                % (args.concurrent, args.repeats),
                ["turn", "prompt", "cached", "TTFT on", "TTFT off", "on/off", "same text"], rows)
    record = {"benchmark": "prefix_cache", "machine": info, "args": vars(args), "turns": per_turn,
              "nodes": nodes, "all_texts_identical": all(e["texts_identical"] for e in per_turn),
              "conversations": repeats}
    benchlib.save_record(args.out, record)
    print("record: %s" % args.out)
    return 0 if record["all_texts_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
