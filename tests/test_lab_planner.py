"""mdi-bench for the layer planner (issue 17): heterogeneous emulated boards (cpu_quota and
memory_limit_mb per node index), partitions auto / all / partition_step, the plan columns of
results.csv, and scripts/plot_planner.py. No root, no node processes."""
import csv
import importlib.util
import json
import os

import pytest
import yaml

from mdi.lab.emulation import Emulation, EmulationSettings, per_node_text
from mdi.lab.nodes import Ring, RunOutcome
from mdi.lab.report import CSV_COLUMNS, make_row, write_csv
from mdi.lab.spec import ExperimentError, all_splits, parse_experiment, plan_rings
from mdi.lab.sweep import over_limit, plan_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANNER = os.path.join(ROOT, "configs", "experiments", "planner.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = {"family": "llama", "n_layer": 6, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "intermediate_size": 64,
        "block_size": 64, "seed": 0}


def parse(extra=None, model=None):
    data = {"models": [dict({"name": "m", "path": "models/m"}, **(model or {}))]}
    data.update(extra or {})
    return parse_experiment(data, "x.yaml")


def _error(extra=None, model=None):
    with pytest.raises(ExperimentError) as e:
        parse(extra, model)
    assert "\n" not in str(e.value)
    return str(e.value)


# --------------------------------------------------------------------------- per-node emulation

def test_per_node_emulation_lists_parse():
    exp = parse({"nodes": [1, 3], "emulation": {"cpu_quota": [1, 0.5, 0.25], "memory_limit_mb": [None, 448, 2048]}})
    s = exp.emulation
    assert s.cpu_quota == [1, 0.5, 0.25] and s.memory_limit_mb == [None, 448, 2048]
    assert [s.cpu_quota_of(k) for k in range(3)] == [1, 0.5, 0.25]
    assert [s.memory_limit_of(k) for k in range(3)] == [None, 448 * 2 ** 20, 2048 * 2 ** 20]
    assert s.wants_cpu() and s.wants_memory() and s.node_lists() == {"cpu_quota": 3, "memory_limit_mb": 3}
    # one number is every node's, as before
    s = parse({"emulation": {"cpu_quota": 0.5, "memory_limit_mb": 1024}}).emulation
    assert (s.cpu_quota_of(2), s.memory_limit_of(2), s.node_lists()) == (0.5, 2 ** 30, {})
    # a list longer than the rings is fine; all null asks for nothing
    s = parse({"nodes": [2], "emulation": {"cpu_quota": [1, 1, 1, 1], "memory_limit_mb": [None, None]}}).emulation
    assert s.wants_cpu() and not s.wants_memory()


@pytest.mark.parametrize("emulation, needle", [
    ({"cpu_quota": [1, 0]}, "x.yaml: emulation.cpu_quota[1]: expected cores per node between 0.01 and 64 (or null: "
                            "no limit), got 0"),
    ({"cpu_quota": [1, 65]}, "emulation.cpu_quota[1]: expected cores per node between 0.01 and 64"),
    ({"cpu_quota": [1, "half"]}, "emulation.cpu_quota[1]: expected cores per node"),
    ({"cpu_quota": [True]}, "emulation.cpu_quota[0]"),
    ({"cpu_quota": []}, "emulation.cpu_quota: expected a number or a list with one per node"),
    ({"cpu_quota": 0}, "emulation.cpu_quota: expected cores per node between 0.01 and 64, got 0"),
    ({"cpu_quota": "half"}, "emulation.cpu_quota: expected an integer or a number or a list"),
    ({"memory_limit_mb": [2048, 32]}, "emulation.memory_limit_mb[1]: expected at least 64 MB (or null: no limit), "
                                      "got 32"),
    ({"memory_limit_mb": [512.5]}, "emulation.memory_limit_mb[0]: expected at least 64 MB"),
    ({"memory_limit_mb": 32}, "emulation.memory_limit_mb: expected at least 64 MB, got 32"),
])
def test_per_node_emulation_errors_name_the_key(emulation, needle):
    assert needle in _error({"nodes": [2], "emulation": emulation})


