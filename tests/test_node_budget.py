"""One memory budget per node (mdi.starter.planning.node_budget), built with the run's plan: `--check`,
serving's slot count, recovery's fit check, the engine's load check and the planner's costs all
read it, so none admits what another refuses; and the starter's adapters count against it."""
import re
from types import SimpleNamespace

import pytest

from mdi.model.source import ModelSource
from mdi.runconfig import ConfigError
from mdi.starter.adapter_set import AdapterSet, StarterTooLarge
from mdi.starter.control import NodeError
from mdi.starter.planning import capacity, preflight as preflight_module, serving_plan
from mdi.starter.planning.node_budget import MB, NodeBudget, check_starter_adapter
from mdi.starter.planning.node_speeds import Profiler
from mdi.starter.planning.preflight import preflight
from mdi.starter.planning.recovery import RecoveryImpossible, replan
from mdi.starter.planning.run_plan import plan_run
from mdi.starter.planning.run_shape import RunShape
from mdi.system.memory import LOAD_HEADROOM_BYTES
from ringconfigs import parse_run_config
from test_adapter_ring import write_peft_lora

PREFIX = 3 << 20


@pytest.fixture(scope="module")
def everything(tiny_models, tmp_path_factory):
    """A ring of unreachable workers (a fixed split contacts none to plan) with two adapters, a
    sized prefix cache and a draft model: every part a budget has."""
    model = tiny_models["llama"]
    source = ModelSource(model)
    base = tmp_path_factory.mktemp("budget")
    adapters = {name: write_peft_lora(str(base / name), source.config, seed=i + 1) for i, name in enumerate("ab")}
    cfg = parse_run_config(model, [10, 11], layers=[1, 1, 2], adapters=adapters, runtime={"prefix_cache": PREFIX},
                           generation={"speculation": {"draft": model}, "n_samples": 4})
    return cfg, source, plan_run(cfg, source, RunShape(4, 64))


class FakeRegistry:
    """Workers answering /status with a capacity each; `dead` ones answer nothing."""

    def __init__(self, capacity, dead=(), backend=None):
        self.capacity, self.dead, self.backend = capacity, set(dead), backend

    def client(self, node):
        if node.name in self.dead:
            def fail(*a, **k):
                raise NodeError("node %s is down" % node.name, node.name)
            return SimpleNamespace(health=fail, status=fail)
        status = SimpleNamespace(capacity_bytes=lambda: self.capacity.get(node.name), backend=self.backend)
        return SimpleNamespace(health=lambda: {}, status=lambda: status)


def test_every_budget_has_every_part(everything):
    cfg, source, plan = everything
    starter, w1, w2 = plan.budgets
    assert [b.node for b in plan.budgets] == ["starter", "w1", "w2"] and w2.layers == (2, 4)
    assert all(b.adapters > 0 and b.prefix_reserve == PREFIX == plan.prefix_reserve and b.slots == 4
               for b in plan.budgets)
    assert starter.draft == plan.draft_bytes(4) > 0 and w1.draft == w2.draft == 0
    assert w2.adapters == 2 * w1.adapters  # two layers' matrices
    for b in plan.budgets:
        assert b.total == b.weights + b.kv + b.adapters + b.prefix_reserve + b.draft
    assert plan.with_slots(2).budgets[1].total == w1.total - 2 * w1.kv_per_slot


def test_check_serving_recovery_the_engine_and_the_planner_agree(everything, capsys, monkeypatch):
    cfg, source, plan = everything
    starter, w1, w2 = plan.budgets

    # --check: each node's need is its budget's total (the workers do not answer here)
    planned = []
    monkeypatch.setattr(preflight_module, "plan_run", lambda *a, **k: planned.append(plan_run(*a, **k)) or planned[0])
    assert preflight(cfg) == 1
    out = capsys.readouterr().out
    needs = [float(m) for m in re.findall(r"needs +([0-9.]+) MB", out)]
    assert needs == [round(b.total / MB, 1) for b in planned[0].budgets], out
    assert planned[0].budgets[1] == w1.with_slots(4) if planned[0].max_len == plan.max_len else planned[0].budgets

    # serving: the slots whose budget fits; the tightest node sets them
    capacities = {"w1": w1.with_slots(3).total, "w2": w2.with_slots(2).total + w2.per_slot - 1}
    monkeypatch.setattr(serving_plan, "starter_free_bytes", lambda device: starter.total)
    assert serving_plan.plan_slots(plan, source, FakeRegistry(capacities)) == 2
    capacities["w2"] = w2.with_slots(1).total - 1  # its fixed part and one slot do not fit
    with pytest.raises(ConfigError, match="node w2: .* cannot hold its budget"):
        serving_plan.plan_slots(plan, source, FakeRegistry(capacities))

    # recovery: w2 dies, w1 takes its layers if the budget of layers 1..4 fits (adapters included)
    grown = plan.with_ring(source, plan.specs[:2], [[0, 1], [1, 4]], []).budgets[1]
    assert grown.adapters == 3 * w1.adapters and grown.prefix_reserve == PREFIX
    dead = NodeError("node w2 is down", "w2")
    new, how = replan(plan, source, FakeRegistry({"w1": grown.total}, dead={"w2"}), dead, None)
    assert new.ranges == [[0, 1], [1, 4]] and new.budgets[1] == grown, how
    with pytest.raises(RecoveryImpossible):
        replan(plan, source, FakeRegistry({"w1": grown.total - 1}, dead={"w2"}), dead, None)

    # the engine's load check: the starter's whole budget, the prefix reserve and draft included
    monkeypatch.setattr(capacity, "starter_free_bytes", lambda device: starter.total)
    assert capacity.check_fits_here(starter, "cpu", False) == PREFIX - LOAD_HEADROOM_BYTES
    monkeypatch.setattr(capacity, "starter_free_bytes", lambda device: starter.total - 1)
    with pytest.raises(ConfigError) as e:
        capacity.check_fits_here(starter, "cpu", False)
    assert "\n" not in str(e.value) and "draft model" in str(e.value) and "prefix cache" in str(e.value)

    # the planner: a node's fixed bytes plus its layers' are its budget (measured against its limit)
    profiler = Profiler(cfg, source, 4, 64, 4, memory=plan.memory)
    timing = {"layer_s": {"1": 0.001}, "prefill_token_s": 0.0, "frame_s": {"1": 0.0001}, "threads": 1,
              "device": "cpu", "seconds": 1.0, "ends_s": {"1": 0.0002}}
    for i, budget in enumerate(plan.budgets):
        cost = profiler._cost(i, cfg.nodes[i], timing, [], budget.total)
        assert cost.bytes_for(*budget.layers) == budget.total and cost.fits(*budget.layers), budget.node
        assert not cost.fits(budget.layers[0], budget.layers[1] + 1) or budget.layers[1] == 4


