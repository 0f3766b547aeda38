"""The planner's solver on made-up node costs: no processes, no timing."""
import itertools

import pytest

from mdi.starter.planning.planner import NodeCost, PlanError, format_plan, groups, interpolate, make_plan, \
    predict_tokens_per_s, solve

MB = 1024 * 1024


def node(name, layer_ms, fixed_ms=0.0, hop_ms=0.0, capacity_mb=None, ends_mb=0, n_layer=12, layer_mb=10,
         batch_cost=1.0):
    """A node whose block costs layer_ms for one row and batch_cost x that for 4 rows."""
    return NodeCost(name, {1: layer_ms / 1e3, 4: batch_cost * layer_ms / 1e3}, {1: fixed_ms / 1e3},
                    {1: hop_ms / 1e3}, [layer_mb * MB] * n_layer, ends_mb * MB,
                    capacity_mb * MB if capacity_mb is not None else None)


def brute_force(costs, n_layer, rows=1, keep_all=False):
    """The smallest slowest stage over every split, by enumeration (counts 0 = left out)."""
    best = None
    n = len(costs)
    for cuts in itertools.combinations_with_replacement(range(n_layer + 1), n - 1):
        bounds = [0] + list(cuts) + [n_layer]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        if counts[0] == 0 or (keep_all and 0 in counts):
            continue
        if any(k and not c.fits(a, a + k) for c, k, a in zip(costs, counts, bounds)):
            continue
        worst = max(c.stage_s(k, rows) for c, k in zip(costs, counts) if k)
        best = worst if best is None else min(best, worst)
    return best


def test_equal_nodes_get_equal_shares():
    costs = [node("a", 1.0), node("b", 1.0), node("c", 1.0)]
    assert solve(costs, 12).counts == [4, 4, 4]


def test_the_starter_head_moves_layers_off_it():
    # The starter's head costs as much as 6 layers: it gets fewer of them.
    costs = [node("starter", 1.0, fixed_ms=6.0), node("b", 1.0), node("c", 1.0)]
    split = solve(costs, 12)
    assert split.counts[0] == 1 and max(split.counts[1:]) <= 7
    assert split.bottleneck_s == pytest.approx(0.007)


def test_speeds_set_the_shares():
    costs = [node("fast", 1.0), node("half", 2.0), node("quarter", 4.0)]
    split = solve(costs, 14)
    assert split.counts == [8, 4, 2]
    assert split.bottleneck_s == pytest.approx(0.008)


@pytest.mark.parametrize("seed", range(12))
def test_the_solver_finds_the_brute_force_optimum(seed):
    import random
    rnd = random.Random(seed)
    n_layer = rnd.randint(3, 10)
    costs = [node("n%d" % i, rnd.uniform(0.5, 5), fixed_ms=rnd.uniform(0, 3), hop_ms=rnd.uniform(0, 1),
                  capacity_mb=rnd.choice([None, 30, 60, 200]) if i else None, n_layer=n_layer)
             for i in range(rnd.randint(1, 4))]
    want = brute_force(costs, n_layer)
    if want is None:
        with pytest.raises(PlanError):
            solve(costs, n_layer)
        return
    split = solve(costs, n_layer)
    assert split.bottleneck_s == pytest.approx(want)
    assert sum(split.counts) == n_layer and split.counts[0] >= 1


def test_memory_bounds_a_node_below_its_fair_share():
    # b is the fastest but holds only 3 layers of 10 MB (+ nothing else): the rest goes elsewhere.
    costs = [node("starter", 2.0), node("b", 0.5, capacity_mb=35), node("c", 2.0)]
    split = solve(costs, 12)
    assert split.counts[1] == 3
    assert all(c.fits(a, a + k) for c, k, a in zip(costs, split.counts, [0, split.counts[0], 12 - split.counts[2]]))


def test_a_ring_that_cannot_hold_the_model_names_the_missing_bytes():
    costs = [node("starter", 1.0, capacity_mb=50, ends_mb=20), node("b", 1.0, capacity_mb=40)]
    with pytest.raises(PlanError) as e:
        solve(costs, 12)
    msg = str(e.value)
    assert "140 MB" in msg and "90 MB" in msg and "50 MB missing" in msg, msg
    assert "starter 50 MB" in msg and "b 40 MB" in msg


def test_a_slow_board_is_left_out_and_the_plan_says_why():
    costs = [node("starter", 1.0), node("b", 1.0), node("slow", 20.0)]
    plan = make_plan(costs, 12, samples=2, max_batch=1)
    assert plan.counts == [6, 6, 0]
    assert "slow" in plan.dropped and "20.0 ms" in plan.dropped["slow"]
    assert "left out" in format_plan(plan)
    # Forced to keep it, the ring is slower: the one layer it must take is the bottleneck.
    assert solve(costs, 12, keep_all=True).bottleneck_s == pytest.approx(0.020)


