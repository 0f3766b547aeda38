"""Decode and verification steps over a chunk's blocks as CUDA graph replays.

On a GPU a decode step is bound by launching its ~30 kernels per layer from Python, not by the
GPU: SmolLM2 in float16 kept an H200 11% busy (results/gpu/README.md). A CUDA graph records a
step's kernels once and replays them all with one launch. A graph replays fixed shapes and
addresses, so the step it records differs from the eager one in two ways:
- each sample's slot and its rows' positions are read from small device tensors, copied in
  before each replay (RoPE tables and the KV writes are gathered and indexed with them);
- attention reads each sample's whole cache slot, the positions past each row's masked
  (attention.attend_decode_rows over whole slots), where the eager step reads up to the
  longest position in the frame: the same arithmetic up to rounding.
A step is a frame whose samples bring the same number of rows: one each (decode), or 1 + k
each (a speculative verification, mdi.starter.speculation: recorded too, as left eager its
passes cost several recorded one-row steps and drafting lost to plain decoding, 0.62x the
plain ring at a = 0.7 on an H200, SmolLM2 shape). One graph per
(samples, rows per sample, dtype), recorded at its first use (after two eager runs of that very
step: each writes the same keys and values at the same positions, so recording costs nothing
but time), all in one memory pool, and dropped with the cache it points into. What a step
holds beyond the eager one: attention's gathered keys and values span whole slots, not the
longest position (per layer, samples x slot length). A short prompt (up to MAX_ROWS rows) is
such a frame too. Frames it does not cover run the eager blocks: longer prompts, frames of
unequal samples, adapters' samples, verifications attending row by row (`RowBatch.row_wise`),
anything under autograd, CPUs. `MDI_CUDA_GRAPHS=0` turns it off. Gemma 3's sliding-window
layers are recorded too: their window's mask and their RoPE base's tables are a step's as well.
"""
import logging
import os
from typing import Any, Dict, Optional, Set, Tuple

import torch

from mdi.model.row_batch import RowBatch, decode_window_key
from mdi.system.transfers import ints_to_device, to_device

log = logging.getLogger(__name__)

ENV = "MDI_CUDA_GRAPHS"  # "0": every frame on a GPU runs the eager blocks


def enabled() -> bool:
    """Read at each call, not at import: a benchmark or test that sets the variable later is heard."""
    return os.environ.get(ENV, "1") != "0"


MAX_ROWS = 16  # rows per sample a step may carry: 1 + the most drafts (runtime's max_draft is 32: eager beyond)


def covers(x: torch.Tensor, batch: RowBatch) -> bool:
    """Whether a graph may replay this frame: on a GPU, without autograd, every sample with the
    same rows (one, or a verification's few, not attending row by row), no adapter (its rows'
    deltas are chosen per frame)."""
    rows = batch.counts[0]
    # not under autograd: a replay records no graph of its own for backward (training runs
    # forward_batch anyway; inference runs under inference_mode)
    return x.is_cuda and not torch.is_grad_enabled() and batch.adapters is None and rows <= MAX_ROWS \
        and all(c == rows for c in batch.counts) and not (rows > 1 and batch.row_wise) and enabled() \
        and hasattr(torch.cuda, "CUDAGraph")


