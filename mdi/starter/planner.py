"""The planner: contiguous layer ranges, in ring order, from each node's measured speed, memory
and link (mdi.starter.profiling measures them), so the slowest stage is as fast as it can be.

A stage is what one node does per pass: its blocks, plus the starter's embedding, head and
sampling, plus handling the frame and sending it on. With G groups of samples circulating
(runtime.max_batch makes S samples travel as about one group per node), one turn of the ring
takes max(ring time, G x slowest stage), and each turn yields one token per sample:

    tokens/s(S) = S / max(sum of stages, G x max stage)

The solver minimises the slowest stage (the steady state, every node busy), then, among splits
within `TIE` of that, the ring time (what one sample alone waits). A worker may get no layer
at all: it is left out of the ring when that makes the slowest stage faster, and the plan says
why. Memory is a hard limit: each node's weights and KV cache must fit what it has.
"""
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mdi.runconfig import ConfigError

TIE = 0.01  # splits whose slowest stage is within 1% of the best count as equally fast
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


def solve(costs: Sequence[NodeCost], n_layer: int, rows: float = 1, keep_all: bool = False) -> Split:
    """The split of `n_layer` layers over `costs` (ring order, the starter first, holding at
    least one layer) with the fastest slowest stage, then the shortest ring; `keep_all`: every
    node gets at least one layer. PlanError when no split fits in memory."""
    n = len(costs)
    if n == 0:
        raise PlanError("no nodes to plan")
    stage = [[0.0] + [c.stage_s(k, rows) for k in range(1, n_layer + 1)] for c in costs]

    def allowed(i: int, first: int, last: int) -> bool:
        if last == first:
            return i > 0 and not keep_all
        return costs[i].fits(first, last)

    best = _min_max(stage, allowed, n, n_layer)
    if best is None:
        raise PlanError(_missing_memory(costs, n_layer))
    counts = _min_sum(stage, allowed, n, n_layer, best * (1 + TIE))
    return Split(counts, [stage[i][c] if c else 0.0 for i, c in enumerate(counts)], rows)


def _min_max(stage, allowed, n: int, L: int) -> Optional[float]:
    """The smallest slowest stage over every split (dynamic programming over node, layers so far)."""
    inf = float("inf")
    f = [0.0] + [inf] * L  # f[l]: best bottleneck of the nodes so far holding layers [0, l)
    for i in range(n):
        g = [inf] * (L + 1)
        for last in range(L + 1):
            for first in range(last + 1):
                if f[first] == inf or not allowed(i, first, last):
                    continue
                v = max(f[first], stage[i][last - first])
                if v < g[last]:
                    g[last] = v
        f = g
    return f[L] if f[L] < inf else None


def _min_sum(stage, allowed, n: int, L: int, limit: float) -> List[int]:
    """The split with the shortest ring among those whose every stage is within `limit`."""
    inf = float("inf")
    f = [0.0] + [inf] * L
    choice = []  # type: List[List[int]]
    for i in range(n):
        g, pick = [inf] * (L + 1), [-1] * (L + 1)
        for last in range(L + 1):
            for first in range(last + 1):
                k = last - first
                if f[first] == inf or stage[i][k] > limit or not allowed(i, first, last):
                    continue
                v = f[first] + stage[i][k]
                if v < g[last] - 1e-15:
                    g[last], pick[last] = v, first
        f = g
        choice.append(pick)
    counts, last = [0] * n, L
    for i in range(n - 1, -1, -1):
        first = choice[i][last]
        counts[i] = last - first
        last = first
    return counts


def size_text(nbytes: float) -> str:
    return "%.0f MB" % (nbytes / MB) if nbytes >= 10 * MB else "%.1f MB" % (nbytes / MB) if nbytes >= MB \
        else "%.0f kB" % (nbytes / 1024)


