#!/usr/bin/env python
"""What each sampling field costs per token in `sample_next` / `draw` on SmolLM2's 49152-token
vocabulary, at one thread, in one process, on SmolLM2's own logits (the rows of a prompt's
positions: random logits are far flatter, and top-p's cost depends on the shape).

Variants run in interleaved rounds (every variant once per round, rounds repeated), so a
neighbour's burst on this shared machine hits them alike; each repeat is the mean time of
`--draws` draws. Reported: median [min, max] microseconds per token over the repeats, and the
median's difference from the baseline of the same mode (sampled or greedy). The penalties see
a history of `--history` generated tokens and a 64-token prompt.

    python scripts/bench_sampling.py                 # 7 repeats x 300 draws
"""
import argparse
import os
import random
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import benchlib
from benchlib import fmt_stat, print_table, summarize

VOCAB = 49152


def variants() -> List[Tuple[str, Dict[str, Any], Optional[int]]]:
    """(name, SamplingParams fields beyond the mode's temperature, top_logprobs)."""
    bias = dict((i * 97, 5.0) for i in range(10))
    return [("baseline", {}, None),
            ("neutral fields given", {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                      "repeat_penalty": 1.0, "logit_bias": {}}, None),
            ("min_p 0.05", {"min_p": 0.05}, None),
            ("presence+frequency 0.5", {"presence_penalty": 0.5, "frequency_penalty": 0.5}, None),
            ("repeat_penalty 1.1 (last 64)", {"repeat_penalty": 1.1}, None),
            ("logit_bias (10 ids)", {"logit_bias": bias}, None),
            ("logprobs (chosen only)", {}, 0),
            ("top_logprobs 5", {}, 5),
            ("top_logprobs 20", {}, 20),
            ("all of them", {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                             "repeat_penalty": 1.1, "logit_bias": bias}, 5)]


def model_rows(path: str) -> List[Any]:
    """The model's logits at each position of a prose prompt."""
    import torch
    source, chunk = benchlib.load_mdi(path)
    ids = source.tokenizer.encode("The history of the printing press begins in the fifteenth century, when Johannes "
                                  "Gutenberg combined movable metal type, oil-based ink and a wooden press into a "
                                  "system that could print books quickly. Within fifty years, presses")
    chunk.allocate_cache(1, len(ids))
    with torch.no_grad():
        logits = chunk.head(chunk.forward_blocks(chunk.embed(torch.tensor(ids), 0), 0, 0)).float()
    assert logits.shape[-1] == VOCAB, logits.shape
    return list(logits)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--draws", type=int, default=300)
    p.add_argument("--history", type=int, default=256, help="generated tokens the penalties read")
    p.add_argument("--model", default=benchlib.DEFAULT_MODEL, help="prepared mdi model directory (SmolLM2-135M)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_sampling.json"))
    args = p.parse_args(argv)
    import torch
    from mdi.model.sampling import SamplingParams, draw, sample_generator
    torch.set_num_threads(1)
    info = benchlib.machine_info(1)
    info["isa"] = torch.backends.cpu.get_cpu_capability()
    rows = model_rows(args.model)
    rng = random.Random(0)
    generated = [rng.randrange(VOCAB) for _ in range(args.history)]
    prompt = [rng.randrange(VOCAB) for _ in range(64)]
    modes = {"T 0.8": {"temperature": 0.8}, "T 0.8 top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
             "greedy": {"temperature": 0.0}}
    cases = [(mode, name, SamplingParams(**dict(base, **fields)), top)
             for mode, base in modes.items() for name, fields, top in variants()]
    times: Dict[Tuple[str, str], List[float]] = dict(((m, n), []) for m, n, _, _ in cases)
    for _ in range(args.repeats):
        for mode, name, params, top in cases:
            gen = sample_generator(1, 0)
            t0 = time.perf_counter()
            for i in range(args.draws):
                draw(rows[i % len(rows)], params, gen, generated, prompt, top)
            times[(mode, name)].append((time.perf_counter() - t0) / args.draws)
    benchlib.finish_machine_info(info)
    record: Dict[str, Any] = {"machine": info, "vocab": VOCAB, "draws": args.draws, "history": args.history,
                              "results": []}
    table = []
    for mode, name, _, _ in cases:
        s = summarize(times[(mode, name)])
        base = summarize(times[(mode, "baseline")])["median"]
        record["results"].append({"mode": mode, "variant": name, "seconds_per_token": s,
                                  "added_us": (s["median"] - base) * 1e6})
        table.append([mode, name, fmt_stat(s, "%.0f", 1e6), "%+.0f" % ((s["median"] - base) * 1e6)])
    print_table("sample_next per token, %d-token vocabulary, 1 thread, %s (us: median [min, max] of %d repeats)"
                % (VOCAB, info["isa"], args.repeats), ["mode", "fields", "us/token", "vs baseline"], table)
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
