"""The planner: contiguous layer ranges, in ring order, from each node's measured speed, memory
and link (mdi.starter.planning.node_speeds measures them), so the slowest stage is as fast as it can be.

A stage is what one node does per pass: its blocks, plus the starter's embedding, head and
sampling, plus handling the frame and sending it on. With G groups of samples circulating
(runtime.max_batch makes S samples travel as about one group per node), one turn of the ring
takes max(ring time, G x slowest stage), and each turn yields one token per sample:

    tokens/s(S) = S / max(sum of stages, G x max stage)

The solver minimises the slowest stage (the steady state, every node busy), then, among splits
within `TIE` of that, the ring time (what one sample alone waits). A worker may get no layer
at all: it is left out of the ring when that makes the ring faster, and the plan says why. The
plan solves once per number of nodes used, at the rows per pass that many nodes make of the
samples (fewer nodes carry them in bigger groups), and keeps the split predicted to make the
most tokens/s. Memory is a hard limit: each node's weights and KV cache must fit what it has.
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mdi.model.layout import layer_span
from mdi.runconfig import ConfigError, samples_per_frame

TIE = 0.01  # splits whose slowest stage is within 1% of the best count as equally fast
MAX_LIMITS = 64  # stage limits tried for a ring too long for its groups (each one more solve)
MB = 1024 * 1024


class PlanError(ConfigError):
    """No split fits: the message names how many bytes are missing, and where."""


def interpolate(table: Dict[int, float], rows: float) -> float:
    """A measured cost at `rows` rows per pass: linear between the measured sizes, extended
    along the last two beyond them (never below the largest measured value). One size alone
    stands for every size (decode is bound by reading the weights, not by the rows)."""
    sizes = sorted(table)
    if len(sizes) == 1 or rows <= sizes[0]:
        return table[sizes[0]]
    for a, b in zip(sizes, sizes[1:]):
        if rows <= b:
            return table[a] + (table[b] - table[a]) * (rows - a) / (b - a)
    a, b = sizes[-2], sizes[-1]
    return max(table[b], table[b] + (table[b] - table[a]) * (rows - b) / (b - a))


@dataclass
class NodeCost:
    """One node in the planner's terms (seconds per pass by rows per pass; bytes)."""
    name: str
    layer_s: Dict[int, float]  # one block
    fixed_s: Dict[int, float]  # the rest of its pass: frame handling (+ the starter's ends)
    hop_s: Dict[int, float]  # sending its output on (half a round trip + bytes / bandwidth)
    layer_bytes: List[int]  # weights + KV cache of each layer of the model, as this node would hold it
    fixed_bytes: int = 0  # the starter's embedding and head
    capacity_bytes: Optional[int] = None  # what it can hold; None: unknown (not checked)
    prefill_token_s: float = 0.0  # one block, per prompt token (reported, not planned on)
    note: str = ""  # why it cannot be used at all (its stage times are then infinite)

    def stage_s(self, n_layers: int, rows: float) -> float:
        return (interpolate(self.fixed_s, rows) + n_layers * interpolate(self.layer_s, rows)
                + interpolate(self.hop_s, rows))

    def bytes_for(self, first: int, last: int) -> int:
        return self.fixed_bytes + sum(self.layer_bytes[first:last])

    def fits(self, first: int, last: int) -> bool:
        return self.capacity_bytes is None or self.bytes_for(first, last) <= self.capacity_bytes


@dataclass
class Split:
    counts: List[int]  # per node of the candidate ring, 0 = left out (never the starter)
    stage_s: List[float]  # 0 for a node left out
    rows: float

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_s)

    @property
    def ring_s(self) -> float:
        return sum(self.stage_s)

    @property
    def used(self) -> int:
        return sum(1 for c in self.counts if c > 0)


