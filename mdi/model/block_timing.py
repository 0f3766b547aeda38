"""How fast this machine runs a model's blocks, timed on random weights of the real shapes,
dtype and quantization: a board is profiled before any weight is sent (the planner,
mdi.starter.planning.planner, splits the layers by these numbers).

Times are wall-clock seconds per call averaged over a window of at least `MIN_WINDOW_S`: a
board under a CPU quota (a cgroup, or a Jetson's power mode) runs in bursts, and only a window
of many scheduler periods shows its real speed.
"""
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from mdi.model.config import ModelConfig
from mdi.model.layout import QuantLayout
from mdi.model.profile_size import repeated_layout
from mdi.model.row_batch import RowBatch
from mdi.model.sampling import SamplingParams, sample_generator, sample_next
from mdi.model.source import random_chunk
from mdi.model.timing_loop import PROFILE_LAYERS, seconds_per_call
from mdi.model.transformer import ModelChunk

@dataclass
class ChunkTiming:
    """Seconds on this machine. Keys of the dicts are rows per pass (samples of one decode row
    each); `layer_s` is per block, `ends_s` the starter's embedding + final norm + head +
    sampling per pass (only when asked for)."""
    layer_s: Dict[int, float]
    prefill_token_s: float  # per block per prompt token, in a pass of `prefill_tokens`
    prefill_tokens: int
    ends_s: Dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0  # how long the profile took


def profile_chunk(config: ModelConfig, dtype: torch.dtype, device: str, quant: Optional[QuantLayout],
                  compute_dtype: Optional[torch.dtype] = None, with_ends: bool = False,
                  n_blocks: int = PROFILE_LAYERS) -> ModelChunk:
    """`n_blocks` random blocks (`profile_blocks`) of the model's shapes, dtype and quantization
    (`with_ends`: the embedding and head too, as the starter holds them): what a node times."""
    n = min(n_blocks, config.n_layer)
    return random_chunk(config, 0, n, with_ends, with_ends, dtype, device, compute_dtype, repeated_layout(quant, n))


def time_chunk(chunk: ModelChunk, batch_sizes: Sequence[int], context: int, prefill_tokens: int,
               params: Optional[SamplingParams] = None) -> ChunkTiming:
    """Decode passes of every size in `batch_sizes` (each sample one row at position `context`)
    and one prefill pass of `prefill_tokens`, through a `profile_chunk` (with its head: the
    starter's embedding, head and sampling per pass too)."""
    t_start = time.perf_counter()
    config, n_layers, with_ends = chunk.config, chunk.n_layers, chunk.with_head
    rows_max = max(batch_sizes)
    max_len = min(config.block_size, max(context + 1, prefill_tokens))
    context = min(context, max_len - 1)
    cache = chunk.allocate_cache(rows_max, max_len)
    work, dev = cache.k.dtype, cache.k.device  # the activations' dtype and device
    layer_s: Dict[int, float] = {}
    ends_s: Dict[int, float] = {}
    with torch.inference_mode():
        for rows in sorted(set(batch_sizes)):
            x = torch.randn(rows, config.n_embd, dtype=work, device=dev)
            slots = list(range(rows))

            def decode(x=x, slots=slots, rows=rows):
                return chunk.forward_rows(x, RowBatch.of(slots, [context] * rows, [1] * rows, dev))
            layer_s[rows] = seconds_per_call(decode) / n_layers
            if with_ends:
                ends_s[rows] = seconds_per_call(ends_pass(chunk, rows, context, dev, params or SamplingParams()))
        x = torch.randn(prefill_tokens, config.n_embd, dtype=work, device=dev)
        prefill = seconds_per_call(lambda: chunk.forward_rows(x, RowBatch.of([0], [0], [prefill_tokens], dev)),
                                   rounds=1)
    return ChunkTiming(layer_s, prefill / (n_layers * prefill_tokens), prefill_tokens, ends_s,
                       time.perf_counter() - t_start)


def ends_pass(chunk: Any, rows: int, position: int, device: Any,
              params: SamplingParams) -> Callable[[], List[int]]:
    """What the starter does per pass besides its blocks: embed the new tokens, then the final
    norm, the head over the rows that sample and each sample's own draw."""
    ids = torch.randint(0, chunk.config.vocab_size, (rows,), device=device)
    positions = torch.full((rows,), position, dtype=torch.long, device=device)
    gens = [sample_generator(1, i) for i in range(rows)]

    def run() -> List[int]:
        x = chunk.embed_rows(ids, positions)
        logits = chunk.head(x)
        return [sample_next(row, params, gen) for row, gen in zip(logits, gens)]
    return run
