"""An adapter's matrices reaching a worker (POST /adapters/<id>): held within the worker's
memory budget like its weights (a board limited to 0.7 GB had held 1.28 GB of adapters and of
the mixes any client may ask for), refused before they are unpacked when they cannot fit."""
from typing import Any, Dict, Optional

from mdi.ring.init_request import RequestError, TooLarge
from mdi.system.memory import release_freed_memory


def hold_adapter(chunk: Any, adapter: int, body: bytes, held: int, limit: Optional[int], what: str) -> Dict[str, Any]:
    """Set adapter `adapter` (safetensors `body`: "<layer>.lora_A" [r, in], "<layer>.lora_B"
    [out, r], scale folded in) on `chunk`, the worker holding `held` bytes of the `limit` it
    may use (None: no limit; `what`: where the limit comes from, for the refusal)."""
    def refuse(nbytes: int) -> TooLarge:
        return TooLarge("adapter %d needs %.1f MB, but this worker holds %.1f MB of the %.1f MB it may use (%s)"
                        % (adapter, nbytes / 2 ** 20, held / 2 ** 20, (limit or 0) / 2 ** 20, what))
    # ggml holds the float32 body's pairs in float16 (mdi.model.ggml.adapters): judged by the
    # body's size, a ggml board took a third of the adapters it could hold (h66)
    needs = len(body) // 2 if chunk.backend == "ggml" else len(body)
    if limit is not None and held + needs > limit:
        raise refuse(needs)
    from mdi.ring.adapter_request import read_adapter_tensors  # numpy on ggml: torch stays unloaded
    tensors = read_adapter_tensors(body, arrays=chunk.backend == "ggml")
    before = chunk.adapter_bytes
    try:
        chunk.set_adapter(adapter, tensors)
    except ValueError as e:
        raise RequestError(str(e))
    finally:
        del tensors
        release_freed_memory()  # the unpacked copies go back to the OS, as a drop's do (RSS stayed 6x up)
    grown = chunk.adapter_bytes - before
    if limit is not None and held + grown > limit:  # more than guessed: float32 pairs (adapters.pair_type)
        chunk.drop_adapter(adapter)
        release_freed_memory()
        raise refuse(grown)
    return {"ok": True, "adapter": adapter, "bytes": chunk.adapter_bytes}
