"""One tensor's bytes in a GGUF type, for mdi.model.files.gguf_export: mdi's own int8 / int4 blocks
copied where they already are the type's blocks (int8 in groups of 32 IS Q8_0, int4 IS Q4_1, or
Q4_0 where each min is -8 scales), else float32 values quantized by ggml's ggml_quantize_chunk,
a run of rows per job so several threads encode at once (ggml and numpy run outside the GIL)."""
import ctypes
from typing import Any, List, Tuple

import numpy as np
import torch

from mdi.model.layout import CheckpointError
from mdi.model.quantization.quant import QParts, Stored

CHUNK_ELEMENTS = 1 << 22  # values dequantized / quantized at a time (16 MB of float32)


def rows_of(w: Stored, index: Any) -> Stored:
    """Rows `index` (a slice or an index tensor) of a weight, quantized or not."""
    return w.rows(index) if isinstance(w, QParts) else w[index]


def q8_0_blocks(w: QParts) -> np.ndarray:
    """mdi int8 in groups of 32 -> Q8_0 blocks ([float16 d][32 x int8]), copied."""
    q = w.tensors["qweight"].numpy()
    n, k = q.shape
    out = np.empty((n, k // 32, 34), np.uint8)
    out[..., 0:2] = w.tensors["scales"].to(torch.float16).numpy().reshape(n, k // 32, 1).view(np.uint8)
    out[..., 2:] = q.reshape(n, k // 32, 32).view(np.uint8)
    return out.reshape(-1)


def q4_blocks(w: QParts, kind: str) -> np.ndarray:
    """mdi int4 in groups of 32 -> Q4_1 ([d][m][16 bytes]: values 0-15 in the low nibbles,
    16-31 in the high ones; w = d q + m) or Q4_0 ([d][16 bytes], w = d (q - 8)), copied:
    quant.from_gguf_blocks, the other way."""
    packed = w.tensors["qweight"].numpy()
    n, k = packed.shape[0], packed.shape[1] * 2
    q = np.empty((n, k), np.uint8)
    q[:, 0::2] = packed & 15  # quant.pack_int4: the even column in the low nibble
    q[:, 1::2] = packed >> 4
    g = q.reshape(n, k // 32, 32)
    nibbles = g[..., :16] | (g[..., 16:] << 4)
    head = 4 if kind == "Q4_1" else 2
    out = np.empty((n, k // 32, head + 16), np.uint8)
    out[..., 0:2] = w.tensors["scales"].to(torch.float16).numpy().reshape(n, k // 32, 1).view(np.uint8)
    if kind == "Q4_1":
        out[..., 2:4] = w.tensors["mins"].to(torch.float16).numpy().reshape(n, k // 32, 1).view(np.uint8)
    out[..., head:] = nibbles
    return out.reshape(-1)


def is_exact(w: Stored, kind: str) -> bool:
    """Whether a quantized weight already is blocks of `kind` (copied, not re-rounded)."""
    if not isinstance(w, QParts) or w.spec.group_size != 32:
        return False
    if kind == "Q8_0" or kind == "Q4_1":
        return w.spec.kind == ("int8" if kind == "Q8_0" else "int4")
    if kind == "Q4_0" and w.spec.kind == "int4":  # Q4_0's w = d (q - 8): a min of -8 d exactly
        scales, mins = w.tensors["scales"].to(torch.float16), w.tensors["mins"].to(torch.float16)
        return bool(torch.equal(mins, -8 * scales))
    return False


def _floats(w: Stored) -> np.ndarray:
    """float32 values, a quantized weight dequantized with numpy (torch's unpacking of int4 took
    20 times as long)."""
    if not isinstance(w, QParts):
        return np.ascontiguousarray(w.detach().to(torch.float32).numpy())
    q = w.tensors["qweight"].numpy()
    n = q.shape[0]
    if w.spec.kind == "int4":
        values = np.empty((n, q.shape[1] * 2), np.float32)
        values[:, 0::2] = q & 15  # the even column in the low nibble (quant.pack_int4)
        values[:, 1::2] = q >> 4
    else:
        values = q.astype(np.float32)
    groups = values.reshape(n, -1, w.spec.group_size)
    groups *= w.tensors["scales"].numpy().astype(np.float32)[..., None]
    if w.spec.kind == "int4":
        groups += w.tensors["mins"].numpy().astype(np.float32)[..., None]
    return values


Job = Any  # a callable filling part of an encoder's output


def encoder(w: Stored, kind: str) -> Tuple[np.ndarray, List[Job]]:
    """One tensor's output (uint8 bytes of `kind`, or float32 values for F32) and the jobs
    that fill it, a CHUNK_ELEMENTS-sized run of rows each (ggml and numpy run outside the GIL,
    so jobs on several threads run at once). Quantized by ggml's ggml_quantize_chunk."""
    shape = tuple(int(d) for d in w.shape)
    n_rows, n_per_row = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    step = max(1, CHUNK_ELEMENTS // n_per_row)
    starts = range(0, n_rows, step)

    def rows(a: int) -> np.ndarray:
        return _floats(rows_of(w, slice(a, min(n_rows, a + step))) if len(shape) == 2 else w).reshape(-1, n_per_row)

    if kind == "F32":
        values = np.empty((n_rows, n_per_row), np.float32)

        def copy(a: int) -> None:
            values[a:a + step] = rows(a)
        return values.reshape(shape), [lambda a=a: copy(a) for a in starts]
    if is_exact(w, kind):  # copied block for block
        block_bytes = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18}[kind]
        blocks = np.empty((n_rows, n_per_row // 32 * block_bytes), np.uint8)

        def copy_blocks(a: int) -> None:
            assert isinstance(w, QParts)
            part = w.rows(slice(a, a + step))
            blocks[a:a + step] = (q8_0_blocks(part) if kind == "Q8_0" else q4_blocks(part, kind)).reshape(
                -1, blocks.shape[1])
        return blocks.reshape(-1), [lambda a=a: copy_blocks(a) for a in starts]
    from mdi.model.ggml import lib
    gg = lib.require()
    type_id = lib.TYPE_IDS[kind]
    if gg.ggml_quantize_requires_imatrix(type_id):
        raise CheckpointError("GGUF type %s needs an importance matrix, which mdi does not compute" % kind)
    row_bytes = int(gg.ggml_row_size(type_id, n_per_row))
    out = np.empty(n_rows * row_bytes, np.uint8)
    gg.ggml_quantize_init(type_id)  # its tables, before threads share them

    def run(a: int) -> None:
        src = rows(a)
        gg.ggml_quantize_chunk(type_id, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                               out[a * row_bytes:].ctypes.data, 0, src.shape[0], n_per_row, None)
    return out, [lambda a=a: run(a) for a in starts]


def encode(w: Stored, kind: str) -> np.ndarray:
    """One tensor's bytes as `kind` (uint8), or float32 values for F32 (on this thread)."""
    out, jobs = encoder(w, kind)
    for job in jobs:
        job()
    return out
