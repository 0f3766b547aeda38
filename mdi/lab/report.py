"""What a sweep writes: one CSV row per run, the summary with pipeline efficiency and the
machine record (report.md, the summary's digest: mdi.lab.report_md)."""
import csv
import os
import statistics
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from mdi.system.memory import meminfo
from mdi.lab.commands import command_text
from mdi.lab.nodes import RunOutcome
from mdi.lab.spec import Experiment, RingPlan


# The batching the metrics record reports per node (mdi-start --metrics-out, "nodes"), each a
# per-node CSV column: token rows and samples per forward pass, mean and max. Absent in records
# of rings without batching: the cells are then empty.
FORWARD_COLUMNS = ["rows_per_forward_mean", "rows_per_forward_max", "samples_per_forward_mean",
                   "samples_per_forward_max"]

# One row per run. List-valued cells (one value per node, starter first) are joined with ";".
# A run is identified by (model, nodes, partition, max_batch, samples, repeat).
INTERRUPTED = "interrupted"  # the status of the run a Ctrl-C cut short (its row is kept, counted nowhere)
CSV_COLUMNS = [
    "model", "nodes", "partition", "samples", "max_batch", "tokens", "tokens_per_s", "ttft_s",
    "peak_memory_mb", "decode_bytes_per_hop", "repeat",
    "decode_tokens_per_s", "generated_tokens", "seconds", "ttft_max_s", "partition_kind", "dtype",
    "quant", "quant_kernel", "wire_codec", "weights_mb", "cache_mb", "cgroup_memory_mb", "bytes_sent", "node_busy",
    "backends",  # what each node computed with (ggml or torch; ';' per node): quant/dtype are what was asked
] + FORWARD_COLUMNS + [
    "emulation", "starter_mode",
    "load_1min", "experiment", "status", "metrics_file",
    # Rings with `layers: auto` (partition "auto"): the counts mdi-start's planner chose, '+'-joined
    # in ring order (0: a node left out), and the tokens/s it predicted; empty for other rings.
    "plan", "predicted_tokens_per_s",
] + [
    # Speculative decoding (generation.speculation): the starter's drafting counters, and per node
    # (starter first) the passes cancelled (the starter: stale ones that came back; a worker: stale
    # ones it dropped unrun) and the rows it computed for nothing. Empty when speculation is off.
    "spec_drafted", "spec_accepted", "spec_acceptance_rate", "spec_accepted_per_pass",
    "spec_passes_cancelled", "spec_wasted_rows",
] + [
    # (new columns go last: the places of those before them stay)
    "backend",  # runtime.backend as asked (auto, ggml, torch)
    "weight_types",  # what the weights are stored as: the GGUF's types (ggml nodes), torch's layout (torch nodes)
    # the nodes the run computed on: fewer than `nodes` where an auto ring's planner left some out
    # (its per-node cells then list those it kept)
    "active_nodes",
]
SUMMARY_COLUMNS = [
    "model", "nodes", "partition", "max_batch", "samples", "tokens", "backends", "runs_ok", "runs_short", "runs_failed",
    "decode_tokens_per_s_median", "decode_tokens_per_s_min", "decode_tokens_per_s_max",
    "tokens_per_s_median", "ttft_s_median", "efficiency_median", "efficiency_min", "efficiency_max",
    "speedup_vs_1_node", "speedup_vs_unbatched", "peak_memory_mb_max", "node_busy_median",
    "samples_per_forward_median",
    "active_nodes",  # (last: the places of the columns before it stay)
]
UNBATCHED = "1"


def batch_label(max_batch: Any) -> str:
    """How plots and reports name a max_batch value ('' for rows from before the column)."""
    v = str(max_batch)
    if v == "":
        return ""
    return "unbatched" if v == UNBATCHED else "batched (%s)" % v


def batch_order(max_batch: str) -> Tuple[int, int, str]:
    """Sort key: unknown (''), then numbers ascending (1 = unbatched first), then auto."""
    v = str(max_batch)
    if v == "":
        return (0, 0, "")
    return (1, int(v), "") if v.isdigit() else (2, 0, v)


def max_batch_of(row: Dict[str, str]) -> str:
    return row.get("max_batch") or ""


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
    """Bytes in MB of 2^20 bytes, as memory_limit_mb, the warnings and mdi-plan count them."""
    return "" if n is None else "%.1f" % (n / 2 ** 20)


