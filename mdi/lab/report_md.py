"""report.md: a sweep's summary.csv as Markdown: whether throughput rises with the node count,
batched against unbatched decode, and one table per model."""
from typing import Any, Dict, List, Sequence, Tuple

from mdi.lab.report import UNBATCHED, backends_of, batch_label, batches_of, max_batch_of, rings_of, series_of


def measured(summary: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """The summary's groups with at least one complete run (the others have no numbers)."""
    return [r for r in summary if r.get("decode_tokens_per_s_median")]


def incomplete(rows: List[Dict[str, str]]) -> str:
    """How many of the rows' runs failed or stopped early, in words ('' where none did)."""
    failed, short = (sum(int(r.get(k) or 0) for r in rows) for k in ("runs_failed", "runs_short"))
    said = ["%d failed" % failed] if failed else []
    return ", ".join(said + (["%d stopped early" % short] if short else []))


def scaling_lines(summary: List[Dict[str, str]]) -> List[str]:
    """Per model: the best S >= N throughput for each node count (any max_batch), and whether
    it rises with N; a node count asked for with no complete run is said, never dropped."""
    lines = []
    for model in sorted({r["model"] for r in summary}):
        best: Dict[int, Tuple[float, Dict[str, str]]] = {}
        for r in measured(summary):
            n, s = int(r["nodes"]), int(r["samples"])
            if r["model"] == model and s >= n:
                v = float(r["decode_tokens_per_s_median"])
                if n not in best or v > best[n][0]:
                    best[n] = (v, r)
        ns = sorted(best)
        parts = ["%d node%s %.2f tok/s (S=%s, %s%s%s)" % (n, "s" if n > 1 else "", best[n][0], best[n][1]["samples"],
                                                           best[n][1]["partition"], _batch_note(best[n][1]),
                                                           _active_note(best[n][1], n))
                 for n in ns]
        missing = sorted({int(r["nodes"]) for r in summary if r["model"] == model} - set(best))
        parts += ["%d node%s: no complete run (%s)" % (n, "s" if n > 1 else "", incomplete(
            [r for r in summary if r["model"] == model and int(r["nodes"]) == n]) or "none with S >= N")
                  for n in missing]
        if not ns:
            verdict = "no node count measured"
        elif len(ns) < 2:
            verdict = "one node count only" if not missing else "one node count measured"
        elif all(best[a][0] < best[b][0] for a, b in zip(ns, ns[1:])):
            verdict = "rises with N"
        else:
            verdict = "does NOT rise with N"
        lines.append("- %s: %s: %s" % (model, "; ".join(parts), verdict))
    return lines


def _active_note(row: Dict[str, str], n: int) -> str:
    """Where an auto ring's planner left nodes out: on how many the figure was measured (an
    N-node figure from fewer nodes had read as N nodes' scaling)."""
    active = row.get("active_nodes") or ""
    return "" if active in ("", str(n)) else ", computed on %s of the %d nodes: the planner left the others out" % (
        active, n)


def _batch_note(row: Dict[str, str]) -> str:
    mb = row.get("max_batch") or ""
    return ", %s" % batch_label(mb) if mb else ""


def batching_lines(summary: List[Dict[str, str]]) -> List[str]:
    """Per ring run both unbatched (max_batch 1) and batched: each batched max_batch at S = 4N
    (else at its best S) against the unbatched runs at the same S and the best unbatched S
    (issue 16: batched S = 4N >= 2x unbatched at the same S and >= 1.5x the best unbatched)."""
    lines = []

    def rate(r: Dict[str, str]) -> float:
        return float(r["decode_tokens_per_s_median"])
    for model in sorted({r["model"] for r in summary}):
        mrows = [r for r in measured(summary) if r["model"] == model]
        for n, part in rings_of(mrows):
            ring = [r for r in mrows if int(r["nodes"]) == n and r["partition"] == part]
            unbatched = {int(r["samples"]): r for r in ring if max_batch_of(r) == UNBATCHED}
            if not unbatched:
                continue
            best_u = max(unbatched.values(), key=rate)
            for mb in batches_of(ring):
                if mb in ("", UNBATCHED):
                    continue
                batched = {int(r["samples"]): r for r in ring if max_batch_of(r) == mb}
                s = 4 * n if 4 * n in batched else max(batched, key=lambda k: rate(batched[k]))
                b = batched[s]
                same = ("%.2fx unbatched at the same S" % (rate(b) / rate(unbatched[s]))
                        if s in unbatched and rate(unbatched[s]) > 0 else "no unbatched run at this S")
                best = "%.2fx the best unbatched (%.2f tok/s at S=%d)" % (
                    rate(b) / rate(best_u) if rate(best_u) > 0 else float("nan"), rate(best_u), int(best_u["samples"]))
                lines.append("- %s N=%d %s %s: S=%d%s %.2f tok/s = %s, %s" % (
                    model, n, part, batch_label(mb), s, " (4N)" if s == 4 * n else "", rate(b), same, best))
    return lines


def write_report(path: str, summary: List[Dict[str, str]], machine: Dict[str, Any]) -> None:
    """A Markdown digest of summary.csv: scaling check and one table per model."""
    lines = ["# %s" % machine.get("experiment", {}).get("name", "experiment"), ""]
    if machine.get("interrupted"):
        lines += ["**Interrupted**: %s of %s runs made; every figure below is from those only." % (
            machine.get("runs", "?"), machine.get("runs_planned", "?")), ""]
    lines += [machine_line(machine), ""]
    emu = machine.get("emulation", {}).get("summary")
    if emu:
        lines += [emu, ""]
    start, end = machine.get("loadavg_start"), machine.get("loadavg_end")
    if start and end:
        lines += ["Load average (1/5/15 min) at start %s, at end %s; %s CPUs." % (
            "/".join("%.2f" % x for x in start), "/".join("%.2f" % x for x in end), machine.get("cpu_count")), ""]
    caution = caution_line(machine, summary)
    if caution:
        lines += [caution, ""]
    left_out = incomplete(summary)
    if left_out:  # never averaged in, never unsaid
        lines += ["Runs left out of every number below: %s (results.csv says why; a run some of whose samples "
                  "stopped early did not decode its S samples throughout)." % left_out, ""]
    lines += ["Best decode throughput with S >= N samples in flight (median of repeats):", ""]
    lines += scaling_lines(summary) + [""]
    batching = batching_lines(summary)
    if batching:
        lines += ["Batched against unbatched decode throughput (median of repeats):", ""] + batching + [""]
    for model in sorted({r["model"] for r in summary}):
        lines += _model_table(model, [r for r in summary if r["model"] == model])
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def caution_line(machine: Dict[str, Any], summary: Sequence[Dict[str, str]] = ()) -> str:
    """A warning above the verdicts where they rest on little: fewer than 3 complete runs of a
    figure (no spread to see: few repeats, or a sweep cut short, or runs that failed), or a
    machine busier than its cores (a 1-minute load average past the CPU count at the start or
    the end: others' work in every figure). '' where neither."""
    made = [int(r["runs_ok"]) for r in measured(list(summary)) if (r.get("runs_ok") or "").isdigit()]
    repeats = min(made) if made else (machine.get("experiment") or {}).get("repeats")
    cpus = machine.get("cpu_count") or 0
    loads = [x[0] for x in (machine.get("loadavg_start"), machine.get("loadavg_end")) if x]
    why = []
    if isinstance(repeats, int) and repeats < 3:
        why.append("%d complete run%s of a figure (no spread to judge noise by)"
                   % (repeats, "" if repeats == 1 else "s"))
    if cpus and loads and max(loads) > cpus:
        why.append("a 1-minute load of %.1f on %d CPUs (other work shared them)" % (max(loads), cpus))
    return "**Caution**: %s; read the figures below as indications, not results." % " and ".join(why) if why else ""


def machine_line(machine: Dict[str, Any]) -> str:
    """Where the figures were measured: the CPU, the instruction sets torch and ggml use on it,
    the libraries' versions and the commit (machine.json has the rest)."""
    cpu = machine.get("cpu") or {}
    ggml = machine.get("ggml", "?")
    features = machine.get("ggml_cpu_features")
    commit = (machine.get("git_commit") or "?")[:12] + (" (modified)" if machine.get("git_dirty") else "")
    return "Machine: %s (%s, %s CPUs); torch %s (ISA %s); ggml %s (%s); mdi %s, commit %s." % (
        machine.get("cpu_model", "?"), machine.get("machine", "?"), machine.get("cpu_count", "?"),
        machine.get("torch", "not installed"), cpu.get("isa", "?"), ggml,
        " ".join(features) if features else "no CPU features read", machine.get("mdi", "?"), commit)


def _model_table(model: str, rows: List[Dict[str, str]]) -> List[str]:
    samples = sorted({int(r["samples"]) for r in rows})
    out = ["## %s" % model, "",
           "Decode tokens/s, median [min-max] of repeats, and pipeline efficiency "
           "(S-sample rate / (N x 1-sample rate), same ring and max_batch, paired by repeat).", "",
           "| nodes | partition | max_batch | backends | " + " | ".join("S=%d" % s for s in samples) + " |",
           "|---|---|---|---|" + "---|" * len(samples)]
    for n, part, mb in series_of(rows):
        cells = []
        series = [r for r in rows if int(r["nodes"]) == n and r["partition"] == part and max_batch_of(r) == mb]
        backends = backends_of(series)
        for s in samples:
            r = next((r for r in rows if int(r["nodes"]) == n and r["partition"] == part and max_batch_of(r) == mb
                      and int(r["samples"]) == s), None)
            if r is None:
                cells.append("")
                continue
            if not r.get("decode_tokens_per_s_median"):
                cells.append("no complete run (%s)" % incomplete([r]))
                continue
            cell = "%s [%s-%s]" % tuple(_rounded(r["decode_tokens_per_s_%s" % k]) for k in ("median", "min", "max"))
            if r["efficiency_median"] and n > 1:
                cell += " eff %.2f" % float(r["efficiency_median"])
            cells.append(cell)
        out.append("| %d | %s | %s | %s | %s |" % (n, part, mb or "-", backends or "-", " | ".join(cells)))
    return out + [""]


def _rounded(cell: str) -> str:
    """A CSV number to 2 decimals, rounded (its last digit had been cut: 39.086 read 39.08)."""
    return "%.2f" % float(cell) if cell else ""
