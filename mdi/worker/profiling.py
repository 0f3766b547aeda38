"""POST /profile on a worker: how fast this board runs the asked model's blocks (random weights
of the real shapes, dtype and quantization) and handles a frame, before any weight is sent."""
import time

import torch

from mdi.model import qkernels
from mdi.model.layout import torch_dtype
from mdi.model.profile import time_chunk
from mdi.ring.profile_request import ProfileReply, ProfileRequest, frame_seconds
from mdi.system.devices import resolve_compute_dtype


def profile_here(request: ProfileRequest, device: str) -> ProfileReply:
    """Time the request's passes on `device` with torch's current thread count."""
    t0 = time.perf_counter()
    qkernels.set_preference(request.quant_kernel)
    dtype = torch_dtype(request.dtype)
    asked = request.compute_dtype
    compute, _ = resolve_compute_dtype(device, dtype, torch_dtype(asked) if asked else None)
    timing = time_chunk(request.model, dtype, device, request.quant, request.batch_sizes, request.context,
                        request.prefill_tokens, compute_dtype=compute)
    frames = {b: frame_seconds(b, request.model.n_embd, compute) for b in request.batch_sizes}
    return ProfileReply(timing.layer_s, timing.prefill_token_s, frames, torch.get_num_threads(), device,
                        time.perf_counter() - t0)
