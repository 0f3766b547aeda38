#!/usr/bin/env python
"""What each activation codec on the wire (`runtime.wire_codec`) costs and saves, in one run.

A 3-node ring of real worker processes on loopback runs the same greedy generations once per
codec (raw, float16, bfloat16, int8). Reported per codec: bytes per decode hop (data-plane
bytes of decode frames / decode messages, header included, and the payload alone) as a ratio
to raw float32, and how many generated ids equal raw's (position by position, every prompt).

    python scripts/bench_wire_codec.py                      # SmolLM2-135M float32, 64 tokens
"""
import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional  # noqa: F401  (type comments)

import benchlib
from benchlib import DEFAULT_MODEL, WorkerProcess, print_table

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In 1969, the first",
           "The best way to learn a language is", "Water boils at"]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="prepared mdi model directory (default SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_wire_codec.json"))
    return p.parse_args(argv)


def run_codec(model: str, workers: List[WorkerProcess], codec: str, tokens: int):
    from mdi.runconfig import parse_config
    from mdi.starter import batch
    nodes = [{"name": "starter", "data_port": benchlib.ports_besides(workers)[0]}] + [w.node() for w in workers]
    raw = benchlib.run_config_dict(model, nodes, tokens, threads=1)
    raw["model"]["quant"] = "none"  # float32 activations and weights: the codec is the only change
    raw["runtime"].update(wire_codec=codec, max_batch=1)  # one sample per decode hop
    return batch.run(parse_config(raw, "bench_wire_codec"), PROMPTS)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    from mdi.ring.wire import CODECS, payload_nbytes
    torch.set_num_threads(1)
    info = benchlib.machine_info(1)
    log_dir = tempfile.mkdtemp(prefix="bench-codec-")
    workers = [WorkerProcess("w%d" % i, 1, log_dir) for i in (1, 2)]
    results = {}  # type: Dict[str, Any]
    try:
        for w in workers:
            w.wait_healthy(60)
        for codec in CODECS:
            results[codec] = run_codec(args.model, workers, codec, args.tokens)
            print("%s done" % codec, file=sys.stderr)
    finally:
        for w in workers:
            w.stop()
    from mdi.model.source import ModelSource
    hidden = ModelSource(args.model).config.n_embd
    reference = [s.token_ids for s in results["raw"].samples]
    rows = []
    record = {"model": args.model, "tokens": args.tokens, "prompts": PROMPTS, "machine": info, "codecs": {}}
    raw_hop = None
    for codec, result in results.items():
        sent = sum(n.traffic.get("bytes_sent_by_kind", {}).get("decode", 0) for n in result.nodes)
        messages = sum(n.traffic.get("messages_sent_by_kind", {}).get("decode", 0) for n in result.nodes)
        hop = sent / messages
        payload = payload_nbytes(1, hidden, torch.float32, codec)
        raw_hop = raw_hop or hop
        ids = [s.token_ids for s in result.samples]
        same = sum(a == b for got, ref in zip(ids, reference) for a, b in zip(got, ref))
        total = sum(len(ref) for ref in reference)
        identical = sum(got == ref for got, ref in zip(ids, reference))
        record["codecs"][codec] = {"bytes_per_decode_hop": hop, "payload_bytes_per_decode_hop": payload,
                                   "hop_ratio_vs_raw": hop / raw_hop,
                                   "payload_ratio_vs_raw": payload / payload_nbytes(1, hidden, torch.float32, "raw"),
                                   "ids_equal_to_raw": same, "ids_total": total,
                                   "prompts_identical": identical, "token_ids": ids}
        rows.append([codec, "%.0f" % hop, "%.3f" % (hop / raw_hop), payload,
                     "%.4f" % record["codecs"][codec]["payload_ratio_vs_raw"],
                     "%d/%d (%.1f%%)" % (same, total, 100.0 * same / total), "%d/%d" % (identical, len(PROMPTS))])
    benchlib.finish_machine_info(info)
    benchlib.save_record(args.out, record)
    print_table("wire codecs, 3-node ring, %d greedy tokens x %d prompts" % (args.tokens, len(PROMPTS)),
                ["codec", "bytes/decode hop", "vs raw", "payload bytes", "payload vs raw", "ids equal to raw",
                 "prompts identical"], rows)
    print("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