def test_a_left_out_node_is_told_the_real_reason_not_memory():
    """With no memory limit at all, a node left out because the ring has more nodes than layers,
    or because another node cannot be used, had been told no split "fits in memory"."""
    many = make_plan([node("n%d" % i, 1.0, n_layer=2) for i in range(5)], 2, samples=5)
    assert many.dropped["n1"].endswith("5 nodes for 2 layers"), many.dropped
    broken = node("broken", float("inf"))  # as the profiler leaves a node it could not time
    broken.note = "its /profile failed"
    plan = make_plan([node("starter", 1.0), broken, node("slow", 50.0)], 12, samples=2, max_batch=1)
    assert plan.dropped["broken"] == "left out: its /profile failed"
    assert plan.dropped["slow"].endswith("broken cannot be used"), plan.dropped


def test_a_board_that_helps_is_kept():
    costs = [node("starter", 1.0), node("b", 1.0), node("c", 1.5)]
    plan = make_plan(costs, 12, samples=3, max_batch=1)
    assert all(plan.counts) and not plan.dropped


def test_a_node_left_out_for_a_tie_says_the_fewer_nodes_were_preferred():
    """Within TIE of the ring with every node, the fewer nodes win; the reason says so rather
    than show the ring no slower with every node and leave some out anyway."""
    tie = make_plan([node("a", 1.0, fixed_ms=10.0), node("b", 1.0), node("c", 1.0)], 4, samples=1, max_batch=1)
    assert tie.counts == [4, 0, 0]
    assert tie.dropped["c"].endswith("71.4 tokens/s with every node, 71.4 without (within 1%: fewer nodes preferred)")
    slower = make_plan([node("a", 1.0, fixed_ms=10.0), node("b", 1.0), node("c", 1.0, hop_ms=1.0)], 4, samples=1,
                       max_batch=1)
    assert slower.dropped["c"].endswith("66.7 tokens/s with every node, 71.4 without")


def test_hops_count_in_the_stage():
    # Two equal nodes, but b's link costs 4 ms a hop: it gets fewer layers.
    costs = [node("a", 1.0), node("b", 1.0, hop_ms=4.0)]
    assert solve(costs, 12).counts == [8, 4]


def test_ties_prefer_the_shorter_ring():
    # The starter's 10 ms head sets the bottleneck whatever the split: c (one more hop) would
    # lengthen the ring for nothing, so it is left out.
    costs = [node("a", 1.0, fixed_ms=10.0), node("b", 1.0), node("c", 1.0, hop_ms=1.0)]
    split = solve(costs, 4)
    assert split.bottleneck_s == pytest.approx(0.011) and split.counts == [1, 3, 0]


def test_predictions_follow_the_ring_formula():
    costs = [node("a", 1.0, batch_cost=2.0), node("b", 1.0, batch_cost=2.0)]
    counts = [6, 6]
    # One sample: a turn of the ring (12 ms) per token; two fill both stages (6 ms each).
    assert predict_tokens_per_s(costs, counts, 1, max_batch=1) == pytest.approx(1 / 0.012)
    assert predict_tokens_per_s(costs, counts, 2, max_batch=1) == pytest.approx(2 / 0.012)
    assert predict_tokens_per_s(costs, counts, 4, max_batch=1) == pytest.approx(1 / 0.006)
    # Batched (auto): 4 samples travel as 2 groups of 2 rows; rows cost more per pass.
    b, g = groups(4, 2)
    assert (b, g) == (2, 2)
    plan = make_plan(costs, 12, samples=4)
    assert plan.samples_to_fill == 2 and sorted(plan.predicted) == [1, 2, 3, 4]
    assert plan.predicted[4] > plan.predicted[2] > plan.predicted[1]


def test_interpolation_between_and_beyond_measured_rows():
    table = {1: 1.0, 3: 2.0}
    assert interpolate(table, 1) == 1.0 and interpolate(table, 2) == 1.5
    assert interpolate(table, 5) == 3.0  # along the last two
    assert interpolate({1: 1.0, 2: 0.9}, 8) == 0.9  # never below the largest measured
    assert interpolate({2: 4.0}, 1) == 4.0 and interpolate({2: 4.0}, 9) == 4.0