def test_a_list_shorter_than_a_ring_is_refused_before_anything_runs(tmp_path):
    msg = _error({"nodes": [1, 3], "emulation": {"cpu_quota": [1, 0.5]}})
    assert msg == ("x.yaml: emulation.cpu_quota: 2 entries (one per node index) but models[0] (m) has rings of "
                   "3 nodes")
    msg = _error({"emulation": {"memory_limit_mb": [512]}}, {"nodes": [2]})
    assert "emulation.memory_limit_mb: 1 entry (one per node index)" in msg and "rings of 2 nodes" in msg
    # the plan checks again (an experiment changed after parsing): before any model is built
    exp = parse({"nodes": [2], "emulation": {"cpu_quota": [1, 0.5]}},
                {"path": str(tmp_path / "tiny"), "random": TINY})
    exp.models[0].nodes = [3]
    with pytest.raises(ExperimentError, match=r"emulation\.cpu_quota: 2 entries .* rings of 3 nodes"):
        plan_sweep(exp, lambda m: None)
    assert not (tmp_path / "tiny").exists()


class FakeGroups:
    """CpuCgroups / MemoryCgroups without root: records what would be written."""

    base = "/fake"

    def __init__(self):
        self.quota, self.limit, self.groups = {}, {}, []

    def create(self, key):
        self.groups.append(key)

    def set_quota(self, key, cores, period_us=None):
        self.quota[key] = cores

    def set_limit(self, key, nbytes):
        self.limit[key] = nbytes

    def procs_file(self, key):
        return "/fake/%s/cgroup.procs" % key


def test_each_node_gets_its_own_quota_and_memory_limit():
    settings = EmulationSettings(mode="auto", cpu_quota=[1.0, 0.5, 0.25], cpu_period_us=10000,
                                 memory_limit_mb=[None, 448, 1024])
    emu = Emulation(settings, 3)
    emu.cpu, emu.memory = FakeGroups(), FakeGroups()
    emu.status = {"cpu": "on: x", "memory": "on: y", "network": "off: not asked for"}
    keys = ["g0k%d" % k for k in range(3)]
    for k, key in enumerate(keys):
        emu.prepare_process(key, k)
    assert emu.cpu.quota == {key: None for key in keys}  # no quota while loading
    assert emu.memory.limit == {"g0k0": None, "g0k1": 448 * 2 ** 20, "g0k2": 2 ** 30}
    for k, key in enumerate(keys):
        emu.limit_cpu(key, True, k)
    assert emu.cpu.quota == {"g0k0": 1.0, "g0k1": 0.5, "g0k2": 0.25}
    assert [emu.memory_limit_bytes(k) for k in range(3)] == [None, 448 * 2 ** 20, 2 ** 30]
    assert emu.tag_for_csv() == "cpu=1/0.5/0.25core;mem=-/448/1024MB"
    rec = emu.record()["settings"]
    assert rec["cpu_quota_cores"] == [1.0, 0.5, 0.25] and rec["memory_limit_mb"] == [None, 448, 1024]
    # one value: every node the same, the tag as before
    emu = Emulation(EmulationSettings(cpu_quota=0.5, memory_limit_mb=2048), 3)
    emu.cpu, emu.memory = FakeGroups(), FakeGroups()
    emu.status = {"cpu": "on: x", "memory": "on: y"}
    emu.prepare_process("a", 2)
    emu.limit_cpu("a", True, 2)
    assert (emu.cpu.quota["a"], emu.memory.limit["a"], emu.tag_for_csv()) == (0.5, 2 ** 31, "cpu=0.5core;mem=2048MB")
    assert emu.memory_limit_bytes(1) == 2 ** 31


def test_cpu_status_says_each_nodes_quota(monkeypatch):
    from mdi.lab import emulation
    monkeypatch.setattr(emulation, "CpuCgroups", lambda tag, parent: FakeGroups())
    monkeypatch.setattr(emulation, "own_cpu_cgroup", lambda: "/fake")
    emu = Emulation(EmulationSettings(cpu_quota=[1.0, 0.5, 0.25], cpu_period_us=10000), 3)
    assert emu._start_cpu() == ("1.00/0.50/0.25 core per node index (cgroup v1 cpu.cfs_quota_us 10000/5000/2500 / "
                                "cpu.cfs_period_us 10000)")
    assert per_node_text([None, 448], "%d") == "-/448" and per_node_text(0.5) == "0.5"
    # A quota under the kernel's 1 ms lengthens that node's period and keeps its share.
    emu = Emulation(EmulationSettings(cpu_quota=[1.0, 0.05], cpu_period_us=10000), 2)
    assert emu._start_cpu() == ("1.00/0.05 core per node index (cgroup v1 cpu.cfs_quota_us 10000/1000 / "
                                "cpu.cfs_period_us 10000/20000)")


