"""What a sweep writes: one CSV row per run, the summary with pipeline efficiency, report.md
and the machine record."""
import csv
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: F401  (type comments)

from mdi.system.memory import meminfo
from mdi.lab.commands import command_text
from mdi.lab.nodes import RunOutcome
from mdi.lab.spec import Experiment, RingPlan


# One row per run. List-valued cells (one value per node, starter first) are joined with ";".
CSV_COLUMNS = [
    "model", "nodes", "partition", "samples", "tokens", "tokens_per_s", "ttft_s",
    "peak_memory_mb", "decode_bytes_per_hop", "repeat",
    "decode_tokens_per_s", "generated_tokens", "seconds", "ttft_max_s", "partition_kind", "dtype",
    "quant", "quant_kernel", "weights_mb", "cache_mb", "cgroup_memory_mb", "bytes_sent", "node_busy", "emulation",
    "starter_mode",
    "load_1min", "experiment", "status", "metrics_file",
]
SUMMARY_COLUMNS = [
    "model", "nodes", "partition", "samples", "tokens", "runs_ok",
    "decode_tokens_per_s_median", "decode_tokens_per_s_min", "decode_tokens_per_s_max",
    "tokens_per_s_median", "ttft_s_median", "efficiency_median", "efficiency_min", "efficiency_max",
    "speedup_vs_1_node", "peak_memory_mb_max", "node_busy_median",
]


# --------------------------------------------------------------------------- rows

def steady_rate(token_times: Sequence[Sequence[float]]) -> Optional[float]:
    """Aggregate decode tokens/s while every sample is decoding: from the last sample's first
    token to the first sample's last token (prefill excluded)."""
    lists = [list(t) for t in token_times if len(t) >= 2]
    if not lists:
        return None
    start, end = max(t[0] for t in lists), min(t[-1] for t in lists)
    n = sum(1 for t in lists for x in t if start < x <= end)
    return n / (end - start) if end > start and n else None


def _mb(n: Optional[float]) -> str:
    return "" if n is None else "%.1f" % (n / 1e6)


def _num(x: Optional[float], fmt: str = "%.3f") -> str:
    return "" if x is None else fmt % x


def _joined(values: Sequence[Any]) -> str:
    return ";".join(str(v) for v in values)


def decode_bytes_per_hop(nodes: List[Dict[str, Any]]) -> Optional[float]:
    sent = sum((n.get("bytes_sent_by_kind") or {}).get("decode", 0) for n in nodes)
    msgs = sum((n.get("messages_sent_by_kind") or {}).get("decode", 0) for n in nodes)
    return sent / msgs if msgs else None


def _busy(node: Dict[str, Any], seconds: Optional[float]) -> str:
    """Share of the run a node spent computing (its layers; the starter also its head and
    sampling): near 1 for the bottleneck of a full pipeline, lower where nodes wait."""
    busy = node.get("compute_seconds")
    return "%.3f" % (busy / seconds) if isinstance(busy, (int, float)) and seconds else ""


def make_row(exp: Experiment, plan: RingPlan, samples: int, repeat: int, outcome: RunOutcome, emu_tag: str,
             metrics_file: str) -> Dict[str, str]:
    row = {c: "" for c in CSV_COLUMNS}
    row.update(model=plan.model.name, nodes=str(plan.n_nodes), partition=plan.label, samples=str(samples),
               tokens=str(plan.model.tokens), repeat=str(repeat), partition_kind=plan.kind, dtype=plan.model.dtype,
               quant=plan.model.quant, quant_kernel=plan.model.quant_kernel,
               weights_mb=_joined(_mb(b) for b in plan.weights), emulation=emu_tag, starter_mode=exp.starter,
               load_1min="%.2f" % outcome.load_1min, experiment=exp.name)
    m = outcome.metrics
    if outcome.code != 0 or m is None:
        row["status"] = "failed: %s" % (outcome.error or "exit code %d" % outcome.code)
        return row
    times = [s.get("token_times") or [] for s in m["samples"]]
    firsts = [t[0] for t in times if t]
    nodes = m.get("nodes") or []
    peaks = [p if p is not None else n.get("peak_memory_bytes") for p, n in zip(outcome.peak_rss, nodes)]
    row.update(tokens_per_s=_num(m.get("tokens_per_s")), decode_tokens_per_s=_num(steady_rate(times)),
               generated_tokens=str(m.get("n_tokens", "")), seconds=_num(m.get("seconds")),
               ttft_s=_num(statistics.median(firsts) if firsts else None, "%.4f"),
               ttft_max_s=_num(max(firsts) if firsts else None, "%.4f"),
               peak_memory_mb=_joined(_mb(p) for p in peaks),
               cache_mb=_joined(_mb(n.get("cache_bytes")) for n in nodes),
               cgroup_memory_mb=_joined(_mb(c) for c in outcome.cgroup_peak) if any(outcome.cgroup_peak) else "",
               decode_bytes_per_hop=_num(decode_bytes_per_hop(nodes), "%.1f"),
               bytes_sent=_joined(n.get("bytes_sent", "") for n in nodes),
               node_busy=_joined(_busy(n, m.get("seconds")) for n in nodes),
               status="ok", metrics_file=metrics_file)
    short = [s for s in m["samples"] if len(s.get("token_ids") or []) < plan.model.tokens]
    if short:
        row["status"] = "ok (%d samples stopped early: %s)" % (len(short), short[0].get("finish_reason"))
    return row


