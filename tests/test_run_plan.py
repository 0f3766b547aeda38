"""The run's one plan (mdi.starter.planning.run_plan): built once from the config and the workload, and
what the engine, its ring session and a recovery read; a rebuilt ring gets a new plan."""
import dataclasses

import pytest

from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.ring.init_request import MAX_ROWS
from mdi.runconfig import samples_per_frame
from ringconfigs import parse_run_config
from mdi.starter.control import NodeError
from mdi.starter.engine import Engine
from mdi.starter.planning.recovery import RecoveryImpossible, replan
from mdi.starter.planning.run_plan import plan_run
from mdi.starter.planning.run_shape import RunShape


def _cfg(model, layers=(1, 1, 2), quant=None, spares=0):
    """A ring of unreachable workers (ports 10, 11...): planning a fixed split contacts none."""
    workers = [10 + i for i in range(len(layers) - 1)]
    options = {i: {"quant": quant} for i in range(1, len(layers))} if quant else None
    return parse_run_config(model, workers, layers=list(layers), spares=[40 + i for i in range(spares)],
                            spare_name="spare%d", node_options=options, runtime={"prefill_chunk": 16})


def test_a_plan_holds_every_node_s_layers_quantization_and_the_run_s_size(tiny_models):
    model = tiny_models["llama"]
    source = ModelSource(model)
    plan = plan_run(_cfg(model, quant="int8"), source, RunShape(7, 40))
    assert [n.name for n in plan.nodes] == ["starter", "w1", "w2"]
    assert plan.ranges == [[0, 1], [1, 2], [2, 4]] == [list(n.layers) for n in plan.nodes]
    assert (plan.n_slots, plan.max_len) == (7, 40)
    assert plan.max_batch == samples_per_frame("auto", 7, 3) == 3
    assert plan.max_rows == min(MAX_ROWS, 3 + 16)
    # each worker's own quant; the starter's layout covers its embedding and head as well
    assert plan.nodes[1].quant and all(s.kind == "int8" for s in plan.nodes[1].quant.values())
    assert any("wte" in k or "embed" in k for k in plan.nodes[0].quant) or not plan.nodes[0].quant
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.n_slots = 8  # type: ignore[misc]


def test_a_smaller_or_rebuilt_ring_is_a_new_plan_with_its_own_max_batch(tiny_models):
    model = tiny_models["llama"]
    source = ModelSource(model)
    plan = plan_run(_cfg(model, spares=1), source, RunShape(6, 32))
    assert [s.name for s in plan.spares] == ["spare1"]
    fewer = plan.with_slots(2)
    assert (fewer.n_slots, fewer.max_batch, plan.n_slots) == (2, 1, 6)
    nodes = plan.specs
    rebuilt = plan.with_ring(source, [nodes[0], nodes[2]], [[0, 2], [2, 4]], [])
    assert [n.name for n in rebuilt.nodes] == ["starter", "w2"] and rebuilt.ranges == [[0, 2], [2, 4]]
    assert rebuilt.max_batch == samples_per_frame("auto", 6, 2) == 3 and rebuilt.spares == ()
    assert plan.ranges == [[0, 1], [1, 2], [2, 4]]  # the old plan is left as it was


def test_recovery_returns_a_new_plan_naming_what_changed(tiny_models):
    """No worker answers on these ports: the one the failure names is dead, and with a
    fixed split and no spare its layers go to its neighbours (the starter may always grow)."""
    model = tiny_models["llama"]
    source = ModelSource(model)
    plan = plan_run(_cfg(model, layers=(1, 3)), source, RunShape(2, 16))

    class Registry:  # every node is unreachable
        def client(self, node):
            from mdi.starter.control import NodeUnreachable

            class Dead:
                def health(self):
                    raise NodeUnreachable("node %s: refused" % node.name, node.name)

                def status(self):
                    raise NodeUnreachable("node %s: refused" % node.name, node.name)
            return Dead()

    cause = RuntimeError("w1 went away")
    new, how = replan(plan, source, Registry(), cause, SamplingParams(0.0))
    assert [n.name for n in new.nodes] == ["starter"] and new.ranges == [[0, 4]]
    assert "w1" in how and new.max_batch == 2
    assert [n.name for n in plan.nodes] == ["starter", "w1"]
    three = plan_run(_cfg(model), source, RunShape(2, 16))
    with pytest.raises(RecoveryImpossible):  # w2's layers can only go to w1, which does not answer
        replan(three, source, Registry(), NodeError("w2 went away", "w2"), SamplingParams(0.0))


def test_the_engine_runs_the_plan_it_is_given(tiny_models):
    model = tiny_models["gpt2"]
    source = ModelSource(model)
    plan = plan_run(parse_run_config(model, runtime={"max_batch": 2}), source, RunShape(3, 24))
    engine = Engine(plan, source, SamplingParams(0.0))
    engine.open()
    try:
        assert engine.plan is plan and engine.pipeline.max_batch == plan.max_batch == 2
        assert engine.chunk.cache.n_slots == 3 and engine.chunk.cache.max_len == 24
        assert engine.ranges == plan.ranges == [[0, source.config.n_layer]]
    finally:
        engine.close()