def test_quota_and_period_keep_the_share_above_the_kernel_minimum():
    from mdi.lab.cgroups import quota_and_period
    assert quota_and_period(0.5, 10000) == (5000, 10000)
    assert quota_and_period(0.1, 10000) == (1000, 10000)
    assert quota_and_period(0.05, 10000) == (1000, 20000)  # not 1000 / 10000: 0.1 core
    assert quota_and_period(0.03, 10000) == (1000, 33334)
    assert quota_and_period(2.0, 10000) == (20000, 10000)


# --------------------------------------------------------------------------- partitions

def test_auto_and_all_partitions():
    m = parse(model={"nodes": [1, 2, 3], "partitions": ["auto", "balanced", "all"]}).models[0]
    rings = plan_rings(m, "x.yaml: models[0]", 6)
    assert rings[:2] == [(1, [6], "auto"), (1, [6], "balanced")]
    two = [r for r in rings if r[0] == 2]
    assert two == [(2, [3, 3], "auto"), (2, [3, 3], "balanced"), (2, [1, 5], "explicit"), (2, [2, 4], "explicit"),
                   (2, [4, 2], "explicit"), (2, [5, 1], "explicit")]
    three = [r for r in rings if r[0] == 3]
    assert len(three) == 2 + 10 - 1 and three[0] == (3, [2, 2, 2], "auto")
    # `all` first: the balanced split it makes is still the balanced ring (kind), once
    m = parse(model={"nodes": [2], "partitions": ["all", "balanced", [2, 4]]}).models[0]
    assert plan_rings(m, "w", 6) == [(2, [1, 5], "explicit"), (2, [2, 4], "explicit"), (2, [3, 3], "balanced"),
                                     (2, [4, 2], "explicit"), (2, [5, 1], "explicit")]


def test_all_splits_in_steps():
    assert all_splits(6, 2, 2) == [[2, 4], [4, 2]]
    assert all_splits(30, 3, 3)[0] == [3, 3, 24] and len(all_splits(30, 3, 3)) == 36
    assert all(sum(c) == 30 and all(x % 5 == 0 and x > 0 for x in c) for c in all_splits(30, 3, 5))
    m = parse(model={"nodes": [3], "partitions": ["all"], "partition_step": 2}).models[0]
    assert [c for _, c, _ in plan_rings(m, "w", 6)] == [[2, 2, 2]]
    assert parse({"partition_step": 5}).models[0].partition_step == 5  # a default for every model


@pytest.mark.parametrize("model, needle", [
    ({"partitions": ["best"]}, "models[0].partitions[0]: expected 'balanced', 'auto', 'all' or a list of layer counts"),
    ({"partitions": [["all"]]}, "models[0].partitions[0]"),
    ({"partition_step": 0}, "models[0].partition_step: expected a positive integer (layers), got 0"),
    ({"partition_step": "2"}, "models[0].partition_step: expected an integer"),
])
def test_partition_key_errors(model, needle):
    assert needle in _error(model=model)


def test_all_refuses_a_step_that_does_not_divide_and_too_many_rings():
    m = parse(model={"nodes": [3], "partitions": ["all"], "partition_step": 4}).models[0]
    with pytest.raises(ExperimentError) as e:
        plan_rings(m, "x.yaml: models[0]", 30)
    assert str(e.value) == "x.yaml: models[0].partition_step: 4 does not divide the 30 layers of m"
    m = parse(model={"nodes": [3], "partitions": ["balanced", "all"]}).models[0]
    with pytest.raises(ExperimentError) as e:
        plan_rings(m, "x.yaml: models[0]", 120)
    assert str(e.value).startswith("x.yaml: models[0].partitions[1]: 'all' makes 7021 rings (m's 120 layers over 3 "
                                   "nodes in steps of 1), more than 2000: raise partition_step")
    m.partition_step = 3  # C(39, 2) = 741
    assert len(plan_rings(m, "w", 120)) == 741 + 1
    m = parse(model={"nodes": [4], "partitions": ["all"], "partition_step": 3}).models[0]
    with pytest.raises(ExperimentError, match=r"partitions\[0\]: 'all' has no split of m's 9 layers over 4 nodes"):
        plan_rings(m, "w", 9)
    # 'all' is only checked when given
    assert plan_rings(parse(model={"nodes": [3], "partition_step": 4}).models[0], "w", 30) == [
        (3, [10, 10, 10], "balanced")]


