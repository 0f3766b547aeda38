"""Quantized weights: quantize, dequantize, take GGUF blocks over as they are, and convert a
stored state dict to the quantization a node asks for, one weight at a time.

The formats (which tensors, shapes and dtypes) are `mdi.model.layout.QuantSpec`'s; this module
does the arithmetic. A quantized weight travels as a `QParts` until it is flattened into a
state dict as `X.qweight`, `X.scales` (and `X.mins`).
"""
import logging
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Union, cast

import numpy as np
import torch

from mdi.model.layout import QUANT_SUFFIXES, CheckpointError, QuantLayout, QuantSpec, stored_layout
from mdi.model.quantization.layouts import (  # noqa: F401  (their home; named from here too)
    DEFAULT_INT4_GROUP, HEAD_WEIGHTS, describe, restrict, uniform_layout)

log = logging.getLogger(__name__)

DEQUANT_ELEMENTS = 1 << 21  # values dequantized at a time (8 MB of float32), never a whole layer


@dataclass
class QParts:
    """One quantized [n_out, n_in] matrix: its spec and its stored tensors by suffix."""
    spec: QuantSpec
    tensors: Dict[str, torch.Tensor]
    n_in: int

    @property
    def n_out(self) -> int:
        return int(self.tensors["qweight"].shape[0])

    @property
    def shape(self):  # the matrix's, so shape checks treat it like the float weight
        return torch.Size((self.n_out, self.n_in))

    def rows(self, index: Union[slice, torch.Tensor]) -> "QParts":
        return QParts(self.spec, {k: t[index] for k, t in self.tensors.items()}, self.n_in)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.tensors, self.spec, self.n_in, dtype)


Stored = Union[torch.Tensor, QParts]  # a weight as a checkpoint holds it


