"""Running a whole experiment: every ring of every model, repeats interleaved, with progress,
a state file for --cleanup, and the outputs at the end.

Run order: for each model, every ring (node count x partition) is started once and kept up;
then repeat by repeat, ring by ring, samples ascending, each S once per max_batch value. Interleaving the repeats across rings
spreads a noisy neighbour's load over every configuration instead of one. With one repeat
there is nothing to interleave: each ring is started, run and stopped before the next (a
`partitions: [all]` sweep has hundreds of rings, too many to keep up at once).
"""
import json
import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from mdi.system.files import write_json
from mdi.lab.commands import command_text
from mdi.lab.emulation import Emulation, remove_leftovers
from mdi.model.backend import default_backend
from mdi.lab.model_setup import gguf_model, gguf_weigher, sweep_model, weight_bytes, weight_types
from mdi.lab.nodes import STARTER_SERVICE_MODULE, Ring, RunOutcome, read_json
from mdi.lab.report import (CSV_COLUMNS, INTERRUPTED, SUMMARY_COLUMNS, machine_record, make_row, read_rows, summarize,
                            write_csv)
from mdi.lab.report_md import batching_lines, scaling_lines, write_report
from mdi.cli.process import EXIT_RUN
from mdi.lab.spec import (Experiment, ExperimentError, RingPlan, check_node_lists, max_batches, plan_rings,
                          samples_for)


# --------------------------------------------------------------------------- progress

class Progress:
    """Which run, how many left, and an estimate from the seconds per sample-token measured
    so far on the same model (plus what is left of the rings' start-ups)."""

    def __init__(self, plan: List[Tuple[str, int]], log: Callable[[str], None]) -> None:
        self.plan = plan  # (model, samples x tokens) per run, in order
        self.log = log
        self.done = 0
        self.t0 = time.monotonic()
        self.spent: Dict[str, List[float]] = {}  # model -> [seconds, work]

    def begin(self, text: str) -> None:
        left = len(self.plan) - self.done
        self.log("mdi-bench: [%d/%d] %s  (%s elapsed, %d run%s left%s)"
                 % (self.done + 1, len(self.plan), text, _duration(time.monotonic() - self.t0), left,
                    "" if left == 1 else "s", self._eta()))

    def end(self, model: str, work: int, seconds: float) -> None:
        s = self.spent.setdefault(model, [0.0, 0.0])
        s[0] += seconds
        s[1] += work
        self.done += 1

    def _eta(self) -> str:
        total = [sum(v[0] for v in self.spent.values()), sum(v[1] for v in self.spent.values())]
        if not total[1]:
            return ""
        eta = 0.0
        for model, work in self.plan[self.done:]:
            seconds, done_work = self.spent.get(model) or total
            eta += work * seconds / done_work if done_work else 0.0
        return ", ~%s to go" % _duration(eta)