def _auto_plans(tmp_path, **model):
    exp = parse({"nodes": [1, 3], "emulation": {"enabled": "off"}},
                dict({"path": str(tmp_path / "tiny"), "random": TINY, "partitions": ["auto", "balanced"]}, **model))
    return exp, plan_sweep(exp, lambda m: None, build=False)


def test_auto_ring_plan_and_run_config(tmp_path):
    exp, plans = _auto_plans(tmp_path)
    auto = [p for p in plans[0] if p.kind == "auto"]
    assert [(p.n_nodes, p.label, p.counts) for p in auto] == [(1, "auto", [6]), (3, "auto", [2, 2, 2])]
    p3 = auto[1]
    assert p3.weights == p3.weigh([2, 2, 2]) and len(p3.weights) == 3  # the balanced estimate
    emu = Emulation(EmulationSettings(mode="off"), 3)
    ring = Ring(p3, exp, emu, None, str(tmp_path), print)
    config = ring.run_config("auto")
    assert [n["layers"] for n in config["nodes"]] == ["auto"] * 3
    cache = ring.env["MDI_PROFILE_CACHE"]
    assert cache == os.path.join(str(tmp_path), "profiles-ring%d" % p3.index)
    other = Ring(auto[0], exp, emu, None, str(tmp_path), print)
    assert other.env["MDI_PROFILE_CACHE"] != cache  # rings never share profiles
    balanced = next(p for p in plans[0] if p.kind == "balanced" and p.n_nodes == 3)
    ring = Ring(balanced, exp, emu, None, str(tmp_path), print)
    assert all("layers" not in n for n in ring.run_config("auto")["nodes"])
    assert ring.env.get("MDI_PROFILE_CACHE") == os.environ.get("MDI_PROFILE_CACHE")
    from mdi.lab.sweep import run_file_name
    assert run_file_name(p3, 6, "auto", 1) == "m_n3_auto_bauto_s6_r1.json"


def test_over_limit_per_node_and_not_for_auto_rings(tmp_path):
    _, plans = _auto_plans(tmp_path)
    everything = {k: 1 for k in range(3)}  # 1 byte: every node is over it
    lines = over_limit(plans, everything.get)
    assert lines and not any(" auto:" in l for l in lines)
    assert all(" 2+2+2:" in l or " 6:" in l for l in lines)
    only_node_2 = over_limit(plans, {2: 1}.get)
    assert len(only_node_2) == 1 and "node 2's weights" in only_node_2[0]
    assert over_limit(plans, lambda k: None) == []


# --------------------------------------------------------------------------- the CSV

PLAN = {"counts": [4, 0, 2], "nodes": ["starter", "node1", "node2"], "dropped": ["node1"],
        "predicted_tokens_per_s": 12.3456, "bottleneck_ms": 81.0, "samples_to_fill": 3}


def _outcome(plan=None, samples=3, tokens=4, code=0):
    record = {"n_tokens": samples * tokens, "tokens_per_s": 8.0, "seconds": 1.0, "nodes": [{}, {}, {}],
              "samples": [{"token_ids": [1] * tokens, "token_times": [0.1 * (k + 1) + 0.01 * i for k in range(tokens)]}
                          for i in range(samples)]}
    if plan is not None:
        record["plan"] = plan
    return RunOutcome(code, None if code == 0 else "boom", record if code == 0 else None, [None] * 3, [None] * 3,
                      0.5, 1.0)


