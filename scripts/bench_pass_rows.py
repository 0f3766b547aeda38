#!/usr/bin/env python3
"""What a pass of n rows costs on the ggml backend, in one-row passes, per weight type: the
price speculation's verifications and batched decoding pay (issue 61).

For each GGUF type asked (--types), a GGUF of the model's real shapes with random weights of that
type (mdi.model.ggml.random_weights; the embedding and head Q8_0 as SmolLM2's file has them,
F16 for a float model) is loaded as one starter chunk (every block, the head), as a node
loads it (repacked where ggml re-lays the type, rows split where measured cheaper:
mdi.model.ggml.row_split). Passes of 1..--rows rows at position --context of one cache slot are
timed in CPU time, interleaved, --rounds times; each size's least disturbed round counts (other
processes only add time). Reported per type: a one-row pass (blocks, head), and what n rows cost
in one-row passes, blocks alone and with the head (what a verification costs the starter).

    MDI_PROFILE_CACHE=/tmp/x python scripts/bench_pass_rows.py --types Q4_1,Q4_0,Q8_0,F16
"""
import argparse
import os
import sys
import time
from typing import Any, Dict, List

import numpy as np

import benchlib
from benchlib import DEFAULT_MODEL, print_table, save_record, summarize

HEAD_TYPE = {"F16": "F16", "F32": "F32", "BF16": "BF16"}  # else the head is Q8_0, as in SmolLM2's Q4_1 file
BLOCK_MATRICES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_up.weight",
                  "ffn_gate.weight", "ffn_down.weight", "attn_qkv.weight")


def time_type(config: Any, kind: str, rows: int, rounds: int, context: int, threads: int) -> Dict[str, Any]:
    from mdi.model.ggml import lib
    from mdi.model.ggml.chunk import GgmlChunk
    from mdi.model.ggml.random_weights import write_probe_gguf
    from mdi.model.ggml.weights import GgufWeights
    from mdi.model.files.gguf_write import remove_quietly
    from mdi.model.pass_rows import PassRows
    head = HEAD_TYPE.get(kind, "Q8_0")
    path = write_probe_gguf(config, {m: kind for m in BLOCK_MATRICES}, config.n_layer, True,
                            {"token_embd.weight": head, "output.weight": head})
    try:
        chunk = GgmlChunk(config, 0, config.n_layer, True, True, GgufWeights(path), lib.ROPE_NEOX, threads)
        try:
            chunk.allocate_cache(1, context + rows + 1)
            width = config.n_embd
            rng = np.random.default_rng(0)
            chunk.forward_rows(rng.standard_normal((context, width)).astype(np.float32) * 0.1,
                               PassRows([0], [0], [context]))
            blocks: Dict[int, List[float]] = {n: [] for n in range(1, rows + 1)}
            heads: Dict[int, List[float]] = {n: [] for n in range(1, rows + 1)}
            for _ in range(rounds):
                for n in range(1, rows + 1):
                    x = rng.standard_normal((n, width)).astype(np.float32) * 0.1
                    t0 = time.process_time()
                    y = chunk.forward_rows(x, PassRows([0], [context], [n]))
                    t1 = time.process_time()
                    chunk.head(y)
                    blocks[n].append(t1 - t0)
                    heads[n].append(time.process_time() - t1)
            split = sorted({s for sizes in chunk.builder.split.values() for s in sizes})
            repacked = len(chunk.weights.repacked)
        finally:
            chunk.close()
    finally:
        remove_quietly(path)
    b1, h1 = min(blocks[1]), min(heads[1])
    return {"type": kind, "head_type": head, "one_row_blocks_ms": b1 * 1e3, "one_row_head_ms": h1 * 1e3,
            "blocks": [round(min(blocks[n]) / b1, 3) for n in blocks],
            "with_head": [round((min(blocks[n]) + min(heads[n])) / (b1 + h1), 3) for n in blocks],
            "split_at": split, "repacked_matrices": repacked,
            "raw_s": {"blocks": {n: summarize(v) for n, v in blocks.items()},
                      "head": {n: summarize(v) for n, v in heads.items()}}}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="whose shapes (its config) are timed")
    p.add_argument("--types", default="Q4_1,Q4_0,Q8_0,F16", help="GGUF types of the block matrices")
    p.add_argument("--rows", type=int, default=8, help="pass sizes 1..ROWS (default 8)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--context", type=int, default=100, help="positions already in the slot (default 100)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_pass_rows.json"))
    args = p.parse_args(argv)
    from mdi.model.ggml import lib
    from mdi.model.source import ModelSource
    if lib.unavailable_reason() is not None:
        p.error("the ggml binding is not available: %s" % lib.unavailable_reason())
    config = ModelSource(args.model).config
    info = benchlib.machine_info(args.threads)
    results = []
    for kind in args.types.split(","):
        print("timing %s ..." % kind, flush=True)
        results.append(time_type(config, kind.strip().upper(), args.rows, args.rounds, args.context, args.threads))
    benchlib.finish_machine_info(info)
    rows = [[r["type"], "%.2f / %.2f" % (r["one_row_blocks_ms"], r["one_row_head_ms"]),
             " ".join("%.2f" % c for c in r["blocks"][1:]), " ".join("%.2f" % c for c in r["with_head"][1:]),
             ",".join(map(str, r["split_at"])) or "-"] for r in results]
    print_table("%s shapes, %d layers, %d thread(s), ggml: a pass of n = 2..%d rows in one-row passes"
                % (config.name, config.n_layer, args.threads, args.rows),
                ["type", "1 row ms (blocks / head)", "blocks", "blocks + head", "split at"], rows)
    print(benchlib.note_load(info))
    save_record(args.out, {"benchmark": "pass_rows", "args": vars(args), "machine": info, "ggml": lib.version(),
                           "model": config.name, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
