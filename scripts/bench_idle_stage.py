#!/usr/bin/env python3
"""Why a ring stage at S = 1 computes slower than the same stage timed in a loop (issue 41).

In a ring of 3 at S = 1 each stage idles for two stage times between its passes while the
other stages run. This times one stage's decode pass in one process: the first --layers layers
of the model as a worker holds them (default SmolLM2-135M int4, `fast` kernels, TorchScript
decode, 1 thread), one row at position --context, in three modes, alternating round by round:

  hot      passes back to back: what a microbenchmark in a loop measures;
  idle     after sleeping --gap ms (default 8: two such stages): a stage whose neighbours
           run elsewhere (separate boards);
  evicted  after spending the same gap reading a buffer of the other stages' weight bytes
           (--others x this stage's): a stage whose neighbours share this machine's last-level
           cache (a loopback ring, mdi-bench's emulated boards).

Each mode's pass time is the median [min, max] over --rounds rounds; the ratios to `hot` are
per round. The record keeps the CPU (its ISA and cache sizes decide the answer) and the load.

    python scripts/bench_idle_stage.py --out results/bench_idle_stage.json
"""
import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (DEFAULT_MODEL, ROOT, finish_machine_info, fmt_stat, machine_info, note_load,  # noqa: E402
                      print_table, save_record, summarize)

MODES = ("hot", "idle", "evicted")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--layers", type=int, default=10, help="the stage's layers (default 10: a third of SmolLM2)")
    p.add_argument("--others", type=float, default=2.0,
                   help="the other stages' weight bytes, in multiples of this stage's (default 2: a ring of 3)")
    p.add_argument("--gap", type=float, default=8.0, help="idle milliseconds before a timed pass (default 8)")
    p.add_argument("--context", type=int, default=64, help="the sample's position (default 64)")
    p.add_argument("--rounds", type=int, default=40, help="timed passes per mode (default 40)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_idle_stage.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from mdi.model.quantization import qkernels
    from mdi.model.row_batch import RowBatch
    from mdi.model.source import ModelSource
    from mdi.system.devices import last_level_cache_bytes
    torch.set_num_threads(args.threads)
    qkernels.set_preference("fast")
    info = machine_info(args.threads)
    source = ModelSource(args.model)
    layers = min(args.layers, source.config.n_layer)
    # A worker's stage: layers only (a starter's embedding is gathered a row at a time, not read whole)
    chunk = source.load_chunk(0, layers, False, False, torch.float32, "cpu", None,
                              source.layout(0, layers, False, "auto"))
    chunk.allocate_cache(1, args.context + 8)
    stage_bytes = sum(t.numel() * t.element_size() for t in list(chunk.parameters()) + list(chunk.buffers()))
    # What the other stages read meanwhile, as one buffer: read whole, it passes through the cache.
    others = torch.ones(max(1, int(args.others * stage_bytes) // 4), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    width = source.config.n_embd
    with torch.inference_mode():
        chunk.forward_rows(torch.randn(args.context, width, generator=gen), RowBatch.of([0], [0], [args.context]))
        x = torch.randn(1, width, generator=gen)

        def one_pass() -> float:
            t0 = time.perf_counter()
            chunk.forward_rows(x, RowBatch.of([0], [args.context], [1]))
            return time.perf_counter() - t0

        def busy_reading(seconds: float) -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                others.sum()

        before: Dict[str, Callable[[], None]] = {
            "hot": lambda: None,
            "idle": lambda: time.sleep(args.gap / 1000),
            "evicted": lambda: busy_reading(args.gap / 1000),
        }
        for _ in range(10):  # warm: kernels chosen and scripted, pages touched
            one_pass()
        times: Dict[str, List[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
                one_pass()  # the stage's previous pass: its weights as warm as the mode leaves them
                before[mode]()
                times[mode].append(one_pass())
    finish_machine_info(info)
    record: Dict[str, Any] = {
        "machine": info, "model": args.model, "layers": layers, "threads": args.threads, "context": args.context,
        "gap_ms": args.gap, "stage_weight_bytes": stage_bytes, "others_bytes": others.numel() * 4,
        "last_level_cache_bytes": last_level_cache_bytes("cpu"),
        "pass_ms": {m: summarize([1000 * t for t in v]) for m, v in times.items()},
        "vs_hot": {m: summarize([t / h for t, h in zip(v, times["hot"])]) for m, v in times.items() if m != "hot"}}
    print_table("one stage's decode pass (%d layers, %.1f MB of weights, %d thread%s; after a %.0f ms gap)"
                % (layers, stage_bytes / 1e6, args.threads, "" if args.threads == 1 else "s", args.gap),
                ["mode", "ms per pass", "x hot"],
                [[m, fmt_stat(record["pass_ms"][m], "%.2f"),
                  fmt_stat(record["vs_hot"][m], "%.2f") if m in record["vs_hot"] else "1.00"] for m in MODES])
    print(note_load(info))
    save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
