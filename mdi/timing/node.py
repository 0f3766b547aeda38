"""How fast this node runs a /profile request's model (mdi.ring.profile_request is the
contract): its blocks on random weights, a frame's encoding, and its whole relay loop. The
worker answers POST /profile with it; the starter measures itself the same way."""
import time
from typing import TYPE_CHECKING, Callable, Dict, Optional

from mdi.model.sampling import SamplingParams
from mdi.ring.profile_request import ProfileReply, ProfileRequest

if TYPE_CHECKING:  # torch's chunk: its modules are imported where torch's blocks are timed
    from mdi.model.transformer import ModelChunk


def profile_positions(request: ProfileRequest) -> int:
    """Positions of the KV cache a profile of `request` allocates (its decode context or its
    prefill chunk)."""
    return min(request.model.block_size, max(request.context + 1, request.prefill_tokens))


def profile_here(request: ProfileRequest, device: str, with_ends: bool = False,
                 params: Optional[SamplingParams] = None, token: Optional[str] = None,
                 time_loop: Optional[Callable[["ModelChunk"], Dict[int, float]]] = None,
                 n_blocks: Optional[int] = None) -> ProfileReply:
    """Time the request's passes on `device` with the request's threads (a number; else torch's
    current count), then the node's whole loop over the same random blocks (`n_blocks`, default
    `profile_blocks`): what a worker answers POST /profile with (its relay, encrypted as its runs
    are when it has a `token`), and (`with_ends`: its quant layout then names the embedding and
    head too; `time_loop`: its pipeline loop) what the starter measures of itself."""
    if request.backend == "ggml":  # the blocks the run will compute with
        from mdi.timing.ggml_profile import profile_ggml
        return profile_ggml(request, device, with_ends, params, token, time_loop, n_blocks)
    import torch  # torch's blocks (a node that computes with ggml never imports these)

    from mdi.model.threads import use_fixed
    # Set here, torch loaded: OMP_NUM_THREADS set before it came too late where ggml's OpenMP was
    # loaded first (a starter's profile ran at every CPU while its run used runtime.threads)
    use_fixed(request.threads)

    from mdi.model.block_timing import profile_chunk, time_chunk
    from mdi.model.profile_size import profile_blocks
    from mdi.model.layout import torch_dtype
    from mdi.model.quantization import kernel_choice, qkernels
    from mdi.system.devices import resolve_compute_dtype
    from mdi.timing.relay import frame_seconds, time_relay
    t0 = time.perf_counter()
    qkernels.set_preference(request.quant_kernel)
    # A profile sizes its blocks by the stored weights (profile_blocks): kernels that hold more
    # are left to the run, which knows what its memory spares (its plan may time it slower).
    allowance = kernel_choice.memory_allowance()
    kernel_choice.set_memory_allowance(0)
    dtype = torch_dtype(request.dtype)
    asked = request.compute_dtype
    compute, _ = resolve_compute_dtype(device, dtype, torch_dtype(asked) if asked else None)
    if n_blocks is None:
        n_blocks = profile_blocks(request.model, request.dtype, request.quant, device)
    try:
        with kernel_choice.unreported():  # a worker's /status keeps naming its run's kernels
            chunk = profile_chunk(request.model, dtype, device, request.quant, compute, with_ends, n_blocks)
    finally:
        kernel_choice.set_memory_allowance(allowance)
    chunk.fused_decode = request.fused_decode  # before time_chunk allocates its cache (and scripts the blocks)
    timing = time_chunk(chunk, request.batch_sizes, request.context, request.prefill_tokens, params=params)
    frames = {b: frame_seconds(b, request.model.n_embd, compute) for b in request.batch_sizes}
    if time_loop is None:
        loop = time_relay(chunk, request.batch_sizes, request.context, token=token)
    else:
        loop = time_loop(chunk)
    return ProfileReply(timing.layer_s, timing.prefill_token_s, frames, torch.get_num_threads(), device,
                        time.perf_counter() - t0, timing.ends_s, loop, chunk.n_layers)

