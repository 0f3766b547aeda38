"""PNG plots of an mdi-bench output folder (results.csv, summary.csv and runs/*.json).

matplotlib is imported only when plotting, with the Agg backend (no display needed):
mdi itself does not depend on it (pip install mdi[bench]).
"""
import json
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

from mdi.lab.report import batch_label, batches_of, max_batch_of, ok_rows, per_node, rings_of, series_of

Row = Dict[str, str]
NO_DATA = "no data"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install matplotlib (or mdi[bench])")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


FIGURES = ("time_vs_tokens.png", "throughput_vs_samples.png", "memory_per_node.png")  # what plot_all writes


def plot_all(out: str, rows: List[Row], summary: List[Row]) -> List[str]:
    """Write the three figures into `out`; returns their paths."""
    plt = _pyplot()
    good = ok_rows(rows)
    if not good:  # no run succeeded: figures an earlier sweep left here would pass for this one's
        for name in FIGURES:
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        return []
    models = _ordered(r["model"] for r in good)
    paths = [time_vs_tokens(plt, out, good, models),
             throughput_vs_samples(plt, out, summary, models),
             memory_per_node(plt, out, good, models)]
    return paths


def _ordered(items) -> List[str]:
    seen: List[str] = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def _of_ring(rows: Sequence[Row], n: int, part: str) -> List[Row]:
    return [r for r in rows if int(r["nodes"]) == n and r["partition"] == part]


def _ring_label(n: int, part: str) -> str:
    return "%d node%s (%s)" % (n, "s" if n > 1 else "", part)


def _of_series(rows: Sequence[Row], n: int, part: str, mb: str) -> List[Row]:
    return [r for r in _of_ring(rows, n, part) if max_batch_of(r) == mb]


def _series(rows: Sequence[Row]) -> List[Any]:
    """(nodes, partition, max_batch, label) of each line to draw: one per ring, and one per
    max_batch as well when the rows have more than one ('unbatched', 'batched (auto)', ...)."""
    several_rings, several_batches = len(rings_of(rows)) > 1, len(batches_of(rows)) > 1
    out = []
    for n, part, mb in series_of(rows):
        batch = batch_label(mb) if several_batches else ""
        if batch and not several_rings:
            label = batch
        else:
            label = ", ".join(x for x in (_ring_label(n, part), batch) if x)
        out.append((n, part, mb, label))
    return out


