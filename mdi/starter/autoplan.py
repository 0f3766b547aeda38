"""`layers: auto`: measure the nodes, plan the split, and give the run a config with the
planned layer counts (nodes the plan leaves out are not in its ring)."""
import dataclasses
import logging
from typing import Callable, List, Optional, Tuple

from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.runconfig import RunConfig
from mdi.starter.planner import NodeCost, Plan, format_plan, make_plan
from mdi.starter.profiling import Profiler

log = logging.getLogger(__name__)


def plan_ring(cfg: RunConfig, source: ModelSource, n_slots: int, max_len: int, samples: int,
              params: Optional[SamplingParams] = None, refresh: bool = False,
              say: Callable[[str], None] = log.info) -> Tuple[Plan, List[NodeCost]]:
    """Measure (or recall) every node of `cfg` and plan for `samples` in flight. Raises
    PlanError, before any weight is sent, when the ring cannot hold the model."""
    profiler = Profiler(cfg, source, n_slots, max_len, samples, params, refresh, say)
    costs = profiler.costs(cfg.nodes)
    plan = make_plan(costs, source.config.n_layer, samples, cfg.runtime.max_batch)
    plan.profile_seconds = profiler.seconds
    return plan, costs


def apply_plan(cfg: RunConfig, plan: Plan) -> RunConfig:
    """`cfg` with the planned layer counts; the nodes left out are dropped from the ring."""
    nodes = [dataclasses.replace(n, layers=k) for n, k in zip(cfg.nodes, plan.counts) if k > 0]
    return dataclasses.replace(cfg, nodes=nodes)


def resolve_layers(cfg: RunConfig, source: ModelSource, n_slots: int, max_len: int,
                   params: Optional[SamplingParams] = None) -> Tuple[RunConfig, Optional[Plan], List[NodeCost]]:
    """For `layers: auto`: the planned config, the plan and the costs (for the recovery re-plan);
    any other config comes back unchanged."""
    if not cfg.auto_layers:
        return cfg, None, []
    plan, costs = plan_ring(cfg, source, n_slots, max_len, n_slots, params)
    for line in format_plan(plan).splitlines():
        log.info("mdi: plan: %s", line)
    for name, why in plan.dropped.items():
        log.warning("mdi: plan: %s %s", name, why)
    return apply_plan(cfg, plan), plan, costs
