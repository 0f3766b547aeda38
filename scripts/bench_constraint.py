#!/usr/bin/env python
"""Structured outputs (issue 37): what a grammar costs, measured two ways in one run.

1. The mask, in this process, on the model's own vocabulary (SmolLM2: 49,152 tokens): for each
   JSON schema, the compile time and the time per token to compute the allowed-token mask as
   a bool tensor, stepping through a valid answer's tokens. llguidance (what mdi uses) and,
   where importable (`--libs DIR` adds a folder with it to sys.path), outlines-core, the
   alternative that installs without torch: its index is built per schema up front.
2. The ring (`--serve` on --nodes processes, 1 thread each, loopback): --clients concurrent
   clients each send --requests chat requests, in rounds that alternate constrained (a strict
   json_schema) and unconstrained (the same prompts, no schema, end tokens banned so that each
   generates as many tokens as its JSON answer did: a shorter answer alone would lower the
   constrained round's tokens/s, its prompt weighing more), greedy, up to --max-tokens each.
   Reported: the aggregate completion tokens/s of each round, the ratio constrained/free per
   pair of rounds (median and spread; the issue asks >= 0.9x), and the server's own mask
   time per token (/metrics: mdi_grammar_mask_seconds_total / mdi_grammar_masks_total).

    python scripts/bench_constraint.py                 # both parts, SmolLM2-135M, ring3
    python scripts/bench_constraint.py --part mask --libs /tmp/libs
Record: results/bench_constraint.json (with the CPU's ISA).
"""
import argparse
import json
import os
import re
import sys
import threading
import time
from typing import Any, Dict, List

import requests
import torch

import benchlib
from bench_serve import Server, with_workers
from benchlib import DEFAULT_MODEL, ROOT, print_table
from mdi.model.constraints.constraint import GrammarCompiler
from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.token_bytes import all_token_bytes, special_token_ids
from mdi.model.tokenizers import load_tokenizer

S = {"type": "string", "maxLength": 24}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags"],
          "properties": {"name": S, "age": {"type": "integer"}, "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": S, "maxItems": 3}}}
SCHEMAS = {  # name -> (schema, a valid answer the mask is stepped through)
    "flat": ({"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": S, "country": S}}, '{"city": "Lyon", "country": "France"}'),
    "person": (PERSON, '{"name": "Ada Lovelace", "age": 36, "color": "green", "tags": ["math", "poetry"]}'),
    "nested": ({"type": "object", "additionalProperties": False, "required": ["team", "members"],
                "properties": {"team": S, "members": {"type": "array", "maxItems": 4, "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "role"],
                    "properties": {"name": S, "role": {"enum": ["dev", "ops", "lead"]}}}}}},
               '{"team": "core", "members": [{"name": "Bo", "role": "dev"}, {"name": "Cy", "role": "lead"}]}'),
}
PROMPTS = ["Describe a person as JSON.", "Describe a friend of yours as JSON.", "A famous scientist, as JSON.",
           "A character from a story, as JSON.", "Your neighbour, as JSON.", "A teacher, as JSON.",
           "An athlete, as JSON.", "A musician, as JSON."]


def mask_llguidance(tok, schema, text, repeats: int) -> Dict[str, Any]:
    compiler = GrammarCompiler(tok, tok.vocab_size)
    spec = GrammarSpec("json_schema", json.dumps(schema), "response_format")
    t0 = time.perf_counter()
    compiler.compile(spec)
    compile_s = time.perf_counter() - t0
    ids, per_token = tok.encode_plain(text), []
    for _ in range(repeats):
        c = compiler.compile(spec)
        for t in ids:
            t0 = time.perf_counter()
            allowed = c.allowed()
            per_token.append(time.perf_counter() - t0)
            assert bool(allowed[t]), "llguidance refused token %d of a valid answer" % t
            c.take(t)
        assert c.complete
    return {"compile_s": compile_s, "mask_us": benchlib.summarize([x * 1e6 for x in per_token]), "tokens": len(ids)}


def mask_outlines(tok, schema, text, repeats: int) -> Dict[str, Any]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    special = set(special_token_ids(tok))
    by_bytes: Dict[bytes, List[int]] = {}
    for i, b in enumerate(all_token_bytes(tok)):
        if i not in special:
            by_bytes.setdefault(b, []).append(i)
    vocab = outlines_core.Vocabulary(tok.eos_id, by_bytes)
    t0 = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), vocab)
    compile_s = time.perf_counter() - t0
    ids, per_token = tok.encode_plain(text), []
    for _ in range(repeats):
        guide = outlines_core.Guide(index)
        for t in ids:
            t0 = time.perf_counter()
            allowed = torch.zeros(tok.vocab_size, dtype=torch.bool)  # the same product: a bool mask
            allowed[torch.tensor(guide.get_tokens(), dtype=torch.long)] = True
            per_token.append(time.perf_counter() - t0)
            assert bool(allowed[t]), "outlines-core refused token %d of a valid answer" % t
            guide.advance(t)
    return {"compile_s": compile_s, "mask_us": benchlib.summarize([x * 1e6 for x in per_token]), "tokens": len(ids)}