# --------------------------------------------------------------------------- summary

def _float(x: str) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def read_rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def ok_rows(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    return [r for r in rows if r.get("status", "").startswith("ok") and _float(r.get("decode_tokens_per_s")) is not None]


def summarize(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """Median and spread per (model, nodes, partition, samples), with the pipeline efficiency
    (S-sample tokens/s / (N x 1-sample tokens/s) on the same ring, paired by repeat)."""
    good = ok_rows(rows)
    groups = {}  # type: Dict[Tuple[str, int, str, int], List[Dict[str, str]]]
    for r in good:
        groups.setdefault((r["model"], int(r["nodes"]), r["partition"], int(r["samples"])), []).append(r)
    out = []
    for (model, n, part, s), rs in sorted(groups.items()):
        dec = [float(r["decode_tokens_per_s"]) for r in rs]
        base = {r["repeat"]: float(r["decode_tokens_per_s"]) for r in groups.get((model, n, part, 1), [])}
        eff = [float(r["decode_tokens_per_s"]) / (n * base[r["repeat"]]) for r in rs if r["repeat"] in base]
        one = [float(r["decode_tokens_per_s"]) for (m2, n2, _, s2), g in groups.items()
               if m2 == model and n2 == 1 and s2 == 1 for r in g]
        peaks = _max_per_node([r["peak_memory_mb"] for r in rs])
        out.append({
            "model": model, "nodes": str(n), "partition": part, "samples": str(s), "tokens": rs[0]["tokens"],
            "runs_ok": str(len(rs)), "decode_tokens_per_s_median": "%.3f" % statistics.median(dec),
            "decode_tokens_per_s_min": "%.3f" % min(dec), "decode_tokens_per_s_max": "%.3f" % max(dec),
            "tokens_per_s_median": _num(_median([_float(r["tokens_per_s"]) for r in rs])),
            "ttft_s_median": _num(_median([_float(r["ttft_s"]) for r in rs]), "%.4f"),
            "efficiency_median": _num(statistics.median(eff) if eff else None),
            "efficiency_min": _num(min(eff) if eff else None), "efficiency_max": _num(max(eff) if eff else None),
            "speedup_vs_1_node": _num(statistics.median(dec) / statistics.median(one) if one else None),
            "peak_memory_mb_max": _joined("%.1f" % p for p in peaks),
            "node_busy_median": _joined("%.2f" % b for b in _median_per_node([r.get("node_busy", "") for r in rs])),
        })
    return out


def _median(xs: List[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def per_node(cells: List[str]) -> List[List[float]]:
    """';'-joined per-node cells of several rows -> the values of each node, by position (an
    empty entry, a node that reported nothing, is skipped without shifting the others; a
    node that never reported has an empty list)."""
    rows = [c.split(";") for c in cells if c]
    return [[float(x) for x in col if x] for col in zip(*rows)]


def _max_per_node(cells: List[str]) -> List[float]:
    return [max(col) for col in per_node(cells) if col]


def _median_per_node(cells: List[str]) -> List[float]:
    return [statistics.median(col) for col in per_node(cells) if col]


def rings_of(rows: Sequence[Dict[str, str]]) -> List[Tuple[int, str]]:
    """The (nodes, partition) rings that rows speak of, in order."""
    return sorted({(int(r["nodes"]), r["partition"]) for r in rows})


def write_csv(path: str, columns: List[str], rows: List[Dict[str, str]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def scaling_lines(summary: List[Dict[str, str]]) -> List[str]:
    """Per model: the best S >= N throughput for each node count, and whether it rises with N."""
    lines = []
    for model in sorted({r["model"] for r in summary}):
        best = {}  # type: Dict[int, Tuple[float, Dict[str, str]]]
        for r in summary:
            n, s = int(r["nodes"]), int(r["samples"])
            if r["model"] == model and s >= n:
                v = float(r["decode_tokens_per_s_median"])
                if n not in best or v > best[n][0]:
                    best[n] = (v, r)
        ns = sorted(best)
        parts = ["%d node%s %.2f tok/s (S=%s, %s)" % (n, "s" if n > 1 else "", best[n][0], best[n][1]["samples"],
                                                       best[n][1]["partition"]) for n in ns]
        if len(ns) < 2:
            verdict = "one node count only"
        elif all(best[a][0] < best[b][0] for a, b in zip(ns, ns[1:])):
            verdict = "rises with N"
        else:
            verdict = "does NOT rise with N"
        lines.append("- %s: %s: %s" % (model, "; ".join(parts), verdict))
    return lines


def write_report(path: str, summary: List[Dict[str, str]], machine: Dict[str, Any]) -> None:
    """A Markdown digest of summary.csv: scaling check and one table per model."""
    lines = ["# %s" % machine.get("experiment", {}).get("name", "experiment"), ""]
    emu = machine.get("emulation", {}).get("summary")
    if emu:
        lines += [emu, ""]
    load = machine.get("loadavg_start"), machine.get("loadavg_end")
    if all(load):
        lines += ["Load average (1/5/15 min) at start %s, at end %s; %s CPUs." % (
            "/".join("%.2f" % x for x in load[0]), "/".join("%.2f" % x for x in load[1]), machine.get("cpu_count")), ""]
    lines += ["Best decode throughput with S >= N samples in flight (median of repeats):", ""]
    lines += scaling_lines(summary) + [""]
    for model in sorted({r["model"] for r in summary}):
        lines += _model_table(model, [r for r in summary if r["model"] == model])
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _model_table(model: str, rows: List[Dict[str, str]]) -> List[str]:
    samples = sorted({int(r["samples"]) for r in rows})
    rings = rings_of(rows)
    out = ["## %s" % model, "",
           "Decode tokens/s, median [min-max] of repeats, and pipeline efficiency "
           "(S-sample rate / (N x 1-sample rate), same ring, paired by repeat).", "",
           "| nodes | partition | " + " | ".join("S=%d" % s for s in samples) + " |",
           "|---|---|" + "---|" * len(samples)]
    for n, part in rings:
        cells = []
        for s in samples:
            r = next((r for r in rows if int(r["nodes"]) == n and r["partition"] == part and int(r["samples"]) == s), None)
            if r is None:
                cells.append("")
                continue
            cell = "%s [%s-%s]" % (r["decode_tokens_per_s_median"][:-1], r["decode_tokens_per_s_min"][:-1],
                                   r["decode_tokens_per_s_max"][:-1])
            if r["efficiency_median"] and n > 1:
                cell += " eff %.2f" % float(r["efficiency_median"])
            cells.append(cell)
        out.append("| %d | %s | %s |" % (n, part, " | ".join(cells)))
    return out + [""]


# --------------------------------------------------------------------------- machine record

def machine_record(source: str) -> Dict[str, Any]:
    import platform
    import mdi
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rec = {"time_start": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv),
           "python": platform.python_version(), "mdi": mdi.__version__, "platform": platform.platform(),
           "machine": platform.machine(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
           "memory_total_mb": _meminfo_mb(), "loadavg_start": list(os.getloadavg()),
           "uptime_start": command_text(["uptime"]), "threads_per_node": 1, "experiment_file": source,
           "git_commit": command_text(["git", "-C", repo, "rev-parse", "HEAD"]),
           "git_dirty": bool(command_text(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"]))}
    try:
        import torch
        rec["torch"] = torch.__version__
    except ImportError:
        pass
    return rec


def _meminfo_mb() -> Optional[int]:
    total = meminfo().get("MemTotal")
    return total // 2 ** 20 if total is not None else None