def solve(costs: Sequence[NodeCost], n_layer: int, rows: float = 1, keep_all: bool = False,
          used: Optional[int] = None, limit: Optional[float] = None) -> Split:
    """The split of `n_layer` layers over `costs` (ring order, the starter first, holding at
    least one layer) with the fastest slowest stage, then the shortest ring; `keep_all`: every
    node gets at least one layer; `used`: exactly that many nodes do; `limit`: the shortest
    ring whose every stage takes at most that. PlanError when no split fits in memory (or none
    with `used` nodes)."""
    n = len(costs)
    if n == 0:
        raise PlanError("no nodes to plan")
    if keep_all:
        used = n
    stage = [[0.0] + [c.stage_s(k, rows) for k in range(1, n_layer + 1)] for c in costs]

    def allowed(i: int, first: int, last: int) -> bool:
        if last == first:
            return i > 0
        return costs[i].fits(first, last)

    best = _min_max(stage, allowed, n, n_layer, used)
    if best is None:
        if used is not None and _min_max(stage, allowed, n, n_layer, None) is not None:
            raise PlanError("no split over exactly %d of the %d nodes fits in memory" % (used, n))
        raise PlanError(_missing_memory(costs, n_layer))
    counts = _min_sum(stage, allowed, n, n_layer, best * (1 + TIE) if limit is None else max(best, limit), used)
    return Split(counts, [stage[i][c] if c else 0.0 for i, c in enumerate(counts)], rows)


# Both passes are dynamic programming over (node, nodes used so far, layers so far): f[u][l] is
# the best value with the nodes seen so far, u of them holding a layer, covering layers [0, l).

def _min_max(stage, allowed, n: int, L: int, used: Optional[int]) -> Optional[float]:
    """The smallest slowest stage over every split (with exactly `used` nodes, when given)."""
    inf = float("inf")
    f = [[0.0] + [inf] * L] + [[inf] * (L + 1) for _ in range(n)]
    for i in range(n):
        g = [[inf] * (L + 1) for _ in range(n + 1)]
        for u in range(i + 1):
            for last in range(L + 1):
                for first in range(last + 1):
                    if f[u][first] == inf or not allowed(i, first, last):
                        continue
                    k = last - first
                    v = max(f[u][first], stage[i][k])
                    if v < g[u + (k > 0)][last]:
                        g[u + (k > 0)][last] = v
        f = g
    best = min(f[u][L] for u in range(n + 1)) if used is None else f[used][L]
    return best if best < inf else None


def _min_sum(stage, allowed, n: int, L: int, limit: float, used: Optional[int]) -> List[int]:
    """The split with the shortest ring among those whose every stage is within `limit`."""
    inf = float("inf")
    f = [[0.0] + [inf] * L] + [[inf] * (L + 1) for _ in range(n)]
    choice: List[List[List[Tuple[int, int]]]] = []  # per node: [u][last] -> (u before, first)
    for i in range(n):
        g = [[inf] * (L + 1) for _ in range(n + 1)]
        pick = [[(-1, -1)] * (L + 1) for _ in range(n + 1)]
        for u in range(i + 1):
            for last in range(L + 1):
                for first in range(last + 1):
                    k = last - first
                    if f[u][first] == inf or stage[i][k] > limit or not allowed(i, first, last):
                        continue
                    v, u2 = f[u][first] + stage[i][k], u + (k > 0)
                    if v < g[u2][last] - 1e-15:
                        g[u2][last], pick[u2][last] = v, (u, first)
        f = g
        choice.append(pick)
    u = min(range(n + 1), key=lambda c: f[c][L]) if used is None else used
    counts, last = [0] * n, L
    for i in range(n - 1, -1, -1):
        u, first = choice[i][u][last]
        counts[i] = last - first
        last = first
    return counts


def size_text(nbytes: float) -> str:
    return "%.0f MB" % (nbytes / MB) if nbytes >= 10 * MB else "%.1f MB" % (nbytes / MB) if nbytes >= MB \
        else "%.0f kB" % (nbytes / 1024)


def _missing_memory(costs: Sequence[NodeCost], n_layer: int) -> str:
    need = costs[0].fixed_bytes + sum(costs[0].layer_bytes)
    known = [(c.name, c.capacity_bytes) for c in costs if c.capacity_bytes is not None]
    have = sum(capacity for _, capacity in known)
    detail = ", ".join("%s %s" % (name, size_text(capacity)) for name, capacity in known)
    if need > have:
        return ("the ring cannot hold the model: %d layers with the embedding and head, weights and KV cache, need "
                "%s but its nodes can give %s (%s): %s missing; quantize (--quant int4), use fewer positions or "
                "samples, or add a board" % (n_layer, size_text(need), size_text(have), detail,
                                             size_text(need - have)))
    return ("no split of the %d layers fits: the nodes can give %s (%s) for %s, but not in contiguous ranges that "
            "each node can hold; use fewer positions or samples" % (n_layer, size_text(have), detail,
                                                                    size_text(need)))


