"""Re-planning the ring after a worker died.

The starter keeps every sample's full token history, so any new ring can rebuild the caches
by re-prefilling and generation goes on with exactly the output it would have had. This
module decides the new ring, as a new RunPlan: a listed spare takes the dead node's place and
layers, or, without one, the dead node's layers go to its ring neighbours if their memory
allows (with measured costs, `layers: auto`, the planner splits them again).
"""
import functools
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from mdi.model.layout import format_layers
from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.runconfig import ConfigError, NodeSpec
from mdi.starter.control import NodeError, NodeRegistry, answers, health_problem
from mdi.starter.planning.planner import PlanError, make_plan
from mdi.starter.planning.node_speeds import Profiler
from mdi.starter.planning.run_plan import RunPlan
from mdi.system.parallel import run_all

log = logging.getLogger(__name__)


class RecoveryImpossible(RuntimeError):
    pass


@dataclass(frozen=True)
class RingChange:
    """What plan_recovery decides for a fixed split."""
    nodes: List[NodeSpec]  # ring order, the starter first
    ranges: List[List[int]]  # half-open layer range per node
    how: str  # one line for the log, e.g. "spare2 replaces board1"
    spare: Optional[NodeSpec] = None  # the spare this plan takes into the ring


def plan_recovery(nodes: List[NodeSpec], ranges: List[List[int]], dead: str, spares: List[NodeSpec],
                  fits: Callable[[int, NodeSpec, List[int]], bool]) -> RingChange:
    """Replace the dead worker by the first spare that can hold its layers, else merge them
    into its neighbours.

    `fits(i, node, layers)` says whether `node`, at place i of the ring, can hold `layers`; it
    is asked about the spares and about the nodes whose range grows (a spare too small for the
    dead node's layers had been taken, and the run failed on its /init: h96).
    """
    i = next((k for k, n in enumerate(nodes) if n.name == dead), None)
    if i is None or i == 0:
        raise RecoveryImpossible("node %s is not a worker of this ring" % dead)
    first, last = ranges[i]
    spare = next((s for s in spares if fits(i, s, [first, last])), None)
    if spare is not None:
        new_nodes = nodes[:i] + [spare] + nodes[i + 1:]
        return RingChange(new_nodes, [list(r) for r in ranges], "spare %s (%s) takes %s of %s"
                    % (spare.name, spare.address, format_layers(first, last), dead), spare)
    options = []  # (layers to predecessor) candidates, most balanced first
    if i + 1 < len(nodes):
        half = first + (last - first + 1) // 2
        options = [half, last, first]
    else:
        options = [last]  # the last worker's layers can only go back to its predecessor
    for cut in options:
        grown_prev = [ranges[i - 1][0], cut]
        grown_next = [cut, ranges[i + 1][1]] if i + 1 < len(nodes) else None
        if cut > first and not fits(i - 1, nodes[i - 1], grown_prev):
            continue
        if grown_next is not None and cut < last and not fits(i + 1, nodes[i + 1], grown_next):
            continue
        new_ranges = [list(r) for r in ranges[:i - 1]] + [grown_prev]
        if grown_next is not None:
            new_ranges += [grown_next] + [list(r) for r in ranges[i + 2:]]
        return RingChange(nodes[:i] + nodes[i + 1:], new_ranges, "%s's %s go to %s"
                    % (dead, format_layers(first, last), _names(nodes, i, cut, first, last)))
    raise RecoveryImpossible("%s and %s's neighbours cannot hold its %s" % (
        "no spare left" if not spares else "spare%s %s cannot hold them" % ("s" if len(spares) > 1 else "",
                                                                            ", ".join(s.name for s in spares)),
        dead, format_layers(first, last)))


def _names(nodes: List[NodeSpec], i: int, cut: int, first: int, last: int) -> str:
    takers = []
    if cut > first:
        takers.append(nodes[i - 1].name)
    if cut < last:
        takers.append(nodes[i + 1].name)
    return " and ".join(takers)


