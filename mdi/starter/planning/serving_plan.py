"""Setting the ring up for serving: how many positions a KV cache slot holds, how many slots
fit in every node's memory, and the engine opened with them.

Starter-level logic with no HTTP in it: `mdi.serving.scheduler` calls `open_serving_ring`
each time it (re)builds the ring.
"""
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.runconfig import ConfigError, RunConfig
from mdi.starter.planning.planner import PlanError
from mdi.starter.planning.capacity import starter_free_bytes
from mdi.starter.control import NodeError, NodeRegistry, NodeUnreachable
from mdi.starter.engine import Engine
from mdi.starter.sample import Sample
from mdi.starter.planning.run_plan import RunPlan, plan_run
from mdi.starter.planning.run_shape import RunShape

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 16  # when serve.max_in_flight is not set (and memory allows)


@dataclass
class ServingRing:
    """An opened engine and the samples it may hold in flight (KV cache slots on every node)."""
    engine: Engine
    slots: int


def open_serving_ring(cfg: RunConfig, source: ModelSource, max_len: int, params: SamplingParams,
                      on_token: Callable[[Sample, int], None], adapters: Any = None,
                      on_engine: Optional[Callable[[Engine], None]] = None) -> ServingRing:
    """Plan the slots from memory, open the engine, and lower the slots to what the workers
    actually allocated. Nothing is left open when this raises. `adapters`: an AdapterSet to
    keep (a rebuilt ring keeps the adapters loaded at run time); `on_engine`: given the engine
    before it opens (another thread may abort it meanwhile)."""
    plan = _planned(cfg, source, max_len, params)
    if adapters is not None:  # a rebuilt ring: every budget counts the adapters it will hold
        plan = plan.with_adapters(adapters)
    registry = NodeRegistry.for_run(plan.cfg)  # the engine's, closed with it
    try:
        plan = plan.with_slots(plan_slots(plan, source, registry))
    except BaseException:
        registry.close()
        raise
    engine = Engine(plan, source, params, on_token, adapters=adapters, registry=registry)
    engine.speculating = True  # a request may ask for speculation (its "speculation" field)
    if on_engine is not None:
        on_engine(engine)
    try:
        engine.open()
        reported = reported_slots(engine)
    except BaseException:
        engine.abort()
        raise
    return ServingRing(engine, min([plan.n_slots] + reported))


def _planned(cfg: RunConfig, source: ModelSource, max_len: int, params: SamplingParams) -> RunPlan:
    """The run's plan for serve.max_in_flight slots; with `layers: auto`, when the ring cannot
    hold that many, planned for half as many down to one (plan_slots lowers them the same way
    for a fixed split)."""
    slots = cfg.serve.max_in_flight or DEFAULT_MAX_IN_FLIGHT
    while True:
        try:
            return plan_run(cfg, source, RunShape(slots, max_len), params)
        except PlanError:
            if slots == 1:
                raise
            slots = max(1, slots // 2)


def plan_slots(plan: RunPlan, source: ModelSource, registry: NodeRegistry) -> int:
    """serve.max_in_flight (default DEFAULT_MAX_IN_FLIGHT), lowered to the slots of the plan's
    positions whose budget fits in every node's memory (mdi.starter.planning.node_budget: weights,
    adapters, a sized prefix cache, a KV cache slot per slot; the starter's draft model's
    weights and its cache slot per slot): what --check counts for that many slots."""
    cfg, max_len = plan.cfg, plan.max_len
    asked = cfg.serve.max_in_flight
    limit = asked or DEFAULT_MAX_IN_FLIGHT
    for i, (node, budget) in enumerate(zip(plan.nodes, plan.budgets)):
        if cfg.backend_of(node.spec) == "ggml":  # (auto: torch's, until the node has chosen)
            budget = plan.ggml_budget(i, source)
        if i == 0:
            capacity = starter_free_bytes(cfg.device_of(node.spec))
        else:
            try:
                capacity = registry.client(node.spec).status().capacity_bytes()
            except NodeUnreachable:
                if cfg.recovery_attempts > 0:  # engine.open replaces it (a spare, or its neighbours), as a batch
                    continue  # run does (a server had refused to start); reported_slots bounds what was allocated
                raise
        fit = budget.slots_that_fit(capacity, limit)
        if fit < 1:
            raise ConfigError("node %s: %.0f MB of memory cannot hold its budget with one KV cache slot of %d positions "
                              "(%s); lower serve.max_len" % (node.name, (capacity or 0) / 2 ** 20, max_len,
                                                            budget.with_slots(1).parts()))
        if fit < limit:
            if asked:
                log.warning("mdi: serve: max_in_flight %d lowered to %d: node %s has memory for %d slots of "
                            "%d positions", asked, fit, node.name, fit, max_len)
            limit = fit
    return limit


def reported_slots(engine: Engine) -> List[int]:
    """The KV slots each worker says it allocated (what bounds the samples in flight)."""
    max_len = engine.plan.max_len
    slots = []
    for node in engine.nodes[1:]:
        cache = engine.registry.client(node).status().cache
        if cache.max_len < max_len:
            raise NodeError("node %s allocated %d positions per slot, not %d" % (node.name, cache.max_len, max_len),
                            node.name)
        slots.append(cache.slots)
    if slots and min(slots) < 1:
        raise NodeError("a worker reports no KV cache slot")
    return slots