def part_mask(args) -> Dict[str, Any]:
    if args.libs:
        sys.path.insert(0, args.libs)
    tok = load_tokenizer(args.model)
    out: Dict[str, Any] = {"vocab": tok.vocab_size, "schemas": {}}
    rows = []
    for name, (schema, text) in SCHEMAS.items():
        entry = {"llguidance": mask_llguidance(tok, schema, text, args.mask_repeats)}
        try:
            entry["outlines_core"] = mask_outlines(tok, schema, text, args.mask_repeats)
        except ImportError as e:
            entry["outlines_core"] = {"skipped": "not importable: %s" % e}
        out["schemas"][name] = entry
        for lib, r in entry.items():
            if "mask_us" in r:
                rows.append([name, lib, "%.3f" % r["compile_s"], benchlib.fmt_stat(r["mask_us"], "%.1f"), r["tokens"]])
    print_table("Token mask on %d tokens, %s (1 process)" % (tok.vocab_size, os.path.basename(args.model)),
                ["schema", "library", "compile s", "mask us/token", "tokens"], rows)
    return out


def chat_round(url: str, clients: int, requests_each: int, budgets: List[List[int]], schema,
               end_ids: List[int]) -> Dict[str, Any]:
    """`clients` threads, each sending `requests_each` greedy chats one after another, request k
    of client i with budgets[i][k] tokens; tokens/s over the round. Free requests may not end
    early (their end tokens banned), so both kinds of round generate the same token counts."""
    tokens = [[0] * requests_each for _ in range(clients)]
    errors: List[str] = []

    def client(i: int) -> None:
        for k in range(requests_each):
            body: Dict[str, Any] = {"messages": [{"role": "user", "content": PROMPTS[(i + k) % len(PROMPTS)]}],
                                    "temperature": 0, "max_tokens": budgets[i][k], "cache_prompt": False}
            if schema is not None:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "p", "schema": schema, "strict": True}}
            else:
                body["logit_bias"] = {str(t): -100 for t in end_ids}
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=600)
            if r.status_code != 200:
                errors.append(r.text[:200])
                return
            tokens[i][k] = r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("a request failed: %s" % errors[0])
    total = sum(map(sum, tokens))
    return {"tokens": total, "seconds": wall, "tokens_per_s": total / wall, "per_request": tokens}


def grammar_counters(url: str) -> Dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {k: float(re.search(r"^mdi_grammar_%s_total (\S+)$" % k, text, re.M).group(1))
            for k in ("masks", "mask_seconds", "requests")}


def part_ring(args) -> Dict[str, Any]:
    end_ids = load_tokenizer(args.model).end_ids

    def body(workers, tmp):
        rounds = []
        with Server(args, "constraint", workers, tmp, 1024, args.clients) as server:
            # The JSON answers end when their schema is complete; a first constrained round finds
            # each one's length, and the measured free rounds generate exactly as many tokens.
            full = [[args.max_tokens] * args.requests for _ in range(args.clients)]
            budgets = chat_round(server.url, args.clients, args.requests, full, PERSON, end_ids)["per_request"]
            for r in range(args.repeats):
                order = [("json_schema", PERSON), ("free", None)] if r % 2 == 0 else [("free", None), ("json_schema", PERSON)]
                pair = {}
                for label, schema in order:
                    pair[label] = chat_round(server.url, args.clients, args.requests, budgets, schema, end_ids)
                    print("repeat %d %-11s %6.1f tok/s (%d tokens in %.1f s)" % (
                        r + 1, label, pair[label]["tokens_per_s"], pair[label]["tokens"], pair[label]["seconds"]),
                          flush=True)
                rounds.append(pair)
            counters = grammar_counters(server.url)
        return rounds, counters

    (rounds, counters), info = with_workers(args, body)
    ratios = [p["json_schema"]["tokens_per_s"] / p["free"]["tokens_per_s"] for p in rounds]
    result = {"rounds": rounds, "ratio_constrained_over_free": benchlib.summarize(ratios),
              "server_mask_us_per_token": 1e6 * counters["mask_seconds"] / max(1.0, counters["masks"]),
              "server_counters": counters, "machine": info}
    print_table("ring of %d, %d clients x %d requests, answers up to %d tokens" % (
        args.nodes, args.clients, args.requests, args.max_tokens),
                ["constrained/free tok/s", "server mask us/token"],
                [[benchlib.fmt_stat(result["ratio_constrained_over_free"], "%.3f"),
                  "%.1f" % result["server_mask_us_per_token"]]])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--part", choices=("mask", "ring", "both"), default="both")
    p.add_argument("--libs", help="a folder to add to sys.path (e.g. with outlines_core installed by "
                                  "pip install --target DIR --no-deps outlines-core)")
    p.add_argument("--mask-repeats", type=int, default=20)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="per client per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4, help="pairs of rounds (constrained, free), order alternating")
    p.add_argument("--quant", help="model.quant (default: the model's own)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_constraint.json"))
    args = p.parse_args()
    record: Dict[str, Any] = {"benchmark": "constraint"}
    if args.part != "both" and os.path.exists(args.out):  # one part again: keep the other's figures
        with open(args.out) as f:
            record = json.load(f)
    record.update({"args_%s" % args.part: vars(args), "machine": benchlib.machine_info(1)})
    if args.part in ("mask", "both"):
        record["mask"] = part_mask(args)
    if args.part in ("ring", "both"):
        record["ring"] = part_ring(args)
    benchlib.finish_machine_info(record["machine"])
    benchlib.save_record(args.out, record)
    print("record: %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