def test_csv_has_the_plan_columns(tmp_path):
    exp, plans = _auto_plans(tmp_path)
    auto = next(p for p in plans[0] if p.kind == "auto" and p.n_nodes == 3)
    # appended after the columns before them (whose places stay), before speculation's
    plan_at = CSV_COLUMNS.index("plan")
    assert CSV_COLUMNS[plan_at:plan_at + 2] == ["plan", "predicted_tokens_per_s"]
    assert CSV_COLUMNS[plan_at - 1] == "metrics_file" and CSV_COLUMNS[plan_at + 2].startswith("spec_")
    row = make_row(exp, auto, 3, 1, _outcome(PLAN, tokens=auto.model.tokens), "off", "runs/a.json")
    assert set(row) == set(CSV_COLUMNS)
    assert (row["status"], row["partition"], row["partition_kind"]) == ("ok", "auto", "auto")
    assert (row["plan"], row["predicted_tokens_per_s"]) == ("4+0+2", "12.346")
    # the weights of the chosen split (node 1 left out: none), not the balanced estimate
    cells = row["weights_mb"].split(";")
    assert len(cells) == 3 and float(cells[1]) == 0 and float(cells[0]) > float(cells[2]) > 0
    # no plan in the record (a fixed partition): empty cells, every other column as before
    balanced = next(p for p in plans[0] if p.kind == "balanced" and p.n_nodes == 3)
    row = make_row(exp, balanced, 3, 1, _outcome(None, tokens=balanced.model.tokens), "off", "runs/b.json")
    assert (row["status"], row["plan"], row["predicted_tokens_per_s"]) == ("ok", "", "")
    assert len(row["weights_mb"].split(";")) == 3
    # a failed auto run: nothing chosen, nothing to say
    row = make_row(exp, auto, 3, 1, _outcome(PLAN, code=1), "off", "runs/c.json")
    assert row["status"] == "failed: boom" and row["plan"] == row["predicted_tokens_per_s"] == row["weights_mb"] == ""
    # a plan without a prediction
    row = make_row(exp, auto, 3, 1, _outcome({"counts": [2, 2, 2]}, tokens=auto.model.tokens), "off", "r.json")
    assert (row["plan"], row["predicted_tokens_per_s"]) == ("2+2+2", "")


# --------------------------------------------------------------------------- one ring at a time

class FakeRing:
    events = []  # type: list

    def __init__(self, plan, exp, emu, token, work, log):
        self.plan = plan
        self.profile_cache = None
        if plan.kind == "auto":  # what the starter's planner would have written there
            self.profile_cache = os.path.join(work, "profiles-ring%d" % plan.index)
            os.makedirs(self.profile_cache, exist_ok=True)
            with open(os.path.join(self.profile_cache, "profiles.json"), "w") as f:
                json.dump({"k": {"ring": plan.index}}, f)

    def start(self):
        FakeRing.events.append(("start", self.plan.index))

    def wait_ready(self, timeout):
        pass

    def limit(self):
        pass

    def run(self, samples, tokens, path, max_batch="auto"):
        FakeRing.events.append(("run", self.plan.index, samples))
        return _outcome(PLAN if self.plan.kind == "auto" else None, samples, tokens)

    def processes(self):
        return []

    def stop(self):
        FakeRing.events.append(("stop", self.plan.index))


@pytest.mark.parametrize("repeats", [1, 2])
def test_rings_run_one_at_a_time_with_one_repeat(tmp_path, monkeypatch, repeats):
    from mdi.lab import sweep
    monkeypatch.setattr(sweep, "Ring", FakeRing)
    FakeRing.events = []
    exp, plans = _auto_plans(tmp_path, samples=[1])
    exp.repeats, exp.warmup = repeats, False
    s = sweep.Sweep(exp, str(tmp_path / "out"), lambda m: None)
    try:
        s.run(plans)
    finally:
        s.close(keep_work=False)
    kinds = [e[0] for e in FakeRing.events]
    if repeats == 1:
        assert kinds == ["start", "run", "stop"] * 4
    else:
        assert kinds == ["start"] * 4 + ["run"] * 8 + ["stop"] * 4
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["plan"] for r in rows if r["partition"] == "auto"] == ["4+0+2"] * 2 * repeats
    # The auto ring's node profiles stay with the results (the work directory is gone).
    auto = [p for group in plans for p in group if p.kind == "auto"]
    assert len(auto) == 2 and sorted(os.listdir(tmp_path / "out" / "profiles")) == \
        sorted("%s-ring%d.json" % (p.model.name, p.index) for p in auto)


