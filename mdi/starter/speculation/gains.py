"""The models the policy runs on: expected tokens per unit of pass time, over plain decoding,
of drafting k tokens a pass, verified one pass at a time or with the ring filled."""
from typing import Optional, Tuple

from mdi.starter.speculation.costs import PassCosts


def verify_gain(a: float, k: int, trip: float) -> float:
    """Expected tokens per unit of time, over plain decoding, of one pass at a time carrying k
    drafts (each right with probability a): 1 + a + .. + a^k tokens per pass of k + 1 rows, which
    costs `trip` passes of one row (PassCosts.of(k + 1))."""
    return (1 - a ** (k + 1)) / (1 - a) / trip


def fill_gain(a: float, k: int, trip: float, stages: int, depth: Optional[int] = None) -> float:
    """The same with the ring filled by `depth` passes in flight (default: one per stage), each
    of k + 1 rows built on the guesses before it, until a guess fails. A pass stands when all
    its k + 1 guesses do (a^(k+1)); the chain that ends at a failing pass gave (k + 1) tokens
    per standing pass and j + 1 from the failing one (j of its guesses right). A pass enters
    every trip / depth; the failing one comes back a whole trip after it entered; and each of
    the depth - 1 passes sent on after it holds a stage for a stage time (trip / stages) before
    the next chain's first pass gets past it: the starter computed its layers, a worker may be
    running it. So deeper filling pays only where chains are long: on 3 emulated 0.5-core
    boards at a = 0.7, 2 passes in flight made 1.73-1.94x the plain ring and 3 made 1.52-1.67x
    (alternating, same run); at a = 0.9 both made 1.8-2.1x. `trip`: what a pass of k + 1 rows
    costs in passes of one row."""
    depth = stages if depth is None else depth
    stands = a ** (k + 1)
    standing = stands / (1 - stands)  # expected standing passes before the failing one
    # sum over j <= k of (j + 1) a^j (1 - a), in closed form, over the chance of failing at all
    failing = (1 - (k + 2) * stands + (k + 1) * stands * a) / ((1 - a) * (1 - stands))
    return (standing * (k + 1) + failing) / (standing * trip / depth + trip + (depth - 1) * trip / stages)


def best_verify(a: float, costs: PassCosts, max_draft: int) -> Tuple[int, float]:
    """(k, gain) with the most expected tokens per unit of time over plain decoding when
    verifying one pass at a time (verify_gain); (0, 1.0) where no k beats plain decoding."""
    best, best_gain = 0, 1.0
    for k in range(1, max_draft + 1):
        gain = verify_gain(a, k, costs.of(k + 1))
        if gain > best_gain:
            best, best_gain = k, gain
    return best, best_gain


def best_fill(a: float, costs: PassCosts, max_draft: int, stages: int) -> Tuple[int, int, float]:
    """(k, depth, gain) with the most expected tokens per unit of time over plain decoding when
    filling the ring (fill_gain): k drafts per pass, 2 .. `stages` passes in flight; (0, 1, 1.0)
    where nothing beats plain decoding."""
    best = (0, 1, 1.0)
    for k in range(max_draft + 1):
        trip = costs.of(k + 1)
        for depth in range(2, stages + 1):
            gain = fill_gain(a, k, trip, stages, depth)
            if gain > best[2]:
                best = (k, depth, gain)
    return best