# --------------------------------------------------------------------------- predictions

def groups(samples: int, n_nodes: int, max_batch="auto") -> Tuple[int, int]:
    """(rows per pass, groups circulating) for S samples under runtime.max_batch."""
    b = samples_per_frame(max_batch, samples, n_nodes)
    return b, math.ceil(samples / b)


def predict_tokens_per_s(costs: Sequence[NodeCost], counts: Sequence[int], samples: int, max_batch="auto") -> float:
    used = [(c, k) for c, k in zip(costs, counts) if k > 0]
    rows, n_groups = groups(samples, len(used), max_batch)
    stages = [c.stage_s(k, rows) for c, k in used]
    return samples / max(sum(stages), n_groups * max(stages))


# --------------------------------------------------------------------------- the plan

@dataclass
class PlanRow:
    name: str
    layers: Optional[List[int]]  # [first, last) or None when left out
    stage_ms: float
    bytes_needed: int
    capacity_bytes: Optional[int]
    note: str = ""


@dataclass
class LayerPlan:
    counts: List[int]  # per node of the config, 0 = left out
    rows: List[PlanRow]
    samples: int  # the samples in flight the plan was made for
    rows_per_pass: int
    bottleneck_ms: float
    ring_ms: float
    samples_to_fill: int  # ceil(ring time / slowest stage): samples in flight that keep every node busy
    predicted: Dict[int, float]  # tokens/s for S = 1..2N
    dropped: Dict[str, str] = field(default_factory=dict)  # node -> why it was left out
    # Each time the kept nodes were timed again without those left out (widen): their names.
    retimed: List[List[str]] = field(default_factory=list)
    profile_seconds: float = 0.0

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.predicted.get(self.samples) or 0.0

    def metrics(self) -> Dict[str, object]:
        """The `plan` key of the metrics record (mdi-bench reads counts and the prediction)."""
        return {"counts": list(self.counts), "nodes": [r.name for r in self.rows], "dropped": sorted(self.dropped),
                "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 3),
                "bottleneck_ms": round(self.bottleneck_ms, 3), "ring_ms": round(self.ring_ms, 3),
                "stage_ms": [round(r.stage_ms, 3) for r in self.rows],
                "samples_to_fill": self.samples_to_fill, "samples": self.samples, "retimed": [list(r) for r in self.retimed],
                "predicted": {str(k): round(v, 3) for k, v in sorted(self.predicted.items())}}


