#!/usr/bin/env python
"""How good mdi-start's layer planner (`layers: auto`) is, from an mdi-bench sweep that ran
auto rings next to fixed partitions (configs/experiments/planner.yaml: partitions [auto,
balanced, all]).

    python scripts/plot_planner.py results/planner

Reads RESULTS_DIR/results.csv. Per (model, node count): the best fixed partition (every
explicit split and the balanced one), the balanced split and the auto ring, each at its best
samples in flight (median over repeats per partition and S, then the best S, then the best
partition), and the planner's predicted tokens/s against the measured ones for every auto run.
Writes RESULTS_DIR/planner.json (the ratios auto/best, auto/balanced, predicted/measured with
median and spread) and RESULTS_DIR/planner.png (predicted vs measured; auto vs balanced vs best).
"""
import argparse
import csv
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: F401  (type comments)

Row = Dict[str, str]
FIXED_KINDS = ("explicit", "balanced")  # partitions whose counts were given (or split evenly)


class PlannerPlotError(Exception):
    """A results folder this script cannot read; the message is one line."""


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir", metavar="RESULTS_DIR", help="an mdi-bench output folder (with results.csv)")
    p.add_argument("--metric", default="decode_tokens_per_s", choices=["decode_tokens_per_s", "tokens_per_s"],
                   help="the measured tokens/s compared (default: the steady decode rate, prefill excluded)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- reading

def _float(x: Optional[str]) -> Optional[float]:
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def read_results(results_dir: str, metric: str) -> List[Row]:
    """The successful runs of RESULTS_DIR/results.csv (status ok, the metric measured)."""
    path = os.path.join(results_dir, "results.csv")
    if not os.path.isfile(path):
        raise PlannerPlotError("%s: no such file (run mdi-bench with this output folder first)" % path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        columns = reader.fieldnames or []
    if not rows:
        raise PlannerPlotError("%s: no runs in it" % path)
    missing = [c for c in ("model", "nodes", "partition", "partition_kind", "samples", "status", metric)
               if c not in columns]
    if missing:
        raise PlannerPlotError("%s: not an mdi-bench results.csv (no column %r)" % (path, missing[0]))
    ok = [r for r in rows if r["status"].startswith("ok") and _float(r[metric]) is not None]
    if not ok:
        raise PlannerPlotError("%s: none of its %d runs succeeded" % (path, len(rows)))
    return ok


# --------------------------------------------------------------------------- analysis

def best_of(rows: Sequence[Row], metric: str) -> Optional[Dict[str, Any]]:
    """One partition's best: the median over repeats at each (max_batch, S), then the best of those."""
    runs = {}  # type: Dict[Tuple[str, int], List[float]]
    for r in rows:
        runs.setdefault((r.get("max_batch", ""), int(r["samples"])), []).append(float(r[metric]))
    if not runs:
        return None
    (mb, s), values = max(runs.items(), key=lambda kv: (statistics.median(kv[1]), -kv[0][1]))
    return {"partition": rows[0]["partition"], "tokens_per_s": statistics.median(values), "samples": s,
            "max_batch": mb, "repeats": len(values)}


def _counts(label: str) -> Optional[List[int]]:
    try:
        return [int(c) for c in label.split("+")]
    except ValueError:
        return None


def balanced_label(n_layer: int, n: int) -> str:
    """mdi's even split (mdi.model.layout.balanced): the first nodes take the remainder."""
    base, extra = divmod(n_layer, n)
    return "+".join(str(base + (1 if i < extra else 0)) for i in range(n))


def _balanced_rows(fixed: Sequence[Row], n: int) -> List[Row]:
    """The balanced ring's runs: its own kind, else the explicit split equal to it (the
    layers are the sum of any fixed split)."""
    rows = [r for r in fixed if r["partition_kind"] == "balanced"]
    if rows or not fixed:
        return rows
    counts = _counts(fixed[0]["partition"])
    even = balanced_label(sum(counts), n) if counts else None
    return [r for r in fixed if r["partition"] == even]


def _plan_of(rows: Sequence[Row], samples: int, max_batch: str) -> Tuple[str, List[str]]:
    """The plan an auto ring chose at its best S (the most frequent one) and every plan it chose."""
    at = [r.get("plan", "") for r in rows if int(r["samples"]) == samples and r.get("max_batch", "") == max_batch]
    every = sorted({r.get("plan", "") for r in rows if r.get("plan")})
    chosen = [p for p in at if p]
    return (max(set(chosen), key=chosen.count) if chosen else ""), every


def _ratio(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> Optional[float]:
    if a is None or b is None or not b["tokens_per_s"]:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def ring_groups(rows: Sequence[Row], metric: str) -> List[Dict[str, Any]]:
    """Per (model, node count): best fixed partition, balanced, auto and their ratios."""
    out = []
    keys = sorted({(r["model"], int(r["nodes"])) for r in rows})
    for model, n in keys:
        mine = [r for r in rows if r["model"] == model and int(r["nodes"]) == n]
        fixed = [r for r in mine if r["partition_kind"] in FIXED_KINDS]
        auto_rows = [r for r in mine if r["partition_kind"] == "auto"]
        per_partition = [best_of([r for r in fixed if r["partition"] == p], metric)
                         for p in sorted({r["partition"] for r in fixed})]
        best = max(per_partition, key=lambda b: b["tokens_per_s"]) if per_partition else None
        bal_rows = _balanced_rows(fixed, n)
        balanced = best_of(bal_rows, metric) if bal_rows else None
        auto = best_of(auto_rows, metric) if auto_rows else None
        if auto is not None:
            auto["plan"], auto["plans"] = _plan_of(auto_rows, auto["samples"], auto["max_batch"])
            auto["predicted_tokens_per_s"] = _median([_float(r.get("predicted_tokens_per_s")) for r in auto_rows
                                                      if int(r["samples"]) == auto["samples"]
                                                      and r.get("max_batch", "") == auto["max_batch"]])
            auto["plan_rank"] = (1 + sum(1 for b in per_partition if b["tokens_per_s"] > auto["tokens_per_s"])
                                 if per_partition else None)  # 1: no fixed partition beat it
        # The sweep's rings of fewer nodes (the first k boards) are the planner's options too:
        # it may leave boards out.
        fewer = [r for r in rows if r["model"] == model and int(r["nodes"]) < n
                 and r["partition_kind"] in FIXED_KINDS]
        smaller = [best_of([r for r in fewer if (r["nodes"], r["partition"]) == key], metric)
                   for key in sorted({(r["nodes"], r["partition"]) for r in fewer})]
        best_any = max([b for b in per_partition + smaller if b], key=lambda b: b["tokens_per_s"], default=None)
        out.append({"model": model, "nodes": n, "fixed_partitions": len(per_partition), "best": best,
                    "balanced": balanced, "auto": auto, "auto_vs_best": _ratio(auto, best),
                    "auto_vs_balanced": _ratio(auto, balanced),
                    "best_any_ring": best_any, "auto_vs_best_any_ring": _ratio(auto, best_any)})
    return out


def predictions(rows: Sequence[Row], metric: str) -> List[Dict[str, Any]]:
    """Every auto run that has the planner's prediction: predicted, measured and their ratio."""
    points = []
    for r in rows:
        predicted, measured = _float(r.get("predicted_tokens_per_s")), _float(r[metric])
        if r["partition_kind"] != "auto" or predicted is None or not measured:
            continue
        points.append({"model": r["model"], "nodes": int(r["nodes"]), "samples": int(r["samples"]),
                       "max_batch": r.get("max_batch", ""), "repeat": r.get("repeat", ""), "plan": r.get("plan", ""),
                       "predicted": predicted, "measured": measured, "ratio": predicted / measured})
    return points


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = (len(sorted_xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def spread(values: Sequence[Optional[float]]) -> Dict[str, Any]:
    """n, median, min, max and the quartiles of the values given (None left out)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "q1": _quantile(xs, 0.25), "q3": _quantile(xs, 0.75)}


def analyse(rows: Sequence[Row], metric: str, csv_path: str) -> Dict[str, Any]:
    groups = ring_groups(rows, metric)
    points = predictions(rows, metric)
    return {"csv": csv_path, "metric": metric, "rings": groups,
            "auto_vs_best": spread([g["auto_vs_best"] for g in groups]),
            "auto_vs_balanced": spread([g["auto_vs_balanced"] for g in groups]),
            "predicted_vs_measured": dict(spread([p["ratio"] for p in points]), runs=points)}


# --------------------------------------------------------------------------- the figure

def plot(result: Dict[str, Any], path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (scatter, bars) = plt.subplots(1, 2, figsize=(13, 5))
    metric = result["metric"].replace("_", " ")

    points = result["predicted_vs_measured"]["runs"]
    models = sorted({p["model"] for p in points})
    for i, model in enumerate(models):
        mine = [p for p in points if p["model"] == model]
        scatter.scatter([p["predicted"] for p in mine], [p["measured"] for p in mine], s=24, alpha=0.8,
                        color="C%d" % (i % 10), label=model)
    if points:
        top = max(max(p["predicted"], p["measured"]) for p in points) * 1.08
        scatter.plot([0, top], [0, top], "k--", lw=1, label="y = x")
        scatter.set_xlim(0, top)
        scatter.set_ylim(0, top)
        scatter.legend(fontsize=8)
    else:
        scatter.text(0.5, 0.5, "no auto runs with a prediction", ha="center", va="center",
                     transform=scatter.transAxes, color="gray")
    med = result["predicted_vs_measured"]["median"]
    scatter.set_title("planner: predicted vs measured%s" % (" (median ratio %.2f)" % med if med else ""),
                      fontsize=10)
    scatter.set_xlabel("predicted tokens/s")
    scatter.set_ylabel("measured %s" % metric)
    scatter.grid(alpha=0.3)

    groups = result["rings"]
    series = (("auto", "auto (planner)", "#4c72b0"), ("balanced", "balanced", "#b0b0b0"),
              ("best", "best fixed partition", "#55a868"))
    if any(g.get("best_any_ring") is not g["best"] for g in groups):
        series += (("best_any_ring", "best over the first k <= N boards", "#8c6bb1"),)
    width = 0.8 / len(series)
    for j, (key, label, color) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [g[key]["tokens_per_s"] if g.get(key) else 0.0 for g in groups]
        bars.bar(xs, ys, width=width, color=color, label=label)
        for x, g in zip(xs, groups):
            if key == "auto" and g["auto"] and g["auto"]["plan"]:
                bars.text(x, g["auto"]["tokens_per_s"], g["auto"]["plan"], ha="center", va="bottom", fontsize=7,
                          rotation=90)
            elif key.startswith("best") and g[key]:
                bars.text(x, g[key]["tokens_per_s"], g[key]["partition"], ha="center", va="bottom",
                          fontsize=7, rotation=90)
    bars.set_xticks(list(range(len(groups))))
    bars.set_xticklabels(["%s\nN=%d" % (g["model"], g["nodes"]) for g in groups], fontsize=8)
    bars.set_ylabel("best measured %s" % metric)
    bars.set_title("auto vs balanced vs the best fixed partition (labels: layer counts)", fontsize=10)
    bars.set_ylim(0, bars.get_ylim()[1] * 1.25)  # room for the labels
    bars.grid(alpha=0.3, axis="y")
    bars.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else "%.2f" % x


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        rows = read_results(args.results_dir, args.metric)
    except (PlannerPlotError, OSError, csv.Error) as e:
        print("plot_planner: error: %s" % e, file=sys.stderr)
        return 2
    result = analyse(rows, args.metric, os.path.join(args.results_dir, "results.csv"))
    json_path = os.path.join(args.results_dir, "planner.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    png = plot(result, os.path.join(args.results_dir, "planner.png"))
    for g in result["rings"]:
        auto = g["auto"]
        print("%s N=%d: auto %s (%s) = %s x best %s (%s), %s x balanced" % (
            g["model"], g["nodes"], _fmt(auto and auto["tokens_per_s"]), auto["plan"] if auto else "no auto ring",
            _fmt(g["auto_vs_best"]), _fmt(g["best"] and g["best"]["tokens_per_s"]),
            g["best"]["partition"] if g["best"] else "-", _fmt(g["auto_vs_balanced"])))
        best_any = g["best_any_ring"]
        if best_any is not None and best_any is not g["best"]:
            print("  %s x the best ring of fewer boards too: %s (%s)" % (
                _fmt(g["auto_vs_best_any_ring"]), _fmt(best_any["tokens_per_s"]), best_any["partition"]))
    pvm = result["predicted_vs_measured"]
    print("predicted/measured over %d auto runs: median %s [%s-%s]" % (pvm["n"], _fmt(pvm["median"]),
                                                                       _fmt(pvm["min"]), _fmt(pvm["max"])))
    print("wrote %s and %s" % (json_path, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
