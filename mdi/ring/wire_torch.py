"""The wire codecs' arithmetic on torch tensors (mdi.ring.wire names the format and validates
frames; mdi.ring.wire_numpy computes the same codecs on numpy arrays for a node without torch).
A process with torch loaded decodes frames to tensors with these."""
from dataclasses import dataclass
from typing import Any, Tuple

import torch
import torch.nn.functional as F

from mdi.model.layout import torch_dtype
from mdi.ring.wire_format import FP16_MAX as _FP16_MAX, INT8_BLOCK, INT8_MAX_WIDTH, FrameError
from mdi.ring.wire_format import outliers as _outliers
from mdi.system.transfers import to_host

_CAST = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # codecs that are a plain cast


def encode_payload(t: torch.Tensor, codec: str) -> memoryview:
    """The payload bytes of tensor `t` in `codec`: a zero-copy view for raw, one converted copy else."""
    t = to_host(t.detach())  # from a GPU: the frame's one wait
    if codec == "raw":
        return _byte_view(t)
    if codec in _CAST:
        return _byte_view(t.to(_CAST[codec]))
    return _encode_int8(t)


def decode_payload(buf: Any, rows: int, width: int, dtype: str, codec: str) -> torch.Tensor:
    # zmq's buffer is read-only and nothing writes activations in place, so wrapping it without
    # a copy is safe (torch warns about it once; entry points silence that warning).
    dt = torch_dtype(dtype)
    if codec == "raw":
        return torch.frombuffer(buf, dtype=dt).view(rows, width)
    if codec in _CAST:
        return torch.frombuffer(buf, dtype=_CAST[codec]).view(rows, width).to(dt)
    return _decode_int8(buf, rows, width, dt)


def quantize_int8_blocks(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] float -> (int8 [rows, width], float16 scales [rows, ceil(width / 32)]).
    Values are rounded against the float16 scale as stored, so what is sent is what was rounded
    against: each decoded value is within half its block's scale (absmax blocks at float16's
    limit excepted: scales clamp at 65504, so values beyond 127 * 65504 saturate)."""
    if x.dim() != 2:
        raise ValueError("int8 blocks need a [rows, width] tensor, got shape %s" % list(x.shape))
    rows, width = x.shape
    blocks = -(-width // INT8_BLOCK)
    pad = blocks * INT8_BLOCK - width
    g = x.detach().float()
    if pad:
        g = F.pad(g, (0, pad))  # zeros change no block's absmax
    g = g.reshape(rows, blocks, INT8_BLOCK)
    scales = (g.abs().amax(-1) / 127.0).clamp_(max=_FP16_MAX).half()
    s = scales.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero (or underflowing) block: q = 0, not 0/0
    q = torch.div(g, s[..., None])  # a new tensor: g may be the caller's own float32 memory
    q = q.round_().clamp_(-127, 127).to(torch.int8).view(rows, blocks * INT8_BLOCK)
    if pad:
        q = q[:, :width].contiguous()
    return q, scales


def dequantize_int8_blocks(q: torch.Tensor, scales: torch.Tensor, width: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_int8_blocks`: int8 values (any shape holding rows * width, e.g.
    a flat wire buffer) and their float16 block scales -> a new [rows, width] tensor of `dtype`."""
    rows = q.numel() // width
    blocks = -(-width // INT8_BLOCK)
    pad = blocks * INT8_BLOCK - width
    v = q.reshape(rows, width).float()
    if pad:
        v = F.pad(v, (0, pad))
    v = v.view(rows, blocks, INT8_BLOCK).mul_(scales.reshape(rows, blocks, 1).float())
    v = v.view(rows, blocks * INT8_BLOCK)
    if pad:
        v = v[:, :width]
    return v.to(dtype).contiguous()


def _byte_view(t: torch.Tensor) -> memoryview:
    # A byte view works for every dtype, bfloat16 included (numpy has no bfloat16).
    # ignore: numpy's stubs declare ndarray's buffer protocol only for Python >= 3.12.
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]


@dataclass
class Int8Rows:
    """The int8 codec's parts for [rows, width] activations (see the module docstring)."""
    q: torch.Tensor  # int8 [rows, width], the outliers' places zero
    scales: torch.Tensor  # float16 [rows, ceil(width / 32)]
    columns: torch.Tensor  # int64 [rows, k]: where each row's outliers are
    values: torch.Tensor  # float16 [rows, k]: the outliers


def quantize_int8(x: torch.Tensor) -> Int8Rows:
    rows, width = x.shape
    if width > INT8_MAX_WIDTH:
        raise ValueError("codec int8 carries rows of at most %d values, not %d" % (INT8_MAX_WIDTH, width))
    g = x.detach().float().clone()  # the outliers are zeroed in this copy, not in the caller's tensor
    columns = g.abs().topk(_outliers(width), dim=1).indices
    values = g.gather(1, columns).clamp(-_FP16_MAX, _FP16_MAX).half()
    g.scatter_(1, columns, 0.0)
    q, scales = quantize_int8_blocks(g)
    return Int8Rows(q, scales, columns, values)


def dequantize_int8(parts: Int8Rows, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = dequantize_int8_blocks(parts.q, parts.scales, width, torch.float32)
    x.scatter_(1, parts.columns, parts.values.float())
    return x.to(dtype)


def _encode_int8(t: torch.Tensor) -> memoryview:
    p = quantize_int8(t)
    parts = [p.q.view(torch.uint8), p.scales.view(torch.uint8), p.columns.to(torch.int16).view(torch.uint8),
             p.values.view(torch.uint8)]
    # ignore: as in _byte_view
    return memoryview(torch.cat([part.reshape(-1) for part in parts]).numpy())  # type: ignore[arg-type]


def _decode_int8(buf: Any, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    n, k = rows * width, _outliers(width)
    n_scales = rows * -(-width // INT8_BLOCK)
    q = torch.frombuffer(buf, dtype=torch.int8, count=n)
    # The parts after the values may start at odd byte offsets: copy them (1/16 of the values'
    # bytes and less) rather than read float16/int16 at unaligned addresses.
    tail = torch.frombuffer(buf, dtype=torch.uint8, offset=n).clone()
    scales = tail[:2 * n_scales].view(torch.float16)
    columns = tail[2 * n_scales:2 * n_scales + 2 * rows * k].view(torch.int16).view(rows, k).long()
    values = tail[2 * n_scales + 2 * rows * k:].view(torch.float16).view(rows, k)
    if rows and (int(columns.min()) < 0 or int(columns.max()) >= width):
        raise FrameError("int8 outlier column outside [0, %d)" % width)
    return dequantize_int8(Int8Rows(q, scales, columns, values), width, dtype)


