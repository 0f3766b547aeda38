"""Host <-> device copies around a frame, made so that a GPU node waits at most once per frame.

A frame's activations arrive as bytes in host memory and leave the same way. From ordinary
(pageable) memory, CUDA's host-to-device copy first waits for everything queued on the stream,
and torch's `.cpu()` waits and then copies through a staging buffer. So a node that moved its
input, its row positions and its slots with plain `.to(device)` paid several waits per frame
before its first layer ran. Here every host-to-device copy goes through page-locked (pinned)
memory and is queued without waiting (`non_blocking`), and the one copy back waits once, for the
whole frame's work. torch's caching host allocator keeps the pinned blocks, and keeps each one
until the copies queued from it are done, so a block is never rewritten under a pending copy.

Measured on an H200 (tests/test_gpu_transfers.py counts the waits with torch's sync debug
mode): one per worker frame, one per starter step. Not yet run on a Jetson, whose GPU shares
the board's RAM. On a CPU node every function here is a plain `.to`: nothing is pinned.
"""
from typing import Any, Optional, Sequence

import numpy as np
import torch


def _is_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def to_device(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`t` on `device` (in `dtype`): a host tensor bound for a GPU is pinned and copied without
    waiting; the dtype conversion runs on the GPU after the copy (the smaller side of a
    float16 -> float32 conversion is the one that travels)."""
    device = torch.device(device)
    if t.device == device and (dtype is None or t.dtype == dtype):
        return t  # what `.to` would return, without its argument parsing (per frame, per token)
    if not _is_gpu(device) or t.device.type != "cpu":
        return t.to(device=device, dtype=dtype)
    on_gpu = t.pin_memory().to(device, non_blocking=True)
    return on_gpu if dtype is None else on_gpu.to(dtype)


def torch_view(t: Any) -> torch.Tensor:
    """A numpy array as a torch tensor on the same memory (no copy); a tensor as it is."""
    return torch.from_numpy(t) if isinstance(t, np.ndarray) else t


def ints_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A list of Python ints as an int64 tensor on `device` (row positions, slots, token ids)."""
    return to_device(torch.tensor(values, dtype=torch.long), torch.device(device))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, for the wire or for sampling. From a GPU: one copy into a pinned
    buffer and one wait, for this copy and the work queued before it (the frame's layers)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out
