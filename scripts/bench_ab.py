#!/usr/bin/env python3
"""A same-run A/B of two checkouts of mdi on any benchmark script: is a change neutral?

    python scripts/bench_ab.py --a ../mdi-old --b . --rounds 3 \\
        --figure turns.3.ratio_on_over_off.median --figure turns.3.ttft_on_s.median \\
        -- bench_prefix_cache.py --turns 4 --doc-tokens 300

Each round runs the script once from each checkout (its own copy of the script, with
PYTHONPATH set to that checkout, so the starter, the workers and the script all import that
tree's mdi; the venv, the model and the machine are shared), in the order A B, then B A, and so
on, so a machine that slows over the run does not favour one side. Each run writes its own
record (the script's --out); the figures named by dotted paths into it (list items by index)
are collected. Reported per figure: A's and B's median [min, max] over the rounds, and the
median [min, max] of the per-round ratios B / A (the two runs of a round are back to back).
Record: results/bench_ab.json (--out), with both trees' commits and the machine.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import benchlib
from benchlib import print_table, save_record, summarize


def figure(record: Any, path: str) -> float:
    """The number at dotted `path` in a benchmark's record ("turns.3.ttft_on_s.median")."""
    value = record
    for part in path.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise SystemExit("bench_ab: the record has no %r (at %r)" % (path, part))
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SystemExit("bench_ab: %r is %r, not a number" % (path, value))
    return float(value)


def commit_of(tree: str) -> str:
    """The checkout's commit, marked dirty when its tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", tree] + list(args), capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_once(tree: str, script: str, args: List[str], out: str, log: str) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.join(tree, "scripts", script)] + args + ["--out", out]
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write("\n$ PYTHONPATH=%s %s\n" % (tree, " ".join(cmd)))
        f.flush()
        code = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tree).returncode
    if code != 0:
        raise SystemExit("bench_ab: %s from %s exited %d (output in %s)" % (script, tree, code, log))
    print("  %s from %s: %.0f s" % (script, tree, time.monotonic() - t0), flush=True)
    with open(out) as f:
        return json.load(f)


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Everything after -- is the benchmark script (a file name in scripts/) and "
                                       "its arguments; --out is added per run.")
    p.add_argument("--a", required=True, help="the baseline checkout (a folder; e.g. a git worktree of the old commit)")
    p.add_argument("--b", required=True, help="the changed checkout")
    p.add_argument("--rounds", type=int, default=3, help="runs of each checkout (default 3)")
    p.add_argument("--figure", action="append", required=True, help="dotted path of a number in the record (repeatable)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_ab.json"))
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = p.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        p.error("name the benchmark script after --")
    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    for side, tree in trees.items():
        if not os.path.isfile(os.path.join(tree, "scripts", bench[0])):
            p.error("%s: %s has no scripts/%s" % (side, tree, bench[0]))
    info = benchlib.machine_info(1)
    values: Dict[str, Dict[str, List[float]]] = {side: {f: [] for f in args.figure} for side in trees}
    log = os.path.join(tempfile.gettempdir(), "mdi-bench-ab.log")  # every run's output, for a failure's cause
    open(log, "w").close()
    print("the runs' output goes to %s" % log)
    with tempfile.TemporaryDirectory(prefix="mdi-ab-") as tmp:
        for r in range(args.rounds):
            print("round %d/%d" % (r + 1, args.rounds), flush=True)
            for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
                record = run_once(trees[side], bench[0], bench[1:], os.path.join(tmp, "%s%d.json" % (side, r)), log)
                for f in args.figure:
                    values[side][f].append(figure(record, f))
    benchlib.finish_machine_info(info)
    rows, figures = [], {}
    for f in args.figure:
        a, b = values["A"][f], values["B"][f]
        ratios = [y / x if x else float("nan") for x, y in zip(a, b)]
        figures[f] = {"A": summarize(a), "B": summarize(b), "B_over_A": summarize(ratios)}
        rows.append([f, benchlib.fmt_stat(figures[f]["A"], "%.4g"), benchlib.fmt_stat(figures[f]["B"], "%.4g"),
                     benchlib.fmt_stat(figures[f]["B_over_A"], "%.3f")])
    print_table("A = %s (%s), B = %s (%s)" % (trees["A"], commit_of(trees["A"]), trees["B"], commit_of(trees["B"])),
                ["figure", "A", "B", "B / A"], rows)
    print(benchlib.note_load(info))
    save_record(args.out, {"benchmark": "ab", "bench": bench, "rounds": args.rounds, "machine": info,
                           "trees": {side: {"path": tree, "commit": commit_of(tree)} for side, tree in trees.items()},
                           "figures": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