class DecodeStep:
    """One step of `n` samples of `rows` rows each over a chunk's blocks, on static tensors:
    recorded as a CUDA graph (`record`), or run eagerly on them (a CPU's check of the same logic)."""

    def __init__(self, chunk: Any, n: int, rows: int, dtype: torch.dtype, record: bool) -> None:
        cache = chunk.cache
        device = cache.k.device
        self.rows = rows
        self.groups = chunk.config.n_head // chunk.config.n_kv_head  # query heads per KV head
        self.x = torch.zeros(n * rows, chunk.config.n_embd, dtype=dtype, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n * rows, dtype=torch.long, device=device)
        self.steps = torch.arange(cache.max_len, device=device)  # the positions a slot holds
        self.record = record
        self.graph: Optional[Any] = None
        self.out: Optional[torch.Tensor] = None
        if chunk.rope is not None:
            chunk.rope.reserve(cache.max_len)  # its tables are never reallocated under the graph

    def _run(self, chunk: Any) -> torch.Tensor:
        n, r = self.slots.shape[0], self.rows
        # Python-side placeholders: with `whole_slots` attention reads only the device tensors
        batch = RowBatch(list(range(n)), [0] * n, [r] * n, self.positions, whole_slots=True)
        # each query row (g, t) of a sample sees its slot up to row t's position
        seen = self.positions.view(n, 1, r).expand(n, self.groups, r).reshape(n, self.groups * r)
        mask = self.steps[None, None, :] <= seen[:, :, None]
        batch.decode_tables = (self.slots, self.positions, mask[:, None])
        window = chunk.config.sliding_window
        if window:  # Gemma 3's sliding-window layers: each row sees its last `window` positions
            narrowed = mask & (self.steps[None, None, :] > seen[:, :, None] - window)
            batch.window_masks[decode_window_key(window)] = narrowed[:, None]
        if chunk.rope is not None:
            for rope in (chunk.rope, chunk.rope.local):
                if rope is not None:
                    tables = (rope.cos[self.positions].to(self.x.dtype).unsqueeze(1),
                              rope.sin_signed[self.positions].to(self.x.dtype).unsqueeze(1))
                    if rope.is_local:
                        batch.local_rope_tables = tables
                    else:
                        batch.rope_tables = tables
        x = self.x
        for block, (k, v) in zip(chunk.blocks.values(), chunk.cache.layers):
            x = block(x, k, v, batch, chunk.rope)
        return x

    def __call__(self, chunk: Any, x: torch.Tensor, batch: RowBatch, pool: Optional[Any] = None) -> torch.Tensor:
        """The step's output for frame `x`; recorded first where it never was, in `pool` (the
        memory pool of the chunk's other steps: each replay's output is copied out at once and
        the next replay needs nothing of the last, so one pool serves them all)."""
        self.x.copy_(x)
        self.slots.copy_(ints_to_device(batch.slots, self.slots.device))  # pinned, not waited for
        self.positions.copy_(to_device(batch.positions, self.positions.device))
        if not self.record:
            return self._run(chunk)
        if self.graph is None:
            device = self.x.device
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm: kernels chosen and libraries' workspaces made
                for _ in range(2):
                    self._run(chunk)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with _capturing(graph, pool):
                self.out = self._run(chunk)
            self.graph = graph
        self.graph.replay()
        assert self.out is not None
        return self.out.clone()  # the next replay writes over `out`


def _capturing(graph: Any, pool: Optional[Any]) -> Any:
    """torch.cuda.graph over this thread's work only where torch can (2.1+): a worker's other
    threads (its receiver, heartbeats) may touch the GPU meanwhile, which would void a global
    capture."""
    try:
        return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
    except TypeError:
        return torch.cuda.graph(graph, pool=pool)


class Recorder:
    """A chunk's recorded decode steps, by number of samples and dtype, in one memory pool."""

    def __init__(self) -> None:
        self.steps: Dict[Tuple[int, int, torch.dtype], DecodeStep] = {}  # by (samples, rows each, dtype)
        self.pool: Optional[Any] = None
        self.failed: Set[Tuple[int, int, torch.dtype]] = set()  # recording failed: those frames run eagerly

    def forward(self, chunk: Any, x: torch.Tensor, batch: RowBatch) -> Optional[torch.Tensor]:
        """The blocks over a frame by its recorded step, or None where no graph covers it."""
        if not covers(x, batch):
            return None
        key = (len(batch.slots), batch.counts[0], x.dtype)
        if key in self.failed:
            return None
        step = self.steps.get(key)
        try:
            if step is None:
                step = self.steps[key] = DecodeStep(chunk, key[0], key[1], x.dtype, record=True)
            out = step(chunk, x, batch, self.pool)
        except RuntimeError as e:  # an op this torch cannot record: the eager blocks, for this shape
            self.steps.pop(key, None)
            self.failed.add(key)
            log.warning("layers [%d, %d): steps of %d samples x %d rows run eagerly: recording a CUDA graph "
                        "failed: %s", chunk.first, chunk.last, key[0], key[1], str(e).splitlines()[0][:160])
            return None
        if self.pool is None and step.graph is not None:
            self.pool = step.graph.pool()
        return out
