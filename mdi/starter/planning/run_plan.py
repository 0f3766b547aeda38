"""One run's plan, built once as one value: which node holds which layers, kept quantized how,
how many KV cache slots of how many positions, how samples travel (max batch, prefill chunk),
and the planner's measured costs.

The engine, its ring session, `--check`, serving, the metrics record and mdi-plan's YAML all
read this one value; none sizes the run again. Each used to: the positions per slot by four
rules, the layer ranges three times, the `max_batch: auto` rule twice, and `--check` checked
fewer slots than the run then allocated. A recovered ring gets a new plan (`with_ring`), never
an edit of the old one. A feature that changes a run's shape (a draft model, a prefix cache)
adds a field here, and to every node's memory budget (`budgets`, mdi.starter.planning.node_budget),
which `--check`, serving's slots, recovery and the engine's load check all read.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from mdi.model.layout import QuantSpec, torch_dtype
from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.ring.backend_request import BackendRequest
from mdi.ring.init_request import MAX_ROWS
from mdi.runconfig import NodeSpec, RunConfig
from mdi.runconfig.nodes import AUTO_LAYERS
from mdi.starter.control import NodeError, NodeRegistry, NodeUnreachable, answers
from mdi.starter.planning.autoplan import apply_plan, plan_ring
from mdi.starter.planning.capacity import node_quant
from mdi.starter.speculation.draft_model import DraftSource, open_draft
from mdi.starter.planning.node_budget import NodeBudget, RunMemory, run_memory
from mdi.starter.planning.planner import LayerPlan, NodeCost, format_plan
from mdi.starter.planning.run_shape import RunShape

if TYPE_CHECKING:  # torch is imported where a torch path needs it: a ggml starter never loads it
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodePlan:
    """One node of the ring and what it holds."""
    spec: NodeSpec
    layers: Tuple[int, int]  # half-open [first, last)
    quant: Dict[str, QuantSpec]  # the weights it keeps quantized (sent in /init)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class RunPlan:
    cfg: RunConfig  # the run's config, `layers: auto` resolved (its nodes hold the planned counts)
    nodes: Tuple[NodePlan, ...]  # ring order, the starter first
    spares: Tuple[NodeSpec, ...]  # nodes that may take a dead worker's place, in order
    n_slots: int  # KV cache slots on every node: the samples (or requests) in flight at once
    max_len: int  # positions per slot
    max_batch: int  # samples per frame (runtime.max_batch resolved for these slots and nodes)
    prefill_chunk: int  # prompt tokens a sample's pass carries at most
    costs: Tuple[NodeCost, ...] = ()  # measured for `layers: auto`: a failure re-plans with them
    layer_plan: Optional[LayerPlan] = None  # the planner's split and why (`layers: auto`, mdi-plan)
    # generation.speculation's draft model, its vocabulary checked once here; the starter holds
    # its weights and one cache slot per slot beside its chunk
    draft: Optional[DraftSource] = None
    # the budgets' parts (adapters per layer, the prefix reserve, the draft's bytes) and each
    # node's budget, ring order: built here, rebuilt by with_slots, with_ring, with_adapters
    memory: Optional[RunMemory] = None
    budgets: Tuple[NodeBudget, ...] = ()

    @property
    def specs(self) -> List[NodeSpec]:
        return [n.spec for n in self.nodes]

    @property
    def ranges(self) -> List[List[int]]:
        """Each node's half-open [first, last) layers, in ring order."""
        return [list(n.layers) for n in self.nodes]

    @property
    def workers(self) -> Tuple[NodePlan, ...]:
        return self.nodes[1:]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' and KV cache's torch dtype on every node (model.dtype; imports torch)."""
        return torch_dtype(self.cfg.model.dtype)

    @property
    def max_rows(self) -> int:
        """The rows a frame may carry: a batch of decode rows plus a prefill chunk."""
        return min(MAX_ROWS, self.max_batch + self.prefill_chunk)

    def draft_bytes(self, n_slots: int) -> int:
        """What the draft model takes on the starter with `n_slots` cache slots (0: its weights)."""
        return self.draft.bytes_needed(n_slots, self.max_len, self.cfg.model.dtype) if self.draft is not None else 0

    @property
    def prefix_reserve(self) -> int:
        """What every node keeps for a sized prefix cache (runtime.prefix_cache; 0 for "auto")."""
        return self.memory.prefix_reserve if self.memory is not None else 0

    def budget_for(self, node: NodeSpec, layers: Sequence[int], quant: Dict[str, QuantSpec]) -> NodeBudget:
        """What worker `node` would need holding `layers` in this plan (recovery asks before it
        grows a range)."""
        assert self.memory is not None, "a plan made by plan_run has its budget parts"
        return self.memory.budget(node.name, layers, quant, self.n_slots, False)

    def budget_on(self, backend: Optional[str], node: NodeSpec, layers: Sequence[int],
                  source: ModelSource) -> NodeBudget:
        """budget_for `layers` kept as `node`'s quant keeps them, on the backend worker `node`
        computes with: ggml's as ggml_budget counts it; torch's (the plan's) for torch or a
        backend not chosen yet (auto)."""
        budget = self.budget_for(node, layers, node_quant(self.cfg, source, node, layers))
        return self._on_ggml(budget, layers, False, source) if backend == "ggml" else budget

    def ggml_budget(self, i: int, source: ModelSource) -> NodeBudget:
        """Node i's budget where it computes with ggml: its GGUF tensors as stored and ggml's KV
        cache (as its load check counts them), where the plan counted torch's."""
        return self._on_ggml(self.budgets[i], self.nodes[i].layers, i == 0, source)

    def _on_ggml(self, budget: NodeBudget, layers: Sequence[int], ends: bool, source: ModelSource) -> NodeBudget:
        from mdi.model.ggml.kv_cache import kv_cache_bytes  # (loads ggml: only asked of a ggml node)
        first, last = layers
        return budget.on_ggml(source.gguf_bytes(first, last, ends, ends), kv_cache_bytes(
            source.config, first, last, 1, self.max_len, self.cfg.runtime.kv_type, self.prefill_chunk))

    def with_slots(self, n_slots: int) -> "RunPlan":
        """This ring with `n_slots` slots (serving lowers them to what every node's memory holds)."""
        return dataclasses.replace(self, n_slots=n_slots, budgets=tuple(b.with_slots(n_slots) for b in self.budgets),
                                   max_batch=self.cfg.max_batch(n_slots, len(self.nodes)))

    def with_adapters(self, adapters: Any) -> "RunPlan":
        """This plan with the adapters of `adapters` (an AdapterSet a rebuilt serving ring keeps,
        loaded ones included) in every node's budget instead of the configured ones."""
        if self.memory is None:
            return self
        memory = self.memory.with_adapters(adapters.layer_bytes())
        return dataclasses.replace(self, memory=memory, budgets=_budgets(memory, self.nodes, self.n_slots))

    def with_ring(self, source: ModelSource, nodes: Sequence[NodeSpec], ranges: Sequence[Sequence[int]],
                  spares: Sequence[NodeSpec], costs: Optional[Sequence[NodeCost]] = None) -> "RunPlan":
        """The plan of a rebuilt ring (recovery): other nodes or ranges, the same slots."""
        return dataclasses.replace(
            self, nodes=_node_plans(self.cfg, source, nodes, ranges), spares=tuple(spares),
            max_batch=self.cfg.max_batch(self.n_slots, len(nodes)),
            costs=self.costs if costs is None else tuple(costs)).with_budgets()

    def with_budgets(self) -> "RunPlan":
        """This plan with every node's budget built again from its ranges and slots."""
        if self.memory is None:
            return self
        return dataclasses.replace(self, budgets=_budgets(self.memory, self.nodes, self.n_slots))

    def metrics(self) -> Dict[str, Any]:
        """What the metrics record says of the plan: the planner's split, when it made one."""
        return {"plan": self.layer_plan.metrics()} if self.layer_plan is not None else {}


def plan_run(cfg: RunConfig, source: ModelSource, shape: RunShape, params: Optional[SamplingParams] = None,
             measure: bool = False, refresh: bool = False, say: Optional[Callable[[str], None]] = None,
             recover: bool = True) -> RunPlan:
    """The plan of a run of `shape` on `cfg`'s nodes. With `layers: auto` (or `measure`, as
    mdi-plan asks) every node is timed (or recalled from the profile cache) and the planner
    splits the layers; the nodes it leaves out are not in the ring. A run's plan (`recover`)
    replaces a worker lost meanwhile as recovery would. Raises PlanError, NodeError or
    ConfigError (a draft model of another vocabulary) before any weight is sent."""
    draft = open_draft(cfg, source)  # before the planner times any node
    # every node's budget parts, counted per layer by the planner as by the plan's budgets
    memory = run_memory(cfg, source.config, shape.max_len, cfg.model.dtype, draft)
    layer_plan: Optional[LayerPlan] = None
    costs: List[NodeCost] = []
    attempts = cfg.recovery_attempts if recover and not measure else 0  # (mdi-plan, --check: the nodes given)
    lost: Dict[str, str] = {}  # workers lost while the planner timed them -> why (said when lost)
    while cfg.auto_layers or measure:
        try:
            layer_plan, costs = plan_ring(cfg, source, shape.n_slots, shape.max_len, passes_in_flight(cfg, shape),
                                          params, refresh, say or log.info, memory)
        except NodeError as e:
            changed = _without_lost_worker(cfg, e) if attempts > 0 else None
            if changed is None:
                raise
            attempts -= 1
            lost.update({n.name: "was lost while the planner timed it: %s" % e
                         for n in cfg.nodes if n.name not in {m.name for m in changed.nodes}})
            cfg = changed
            continue
        if say is None:
            for line in format_plan(layer_plan).splitlines():
                log.info("mdi: plan: %s", line)
            for name, why in layer_plan.dropped.items():
                log.warning("mdi: plan: %s %s", name, why)
        # the run's record lists a lost worker among the nodes left out (its nodes had just lacked it)
        layer_plan = dataclasses.replace(layer_plan, dropped=dict(lost, **layer_plan.dropped))
        cfg = apply_plan(cfg, layer_plan)
        break
    nodes = _node_plans(cfg, source, cfg.nodes, cfg.layer_ranges(source.config.n_layer))
    return RunPlan(cfg, nodes, tuple(cfg.spares), shape.n_slots, shape.max_len,
                   cfg.max_batch(shape.n_slots, len(nodes)), cfg.runtime.prefill_chunk, tuple(costs), layer_plan, draft,
                   memory, _budgets(memory, nodes, shape.n_slots))


def _without_lost_worker(cfg: RunConfig, e: NodeError) -> Optional[RunConfig]:
    """cfg with the worker `e` names replaced by the first spare that answers, or left out, where
    that worker is gone (unreachable, or not answering /health now: killed while the planner
    timed it): what recovery does once the ring runs, before any layer is placed. None where
    `e` is no loss (a refusal, a slow answer from a worker still there)."""
    lost = next((n for n in cfg.nodes[1:] if n.name == getattr(e, "node", None)), None)
    if lost is None:
        return None
    registry = NodeRegistry.for_run(cfg)
    try:
        if not isinstance(e, NodeUnreachable) and answers(registry, lost):
            return None
        spares = [s for s in cfg.spares if answers(registry, s)]
    finally:
        registry.close()
    spare = spares[0] if spares else None
    log.warning("mdi: plan: node %s is lost (%s): %s", lost.name, e, "spare %s takes its place" % spare.name
                if spare is not None else "the layers are planned without it")
    nodes = [n for n in cfg.nodes if n is not lost] if spare is None else \
        [dataclasses.replace(spare, layers=AUTO_LAYERS) if n is lost else n for n in cfg.nodes]
    return dataclasses.replace(cfg, nodes=nodes, spares=[s for s in cfg.spares if s is not spare])


def passes_in_flight(cfg: RunConfig, shape: RunShape) -> int:
    """The passes the ring is planned to carry at once: one per sample, and, where samples fill
    the ring with speculative passes (generation.speculation's `fill`), one per node however few
    samples there are. A ring planned for one sample's latency leaves boards out (each costs a
    hop); a filled ring runs at its slowest stage, which every board kept shortens (SmolLM2 on
    3 emulated 0.5-core boards: a = 0.7 filled 1.62x the plain ring with the starter's stage
    balanced against its head, 1.47x with the layers split evenly)."""
    spec = cfg.generation.speculation
    return max(shape.n_slots, len(cfg.nodes)) if spec.on and spec.fill else shape.n_slots


def _node_plans(cfg: RunConfig, source: ModelSource, nodes: Sequence[NodeSpec],
                ranges: Sequence[Sequence[int]]) -> Tuple[NodePlan, ...]:
    """Each node with its range and quantization; the starter's (first) with the embedding and head."""
    return tuple(NodePlan(node, (layers[0], layers[1]), node_quant(cfg, source, node, layers, with_ends=i == 0))
                 for i, (node, layers) in enumerate(zip(nodes, ranges)))


def _budgets(memory: RunMemory, nodes: Sequence[NodePlan], n_slots: int) -> Tuple[NodeBudget, ...]:
    """Every node's budget, ring order; the starter's (first) with its ends and the draft model."""
    return tuple(memory.budget(n.name, n.layers, n.quant, n_slots, i == 0) for i, n in enumerate(nodes))


def backend_request(plan: RunPlan, source: ModelSource, node: Any, adapters: bool = False) -> BackendRequest:
    """POST /backend for a worker of `plan` (its NodePlan `node`): what it may compute its layers
    with, auto measured there (the ring session and --check ask it alike)."""
    cfg = plan.cfg
    first, last = node.layers
    # a node that reads its own weights file (`weights:`) computes what that file holds: a
    # safetensors chunk (mdi-prepare --chunks) is torch's alone, whatever the model's GGUF
    own = node.spec.weights
    gguf = source.gguf_path is not None and not (own and own.lower().endswith(".safetensors"))
    return BackendRequest(
        model=source.config, layers=[first, last], asked=cfg.backend_of(node.spec), device=cfg.device_of(node.spec),
        dtype=cfg.model.dtype, threads=cfg.runtime.threads or None, rows=plan.max_batch,
        gguf_types=source.gguf_types(first, last, False, False) if gguf else {},
        quant=node.quant, quant_kernel=cfg.runtime.quant_kernel, kv_type=cfg.runtime.kv_type,
        adapters=bool(cfg.adapters) or adapters, prefill_weights=cfg.prefill_weights_of(node.spec),
        prefill_chunk=cfg.runtime.prefill_chunk, repack=cfg.runtime.repack, compute_dtype=cfg.model.compute_dtype)