def test_the_run_in_hand_when_a_sweep_is_interrupted_gets_a_row_saying_so(tmp_path, monkeypatch):
    """Ctrl-C during a run left its metrics file in runs/ with no row in results.csv."""
    from mdi.lab import sweep

    class Interrupted(FakeRing):
        def run(self, samples, tokens, path, max_batch="auto"):
            if sum(e[0] == "run" for e in FakeRing.events) == 1:
                with open(path, "w") as f:
                    f.write('{"error": "interrupted by SIGINT"}')  # what the starter wrote of it
                raise KeyboardInterrupt
            return FakeRing.run(self, samples, tokens, path, max_batch)
    monkeypatch.setattr(sweep, "Ring", Interrupted)
    FakeRing.events = []
    exp, plans = _auto_plans(tmp_path, samples=[1])
    exp.repeats, exp.warmup = 1, False
    s = sweep.Sweep(exp, str(tmp_path / "out"), lambda m: None)
    try:
        with pytest.raises(KeyboardInterrupt):
            s.run(plans)
    finally:
        s.close(keep_work=False)
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "interrupted"], rows
    assert rows[1]["metrics_file"].startswith("runs/") and rows[1]["decode_tokens_per_s"] == "", rows[1]
    summary = sweep.summarize(rows)  # counted nowhere: neither made nor failed
    assert [(r["runs_ok"], r["runs_failed"]) for r in summary] == [("1", "0")], summary
    assert [e[0] for e in FakeRing.events] == ["start", "run", "stop", "start", "stop"]


# --------------------------------------------------------------------------- scripts/plot_planner.py

