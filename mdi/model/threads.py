"""`runtime.threads: auto`: each node times its own loaded chunk at a few thread counts and
keeps the fastest.

More threads are not always faster: a decode pass is ~40 small ops per layer that do not
parallelise (on a 2-core VM, SmolLM2 int4 decodes 1.3x faster with 2 threads than 1, not 2x),
a board under a CPU quota (a cgroup, a Jetson power mode) pays for every extra thread in
throttled periods, and a node that shares its cores with another process loses to it. So the
node measures passes of its own layers, shapes and kernels, on its own machine, as it will run
them: one-row decode passes (a sample's latency) and, when the run batches, passes of
`max_batch` rows (the ring's throughput).
"""
import logging
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List

from mdi.model.timing_loop import seconds_per_call

# torch is imported where a torch chunk or torch's own threads are at stake: a node computing
# with ggml sets its threads without loading it.

log = logging.getLogger(__name__)

AUTO = "auto"
WINDOW_S = 0.05  # per candidate and round
ROUNDS = 3  # candidates alternate round by round, so a burst of load elsewhere hits them alike
TIE = 0.03  # within 3% of the fastest, fewer threads win: they leave cores to the rest


def use_fixed(threads: object) -> None:
    """A run's runtime.threads when it is a number: torch set to it (auto and None leave it be).
    Set before the first parallel op: a pool torch starts wider keeps a thread that spins on a
    core, which a board under a CPU quota pays for. Where torch is not loaded yet (a worker that
    may compute with ggml and never load it), OMP_NUM_THREADS says it for when it is."""
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0:
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(threads)
        else:
            os.environ["OMP_NUM_THREADS"] = str(threads)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def candidates(cpus: int) -> List[int]:
    """1, 2, 4, ... up to `cpus`, and `cpus` itself."""
    out, t = [], 1
    while t < cpus:
        out.append(t)
        t *= 2
    return out + [cpus]


@dataclass
class ThreadChoice:
    threads: int
    pass_ms: Dict[int, float] = field(default_factory=dict)  # candidate -> ms of one timed pass set

    def describe(self) -> str:
        chosen = "%d thread%s" % (self.threads, "" if self.threads == 1 else "s")
        if not self.pass_ms:
            return chosen + " (the only choice)"
        return "%s (%s ms per pass)" % (chosen, ", ".join("%d: %.2f" % (t, ms) for t, ms in sorted(self.pass_ms.items())))


def choose_threads(chunk: Any, max_batch: int = 1, cpus: int = 0) -> ThreadChoice:
    """The thread count for which passes through `chunk` (its cache allocated, no run using it
    yet: slot 0.. at position 0 are written and later overwritten by the first prefill) are
    fastest. Leaves torch (or the ggml chunk's backend) set to it."""
    options = candidates(cpus or usable_cpus())
    if chunk.backend == "ggml":
        return _choose_ggml_threads(chunk, max_batch, options)
    import torch
    from mdi.model.row_batch import RowBatch
    cache = chunk.cache
    if len(options) == 1 or cache is None or (chunk.n_layers == 0 and not chunk.with_head):
        torch.set_num_threads(options[-1])
        return ThreadChoice(options[-1])
    config, dtype, device = chunk.config, cache.k.dtype, cache.k.device  # the activations' dtype and device
    sizes = sorted({1, max(1, min(max_batch, cache.n_slots))})

    def one_pass() -> None:
        for rows in sizes:
            x = torch.zeros(rows, config.n_embd, dtype=dtype, device=device)
            y = chunk.forward_rows(x, RowBatch.of(list(range(rows)), [0] * rows, [1] * rows, device))
            if chunk.with_head:
                chunk.head(y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    before = torch.get_num_threads()
    times: Dict[int, List[float]] = {t: [] for t in options}
    try:
        with torch.inference_mode():
            for _ in range(ROUNDS):
                for t in options:
                    torch.set_num_threads(t)
                    times[t].append(seconds_per_call(one_pass, min_window=WINDOW_S, rounds=1))
    except RuntimeError as e:  # e.g. out of memory on a board: keep what torch had
        log.warning("mdi: threads: auto could not time the chunk (%s); keeping %d", e, before)
        torch.set_num_threads(before)
        return ThreadChoice(before)
    ms = {t: 1e3 * statistics.median(v) for t, v in times.items()}
    fastest = min(ms.values())
    best = min(t for t in options if ms[t] <= fastest * (1 + TIE))
    torch.set_num_threads(best)
    return ThreadChoice(best, ms)


def _choose_ggml_threads(chunk: Any, max_batch: int, options: List[int]) -> ThreadChoice:
    """choose_threads for a chunk computing with ggml: its CPU backend's thread count."""
    import numpy as np
    from mdi.model.pass_rows import PassRows
    cache = chunk.cache
    if len(options) == 1 or cache is None or (chunk.n_layers == 0 and not chunk.with_head):
        chunk.set_threads(options[-1])
        return ThreadChoice(options[-1])
    sizes = sorted({1, max(1, min(max_batch, cache.n_slots))})

    def one_pass() -> None:
        for rows in sizes:
            x = np.zeros((rows, chunk.config.n_embd), np.float32)
            y = chunk.forward_rows(x, PassRows(list(range(rows)), [0] * rows, [1] * rows))
            if chunk.with_head:
                chunk.head(y)

    times: Dict[int, List[float]] = {t: [] for t in options}
    for _ in range(ROUNDS):
        for t in options:
            chunk.set_threads(t)
            times[t].append(seconds_per_call(one_pass, min_window=WINDOW_S, rounds=1))
    ms = {t: 1e3 * statistics.median(v) for t, v in times.items()}
    fastest = min(ms.values())
    best = min(t for t in options if ms[t] <= fastest * (1 + TIE))
    chunk.set_threads(best)
    return ThreadChoice(best, ms)
