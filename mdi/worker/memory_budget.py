"""What a worker may give a run: one rule (`memory_limit`) behind its loads, its KV cache check,
the adapters it takes and the capacity its /status reports to planners; and what it holds now."""
from typing import Any, Optional, Tuple

from mdi.ring.init_request import InitRequest, TooLarge
from mdi.system.memory import LOAD_HEADROOM_BYTES, free_bytes_on


def chunk_nbytes(chunk: Optional[Any]) -> int:
    """Bytes of the weights this worker holds, quantized ones as their kernel keeps them (the
    KV cache is counted apart); a torch or a ggml chunk."""
    return chunk.weight_bytes if chunk is not None else 0


def held_bytes(chunk: Optional[Any]) -> int:
    """What a worker holds now for a run: weights, adapters and KV cache."""
    if chunk is None:
        return 0
    return chunk_nbytes(chunk) + chunk.adapter_bytes + (chunk.cache.nbytes if chunk.cache is not None else 0)


def training_bytes(run: Optional[Any]) -> int:
    """What a run's training job holds (its LoRA pairs and their optimizer state); 0 when none."""
    training = run.training if run is not None else None
    return training.nbytes if training is not None else 0


def memory_limit(max_memory: Optional[int], device: str, held: int) -> Tuple[Optional[int], str]:
    """(bytes, what): the most memory a worker gives a run's weights and KV cache on `device`:
    its --max-memory, else the memory free there (a discrete GPU's own) plus what it holds now
    (`held`) and lets go of for the next run (weights, adapters, cache), less what a run needs
    beside its weights and cache (LOAD_HEADROOM_BYTES). None: unknown."""
    if max_memory is not None:
        return max_memory, "--max-memory"
    avail = free_bytes_on(device)
    if avail is None:
        return None, "unknown"
    return (max(0, avail + held - LOAD_HEADROOM_BYTES),
            "available memory less %d MB a run needs beside them" % (LOAD_HEADROOM_BYTES >> 20))


def check_cache_fits(request: InitRequest, cache_bytes: int, limit: Optional[int], what: str) -> None:
    """Refuse an /init whose KV cache is over its own budget or the worker's limit."""
    budget = request.cache_budget_bytes
    if budget is not None and cache_bytes > budget:
        raise TooLarge("KV cache needs %d bytes, over the budget of %d" % (cache_bytes, budget))
    if limit is not None and cache_bytes > limit:
        raise TooLarge("KV cache of %d bytes does not fit in this worker's limit of %d bytes (%s)"
                           % (cache_bytes, limit, what))