def _plot_planner():
    spec = importlib.util.spec_from_file_location("plot_planner", os.path.join(ROOT, "scripts", "plot_planner.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(model, kind, partition, samples, rate, repeat=1, plan="", predicted=""):
    row = {c: "" for c in CSV_COLUMNS}
    row.update(model=model, nodes="3", partition=partition, partition_kind=kind, samples=str(samples),
               max_batch="auto", repeat=str(repeat), status="ok", decode_tokens_per_s=str(rate),
               tokens_per_s=str(rate), plan=plan, predicted_tokens_per_s=str(predicted))
    return row


def _synthetic_rows():
    rows = []
    for rep, noise in ((1, 0.0), (2, 1.0), (3, -1.0)):
        rows += [_row("a", "balanced", "2+2+2", 3, 10 + noise, rep), _row("a", "balanced", "2+2+2", 6, 12 + noise, rep),
                 _row("a", "explicit", "3+2+1", 3, 14 + noise, rep), _row("a", "explicit", "3+2+1", 6, 16 + noise, rep),
                 _row("a", "explicit", "1+2+3", 6, 5 + noise, rep),
                 _row("a", "auto", "auto", 3, 13 + noise, rep, "3+2+1", 15),
                 _row("a", "auto", "auto", 6, 15 + noise, rep, "3+2+1", 18)]
    # model b: no balanced kind, its even split run as an explicit one; a failed run is ignored
    rows += [_row("b", "explicit", "4+4+4", 3, 20), _row("b", "explicit", "6+4+2", 3, 30),
             _row("b", "auto", "auto", 3, 27, plan="6+6+0", predicted=30)]
    failed = _row("b", "explicit", "10+1+1", 3, 99)
    failed["status"] = "failed: killed"
    return rows + [failed]


def test_plot_planner_writes_json_and_png(tmp_path, capsys):
    pp = _plot_planner()
    write_csv(str(tmp_path / "results.csv"), CSV_COLUMNS, _synthetic_rows())
    assert pp.main([str(tmp_path)]) == 0
    with open(tmp_path / "planner.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with open(tmp_path / "planner.json") as f:
        result = json.load(f)
    a, b = result["rings"]
    assert (a["model"], a["nodes"], a["fixed_partitions"]) == ("a", 3, 3)
    # median over repeats per S, best S per partition, best partition
    assert (a["best"]["partition"], a["best"]["tokens_per_s"], a["best"]["samples"]) == ("3+2+1", 16.0, 6)
    assert (a["balanced"]["partition"], a["balanced"]["tokens_per_s"]) == ("2+2+2", 12.0)
    assert (a["auto"]["tokens_per_s"], a["auto"]["plan"], a["auto"]["predicted_tokens_per_s"]) == (15.0, "3+2+1", 18)
    assert a["auto"]["plan_rank"] == 2
    assert a["auto_vs_best"] == pytest.approx(15 / 16) and a["auto_vs_balanced"] == pytest.approx(15 / 12)
    assert (b["best"]["partition"], b["balanced"]["partition"], b["auto"]["plan"]) == ("6+4+2", "4+4+4", "6+6+0")
    assert b["auto_vs_balanced"] == pytest.approx(27 / 20)
    assert result["auto_vs_best"]["n"] == 2 and result["auto_vs_best"]["max"] == pytest.approx(15 / 16)
    pvm = result["predicted_vs_measured"]
    assert pvm["n"] == len(pvm["runs"]) == 7  # every auto run with a prediction
    assert pvm["median"] == pytest.approx(sorted(p["ratio"] for p in pvm["runs"])[3])
    assert pvm["min"] <= pvm["q1"] <= pvm["median"] <= pvm["q3"] <= pvm["max"]
    out = capsys.readouterr().out
    assert "a N=3: auto 15.00 (3+2+1) = 0.94 x best 16.00 (3+2+1), 1.25 x balanced" in out


def test_plot_planner_without_auto_rings_still_plots(tmp_path):
    pp = _plot_planner()
    write_csv(str(tmp_path / "results.csv"), CSV_COLUMNS, [_row("a", "balanced", "2+2+2", 3, 10)])
    assert pp.main([str(tmp_path)]) == 0
    with open(tmp_path / "planner.json") as f:
        result = json.load(f)
    assert result["rings"][0]["auto"] is None and result["predicted_vs_measured"]["n"] == 0
    assert (tmp_path / "planner.png").is_file()


def test_plot_planner_errors_are_one_line(tmp_path, capsys):
    pp = _plot_planner()
    assert pp.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plot_planner: error: %s: no such file" % (tmp_path / "results.csv")) and err.count("\n") == 1
    write_csv(str(tmp_path / "results.csv"), CSV_COLUMNS, [])
    assert pp.main([str(tmp_path)]) == 2
    assert "results.csv: no runs in it" in capsys.readouterr().err
    failed = _row("a", "auto", "auto", 3, 1)
    failed["status"] = "failed: x"
    write_csv(str(tmp_path / "results.csv"), CSV_COLUMNS, [failed])
    assert pp.main([str(tmp_path)]) == 2
    assert "none of its 1 runs succeeded" in capsys.readouterr().err
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    assert pp.main([str(tmp_path)]) == 2
    assert "not an mdi-bench results.csv" in capsys.readouterr().err
    assert not (tmp_path / "planner.json").exists()


# --------------------------------------------------------------------------- the shipped draft

def test_planner_experiment_parses_and_plans(tmp_path):
    with open(PLANNER) as f:
        data = yaml.safe_load(f)
    exp = parse_experiment(data, PLANNER)
    assert exp.emulation.cpu_quota == [1.0, 0.5, 0.25] and exp.emulation.cpu_period_us == 10000
    assert exp.emulation.memory_limit_mb is None and exp.repeats == 1
    # The memory-bound case is its own experiment: the 0.5-core board alone limited.
    with open(os.path.join(os.path.dirname(PLANNER), "planner-memory.yaml")) as f:
        memory = parse_experiment(yaml.safe_load(f), "planner-memory.yaml")
    assert memory.emulation.memory_limit_mb == [None, 300, None]
    names = [m.name for m in exp.models]
    assert names == ["smollm2", "gpt2-random"]
    for m in exp.models:
        assert m.partitions == ["auto", "balanced", "all"] and m.nodes == [3] and m.samples == ["N", "2N"]
    gpt2 = exp.models[1]
    gpt2.path = str(tmp_path / "gpt2")  # planned from its spec, never built
    rings = plan_rings(gpt2, "w", gpt2.random["n_layer"])
    assert [k for _, _, k in rings].count("auto") == 1 and len(rings) == 1 + 55
