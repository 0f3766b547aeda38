"""How long one call takes, as every measurement in mdi times it (the planner's profile, the
kernel and backend choices): the median over a few windows of the mean of many calls.

A window lasts at least `MIN_WINDOW_S`: a board under a CPU quota (a cgroup, or a Jetson's power
mode) runs in bursts, and only a window of many scheduler periods shows its real speed. No torch
import here (a node computing with ggml times itself without it); a GPU's queue is waited for
only where torch is already loaded.
"""
import statistics
import sys
import time
from typing import Callable

MIN_WINDOW_S = 0.2
ROUNDS = 3
# A profile builds this many random blocks to time one at least: two, so the per-pass setup
# is shared as in a real chunk (mdi.model.block_timing; /profile names their weights).
PROFILE_LAYERS = 2


def seconds_per_call(fn: Callable[[], object], min_window: float = MIN_WINDOW_S, rounds: int = ROUNDS) -> float:
    """The median over `rounds` windows of the mean time of one call (one warm-up call first).
    A GPU runs what a call queued after it returns: the clock is read once the GPU is done."""
    torch = sys.modules.get("torch")

    def finished() -> None:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    fn()
    finished()
    means = []
    for _ in range(rounds):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            finished()
            elapsed = time.perf_counter() - t0
            if calls >= 2 and elapsed >= min_window:
                break
        means.append(elapsed / calls)
    return statistics.median(means)
