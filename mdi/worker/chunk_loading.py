"""Weights read into a worker's chunk, torch's or ggml's, and what a run's weights and KV cache
take in memory as the backend keeps them (what /init checks against the worker's limit)."""
from typing import Any, Optional, Tuple

from mdi.model.ggml.kv_cache import kv_cache_bytes
from mdi.model.ggml.tensors import typed_bytes
from mdi.model.layout import CheckpointError, torch_dtype, torch_kv_cache_bytes, weight_bytes
from mdi.ring.init_request import InitRequest, RequestError
from mdi.worker.weight_intake import LoadedWeights


def run_cache_bytes(request: InitRequest, backend: str, compute: Any) -> Tuple[int, int]:
    """(the run's KV cache, one position's of one slot) in bytes, as `backend` keeps them."""
    config, (first, last) = request.model, request.layers
    if backend == "ggml":
        return (kv_cache_bytes(config, first, last, request.n_slots, request.max_len, request.kv_type,
                               request.prefill_chunk),
                kv_cache_bytes(config, first, last, 1, 1, request.kv_type))
    return (torch_kv_cache_bytes(config, last - first, request.n_slots, request.max_len, compute),
            torch_kv_cache_bytes(config, last - first, 1, 1, compute))


def loaded_weights_bytes(request: InitRequest, key: LoadedWeights) -> int:
    """What the weights `key` names take once loaded (ggml: its GGUF tensors as stored)."""
    first, last = key.layers
    if key.backend == "ggml":
        return typed_bytes(request.model, request.gguf_types, first, last)
    return weight_bytes(request.model, [first, last], request.dtype, quant=request.quant)


def load_torch_chunk(key: LoadedWeights, quant: Any, fn: str, exact: bool, kernel_memory: Any,
                     spare: Optional[int]) -> Any:
    """Layers [first, last) from `fn` as torch's ModelChunk. Kernels may hold more than the
    stored weights only within runtime.kernel_memory (`kernel_memory`), and what the memory
    spares (`spare`, None: unknown). The caller set the run's threads first: kernels are
    measured with the threads the run will use."""
    from mdi.model.quantization import kernel_choice, qkernels
    from mdi.model.source import build_chunk_from_file
    first, last = key.layers
    qkernels.set_preference(key.quant_kernel)
    kernel_choice.set_memory_allowance(kernel_choice.allowance_for(kernel_memory, spare))
    kernel_choice.start_report()  # reports name these layers' kernels only
    try:
        return build_chunk_from_file(key.model, fn, first, last, torch_dtype(key.dtype), key.device, exact, quant)
    except (CheckpointError, OSError, ValueError, RuntimeError) as e:
        where = "pushed weights" if exact else "weights"
        raise RequestError("cannot load %s for layers [%d, %d): %s" % (where, first, last, e))


def load_ggml_chunk(key: LoadedWeights, fn: str, threads: int) -> Any:
    """Layers [first, last) from a GGUF (the model's own, or the node's part pushed): its
    tensors as stored, checked against the model before a graph is built."""
    from mdi.model.files.gguf_config import rope_mode_of, rope_permuted
    from mdi.model.files.gguf_layout import open_reader
    from mdi.model.ggml.chunk import GgmlChunk
    from mdi.model.ggml.weights import GgufWeights
    first, last = key.layers
    try:
        reader = open_reader(fn)
        return GgmlChunk(key.model, first, last, False, False, GgufWeights(fn, reader),
                         rope_mode_of(rope_permuted(reader, fn)), threads, key.kv_type, key.repack, key.device)
    except (CheckpointError, OSError, ValueError, RuntimeError, MemoryError) as e:
        raise RequestError("cannot load the GGUF weights for layers [%d, %d): %s" % (first, last, e))