def _best_split(costs: Sequence[NodeCost], n_layer: int, samples: int, max_batch="auto") -> Split:
    """The split with the most predicted tokens/s for `samples` in flight (ties within `TIE`:
    fewer nodes, then the shorter ring). A ring with a node left out carries the same samples
    in bigger groups, so the solver runs at the rows per pass of every ring size, and each
    result is judged at its own."""
    candidates: List[Split] = []
    for size in range(1, len(costs) + 1):
        rows, n_groups = groups(samples, size, max_batch)
        try:
            split = solve(costs, n_layer, rows, used=size)
        except PlanError:
            continue  # no split over that many nodes fits in memory
        candidates.append(split)
        if split.ring_s > n_groups * split.bottleneck_s:
            # Too few groups to fill the ring: a turn takes the ring time, so a split with a
            # slower slowest stage but a shorter ring can be faster. Try the stage limits up to
            # where G x the limit passes this ring.
            stages = {c.stage_s(k, rows) for c in costs for k in range(1, n_layer + 1)}
            limits = sorted(v for v in stages if split.bottleneck_s < v <= split.ring_s / n_groups)
            for limit in limits[::max(1, len(limits) // MAX_LIMITS)]:
                candidates.append(solve(costs, n_layer, rows, used=size, limit=limit))
    if not candidates:  # no split fits at all: solve raises the PlanError that says why
        solve(costs, n_layer)

    def speed(split: Split) -> float:
        return predict_tokens_per_s(costs, split.counts, samples, max_batch)
    fastest = max(speed(c) for c in candidates)
    return min((c for c in candidates if speed(c) >= fastest * (1 - TIE)), key=lambda c: (c.used, c.ring_s))


def make_plan(costs: Sequence[NodeCost], n_layer: int, samples: int, max_batch="auto") -> LayerPlan:
    """Solve for `samples` in flight and explain the result (stage times, memory, left-out nodes)."""
    split = _best_split(costs, n_layer, samples, max_batch)
    rows = split.rows
    dropped = {}
    if split.used < len(costs):
        try:
            everyone = solve(costs, n_layer, groups(samples, len(costs), max_batch)[0], keep_all=True)
            rates = (predict_tokens_per_s(costs, everyone.counts, samples, max_batch),
                     predict_tokens_per_s(costs, split.counts, samples, max_batch))
            why = "the ring makes %.1f tokens/s with every node, %.1f without" % rates
            if rates[0] >= rates[1]:  # (not faster by TIE or more: the fewer nodes are kept)
                why += " (within %d%%: fewer nodes preferred)" % round(TIE * 100)
        except PlanError:  # say which: a node unusable, more nodes than layers, or memory
            unusable = [c.name for c in costs if c.note]
            why = ("%s cannot be used" % ", ".join(unusable) if unusable
                   else "%d nodes for %d layers" % (len(costs), n_layer) if len(costs) > n_layer
                   else "no split that gives every node a layer fits in memory")
        for c, k in zip(costs, split.counts):
            if k == 0 and c.note:
                dropped[c.name] = "left out: %s" % c.note
            elif k == 0:
                alone = c.stage_s(1, rows) * 1e3
                dropped[c.name] = "left out: even one layer there takes %.1f ms per pass; %s" % (alone, why)
    used = [(c, k) for c, k in zip(costs, split.counts) if k > 0]
    plan_rows, first = [], 0
    for c, k in zip(costs, split.counts):
        if k == 0:
            plan_rows.append(PlanRow(c.name, None, 0.0, 0, c.capacity_bytes, dropped.get(c.name, "")))
            continue
        plan_rows.append(PlanRow(c.name, [first, first + k], c.stage_s(k, rows) * 1e3, c.bytes_for(first, first + k),
                                 c.capacity_bytes))
        first += k
    n_used = len(used)
    predicted = {s: predict_tokens_per_s(costs, split.counts, s, max_batch) for s in range(1, 2 * n_used + 1)}
    predicted.setdefault(samples, predict_tokens_per_s(costs, split.counts, samples, max_batch))
    fill = max(1, math.ceil(split.ring_s / split.bottleneck_s - 1e-9))
    return LayerPlan(split.counts, plan_rows, samples, int(rows), split.bottleneck_s * 1e3, split.ring_s * 1e3, fill,
                predicted, dropped)


def widen(inner: LayerPlan, kept: Sequence[int], outer: LayerPlan) -> LayerPlan:
    """`inner`, planned over the nodes `kept` (indices) of `outer`'s ring, timed again by
    themselves, as a plan over all of them: the others left out, for `outer`'s reasons."""
    counts, rows = [0] * len(outer.counts), list(outer.rows)
    for j, i in enumerate(kept):
        counts[i], rows[i] = inner.counts[j], inner.rows[j]
    return dataclasses.replace(inner, counts=counts, rows=rows, dropped=dict(outer.dropped, **inner.dropped),
                               retimed=outer.retimed + [[outer.rows[i].name for i in kept]])


def format_plan(plan: LayerPlan) -> str:
    """The plan as a table for people (mdi-plan, --check, the log)."""
    lines = ["%-14s %-15s %10s %22s  %s" % ("node", "layers", "stage ms", "memory use / limit", "")]
    for r in plan.rows:
        layers = "%s (%d)" % (layer_span(*r.layers), r.layers[1] - r.layers[0]) if r.layers else "-"
        limit = "%.0f MB" % (r.capacity_bytes / MB) if r.capacity_bytes is not None else "?"
        memory = "%.0f MB / %s" % (r.bytes_needed / MB, limit) if r.layers else "- / %s" % limit
        stage = "%.2f" % r.stage_ms if r.layers else "-"
        lines.append("%-14s %-15s %10s %22s  %s" % (r.name[:14], layers, stage, memory, r.note))
    lines.append("slowest stage %.2f ms, ring %.2f ms per pass of %d row(s); %d samples in flight fill the ring"
                 % (plan.bottleneck_ms, plan.ring_ms, plan.rows_per_pass, plan.samples_to_fill))
    lines.append("predicted tokens/s: " + ", ".join("S=%d %.1f" % (s, v) for s, v in sorted(plan.predicted.items())))
    return "\n".join(lines)
