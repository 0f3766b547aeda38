"""`layers: auto`: measure the nodes and split the layers over them (the run's plan,
mdi.starter.planning.run_plan, takes the split; nodes it leaves out are not in its ring)."""
import dataclasses
import logging
from typing import Callable, List, Optional, Tuple

from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.runconfig import RunConfig
from mdi.starter.planning.node_budget import RunMemory
from mdi.starter.planning.planner import LayerPlan, NodeCost, PlanError, make_plan, widen
from mdi.starter.planning.node_speeds import Profiler, machine_mates

log = logging.getLogger(__name__)


def plan_ring(cfg: RunConfig, source: ModelSource, n_slots: int, max_len: int, samples: int,
              params: Optional[SamplingParams] = None, refresh: bool = False,
              say: Callable[[str], None] = log.info, memory: Optional[RunMemory] = None
              ) -> Tuple[LayerPlan, List[NodeCost]]:
    """Measure (or recall) every node of `cfg` and plan for `samples` in flight, each node's
    bytes by the run's budget parts (`memory`: the run plan's; None: built from `cfg`). Raises
    PlanError, before any weight is sent, when the ring cannot hold the model."""
    profiler = Profiler(cfg, source, n_slots, max_len, samples, params, refresh, say, memory=memory)
    try:
        return _plan(cfg, source, profiler, samples)
    finally:
        profiler.close()


def _plan(cfg: RunConfig, source: ModelSource, profiler: Profiler, samples: int) -> Tuple[LayerPlan, List[NodeCost]]:
    costs = profiler.costs(cfg.nodes)
    n_layer, max_batch = source.config.n_layer, cfg.runtime.max_batch
    plan = make_plan(costs, n_layer, samples, max_batch)
    mates = machine_mates(cfg.nodes)
    timed = list(range(len(cfg.nodes)))  # the nodes timed side by side for the plan in hand
    while True:
        # Nodes left out shared a machine with kept ones while they were timed (emulated
        # boards, several workers on one box): its cores, memory bandwidth and cache, which
        # the ring will not share with them. Timed beside a 0.25-core board the plan left out,
        # the starter and the 0.5-core board of planner-memory-gpt2-final took 1.4x and 1.6x as
        # long per GPT-2 layer as timed by themselves, and the plan predicted 0.64-0.85x the
        # tokens/s its ring made. So the kept nodes are timed again by themselves and the plan
        # made over them, until a plan keeps every node it was timed with on their machines:
        # each round times fewer nodes, so it ends (a plan that drops another node was made
        # from times that node disturbed).
        kept = [i for i, k in enumerate(plan.counts) if k > 0]
        left = {cfg.nodes[j].name for j in timed if j not in kept}
        if not any(set(mates[cfg.nodes[i].name]) & left for i in kept):
            break
        again = profiler.costs([cfg.nodes[i] for i in kept])
        try:
            plan = widen(make_plan(again, n_layer, samples, max_batch), kept, plan)
        except PlanError as e:  # their memory shrank between the two looks: keep the plan in hand
            log.warning("mdi: plan: kept the plan timed with the nodes it leaves out: %s", e)
            break
        costs = [again[kept.index(i)] if i in kept else c for i, c in enumerate(costs)]
        timed = kept
    plan.profile_seconds = profiler.seconds
    return plan, costs


def apply_plan(cfg: RunConfig, plan: LayerPlan) -> RunConfig:
    """`cfg` with the planned layer counts; the nodes left out are dropped from the ring."""
    nodes = [dataclasses.replace(n, layers=k) for n, k in zip(cfg.nodes, plan.counts) if k > 0]
    return dataclasses.replace(cfg, nodes=nodes)