def test_serving_and_recovery_count_a_ggml_node_on_ggml(tiny_models, monkeypatch):
    """A node computing with ggml holds its GGUF's tensors and a float16 cache: serving's slots
    and recovery's fit check had counted torch's float32 cache there (h75: a recovery that fitted
    was refused, and a serving ring got half the slots its ggml worker held)."""
    from mdi.model.ggml.lib import unavailable_reason
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    model = tiny_models["llama"]
    source = ModelSource(model)
    cfg = parse_run_config(model, [10, 11], layers=[1, 1, 2], node_options={1: {"backend": "ggml"}},
                           generation={"n_samples": 4})
    plan = plan_run(cfg, source, RunShape(4, 64))
    w1 = plan.ggml_budget(1, source)
    assert w1.per_slot < plan.budgets[1].per_slot  # (float16 against float32)
    monkeypatch.setattr(serving_plan, "starter_free_bytes", lambda device: 1 << 40)
    capacities = {"w1": w1.with_slots(3).total, "w2": 1 << 40}
    assert serving_plan.plan_slots(plan, source, FakeRegistry(capacities)) == 3

    # w2 dies: w1, computing with ggml (its status says), takes layers [1, 4) if ggml's budget fits
    need = plan.with_ring(source, plan.specs[:2], [[0, 1], [1, 4]], []).ggml_budget(1, source).total
    dead = NodeError("node w2 is down", "w2")
    new, how = replan(plan, source, FakeRegistry({"w1": need}, dead={"w2"}, backend="ggml"), dead, None)
    assert new.ranges == [[0, 1], [1, 4]], how
    with pytest.raises(RecoveryImpossible):
        replan(plan, source, FakeRegistry({"w1": need - 1}, dead={"w2"}, backend="ggml"), dead, None)


def test_slots_that_fit():
    b = NodeBudget("n", (0, 2), weights=100, kv_per_slot=10, slots=4, adapters=5, prefix_reserve=20,
                   draft_weights=7, draft_per_slot=3)
    assert (b.fixed, b.per_slot, b.total) == (132, 13, 184)
    assert [b.slots_that_fit(limit, 16) for limit in (None, 131, 144, 145, 184, 10 ** 6)] == [16, 0, 0, 1, 4, 16]
    assert b.fits(184) and not b.fits(183) and b.fits(None)


def test_the_starter_counts_its_adapters_against_its_limit(everything):
    """An adapter loaded while serving has the room its limit left beside the budget and the
    prefix cache, less the adapters loaded since; refused past it in one line (a 413)."""
    _, source, plan = everything
    starter = plan.budgets[0]
    held = AdapterSet({}, source.config)
    assert held.held_bytes(0, 1) == 0
    spare, prefix = 50 * MB, 20 * MB  # 30 MB left for adapters loaded while serving
    check_starter_adapter("x", 30 * MB, starter, spare, prefix, starter.adapters, None)
    check_starter_adapter("x", 20 * MB, starter, spare, prefix, starter.adapters + 10 * MB, None)
    with pytest.raises(StarterTooLarge) as e:
        check_starter_adapter("x", 20 * MB + 1, starter, spare, prefix, starter.adapters + 10 * MB, None)
    message = str(e.value)
    assert "\n" not in message and message.startswith("starter: adapter x needs 20.0 MB") and "10.0 MB" in message
    with pytest.raises(StarterTooLarge, match="which has 10.0 MB free"):  # the memory free now, too
        check_starter_adapter("x", 1 * MB, starter, spare, prefix, starter.adapters, 10 * MB)
    check_starter_adapter("x", 10 ** 9, starter, None, 0, 0, None)  # nothing known: nothing refused