@pytest.mark.parametrize("seed", range(60))
def test_the_plan_is_the_fastest_split_its_prediction_knows(seed):
    """Over every split (nodes left out included), none is predicted faster than the plan:
    a ring with a node left out carries the samples in bigger groups, and a ring that its
    groups do not fill is bound by its length, not its slowest stage."""
    import random
    from mdi.starter.planning.planner import TIE
    r = random.Random(seed)
    n, n_layer = r.choice([2, 3, 4]), r.choice([6, 8, 12])
    costs = [node("n%d" % i, r.uniform(0.5, 8), fixed_ms=r.uniform(0, 5) if i == 0 else r.uniform(0, 1),
                  hop_ms=r.uniform(0, 1), n_layer=n_layer, batch_cost=r.uniform(1.0, 3.5)) for i in range(n)]
    samples = r.choice([1, n - 1, n, n + 1, 2 * n, 2 * n + 1])
    best = 0.0
    for cuts in itertools.combinations_with_replacement(range(n_layer + 1), n - 1):
        bounds = [0] + list(cuts) + [n_layer]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        if counts[0]:
            best = max(best, predict_tokens_per_s(costs, counts, samples))
    plan = make_plan(costs, n_layer, samples)
    assert plan.predicted[samples] >= best * (1 - TIE)
    assert plan.rows_per_pass == groups(samples, sum(1 for c in plan.counts if c))[0]


def test_a_plan_over_the_kept_nodes_widens_back_to_the_whole_ring():
    from mdi.starter.planning.planner import widen
    linear = dict(batch_cost=4.0)  # no gain from bigger passes: two nodes beat one
    costs = [node("s", 1.0, **linear), node("slow", 40.0, **linear), node("w", 1.0, **linear)]
    outer = make_plan(costs, 12, 2)
    kept = [i for i, k in enumerate(outer.counts) if k]
    assert kept == [0, 2] and list(outer.dropped) == ["slow"]  # too slow to hold even one layer
    inner = make_plan([node("s", 0.5, **linear), node("w", 0.5, **linear)], 12, 2)  # timed again, by themselves
    plan = widen(inner, kept, outer)
    assert plan.counts == [inner.counts[0], 0, inner.counts[1]] and sum(plan.counts) == 12
    assert [r.name for r in plan.rows] == ["s", "slow", "w"] and plan.rows[1].layers is None
    assert plan.dropped == outer.dropped and plan.predicted == inner.predicted and plan.retimed == [["s", "w"]]
    assert plan.metrics()["counts"] == plan.counts


def test_nodes_on_one_machine_know_each_other():
    from mdi.runconfig import NodeSpec
    from mdi.starter.planning.node_speeds import machine_mates
    nodes = [NodeSpec("starter", "10.0.0.9", 1), NodeSpec("a", "127.0.0.1", 2), NodeSpec("b", "10.0.0.2", 3),
             NodeSpec("c", "10.0.0.2", 4), NodeSpec("d", "localhost", 5)]
    assert machine_mates(nodes) == {"starter": ["a", "d"], "a": ["d", "starter"], "d": ["a", "starter"],
                                    "b": ["c"], "c": ["b"]}


def test_kept_nodes_are_timed_again_until_the_plan_keeps_every_node_it_was_timed_with(monkeypatch):
    # Four nodes on one machine. Timed together, w1 looks too slow and is left out; the other
    # three, timed again without it, make w2 look too slow; the last two, timed once more, keep
    # each other. The plan is the last one, and each round timed only the nodes kept before it.
    from types import SimpleNamespace
    from mdi.starter.planning import autoplan
    linear = dict(batch_cost=4.0)
    rounds = [[node("s", 1.0, **linear), node("w1", 40.0, **linear), node("w2", 1.0, **linear),
               node("w3", 1.0, **linear)],
              [node("s", 1.0, **linear), node("w2", 40.0, **linear), node("w3", 1.0, **linear)],
              [node("s", 0.5, **linear), node("w3", 0.5, **linear)]]
    timed = []

    class ScriptedProfiler:
        def __init__(self, *args, **kwargs):
            self.seconds = 0.0

        def costs(self, nodes):
            timed.append([n.name for n in nodes])
            return rounds[len(timed) - 1]

        def close(self):
            pass

    monkeypatch.setattr(autoplan, "Profiler", ScriptedProfiler)
    cfg = SimpleNamespace(nodes=[SimpleNamespace(name=n, host="127.0.0.1") for n in ("s", "w1", "w2", "w3")],
                          runtime=SimpleNamespace(max_batch="auto"))
    plan, costs = autoplan.plan_ring(cfg, SimpleNamespace(config=SimpleNamespace(n_layer=12)), 3, 64, 3)
    assert timed == [["s", "w1", "w2", "w3"], ["s", "w2", "w3"], ["s", "w3"]]
    assert plan.retimed == [["s", "w2", "w3"], ["s", "w3"]]
    assert plan.counts[1] == plan.counts[2] == 0 and plan.counts[0] > 0 and plan.counts[3] > 0
    assert set(plan.dropped) == {"w1", "w2"}
    assert [c.stage_s(1, 1) for c in (costs[0], costs[3])] == [c.stage_s(1, 1) for c in rounds[2]]