def _duration(s: float) -> str:
    s = int(round(s))
    return "%dm%02ds" % (s // 60, s % 60) if s >= 60 else "%ds" % s


# --------------------------------------------------------------------------- the plan

def plan_sweep(exp: Experiment, log: Callable[[str], None], build: bool = True) -> List[List[RingPlan]]:
    """The rings of every model, models built or found (build=False: nothing is written);
    every error names the key before anything runs."""
    check_node_lists(exp)  # before any model is built
    plans, index = [], 0
    for i, entry in enumerate(exp.models):
        where = "%s: models[%d]" % (exp.source, i)
        path, config, local, quant = sweep_model(entry, where, exp.source, log, build)
        source = gguf_model(path, where)  # (one read of its GGUF: the types and each node's bytes)
        stored, weigh_gguf = weight_types(source, quant, config), gguf_weigher(source)
        if entry.asked_backend == "ggml" and source is None and not (entry.random or {}).get("gguf"):
            # (every run had started its ring, then failed: said before any runs)
            raise ExperimentError("%s.backend: ggml computes the model's GGUF and %s has none (give random.gguf: TYPE, "
                                  "or prepare it with mdi-prepare)" % (where, path))
        rings = []
        def weigh(counts: List[int], config: Any = config, entry: Any = entry, quant: Any = quant) -> List[int]:
            return weight_bytes(config, counts, entry.dtype, quant)
        for n, counts, kind in plan_rings(entry, where, config.n_layer):
            samples = samples_for(entry.samples, n)
            if not samples:  # (a ring with nothing to run had been started, then left out of every output)
                raise ExperimentError("%s.samples: no sample count for the %d-node ring (%s at N=%d)"
                                      % (where, n, ", ".join(str(s) for s in entry.samples), n))
            rings.append(RingPlan(index, entry, path, n, counts, kind, samples,
                                  local, weigh(counts), max_batches(entry.max_batch), weigh, stored, weigh_gguf))
            index += 1
        plans.append(rings)
    return plans


def over_limit(plans: List[List[RingPlan]], limit: Callable[[int], Optional[int]]) -> List[str]:
    """The nodes whose weights alone (at their quantized size) exceed their board's memory
    (`limit` of the node index: bytes, None: no limit): mdi-start or the worker should refuse
    those runs, naming what they need, else the kernel kills them. Auto rings are left out:
    their counts are not known yet, and the planner fits them to each board's memory."""
    lines = []
    for p in (p for rings in plans for p in rings if p.kind != "auto"):
        for k, nbytes in enumerate(p.weights):
            board = limit(k)
            if board is not None and nbytes > board:
                lines.append("%s N=%d %s: node %d's weights are %.0f MB, over the %.0f MB of memory of an emulated "
                             "board" % (p.model.name, p.n_nodes, p.label, k, nbytes / 2 ** 20, board / 2 ** 20))
    return lines


def run_list(exp: Experiment, plans: List[List[RingPlan]]) -> List[Tuple[str, int]]:
    """(model, work) per run; work = sample-tokens x weight bytes, a proxy for its compute
    that lets the estimate carry over from one model to the next."""
    return [(p.model.name, p.work(s)) for rings in plans for _ in range(exp.repeats) for p in rings
            for _, s in p.runs()]


def run_file_name(p: RingPlan, samples: int, max_batch: Any, repeat: int) -> str:
    """runs/<name>: one metrics record per (ring, max_batch, samples, repeat)."""
    return "%s_n%d_%s_b%s_s%d_r%d.json" % (p.model.name, p.n_nodes, p.label.replace("+", "-"), max_batch, samples,
                                           repeat)


# --------------------------------------------------------------------------- the sweep

class Sweep:
    def __init__(self, exp: Experiment, out: str, log: Callable[[str], None]) -> None:
        self.exp, self.out, self.log = exp, out, log
        self.runs_dir = os.path.join(out, "runs")
        self.csv_path = os.path.join(out, "results.csv")
        self.rows: List[Dict[str, str]] = []
        self.planned = 0  # runs the sweep meant to make (machine.json's runs_planned)
        self.rings: List[Ring] = []
        # No shared secret by default: nodes listen on loopback or on the private namespace
        # network made here. auth: true turns it on (signed control requests, zmq CURVE on every link).
        self.token = secrets.token_hex(16) if exp.auth else None
        self.work = tempfile.mkdtemp(prefix="mdi-bench-")
        self.emu = Emulation(exp.emulation, max(max(m.nodes) for m in exp.models), log)
        self.state_path = os.path.join(tempfile.gettempdir(), "mdi-bench-state-%d.json" % os.getpid())
        self.failed = 0

    def prepare(self) -> List[List[RingPlan]]:
        return plan_sweep(self.exp, self.log)

    # --- running ---------------------------------------------------------------------
    def run(self, plans: List[List[RingPlan]]) -> None:
        os.makedirs(self.runs_dir, exist_ok=True)
        self.emu.start()
        self._save_state()
        self.log("mdi-bench: " + self.emu.describe())
        # a node without a quota runs one torch thread: one core
        cores = [self.exp.emulation.cpu_quota_of(k) for k in range(self.emu.max_nodes)]
        total = sum(1.0 if c is None else c for c in cores)
        if self.emu.active("cpu") and total > (os.cpu_count() or 1):
            self.log("mdi-bench: warning: %d nodes with %s cores = %.2f > %d CPUs: nodes will compete for CPUs"
                     % (self.emu.max_nodes, "+".join("-" if c is None else "%g" % c for c in cores), total,
                        os.cpu_count() or 1))
        self._warn_over_limit(plans)
        runs = run_list(self.exp, plans)
        self.planned = len(runs)
        progress = Progress(runs, self.log)
        write_csv(self.csv_path, CSV_COLUMNS, [])
        for rings in plans:
            self._run_model(rings, progress)

    def _warn_over_limit(self, plans: List[List[RingPlan]]) -> None:
        for line in over_limit(plans, self.emu.memory_limit_bytes):
            self.log("mdi-bench: warning: " + line)

    def _run_model(self, plans: List[RingPlan], progress: Progress) -> None:
        if self.exp.repeats == 1:  # nothing to interleave: one ring up at a time
            self.log("mdi-bench: %d ring(s) for %s, one at a time" % (len(plans), plans[0].model.name))
            for p in plans:
                self._run_rings([p], progress)
            return
        self.log("mdi-bench: starting %d ring(s) for %s" % (len(plans), plans[0].model.name))
        self._run_rings(plans, progress)

    def _run_rings(self, plans: List[RingPlan], progress: Progress) -> None:
        """Start these rings together, run every repeat of each, interleaved, and stop them."""
        self.rings = [Ring(p, self.exp, self.emu, self.token, self.work, self.log) for p in plans]
        try:
            for ring in self.rings:
                ring.start()
                self._save_state()
            for ring in self.rings:
                ring.wait_ready(self.exp.start_timeout)
                ring.limit()  # from here on every node runs under its quota
                if self.exp.warmup:
                    ring.run(1, min(4, ring.plan.model.tokens), os.path.join(self.work, "warmup.json"),
                             ring.plan.max_batch[0])
            for repeat in range(1, self.exp.repeats + 1):
                for ring in self.rings:
                    for max_batch, s in ring.plan.runs():
                        self._one_run(ring, s, max_batch, repeat, progress)
        finally:
            self._stop_rings()

    def _one_run(self, ring: Ring, samples: int, max_batch: Any, repeat: int, progress: Progress) -> None:
        p = ring.plan
        batch = " max_batch %s" % max_batch if len(p.max_batch) > 1 else ""
        progress.begin("%s N=%d %s S=%d%s repeat %d/%d" % (p.model.name, p.n_nodes, p.label, samples, batch, repeat,
                                                          self.exp.repeats))
        name = run_file_name(p, samples, max_batch, repeat)
        try:
            outcome = ring.run(samples, p.model.tokens, os.path.join(self.runs_dir, name), max_batch)
        except KeyboardInterrupt:  # the run in hand gets its row too, naming what its starter wrote of it
            row = make_row(self.exp, p, samples, repeat, RunOutcome(130, None, None, [], [], os.getloadavg()[0], 0.0),
                           self.emu.tag_for_csv(), "", max_batch)
            if os.path.exists(os.path.join(self.runs_dir, name)):
                row["metrics_file"] = os.path.join("runs", name)
            self._add_row(row, INTERRUPTED)
            raise
        row = self._add_row(make_row(self.exp, p, samples, repeat, outcome, self.emu.tag_for_csv(),
                                     os.path.join("runs", name), max_batch))
        progress.end(p.model.name, p.work(samples), outcome.wall_s)
        if row["status"].startswith("ok"):
            self.log("mdi-bench:     %s tok/s decode, %s tok/s overall, ttft %s s, %.1f s wall"
                     % (row["decode_tokens_per_s"], row["tokens_per_s"], row["ttft_s"], outcome.wall_s))
        else:
            self.failed += 1
            self.log("mdi-bench:     %s" % row["status"])

    def _add_row(self, row: Dict[str, str], status: Optional[str] = None) -> Dict[str, str]:
        if status is not None:
            row["status"] = status
        self.rows.append(row)
        write_csv(self.csv_path, CSV_COLUMNS, self.rows)  # rewritten each run: an interrupted sweep keeps its rows
        return row

    def _stop_rings(self) -> None:
        for ring in self.rings:
            self._keep_profiles(ring)
            try:
                ring.stop()
            except Exception as e:  # keep stopping the others; report what went wrong
                self.log("mdi-bench: warning: stopping ring %d: %s" % (ring.plan.index, e))
        self.rings = []
        self.emu.clear_delays()
        self._save_state()

    def _keep_profiles(self, ring: Ring) -> None:
        """An auto ring's node profiles go with the results: what its plans were made from."""
        cache = os.path.join(ring.profile_cache or "", "profiles.json")
        if ring.profile_cache and os.path.exists(cache):
            os.makedirs(os.path.join(self.out, "profiles"), exist_ok=True)
            shutil.copyfile(cache, os.path.join(self.out, "profiles", "%s-ring%d.json"
                                                % (ring.plan.model.name, ring.plan.index)))

    # --- state file and teardown -----------------------------------------------------
    def _save_state(self) -> None:
        """What exists, so `mdi-bench --cleanup` can remove it if this process is killed."""
        # each with its start time: a PID the system gave to another process since is not ours
        pids = [[p.pid, process_started(p.pid)] for r in self.rings for p in r.processes() if p is not None]
        state = {"pid": os.getpid(), "children": pids, "work": self.work}
        state.update(self.emu.resources())
        with open(self.state_path, "w") as f:
            json.dump(state, f)

    def close(self, keep_work: bool) -> None:
        self._stop_rings()
        for problem in self.emu.close():
            self.log("mdi-bench: warning: teardown: %s" % problem)
        if os.path.exists(self.state_path):
            os.remove(self.state_path)
        if keep_work:
            self.log("mdi-bench: node logs kept in %s" % self.work)
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def finish_outputs(out: str, machine: Dict[str, Any], log: Callable[[str], None]) -> None:
    """summary.csv, report.md and the PNGs from results.csv (also what --plot-only does)."""
    rows = read_rows(os.path.join(out, "results.csv"))
    summary = summarize(rows)
    write_csv(os.path.join(out, "summary.csv"), SUMMARY_COLUMNS, summary)
    write_report(os.path.join(out, "report.md"), summary, machine)
    from mdi.lab import plots
    for path in plots.plot_all(out, rows, summary):
        log("mdi-bench: wrote %s" % path)
    for line in scaling_lines(summary) + batching_lines(summary):
        log("mdi-bench: " + line[2:])


# What a sweep writes in its output folder (and its plots' PNGs): an earlier sweep's are moved aside
SWEEP_OUTPUTS = ("results.csv", "summary.csv", "report.md", "machine.json", "experiment.yaml", "runs", "profiles")


def keep_earlier_sweep(out: str, log: Callable[[str], None]) -> None:
    """Move an earlier sweep's outputs in `out` into out/previous-TIME/: a new sweep rewrites
    results.csv from its first run, and one stopped early had left the old report describing
    rows that were gone."""
    names = [n for n in sorted(os.listdir(out)) if n in SWEEP_OUTPUTS or n.endswith(".png")]
    if not names:
        return
    aside = os.path.join(out, "previous-" + time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(aside):  # two sweeps in one second
        aside = tempfile.mkdtemp(prefix=os.path.basename(aside) + "-", dir=out)
    else:
        os.makedirs(aside)
    for name in names:
        os.rename(os.path.join(out, name), os.path.join(aside, name))
    log("mdi-bench: %s held an earlier sweep's results: moved to %s" % (out, aside))


def run_experiment(exp: Experiment, out: str, log: Callable[[str], None]) -> int:
    try:
        os.makedirs(out, exist_ok=True)
        keep_earlier_sweep(out, log)
        shutil.copyfile(exp.source, os.path.join(out, "experiment.yaml"))
    except OSError as e:  # (a folder that cannot be made, /proc/x: a traceback)
        raise ExperimentError("%s: cannot write the results there: %s" % (out, e.strerror or e))
    machine = machine_record(exp.source)
    machine["experiment"] = {"name": exp.name, "description": exp.description, "repeats": exp.repeats,
                             "starter": exp.starter, "temperature": exp.temperature,
                             # as run: experiment.yaml is the file as written (--backend overrides it)
                             "backends": sorted({m.backend or "default (%s)" % default_backend() for m in exp.models})}
    sweep = Sweep(exp, out, log)
    interrupted = False
    try:
        plans = sweep.prepare()
        sweep.run(plans)
    except KeyboardInterrupt:
        interrupted = True
        log("mdi-bench: interrupted; stopping the nodes and removing the emulation")
    finally:
        machine["emulation"] = sweep.emu.record()
        sweep.close(keep_work=interrupted or sweep.failed > 0)
    made = sum(r["status"] != INTERRUPTED for r in sweep.rows)  # (the run a Ctrl-C cut short was not made)
    machine.update(time_end=time.strftime("%Y-%m-%d %H:%M:%S %z"), loadavg_end=list(os.getloadavg()),
                   uptime_end=command_text(["uptime"]), runs=made, runs_failed=sweep.failed,
                   runs_planned=sweep.planned, interrupted=interrupted)
    write_json(os.path.join(out, "machine.json"), machine)
    if made:
        finish_outputs(out, machine, log)
    if interrupted:
        return 130
    return EXIT_RUN if sweep.failed else 0


def dry_run(exp: Experiment, log: Callable[[str], None]) -> int:
    """Check the file and list the runs; writes nothing (no models, no output, no work folder)."""
    plans = plan_sweep(exp, log, build=False)
    for rings in plans:
        for p in rings:
            log("%s: %d node(s), partition %s (%s), samples %s, max_batch %s, %d tokens, %d repeats, backend %s"
                % (p.model.name, p.n_nodes, p.label, p.kind, p.samples,
                   ", ".join(str(b) for b in p.max_batch), p.model.tokens, exp.repeats, p.model.asked_backend))
    on = exp.emulation.mode != "off"
    for line in over_limit(plans, lambda k: exp.emulation.memory_limit_of(k) if on else None):
        log("warning: " + line)
    n = len(run_list(exp, plans))
    log("%d run%s in all" % (n, "" if n == 1 else "s"))
    return 0


def cleanup_stale(log: Callable[[str], None]) -> int:
    """Remove what killed mdi-bench processes left: their node processes (by the PIDs they
    recorded, and only if still an mdi process), namespaces, bridge and cgroups."""
    base = tempfile.gettempdir()
    found = 0
    for name in sorted(os.listdir(base)):
        m = re.fullmatch(r"mdi-bench-state-(\d+)\.json", name)
        if not m or os.path.exists("/proc/%s" % m.group(1)):
            continue
        found += 1
        state = read_json(os.path.join(base, name)) or {}
        for child in state.get("children") or []:
            pid, started = child if isinstance(child, list) else (child, None)  # [pid, start] since 2026-12
            if _is_mdi_process(pid) and (started is None or process_started(pid) == started):
                os.kill(pid, signal.SIGKILL)
                log("mdi-bench: killed leftover node process %d" % pid)
        time.sleep(0.5)
        for problem in remove_leftovers(state):
            log("mdi-bench: warning: %s" % problem)
        if state.get("work"):
            shutil.rmtree(state["work"], ignore_errors=True)
        os.remove(os.path.join(base, name))
    log("mdi-bench: cleaned up after %d stale run(s)" % found)
    return 0


def process_started(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field); None if gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # after the command's name, which may hold spaces
    except (OSError, IndexError, ValueError):
        return None


def _is_mdi_process(pid: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"mdi-worker" in cmd or STARTER_SERVICE_MODULE.encode() in cmd or b"mdi-start" in cmd