def _missing_memory(costs: Sequence[NodeCost], n_layer: int) -> str:
    need = costs[0].fixed_bytes + sum(costs[0].layer_bytes)
    known = [c for c in costs if c.capacity_bytes is not None]
    have = sum(c.capacity_bytes for c in known)
    detail = ", ".join("%s %s" % (c.name, size_text(c.capacity_bytes)) for c in known)
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
    """(rows per pass, groups circulating) for S samples: runtime.max_batch as RunConfig.max_batch."""
    b = max(1, math.ceil(samples / n_nodes)) if max_batch == "auto" else min(int(max_batch), max(1, samples))
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
class Plan:
    counts: List[int]  # per node of the config, 0 = left out
    rows: List[PlanRow]
    samples: int  # the samples in flight the plan was made for
    rows_per_pass: int
    bottleneck_ms: float
    ring_ms: float
    samples_to_fill: int  # ceil(ring time / slowest stage): samples in flight that keep every node busy
    predicted: Dict[int, float]  # tokens/s for S = 1..2N
    dropped: Dict[str, str] = field(default_factory=dict)  # node -> why it was left out
    profile_seconds: float = 0.0

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.predicted.get(self.samples) or 0.0

    def metrics(self, names: Sequence[str]) -> Dict[str, object]:
        """The `plan` key of the metrics record (mdi-bench reads counts and the prediction)."""
        return {"counts": list(self.counts), "nodes": list(names), "dropped": sorted(self.dropped),
                "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 3),
                "bottleneck_ms": round(self.bottleneck_ms, 3), "ring_ms": round(self.ring_ms, 3),
                "stage_ms": [round(r.stage_ms, 3) for r in self.rows],
                "samples_to_fill": self.samples_to_fill, "samples": self.samples,
                "predicted": {str(k): round(v, 3) for k, v in sorted(self.predicted.items())}}


def make_plan(costs: Sequence[NodeCost], n_layer: int, samples: int, max_batch="auto") -> Plan:
    """Solve for `samples` in flight and explain the result (stage times, memory, left-out nodes)."""
    rows, _ = groups(samples, len(costs), max_batch)
    split = solve(costs, n_layer, rows)
    dropped = {}
    if split.used < len(costs):
        try:
            everyone = solve(costs, n_layer, rows, keep_all=True)
            why = ("with every node the slowest stage takes %.1f ms, without it %.1f ms"
                   % (everyone.bottleneck_s * 1e3, split.bottleneck_s * 1e3))
        except PlanError:
            everyone, why = None, "no split that gives every node a layer fits in memory"
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
    return Plan(split.counts, plan_rows, samples, int(rows), split.bottleneck_s * 1e3, split.ring_s * 1e3, fill,
                predicted, dropped)


def format_plan(plan: Plan) -> str:
    """The plan as a table for people (mdi-plan, --check, the log)."""
    lines = ["%-14s %-12s %10s %22s  %s" % ("node", "layers", "stage ms", "memory use / limit", "")]
    for r in plan.rows:
        layers = "%d-%d (%d)" % (r.layers[0], r.layers[1] - 1, r.layers[1] - r.layers[0]) if r.layers else "-"
        limit = "%.0f MB" % (r.capacity_bytes / MB) if r.capacity_bytes is not None else "?"
        memory = "%.0f MB / %s" % (r.bytes_needed / MB, limit) if r.layers else "- / %s" % limit
        stage = "%.2f" % r.stage_ms if r.layers else "-"
        lines.append("%-14s %-12s %10s %22s  %s" % (r.name[:14], layers, stage, memory, r.note))
    lines.append("slowest stage %.2f ms, ring %.2f ms per pass of %d row(s); %d samples in flight fill the ring"
                 % (plan.bottleneck_ms, plan.ring_ms, plan.rows_per_pass, plan.samples_to_fill))
    lines.append("predicted tokens/s: " + ", ".join("S=%d %.1f" % (s, v) for s, v in sorted(plan.predicted.items())))
    return "\n".join(lines)
