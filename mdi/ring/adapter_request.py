"""POST /adapters/<id> (contract): one adapter's low-rank matrices for the layers a worker holds,
as safetensors bytes: "<layer>.lora_A" [r, in] and "<layer>.lora_B" [out, r] for each linear
layer it changes (mdi's names, e.g. "blocks.3.attn.qkv"; the scale folded into B). Safetensors
only, nothing that runs code when read. Both ends use these two functions; a worker computing
with ggml reads the body as numpy arrays (`arrays`), so torch stays unloaded there."""
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from mdi.ring.init_request import RequestError

from mdi.ring.body_limits import MAX_ADAPTER_BYTES  # noqa: E402,F401  (named from here too)
MAX_RANK = 4096


class AdapterTooLarge(ValueError):
    """Matrices a worker would refuse by their size alone (MAX_ADAPTER_BYTES)."""


def adapter_body(weights: Mapping[str, Tuple[Any, Any]]) -> bytes:
    """The body of (A, B) pairs (numpy arrays or torch tensors), in float32; AdapterTooLarge
    past what a worker takes (a mix of two rank-256 adapters had been read, fused and sent
    only to be refused by the worker, as a 502)."""
    from safetensors.numpy import save as safetensors_save

    from mdi.model.sampling import host_array
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[name + ".lora_A"] = np.ascontiguousarray(host_array(a))
        tensors[name + ".lora_B"] = np.ascontiguousarray(host_array(b))
    body: bytes = safetensors_save(tensors)
    if len(body) > MAX_ADAPTER_BYTES:  # (the whole body, as the worker counts it: its header too)
        raise AdapterTooLarge("its matrices for these layers are %.1f MB, over the %d MB an adapter body may take "
                              "(a lower rank, fewer adapters in a mix, or more workers)"
                              % (len(body) / 2 ** 20, MAX_ADAPTER_BYTES >> 20))
    return body


def read_adapter_tensors(body: bytes, arrays: bool = False) -> Dict[str, Tuple[Any, Any]]:
    """The body as {layer: (A, B)} (torch tensors, or numpy arrays with `arrays`), or a
    RequestError naming what is wrong."""
    if not body or len(body) > MAX_ADAPTER_BYTES:
        raise RequestError("an adapter body is 1 to %d bytes of safetensors" % MAX_ADAPTER_BYTES)
    if arrays:  # a ggml worker: no torch in its process
        from safetensors.numpy import load as load_arrays
        loader: Any = load_arrays
    else:
        from safetensors.torch import load as load_tensors
        loader = load_tensors
    try:
        tensors: Dict[str, Any] = loader(bytes(body))
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise RequestError("adapter body is not a safetensors file: %s" % e)
    out = {}
    for key in tensors:
        base, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B") or not base:
            raise RequestError("adapter tensor %r: expected <layer>.lora_A or <layer>.lora_B" % key[:120])
        a, b = tensors.get(base + ".lora_A"), tensors.get(base + ".lora_B")
        if a is None or b is None:
            raise RequestError("adapter layer %r needs both lora_A and lora_B" % base[:120])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or not 1 <= a.shape[0] <= MAX_RANK:
            raise RequestError("adapter layer %r: lora_A %s and lora_B %s are not [r, in] and [out, r]"
                               % (base[:120], list(a.shape), list(b.shape)))
        if arrays:
            floats = np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating)
        else:
            floats = a.dtype.is_floating_point and b.dtype.is_floating_point
        if not floats:
            raise RequestError("adapter layer %r: float tensors expected" % base[:120])
        finite = (np.isfinite(a).all() and np.isfinite(b).all()) if arrays else (a.isfinite().all() and b.isfinite().all())
        if not finite:
            raise RequestError("adapter layer %r holds NaN or infinite values" % base[:120])
        out[base] = (a, b)
    return out
