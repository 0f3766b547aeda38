"""What a pass of several rows costs, in passes of one row (PassCosts), measured on the
starter's chunk at start (measure_pass_costs): the speculation policy's prices."""
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from mdi.model.pass_rows import PassRows
from mdi.starter.pass_compute import takes_host_arrays


@dataclass(frozen=True)
class PassCosts:
    """What a pass of r rows costs, in passes of one row: `relative[r - 1]` (1.0 for one row).
    Measured (measure_pass_costs), as it is not a line: torch's packed int4 CPU kernel
    multiplies rows in blocks of 4, so on SmolLM2 at 1 thread (AVX-512) 4 rows cost about 1.5
    one-row passes and 5 about 2.1. Three drafts per pass then pay where four do not."""
    relative: Tuple[float, ...]

    @classmethod
    def linear(cls, row_cost: float, max_rows: int) -> "PassCosts":
        """Each row beyond the first adds `row_cost` (a model's, or a test's free rows at 0)."""
        return cls(tuple(1.0 + row_cost * r for r in range(max(1, max_rows))))

    def of(self, rows: int) -> float:
        """A pass of `rows` rows; beyond the measured ones, their mean extra row's cost more each."""
        n = len(self.relative)
        if rows <= n:
            return self.relative[max(rows, 1) - 1]
        return self.relative[-1] + self.row_cost * (rows - n)

    @property
    def row_cost(self) -> float:
        """The mean cost of an extra row over the widest measured pass (a one-number summary)."""
        n = len(self.relative)
        return (self.relative[-1] - 1.0) / (n - 1) if n > 1 else 0.0

    def to_json(self) -> List[float]:
        return [round(c, 3) for c in self.relative]

TIMED_ROWS = (1, 2, 3, 4, 5)  # pass sizes always timed: the CPU int4 kernel's first row block and the next
MEASURE_BUDGET_S = 1.0  # timing rounds after the second stop once this much time went (a big model's passes)


def measure_pass_costs(chunk: Any, max_rows: int, repeats: int = 5) -> PassCosts:
    """What a pass of 1 .. max_rows rows through `chunk` costs in passes of one row, run as
    verifications run (decode kernels; row by row attention on a CPU, one call per sample on a
    GPU, as RowBatch.of decides), in a scratch cache slot (slot 0, before any sample holds it).
    Memory-bound layers read their weights once for all rows, so extra rows cost little there;
    compute-bound kernels pay per row or per block of rows.

    With the head where the chunk has one (the starter's): a verification scores every row.
    SmolLM2's int8 head (fbgemm) took 0.88 / 1.01 / 1.09 / 1.56 ms for 1 / 2 / 3 / 4 rows at 1
    thread (AVX-512): fbgemm reads its weight twice from 8 rows, and Int8DynamicLinear makes
    2 x rows + 1 of them. Verifying alone at a = 0.7, 10 prompts, alternating in one run: on a
    loopback ring of 3, timed without the head k = 3 looked best and made 1.45x the plain ring,
    with it k = 2 and 1.60x (1.11x per prompt, better on all 10); on 3 emulated 0.5-core boards
    1.44x against 1.50x (1.04x per prompt, better on 8).

    TIMED_ROWS and max_rows are timed, the sizes between them interpolated; each is the least
    disturbed of up to `repeats` rounds (other processes only add time), at least 2, fewer
    than `repeats` once MEASURE_BUDGET_S has gone (at start: a 7B model's passes take tenths of
    a second each on a board).

    Timed in the process's CPU time, not the wall clock: a board held to a CPU quota (a cgroup,
    mdi-bench's emulated boards, a container) is throttled in whole periods, so a one-row pass
    that fits the period's quota and a longer one that does not differ by the throttling, not
    the work (0.5 core: 2.04 per row by the wall clock, which switched drafting off). A GPU's
    passes are timed by the wall clock, each waited for (its host thread idles meanwhile)."""
    # a slot shorter than 1 + max_draft (a short prompt and few tokens) never holds a longer pass
    max_rows = max(1, min(max_rows, chunk.cache.max_len))
    sizes = sorted({n for n in TIMED_ROWS if n <= max_rows} | {max_rows})
    timings: Dict[int, List[float]] = {n: [] for n in sizes}
    make_pass, on_gpu = _verification_pass(chunk)
    clock = time.perf_counter if on_gpu else time.process_time
    started = time.perf_counter()
    with getattr(chunk, "scratch_graphs", contextlib.nullcontext)():  # ggml's: its graphs go after
        for round_ in range(max(2, repeats)):
            if round_ >= 2 and time.perf_counter() - started > MEASURE_BUDGET_S:
                break
            for n in sizes:
                run = make_pass(n)
                t0 = clock()
                run()
                timings[n].append(clock() - t0)
    one = max(min(timings[1]), 1e-9)
    timed, most = {}, 1.0
    for n in sizes:  # a pass is never cheaper than a shorter one: what says so is noise
        most = max(most, min(timings[n]) / one)
        timed[n] = most
    relative = []
    for rows in range(1, max_rows + 1):
        below = max(n for n in sizes if n <= rows)
        above = min(n for n in sizes if n >= rows)
        share = (rows - below) / (above - below) if above > below else 0.0
        relative.append(timed[below] + share * (timed[above] - timed[below]))
    return PassCosts(tuple(relative))


def _verification_pass(chunk: Any) -> Tuple[Callable[[int], Callable[[], None]], bool]:
    """(n -> a pass of n zero rows in slot 0 through `chunk` and its head, row by row as a
    verification runs; whether it runs on a GPU, each pass then waited for). Its rows are what
    the chunk takes: numpy for ggml's (a ggml starter never loads torch), tensors for torch's."""
    width = chunk.config.n_embd
    if takes_host_arrays(chunk):
        def host_pass(n: int) -> Callable[[], None]:
            x, rows = np.zeros((n, width), dtype=np.float32), PassRows([0], [0], [n], row_wise=True)
            return lambda: chunk.head(chunk.forward_rows(x, rows)) if chunk.with_head else chunk.forward_rows(x, rows)
        return host_pass, False
    import torch

    from mdi.model.row_batch import RowBatch
    device = chunk.device
    on_gpu = device.type == "cuda"

    def torch_pass(n: int) -> Callable[[], None]:
        batch = RowBatch.of([0], [0], [n], device, row_wise=True)
        x = torch.zeros(n, width, dtype=chunk.activation_dtype, device=device)

        def run() -> None:
            with torch.inference_mode():
                y = chunk.forward_rows(x, batch)
                if chunk.with_head:
                    chunk.head(y)
                if on_gpu:
                    torch.cuda.synchronize(device)
        return run
    return torch_pass, on_gpu
