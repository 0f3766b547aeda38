"""Timing one kernel call as a decode step meets it: on a CPU whose caches hold something else.

A decode step reads each layer's weights once, from memory; a call timed on weights the
previous call left in the cache flatters the kernel that reads the most bytes. kernel_choice
times its candidates with `time_call`.
"""
import time
from typing import Callable, List, Sequence

import torch

from mdi.system.devices import last_level_cache_bytes

MEASURE_SECONDS = 0.03  # per candidate and shape


def time_call(fn: Callable[[], torch.Tensor], device: torch.device, evict_from: int,
          resident: Sequence[torch.Tensor] = ()) -> float:
    """The least disturbed of a few calls (other processes only ever add time), each on a CPU
    with its caches first filled with something else: a decode step reads each layer's weights
    once, from memory, and a kernel that reads more bytes than another (fbgemm's padded rows)
    loses there what a call on cached weights hides (SmolLM2's gate_up at 1 thread: 0.17 ms
    cached, ~0.4 in a decode step). Filled by reading, as the other layers fill them: written
    lines would have to go back to memory during the timed call, which slowed the memory-bound
    kernels most and turned choices on the 1.1B shape. `evict_from`: the layer's bytes, for
    `cache_fill` (twice the last-level cache, or nothing: a GPU, a small layer);
    `resident`: tensors the process holds anyway (the chunk's other weights), read first."""
    evict = cache_fill(device, evict_from, resident)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()
    sync()
    times: List[float] = []
    deadline = time.perf_counter() + MEASURE_SECONDS
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 10):
        for t in evict:
            t.max()  # reads in the tensor's own dtype: an int8 sum() first copies it as int64
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


EVICT_FROM_BYTES = 128 * 1024  # smaller layers belong to models that stay cached (tests' tiny ones): timed hot
EVICT_BUFFER_BYTES = 32 * 2 ** 20  # the most a cache fill allocates: part of a load's small fixed overhead


def cache_fill(device: torch.device, layer_bytes: int, resident: Sequence[torch.Tensor] = ()) -> List[torch.Tensor]:
    """What to read before each timed call to fill the CPU's caches: twice the last-level cache.
    Tensors the process holds anyway (the chunk's other weights) come first; only what they
    fall short of is a buffer made here and freed after. A fresh 2x-cache buffer for every layer
    (64 MB on a 32 MB L3), held beside the candidates' packings, set a GGUF load's peak memory;
    the buffer is at most EVICT_BUFFER_BYTES: a VM reporting its host's 300 MB L3 made a 600 MB
    one (the shipped GGUF's load peaked at 1.25x the float32 run's memory). Where the chunk's
    weights fall that short of the cache, a decode step finds them partly cached anyway."""
    if device.type != "cpu" or layer_bytes < EVICT_FROM_BYTES:
        return []
    need = 2 * last_level_cache_bytes("cpu")
    reads: List[torch.Tensor] = []
    for t in sorted((t for t in resident if t.device.type == "cpu" and t.numel()), key=nbytes, reverse=True):
        if need <= 0:
            break
        reads.append(t)
        need -= nbytes(t)
    if need > 0:
        reads.append(torch.ones(-(-min(need, EVICT_BUFFER_BYTES) // 4)))
    return reads


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
