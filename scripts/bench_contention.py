#!/usr/bin/env python
"""How much do independent processes on this machine slow each other down?

The emulated-board sweeps (results/boards/) put N node processes on one 2-core machine.
Pipeline efficiency can only reach 1 if N processes, each inside its own CPU quota, compute
as fast together as one alone. This measures that ceiling directly, without any ring: K
copies of the whole model decode greedily at the same time, each in its own cgroup v1 CPU
quota (the same settings as the sweep), and each copy's decode tokens/s is compared with one
copy alone, in the same run:

    slowdown(K) = median per-copy tokens/s with K copies / tokens/s of 1 copy

A slowdown below 1 that the CPU quota does not explain (K x quota <= cores) is contention
for shared memory bandwidth and caches: the ring cannot beat it.

    python scripts/bench_contention.py                                # SmolLM2, K = 1 2 3, 0.5 core
    python scripts/bench_contention.py --model models/nanogpt-shakespeare --quota 0
Needs root for the quotas; without root (or with --quota 0) copies run unconstrained.
"""
import argparse
import json
import subprocess
import sys
import time
from typing import Dict, List, Optional  # noqa: F401  (type comments)

import benchlib
from benchlib import DEFAULT_MODEL, CpuCgroups, cgroup_unavailable_reason, print_table, summarize


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="mdi model directory (default: %(default)s)")
    p.add_argument("--copies", type=int, nargs="+", default=[1, 2, 3], help="K values (default: 1 2 3)")
    p.add_argument("--quota", type=float, default=0.5, help="cores per copy; 0 = no quota (default 0.5)")
    p.add_argument("--period-us", type=int, default=10000, help="cgroup cpu.cfs_period_us (default 10000)")
    p.add_argument("--seconds", type=float, default=12.0, help="decode time per copy per round (default 12)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over all K, interleaved (default 2)")
    p.add_argument("--out", help="write the record as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(model: str, seconds: float) -> int:
    """One copy: load, prefill, say 'ready', wait for 'go', decode for `seconds`, print JSON."""
    import torch
    torch.set_num_threads(1)
    src, chunk = benchlib.load_mdi(model)
    max_len = min(src.config.block_size, 256)
    chunk.allocate_cache(1, max_len)
    with torch.inference_mode():
        ids = torch.tensor([1, 2, 3, 4])
        nxt = chunk.head(chunk.forward_blocks(chunk.embed(ids, 0), 0, 0))[-1:].argmax(-1)
        print("ready", flush=True)
        sys.stdin.readline()
        pos, n, t0 = len(ids), 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if pos >= max_len:  # wrap around: the cost of a step barely depends on the position here
                pos = len(ids)
            logits = chunk.head(chunk.forward_blocks(chunk.embed(nxt, pos), 0, pos))
            nxt = logits[-1:].argmax(-1)
            pos, n = pos + 1, n + 1
        print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


def one_round(args, k: int, cgroups: Optional[CpuCgroups]) -> List[float]:
    procs = []
    for i in range(k):  # copy i uses group i: the previous round's copies have exited
        pre = cgroups.preexec("copy%d" % i) if cgroups is not None else None
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--child", "--model", args.model, "--seconds", str(args.seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=pre))
    try:
        for p in procs:  # all loaded before any starts: the decode windows overlap fully
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a copy failed to load the model")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        rates = []
        for p in procs:
            out, _ = p.communicate(timeout=args.seconds + 120)
            rec = json.loads(out.strip().splitlines()[-1])
            rates.append(rec["tokens"] / rec["seconds"])
        return rates
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.model, args.seconds)
    info = benchlib.machine_info(1)
    why = cgroup_unavailable_reason() if args.quota > 0 else "--quota 0"
    cgroups = CpuCgroups("mdi_contention") if why is None else None
    for i in range(max(args.copies) if cgroups else 0):
        cgroups.create("copy%d" % i)
        cgroups.set_quota("copy%d" % i, args.quota, args.period_us)
    quota_text = "%.2f core per copy (period %d us)" % (args.quota, args.period_us) if cgroups else \
        "no CPU quota (%s)" % why
    print("mdi bench_contention: %s, %s, %s" % (args.model, quota_text, benchlib.note_load(info)), flush=True)
    rates = {k: [] for k in args.copies}  # type: Dict[int, List[float]]
    try:
        for r in range(args.repeats):
            for k in args.copies:
                got = one_round(args, k, cgroups)
                rates[k].extend(got)
                print("  round %d, K=%d: %s tokens/s per copy" % (r + 1, k, " ".join("%.2f" % x for x in got)),
                      flush=True)
    finally:
        if cgroups is not None:
            for problem in cgroups.cleanup():
                print("mdi bench_contention: %s" % problem, file=sys.stderr)
    base = summarize(rates[min(args.copies)])["median"]
    rows, record = [], {"model": args.model, "quota": quota_text, "seconds": args.seconds, "results": {}}
    for k in args.copies:
        s = summarize(rates[k])
        rows.append([k, "%.2f" % s["median"], "%.2f" % (s["median"] * k), "%.2f" % (s["median"] / base)])
        record["results"][str(k)] = {"per_copy": s, "aggregate": s["median"] * k, "slowdown": s["median"] / base}
    print_table("Independent copies decoding at once", ["K", "tok/s per copy", "aggregate", "per-copy / K=1"],
                rows)
    benchlib.finish_machine_info(info)
    record["machine"] = info
    if args.out:
        benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