def _num(x: Optional[float], fmt: str = "%.3f") -> str:
    return "" if x is None else fmt % x


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _joined(values: Iterable[Any]) -> str:
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


def _per_node(nodes: List[Dict[str, Any]], key: str, fmt: str) -> str:
    """A per-node cell of a metrics key; empty when no node reports it (an older record)."""
    if not any(isinstance(n.get(key), (int, float)) for n in nodes):
        return ""
    return _joined(fmt % n[key] if isinstance(n.get(key), (int, float)) else "" for n in nodes)


def chosen_plan(metrics: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The planner's record in a run's metrics ("plan": counts, predicted_tokens_per_s, ...),
    None for a run without one (fixed layer counts)."""
    plan = (metrics or {}).get("plan")
    return plan if isinstance(plan, dict) else None


def plan_counts(plan: Optional[Dict[str, Any]]) -> Optional[List[int]]:
    counts = (plan or {}).get("counts")
    if isinstance(counts, list) and counts and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return counts
    return None


def _weights_cell(plan: RingPlan, chosen: Optional[Dict[str, Any]], backends: Sequence[str] = ()) -> str:
    """Each node's weights; an auto ring's from the counts its planner chose (the plan's
    own balanced estimate would be wrong), empty until a run says them. A node that computed
    with ggml (`backends`: the run's nodes', in ring order) holds its GGUF tensors as stored
    (torch's sizes had overstated a float16 GGUF's two to three times)."""
    if plan.kind != "auto":
        counts, weights = plan.counts, list(plan.weights)
    else:
        counts = plan_counts(chosen) or []
        if plan.weigh is None or len(counts) != plan.n_nodes or sum(counts) != sum(plan.counts):
            return ""
        weights = plan.weigh(counts)
    if "ggml" in backends and plan.weigh_gguf is not None:
        # the run's nodes are those the planner kept (a node left out is in no record)
        kept = [k for k, c in enumerate(counts) if c > 0 or k == 0]
        on_gguf = plan.weigh_gguf(list(counts))
        for k, backend in zip(kept, backends):
            if backend == "ggml":
                weights[k] = on_gguf[k]
    return _joined(_mb(b) for b in weights)


def make_row(exp: Experiment, plan: RingPlan, samples: int, repeat: int, outcome: RunOutcome, emu_tag: str,
             metrics_file: str, max_batch: Any = "auto") -> Dict[str, str]:
    row = {c: "" for c in CSV_COLUMNS}
    m = outcome.metrics
    chosen = chosen_plan(m)
    counts = plan_counts(chosen)
    row.update(model=plan.model.name, nodes=str(plan.n_nodes), partition=plan.label, samples=str(samples),
               max_batch=str(max_batch), tokens=str(plan.model.tokens), repeat=str(repeat), partition_kind=plan.kind,
               dtype=plan.model.dtype, quant=plan.model.quant, quant_kernel=plan.model.quant_kernel,
               wire_codec=plan.model.wire_codec, backend=plan.model.asked_backend, weight_types=plan.weight_types,
               weights_mb=_weights_cell(plan, chosen), emulation=emu_tag, starter_mode=exp.starter,
               load_1min="%.2f" % outcome.load_1min, experiment=exp.name,
               plan="+".join(str(c) for c in counts) if counts else "",
               predicted_tokens_per_s=_num(_number((chosen or {}).get("predicted_tokens_per_s"))))
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
               backends=_joined(n.get("backend") or "" for n in nodes), status="ok", metrics_file=metrics_file,
               weights_mb=_weights_cell(plan, chosen, [n.get("backend") or "" for n in nodes]),
               active_nodes=str(len(nodes)))
    for key in FORWARD_COLUMNS:
        row[key] = _per_node(nodes, key, "%.2f" if key.endswith("_mean") else "%g")
    row.update(speculation_cells(nodes))
    short = [s for s in m["samples"] if len(s.get("token_ids") or []) < plan.model.tokens]
    if short:
        row["status"] = "ok (%d samples stopped early: %s)" % (len(short), short[0].get("finish_reason"))
    return row


def speculation_cells(nodes: List[Dict[str, Any]]) -> Dict[str, str]:
    """The spec_* cells of a run's metrics nodes ({} when its starter drafted nothing at all:
    speculation off). A node computes the rows the starter counts as wasted (rejected drafts,
    stale passes that came back) and those of the stale passes dropped unrun by nodes after it."""
    spec = (nodes[0].get("speculation") or {}) if nodes else {}
    if not isinstance(spec.get("drafted"), int):
        return {}
    dropped = [int((n.get("speculation") or {}).get("rows_cancelled") or 0) for n in nodes]
    wasted = [int(spec.get("rows_wasted") or 0) + sum(dropped[i + 1:]) for i in range(len(nodes))]
    cancelled = [spec.get("passes_stale") or 0] + [(n.get("speculation") or {}).get("passes_cancelled") or 0
                                                    for n in nodes[1:]]
    return {"spec_drafted": str(spec["drafted"]), "spec_accepted": str(spec.get("accepted", "")),
            "spec_acceptance_rate": _num(_number(spec.get("acceptance_rate")), "%.4f"),
            "spec_accepted_per_pass": _num(_number(spec.get("accepted_per_pass")), "%.4f"),
            "spec_passes_cancelled": _joined(cancelled), "spec_wasted_rows": _joined(wasted)}


# --------------------------------------------------------------------------- summary

def _float(x: Optional[str]) -> Optional[float]:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def read_rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def ok_rows(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """The complete runs: every sample decoded its tokens. A run some of whose samples stopped
    early ("ok (2 samples stopped early: eos)") is left out: its decode rate is that of the
    samples still decoding, not of its S (a 4-sample row had been the rate of 2)."""
    return [r for r in rows if _complete(r)]


def _complete(row: Dict[str, str]) -> bool:
    return row.get("status") == "ok" and _float(row.get("decode_tokens_per_s")) is not None


def _short(row: Dict[str, str]) -> bool:
    return row.get("status", "").startswith("ok (")


Group = Tuple[str, int, str, str, int]  # model, nodes, partition, max_batch, samples


def _group_order(key: Group) -> Tuple[Any, ...]:
    model, n, part, mb, s = key
    return (model, n, part, batch_order(mb), s)


def _baseline(groups: Dict[Group, List[Dict[str, str]]], model: str, n: int, part: str,
              mb: str) -> List[Dict[str, str]]:
    """The 1-sample runs that a (ring, max_batch)'s efficiency is measured against: those of the
    same max_batch; one sample travels alone whatever max_batch says, so without them the
    ring's unbatched (then any) 1-sample runs."""
    same = groups.get((model, n, part, mb, 1))
    if same:
        return same
    others = sorted((k for k in groups if k[:3] == (model, n, part) and k[4] == 1), key=_group_order)
    unbatched = [k for k in others if k[3] == UNBATCHED]
    return groups[(unbatched or others)[0]] if others else []


