"""POST /profile for a node that will compute with ggml: the request's passes timed on random
blocks of the model's real dims and GGUF types (mdi.model.ggml.random_weights), the frames and
the node's whole relay loop as mdi.timing.node times torch's. No torch here unless the caller
has it (a starter timing its embedding, head and sampling does): a ggml worker stays without it."""
import sys
import time
from typing import Any, Callable, Dict, Optional

from mdi.model.config import ModelConfig
from mdi.model.files.gguf_write import remove_quietly
from mdi.model.ggml import lib
from mdi.model.ggml.chunk import GgmlChunk
from mdi.model.ggml.kv_cache import kv_cache_bytes
from mdi.model.ggml.random_weights import probe_block_bytes, write_probe_gguf
from mdi.model.ggml.weights import GgufWeights
from mdi.model.pass_rows import PassRows
from mdi.model.threads import usable_cpus
from mdi.model.timing_loop import PROFILE_LAYERS, seconds_per_call
from mdi.ring.profile_request import ProfileReply, ProfileRequest
from mdi.timing.relay import frame_seconds, time_relay


def probe_blocks(request: ProfileRequest, n_blocks: Optional[int] = None) -> int:
    """How many random blocks profile_ggml times."""
    return max(1, min(n_blocks or PROFILE_LAYERS, request.model.n_layer))


def probe_max_len(request: ProfileRequest) -> int:
    """The positions of the probe's cache: its context and its prefill."""
    return min(request.model.block_size, max(request.context + 1, request.prefill_tokens))


def probe_bytes(request: ProfileRequest) -> int:
    """What profile_ggml holds at its peak: its blocks twice (built in memory, then the probe
    GGUF mapped) and the cache of its widest pass (a worker refuses what its memory cannot)."""
    n = probe_blocks(request)
    return (2 * n * probe_block_bytes(request.model, request.layer_types)
            + kv_cache_bytes(request.model, 0, n, max(request.batch_sizes), probe_max_len(request), request.kv_type))


def profile_ggml(request: ProfileRequest, device: str, with_ends: bool = False, params: Any = None,
                 token: Optional[str] = None, time_loop: Optional[Callable[[Any], Dict[int, float]]] = None,
                 n_blocks: Optional[int] = None) -> ProfileReply:
    t0 = time.perf_counter()
    config = request.model
    n = probe_blocks(request, n_blocks)
    threads = request.threads if isinstance(request.threads, int) else usable_cpus()
    path = write_probe_gguf(config, request.layer_types, n, with_ends, request.end_types)
    chunk = None
    try:
        chunk = GgmlChunk(config, 0, n, with_ends, with_ends, GgufWeights(path), lib.ROPE_NEOX, threads,
                          request.kv_type, request.repack)
        layer_s, prefill_s, ends_s = _time_passes(chunk, request, with_ends, params)
        frames = {b: frame_seconds(b, config.n_embd) for b in request.batch_sizes}
        loop = time_loop(chunk) if time_loop is not None else time_relay(chunk, request.batch_sizes, request.context,
                                                                          token=token)
        return ProfileReply(layer_s, prefill_s, frames, threads, device, time.perf_counter() - t0, ends_s, loop, n)
    finally:
        if chunk is not None:  # its weights, graphs and cache now, not at the next collection
            chunk.close()
        remove_quietly(path)


def _time_passes(chunk: GgmlChunk, request: ProfileRequest, with_ends: bool, params: Any):
    import numpy as np
    config: ModelConfig = chunk.config
    rows_max = max(request.batch_sizes)
    max_len = probe_max_len(request)
    context = min(request.context, max_len - 1)
    chunk.allocate_cache(rows_max, max_len)
    layer_s: Dict[int, float] = {}
    ends_s: Dict[int, float] = {}
    for rows in sorted(set(request.batch_sizes)):
        x = np.zeros((rows, config.n_embd), np.float32)
        batch = PassRows(list(range(rows)), [context] * rows, [1] * rows)

        def decode(x: Any = x, batch: PassRows = batch) -> Any:
            return chunk.forward_rows(x, batch)
        layer_s[rows] = seconds_per_call(decode) / chunk.n_layers
        if with_ends and "torch" in sys.modules:  # the starter: its embedding, head and sampling per pass
            from mdi.model.block_timing import ends_pass
            from mdi.model.sampling import SamplingParams
            ends_s[rows] = seconds_per_call(ends_pass(chunk, rows, context, "cpu", params or SamplingParams()))
    tokens = request.prefill_tokens
    xp = np.zeros((tokens, config.n_embd), np.float32)
    prefill = seconds_per_call(lambda: chunk.forward_rows(xp, PassRows([0], [0], [tokens])), rounds=1)
    chunk.free_cache()
    return layer_s, prefill / (chunk.n_layers * tokens), ends_s