def _median_run(rows: Sequence[Row]) -> Optional[Row]:
    """The repeat whose decode rate is the median one (a real run, not an average)."""
    if not rows:
        return None
    rates = sorted(rows, key=lambda r: float(r["decode_tokens_per_s"]))
    return rates[(len(rates) - 1) // 2]


def _token_times(out: str, row: Row) -> List[float]:
    try:
        with open(os.path.join(out, row["metrics_file"]), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, KeyError):
        return []
    return sorted(t for s in record.get("samples", []) for t in s.get("token_times") or [])


def time_vs_tokens(plt, out: str, rows: List[Row], models: List[str]) -> str:
    """As in the MDI-LLM thesis: seconds to generate k tokens, one line per ring, with one
    sample (left) and with S = N samples in flight (right), all samples' tokens counted."""
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        mrows = [r for r in rows if r["model"] == model]
        for j, title in enumerate(("1 sample", "S = N samples in flight")):
            ax = axes[i][j]
            lines = 0
            for n, part, mb, label in _series(mrows):
                s = 1 if j == 0 else n
                run = _median_run([r for r in _of_series(mrows, n, part, mb) if int(r["samples"]) == s])
                times = _token_times(out, run) if run else []
                if times:
                    ax.plot(range(1, len(times) + 1), times, label=label)
                    lines += 1
            ax.set_title("%s: %s" % (model, title), fontsize=10)
            ax.set_xlabel("generated tokens (all samples)")
            ax.set_ylabel("time since start (s)")
            ax.grid(alpha=0.3)
            _finish_panel(ax, lines > 0)
    return _save(fig, plt, out, FIGURES[0])


def throughput_vs_samples(plt, out: str, summary: List[Row], models: List[str]) -> str:
    """Aggregate decode tokens/s against samples in flight (median, bars = min..max of repeats),
    and the pipeline efficiency S-rate / (N x 1-sample rate): one line per ring, and per
    max_batch when the experiment ran more than one (batched against unbatched)."""
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        mrows = [r for r in summary if r["model"] == model and r.get("decode_tokens_per_s_median")]  # measured
        ax, ax2 = axes[i]
        xs_all: List[int] = []
        eff_xs: List[int] = []
        for c, (n, part, mb, label) in enumerate(_series(mrows)):
            color = "C%d" % c  # the same line has the same colour in both panels
            rs = sorted(_of_series(mrows, n, part, mb), key=lambda r: int(r["samples"]))
            xs = [int(r["samples"]) for r in rs]
            xs_all += xs
            med = [float(r["decode_tokens_per_s_median"]) for r in rs]
            lo = [m - float(r["decode_tokens_per_s_min"]) for m, r in zip(med, rs)]
            hi = [float(r["decode_tokens_per_s_max"]) - m for m, r in zip(med, rs)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, color=color, label=label)
            eff = [(x, float(r["efficiency_median"])) for x, r in zip(xs, rs) if r.get("efficiency_median")]
            if n > 1 and eff:
                ax2.plot([x for x, _ in eff], [e for _, e in eff], marker="o", color=color, label=label)
                eff_xs += [x for x, _ in eff]
        ax.set_title("%s: aggregate decode throughput" % model, fontsize=10)
        ax.set_ylabel("tokens/s")
        ax2.set_title("%s: pipeline efficiency" % model, fontsize=10)
        ax2.set_ylabel("rate(S) / (N x rate(1))")
        if eff_xs:
            ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
        for a, xs in ((ax, xs_all), (ax2, eff_xs)):
            a.set_xlabel("samples in flight S")
            a.grid(alpha=0.3)
            if xs:
                _samples_axis(a, xs)
            _finish_panel(a, bool(xs))
    return _save(fig, plt, out, FIGURES[1])


def _samples_axis(ax: Any, xs: Sequence[int]) -> None:
    """Samples in flight are whole numbers: integer ticks only, and a lone value centred
    (not 1.900 ... 2.100 around it)."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if len(set(xs)) == 1:
        ax.set_xlim(xs[0] - 0.5, xs[0] + 0.5)


def _finish_panel(ax: Any, has_data: bool, **legend: Any) -> None:
    """A legend where there is something to name; a 'no data' note instead of an empty,
    meaningless axis where there is nothing to show."""
    if not has_data:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, NO_DATA, transform=ax.transAxes, ha="center", va="center", color="gray", fontsize=11)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **legend)


def _node_medians(rows: Sequence[Row], column: str) -> List[float]:
    """Median of each node's values in a per-node column (0 for a node that never reported)."""
    return [statistics.median(col) if col else 0.0 for col in per_node([r.get(column, "") for r in rows])]


def memory_per_node(plt, out: str, rows: List[Row], models: List[str]) -> str:
    """Peak resident memory of every node of every ring (the run with the most samples in
    flight, median of repeats; per max_batch when there are several), split into weights,
    KV cache and the rest."""
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 3.8 * len(models)), squeeze=False)
    colors = {"weights": "#4c72b0", "KV cache": "#dd8452", "other (runtime, buffers)": "#b0b0b0"}
    for i, model in enumerate(models):
        ax = axes[i][0]
        mrows = [r for r in rows if r["model"] == model]
        x, ticks, labels, bars = 0.0, [], [], 0
        several_batches = len(batches_of(mrows)) > 1
        for n, part, mb, _ in _series(mrows):
            ring = _of_series(mrows, n, part, mb)
            top = max(int(r["samples"]) for r in ring)
            at_top = [r for r in ring if int(r["samples"]) == top]
            peak, weights, cache = (_node_medians(at_top, c) for c in ("peak_memory_mb", "weights_mb", "cache_mb"))
            if not peak:
                continue
            for k, p in enumerate(peak):
                w = weights[k] if k < len(weights) else 0.0
                c = cache[k] if k < len(cache) else 0.0
                parts = (("weights", w), ("KV cache", c), ("other (runtime, buffers)", max(0.0, p - w - c)))
                bottom = 0.0
                for name, v in parts:
                    ax.bar(x, v, bottom=bottom, width=0.8, color=colors[name], label=None if bars else name)
                    bottom += v
                ax.text(x, p, "%.0f" % p, ha="center", va="bottom", fontsize=7)
                x += 1
                bars += 1
            ticks.append(x - (len(peak) + 1) / 2.0)
            batch = "\n" + batch_label(mb) if several_batches and mb else ""
            labels.append("%s%s\nS=%d" % (_ring_label(n, part), batch, top))
            x += 1  # a gap between rings
        ax.set_ylabel("peak RSS per node (MB)")
        ax.set_title("%s: memory per node (bars: starter first, then workers in ring order)" % model, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        if bars:
            ax.set_xticks(ticks)
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the value labels
        _finish_panel(ax, bars > 0, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, plt, out, FIGURES[2])


def _save(fig: Any, plt: Any, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