def replan(plan: RunPlan, source: ModelSource, registry: NodeRegistry, cause: BaseException,
           params: SamplingParams) -> Tuple[RunPlan, str]:
    """The plan of the ring to rebuild after `cause`, and one line saying what changed: the
    dead worker (the one `cause` names, else the first that does not answer) replaced or its
    layers shared; the same plan when every node answers."""
    dead = _dead_worker(plan, registry, cause)
    if dead is None:
        return plan, "every node answers: the ring is rebuilt as it was"
    spares = [s for s in plan.spares if answers(registry, s)]
    if plan.costs:
        return _replan_measured(plan, source, registry, params, dead, spares)

    def fits(i: int, node: NodeSpec, layers: List[int]) -> bool:
        if i == 0:
            return True  # the starter: its memory is ours to spend
        try:
            status = registry.client(node).status()
        except NodeError:
            return False
        # the plan's budget (weights, KV cache, adapters, prefix reserve), as --check and serving count it,
        # on the backend the node computes with: a ring node's own, a spare's asked (its status
        # names the backend of the last run it served), a restarted node's asked
        backend = status.backend if node not in plan.spares and status.backend else plan.cfg.backend_of(node)
        return plan.budget_on(backend, node, layers, source).fits(status.capacity_bytes())
    change = plan_recovery(plan.specs, plan.ranges, dead, spares, fits)
    left = [s for s in plan.spares if s is not change.spare]
    return plan.with_ring(source, change.nodes, change.ranges, left), change.how


def _replan_measured(plan: RunPlan, source: ModelSource, registry: NodeRegistry, params: SamplingParams,
                     dead: str, spares: List[NodeSpec]) -> Tuple[RunPlan, str]:
    """The planner again, on the measured costs: the first live spare (measured now) takes
    the dead node's place, or the survivors share its layers as their speeds say."""
    specs = plan.specs
    i = next(k for k, n in enumerate(specs) if n.name == dead)
    nodes = specs[:i] + specs[i + 1:]
    costs = {c.name: c for c in plan.costs}
    spare = spares[0] if spares else None
    if spare is not None:
        nodes.insert(i, spare)
        if spare.name not in costs:  # timed alone, at the rows per pass its peers were
            sizes = sorted(plan.costs[0].layer_s)
            profiler = Profiler(plan.cfg, source, plan.n_slots, plan.max_len, plan.n_slots, params,
                                sizes=sizes, registry=registry)
            try:
                costs[spare.name] = profiler.worker_cost(spare)
            except ConfigError as e:
                raise RecoveryImpossible("spare %s: %s" % (spare.name, e))
    missing = [n.name for n in nodes if n.name not in costs]
    if missing:
        raise RecoveryImpossible("no measured costs for %s" % ", ".join(missing))
    try:
        split = make_plan([costs[n.name] for n in nodes], source.config.n_layer, plan.n_slots,
                          plan.cfg.runtime.max_batch)
    except PlanError as e:
        raise RecoveryImpossible(str(e))
    kept = [n for n, k in zip(nodes, split.counts) if k > 0]
    ranges = [r.layers for r in split.rows if r.layers is not None]
    left = [s for s in plan.spares if s is not spare]
    how = "re-planned without %s%s: %s" % (dead, " with spare %s" % spare.name if spare else "",
                                           "+".join(str(k) for k in split.counts if k > 0))
    return plan.with_ring(source, kept, ranges, left, list(costs.values())), how


def check_health(plan: RunPlan, registry: NodeRegistry) -> None:
    """Every worker of the ring answers /health (the first NodeError otherwise, naming its node),
    asked at once, with the spares: a spare that does not answer is said now, in one line each,
    not found only when a node is lost (the run goes on without it)."""
    workers, spares = plan.specs[1:], plan.spares
    answers = run_all([registry.client(node).health for node in workers] +
                      [functools.partial(health_problem, registry, spare) for spare in spares], "mdi-health")
    for spare, problem in zip(spares, answers[len(workers):]):
        if problem is not None:
            log.warning("mdi: spare %s does not answer (%s): it cannot stand in for a lost node", spare.name, problem)


def named_worker_lost(plan: RunPlan, registry: NodeRegistry, cause: BaseException) -> bool:
    """Whether the worker `cause` names is gone (its /health unanswered; found silent already:
    not asked again): a refusal is no loss."""
    node = next((n for n in plan.specs[1:] if n.name == getattr(cause, "node", None)), None)
    return node is not None and (getattr(cause, "silent", False) or not answers(registry, node))


def _dead_worker(plan: RunPlan, registry: NodeRegistry, cause: BaseException) -> Optional[str]:
    if named_worker_lost(plan, registry, cause):
        return getattr(cause, "node")
    return next((n.name for n in plan.specs[1:] if not answers(registry, n)), None)
