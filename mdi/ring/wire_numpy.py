"""The wire codecs' arithmetic on numpy arrays, for a node that computes without torch (the
ggml backend): the same bytes as mdi.ring.wire_torch's for the same values (mdi.ring.wire
names the format; tests/test_wire_codec.py holds the two to each other). Activations decode
to float32 (a bfloat16 payload too: numpy has no bfloat16), float16 payloads to float16."""
from typing import Any

import numpy as np

from mdi.ring.wire_format import FP16_MAX as _FP16_MAX, INT8_BLOCK, INT8_MAX_WIDTH, FrameError
from mdi.ring.wire_format import outliers as _outliers


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even as torch's cast rounds (NaN kept NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def _from_bfloat16(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def encode_payload(a: np.ndarray, codec: str) -> memoryview:
    a = np.ascontiguousarray(a)
    if codec == "raw":
        return memoryview(a).cast("B")  # type: ignore[arg-type]  # one C call: numpy's reshape/view/.data ran ~3x longer cold
    if codec == "float16":
        return a.astype(np.float16).reshape(-1).view(np.uint8).data
    if codec == "bfloat16":
        return _bfloat16_bits(a.astype(np.float32)).reshape(-1).view(np.uint8).data
    return _encode_int8(a.astype(np.float32)).data


def decode_payload(buf: Any, rows: int, width: int, dtype: str, codec: str) -> np.ndarray:
    """A read-only view of the payload for raw float32 / float16; a new array otherwise."""
    if codec == "raw" and dtype in ("float32", "float16"):
        return np.frombuffer(buf, dtype=np.float32 if dtype == "float32" else np.float16).reshape(rows, width)
    if codec == "raw" or codec == "bfloat16":  # a bfloat16 raw payload, or the bfloat16 codec
        return _from_bfloat16(np.frombuffer(buf, dtype=np.uint16)).reshape(rows, width)
    if codec == "float16":
        values = np.frombuffer(buf, dtype=np.float16).reshape(rows, width)
        return values if dtype == "float16" else values.astype(np.float32)
    out = _decode_int8(buf, rows, width)
    return out.astype(np.float16) if dtype == "float16" else out


def quantize_int8_blocks(g: np.ndarray):
    """[rows, width] float32 -> (int8 [rows, width], float16 scales [rows, ceil(width / 32)]), as
    wire_torch.quantize_int8_blocks rounds them."""
    rows, width = g.shape
    blocks = -(-width // INT8_BLOCK)
    pad = blocks * INT8_BLOCK - width
    if pad:
        g = np.pad(g, ((0, 0), (0, pad)))
    g = g.reshape(rows, blocks, INT8_BLOCK)
    scales = np.minimum(np.abs(g).max(axis=-1) / np.float32(127.0), np.float32(_FP16_MAX)).astype(np.float16)
    s = scales.astype(np.float32)
    s = np.where(s > 0, s, np.float32(1.0))
    q = np.clip(np.round(g / s[..., None]), -127, 127).astype(np.int8).reshape(rows, blocks * INT8_BLOCK)
    return (q[:, :width] if pad else q), scales


def _encode_int8(x: np.ndarray) -> np.ndarray:
    rows, width = x.shape
    if width > INT8_MAX_WIDTH:
        raise ValueError("codec int8 carries rows of at most %d values, not %d" % (INT8_MAX_WIDTH, width))
    k = _outliers(width)
    g = np.array(x, dtype=np.float32)  # the outliers are zeroed in this copy
    columns = np.argpartition(-np.abs(g), k - 1, axis=1)[:, :k]
    at = np.arange(rows)[:, None]
    values = np.clip(g[at, columns], -_FP16_MAX, _FP16_MAX).astype(np.float16)
    g[at, columns] = 0.0
    q, scales = quantize_int8_blocks(g)
    return np.concatenate([np.ascontiguousarray(q).view(np.uint8).reshape(-1), scales.view(np.uint8).reshape(-1),
                           columns.astype(np.int16).view(np.uint8).reshape(-1), values.view(np.uint8).reshape(-1)])


def _decode_int8(buf: Any, rows: int, width: int) -> np.ndarray:
    n, k = rows * width, _outliers(width)
    n_scales = rows * -(-width // INT8_BLOCK)
    raw = np.frombuffer(buf, dtype=np.uint8)
    q = raw[:n].view(np.int8).reshape(rows, width)
    tail = raw[n:].copy()  # after the values: possibly at odd offsets, so copied before viewing
    scales = tail[:2 * n_scales].view(np.float16).reshape(rows, -1)
    columns = tail[2 * n_scales:2 * n_scales + 2 * rows * k].view(np.int16).reshape(rows, k).astype(np.int64)
    values = tail[2 * n_scales + 2 * rows * k:].view(np.float16).reshape(rows, k)
    if rows and (int(columns.min()) < 0 or int(columns.max()) >= width):
        raise FrameError("int8 outlier column outside [0, %d)" % width)
    blocks = scales.shape[1]
    v = np.zeros((rows, blocks * INT8_BLOCK), np.float32)
    v[:, :width] = q
    v = (v.reshape(rows, blocks, INT8_BLOCK) * scales.astype(np.float32)[..., None]).reshape(rows, -1)[:, :width]
    v = np.ascontiguousarray(v)
    v[np.arange(rows)[:, None], columns] = values.astype(np.float32)
    return v