# ----------------------------------------------------------------------------- arithmetic

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[n, k] values 0..15 -> [n, k/2] uint8, the even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] uint8 -> [n, k] uint8 values 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize(w: torch.Tensor, spec: QuantSpec) -> Dict[str, torch.Tensor]:
    """Round a float [n_out, n_in] matrix to `spec` (round to nearest on the float16 grid the
    scales are stored on, so what is stored is what was rounded against)."""
    n_out, n_in = w.shape
    g = w.detach().float().reshape(n_out, n_in // spec.group_size, spec.group_size)
    if spec.kind == "int8":
        scale = (g.abs().amax(-1) / 127.0).half()
        s = scale.float().clamp(min=1e-30)[..., None]
        q = torch.round(g / s).clamp(-127, 127).to(torch.int8)
        return {"qweight": q.reshape(n_out, n_in), "scales": scale}
    lo, hi = g.amin(-1), g.amax(-1)
    scale, low = ((hi - lo) / 15.0).half(), lo.half()
    s = scale.float().clamp(min=1e-30)[..., None]
    q = torch.round((g - low.float()[..., None]) / s).clamp(0, 15)
    return {"qweight": pack_int4(q.reshape(n_out, n_in)), "scales": scale, "mins": low}


def dequantize(tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = tensors["qweight"]
    n_out, groups = q.shape[0], n_in // spec.group_size
    if spec.kind == "int4":
        q = unpack_int4(q)
    w = q.to(torch.float32).reshape(n_out, groups, spec.group_size) * tensors["scales"].float()[..., None]
    if spec.kind == "int4":
        w += tensors["mins"].float()[..., None]
    return w.reshape(n_out, n_in).to(dtype)


def quantized_linear(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], spec: QuantSpec, n_in: int) -> torch.Tensor:
    """x @ W.T with W dequantized DEQUANT_ELEMENTS values (whole output rows) at a time: exact
    (float32 maths) and on every torch version, at the cost of dequantizing on each call."""
    n_out = tensors["qweight"].shape[0]
    block = max(1, DEQUANT_ELEMENTS // n_in)
    if n_out <= block:
        return torch.nn.functional.linear(x, dequantize(tensors, spec, n_in, x.dtype))
    out = x.new_empty(x.shape[:-1] + (n_out,))
    for a in range(0, n_out, block):
        rows = {k: t[a:a + block] for k, t in tensors.items()}
        out[..., a:a + block] = torch.nn.functional.linear(x, dequantize(rows, spec, n_in, x.dtype))
    return out


# ----------------------------------------------------------------------------- GGUF blocks

# How torch holds each GGUF type: mdi.model.ggml.tensors (GGUF_DIRECT, GGUF_NEAREST, GGUF_FLOAT).


def from_gguf_blocks(raw: np.ndarray, type_name: str, n_out: int, n_in: int) -> QParts:
    """A Q8_0 / Q4_0 / Q4_1 tensor's raw bytes -> the same numbers as mdi int8 / int4 with
    groups of 32: the integers and float16 scales are copied, nothing is rounded."""
    blocks = np.ascontiguousarray(raw).reshape(n_out, n_in // 32, -1)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    if type_name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8)).reshape(n_out, n_in)
        return QParts(QuantSpec("int8", 32), {"qweight": q, "scales": d}, n_in)
    if type_name == "Q4_0":
        nibbles, low = blocks[..., 2:18], -8 * d  # w = d * (q - 8)
    else:  # Q4_1: w = d * q + m
        nibbles, low = blocks[..., 4:20], torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    nib = torch.from_numpy(nibbles.copy())
    # GGUF keeps values 0-15 of a block in the low nibbles and 16-31 in the high ones.
    q = torch.cat((nib & 15, nib >> 4), dim=-1).reshape(n_out, n_in)
    if torch.isinf(low).any():
        raise CheckpointError("a %s block scale is too large for a float16 minimum" % type_name)
    return QParts(QuantSpec("int4", 32), {"qweight": pack_int4(q), "scales": d, "mins": low}, n_in)


# ----------------------------------------------------------------------------- conversions

def cat_rows(parts: Sequence[Stored]) -> Stored:
    """Stack matrices along their output rows (q/k/v into qkv, gate/up). Quantized ones of one
    spec stay quantized (rows are independent); a mix is dequantized, then the result takes the
    most precise of the specs (float beats int8 beats int4)."""
    quantized = cast(Sequence[QParts], parts)  # what `parts` is once the all() below holds
    if all(isinstance(p, QParts) for p in parts) and len({p.spec for p in quantized}) == 1:
        first = quantized[0]
        return QParts(first.spec, {k: torch.cat([p.tensors[k] for p in quantized], 0) for k in first.tensors},
                      first.n_in)
    floats = [p.dequantize() if isinstance(p, QParts) else p for p in parts]
    merged = torch.cat([f.to(floats[0].dtype) for f in floats], 0)
    specs = [p.spec for p in parts if isinstance(p, QParts)]
    if len(specs) < len(parts):
        return merged
    spec = max(specs, key=lambda s: (s.kind == "int8", -s.group_size))
    return QParts(spec, quantize(merged, spec), merged.shape[1])


def flatten(weights: Mapping[str, Stored]) -> Dict[str, torch.Tensor]:
    """Canonical names -> tensors, each QParts `X.weight` written as X.qweight, X.scales, X.mins."""
    out = {}
    for key, value in weights.items():
        if isinstance(value, QParts):
            base = key[:-len(".weight")]
            for suffix, t in value.tensors.items():
                out[base + "." + suffix] = t
        else:
            out[key] = value
    return out


def gather(state: Mapping[str, torch.Tensor]) -> Dict[str, Stored]:
    """The inverse of `flatten`: a stored state dict -> canonical `.weight` names, each
    quantized weight as one QParts."""
    layout = stored_layout({k: (tuple(t.shape), t.dtype) for k, t in state.items()})
    out: Dict[str, Stored] = {}
    for key, t in state.items():
        base, _, suffix = key.rpartition(".")
        if base in layout and suffix in QUANT_SUFFIXES:
            if suffix == "qweight":
                spec = layout[base]
                parts = {s: state[base + "." + s] for s in spec.tensor_shapes(1, spec.group_size)}
                width = t.shape[1] * (2 if spec.kind == "int4" else 1)
                out[base + ".weight"] = QParts(spec, parts, width)
        else:
            out[key] = t
    return out


def convert(weights: Mapping[str, Stored], layout: QuantLayout, dtype: torch.dtype,
            on_requantize: Optional[Callable[[str, QuantSpec, QuantSpec], None]] = None) -> Dict[str, torch.Tensor]:
    """Stored weights -> the flat state dict a node loads: each weight named in `layout` in that
    spec (kept as stored when it already is, else quantized, re-quantizing another spec), every
    other tensor as float `dtype` (a stored quantized weight dequantized)."""
    out: Dict[str, Stored] = {}
    for key, value in weights.items():
        spec = layout.get(key[:-len(".weight")]) if key.endswith(".weight") else None
        if spec is None:
            out[key] = value.dequantize(dtype) if isinstance(value, QParts) else value.to(dtype)
        elif isinstance(value, QParts) and value.spec == spec:
            out[key] = value
        else:
            if isinstance(value, QParts) and on_requantize is not None:
                on_requantize(key, value.spec, spec)
            w = value.dequantize() if isinstance(value, QParts) else value
            out[key] = QParts(spec, quantize(w, spec), w.shape[1])
    return flatten(out)


def weights_layout(weights: Mapping[str, Stored]) -> Dict[str, QuantSpec]:
    """The quantization a stored state dict already has, weight by weight (`auto`)."""
    return {k[:-len(".weight")]: v.spec for k, v in weights.items() if isinstance(v, QParts)}