def summarize(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """Median and spread per (model, nodes, partition, max_batch, samples), with the pipeline
    efficiency (S-sample tokens/s / (N x 1-sample tokens/s) on the same ring at the same
    max_batch, paired by repeat) and, for batched runs, the speedup over the unbatched runs
    (max_batch 1) of the same ring and S."""
    groups: Dict[Group, List[Dict[str, str]]] = {}
    asked: Dict[Group, List[Dict[str, str]]] = {}  # every run, complete or not: none goes unsaid
    for r in rows:
        if r.get("status") == INTERRUPTED:
            continue  # cut short by the user: neither made nor failed
        key = (r["model"], int(r["nodes"]), r["partition"], max_batch_of(r), int(r["samples"]))
        asked.setdefault(key, []).append(r)
        if _complete(r):
            groups.setdefault(key, []).append(r)
    out = []
    for (model, n, part, mb, s), every in sorted(asked.items(), key=lambda kv: _group_order(kv[0])):
        rs = groups.get((model, n, part, mb, s), [])
        short = sum(1 for r in every if _short(r))
        counts = {"runs_ok": str(len(rs)), "runs_short": str(short), "runs_failed": str(len(every) - len(rs) - short)}
        if not rs:  # no complete run: the group is listed with its counts and no numbers
            out.append(dict({c: "" for c in SUMMARY_COLUMNS}, model=model, nodes=str(n), partition=part, max_batch=mb,
                            samples=str(s), tokens=every[0].get("tokens", ""), **counts))
            continue
        dec = [float(r["decode_tokens_per_s"]) for r in rs]
        base = {r["repeat"]: float(r["decode_tokens_per_s"]) for r in _baseline(groups, model, n, part, mb)}
        eff = [float(r["decode_tokens_per_s"]) / (n * base[r["repeat"]]) for r in rs if r["repeat"] in base]
        one = [float(r["decode_tokens_per_s"]) for (m2, n2, _, _, s2), g in groups.items()
               if m2 == model and n2 == 1 and s2 == 1 for r in g]
        unbatched = [float(r["decode_tokens_per_s"]) for r in groups.get((model, n, part, UNBATCHED, s), [])]
        vs_unbatched = (statistics.median(dec) / statistics.median(unbatched)
                        if unbatched and mb not in ("", UNBATCHED) else None)
        peaks = _max_per_node([r["peak_memory_mb"] for r in rs])
        out.append({
            "model": model, "nodes": str(n), "partition": part, "max_batch": mb, "samples": str(s),
            "tokens": rs[0]["tokens"], "backends": backends_of(rs),
            "active_nodes": " / ".join(sorted({r.get("active_nodes") or str(n) for r in rs})), **counts,
            "decode_tokens_per_s_median": "%.3f" % statistics.median(dec),
            "decode_tokens_per_s_min": "%.3f" % min(dec), "decode_tokens_per_s_max": "%.3f" % max(dec),
            "tokens_per_s_median": _num(_median([_float(r["tokens_per_s"]) for r in rs])),
            "ttft_s_median": _num(_median([_float(r["ttft_s"]) for r in rs]), "%.4f"),
            "efficiency_median": _num(statistics.median(eff) if eff else None),
            "efficiency_min": _num(min(eff) if eff else None), "efficiency_max": _num(max(eff) if eff else None),
            "speedup_vs_1_node": _num(statistics.median(dec) / statistics.median(one) if one else None),
            "speedup_vs_unbatched": _num(vs_unbatched),
            "peak_memory_mb_max": _joined("%.1f" % p for p in peaks),
            "node_busy_median": _joined("%.2f" % b for b in _median_per_node([r.get("node_busy", "") for r in rs])),
            "samples_per_forward_median": _joined(
                "%.2f" % b for b in _median_per_node([r.get("samples_per_forward_mean", "") for r in rs])),
        })
    return out


def backends_of(rows: List[Dict[str, str]]) -> str:
    """What the rows' nodes computed with (results.csv's backends, ';' per node), or each of
    the ways they did, ' / '-joined, where runs of one group differed (backend auto)."""
    return " / ".join(sorted({r.get("backends", "") for r in rows if r.get("backends")}))


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


def batches_of(rows: Sequence[Dict[str, str]]) -> List[str]:
    """The max_batch values that rows speak of, in order ('' for rows without the column)."""
    return sorted({max_batch_of(r) for r in rows}, key=batch_order)


def series_of(rows: Sequence[Dict[str, str]]) -> List[Tuple[int, str, str]]:
    """The (nodes, partition, max_batch) series that rows speak of, ring by ring."""
    keys = {(int(r["nodes"]), r["partition"], max_batch_of(r)) for r in rows}
    return sorted(keys, key=lambda k: (k[0], k[1], batch_order(k[2])))


def write_csv(path: str, columns: List[str], rows: List[Dict[str, str]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- machine record

def code_revision() -> Dict[str, Any]:
    """The commit of the mdi that measured, and whether its tracked files differed from it:
    what ties a results file to its code."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"git_commit": command_text(["git", "-C", repo, "rev-parse", "HEAD"]),
            "git_dirty": bool(command_text(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"]))}


def machine_record(source: str) -> Dict[str, Any]:
    import platform
    import mdi
    from mdi.system.cpu import cpu_info
    cpu = cpu_info()
    rec = {"time_start": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv),
           "python": platform.python_version(), "mdi": mdi.__version__, "platform": platform.platform(),
           "machine": platform.machine(), "cpu_model": cpu["model"], "cpu": cpu, "cpu_count": os.cpu_count(),
           "memory_total_mb": _meminfo_mb(), "loadavg_start": list(os.getloadavg()),
           "uptime_start": command_text(["uptime"]), "threads_per_node": 1, "experiment_file": source,
           **code_revision()}
    try:
        import torch
        rec["torch"] = torch.__version__
    except ImportError:
        pass
    try:  # the nodes' other compute library (a results file names what computed: results.csv's backends)
        from mdi.model.ggml import lib
        rec["ggml"] = lib.version()
        rec["ggml_cpu_features"] = sorted(lib.cpu_features())  # what ggml's build uses here (torch's: cpu.isa)
    except Exception as e:  # not installed, or its library does not load here
        rec["ggml"] = "unavailable (%s)" % str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return rec


def _meminfo_mb() -> Optional[int]:
    total = meminfo().get("MemTotal")
    return total // 2 ** 20 if total is not None else None
