"""Random GGUF tensors of a model's real shapes and types: what a node times before any weight
is sent (the planner's profile, the backend choice). A kernel's speed does not depend on the
values, only that they are ordinary numbers: one random row quantized by ggml, repeated."""
import ctypes
import os
import tempfile
from typing import Dict, Tuple

import numpy as np

from mdi.model.config import ModelConfig
from mdi.model.files.gguf_write import RawTensor, remove_quietly, write_gguf
from mdi.model.ggml import lib
from mdi.model.ggml.tensors import block_tensors, end_tensors, tensor_bytes


def random_tensor(kind: str, dims: Tuple[int, ...], norm: bool, rng: np.random.Generator) -> np.ndarray:
    """One tensor's bytes: norms 1, other values ~0.02 (as trained weights are)."""
    gg = lib.require()
    if len(dims) == 1 or kind == "F32":
        values = np.ones(dims[::-1], np.float32) if norm else rng.standard_normal(dims[::-1]).astype(np.float32) * 0.02
        return values if kind == "F32" else values.astype(np.float16)
    if kind == "F16":
        return (rng.standard_normal(dims[::-1]) * 0.02).astype(np.float16)
    type_id = lib.TYPE_IDS[kind]
    n_per_row, n_rows = dims[0], int(np.prod(dims[1:]))
    row_bytes = gg.ggml_row_size(type_id, n_per_row)
    row = np.zeros(row_bytes, np.uint8)
    if not gg.ggml_quantize_requires_imatrix(type_id):
        src = (rng.standard_normal(n_per_row) * 0.02).astype(np.float32)
        gg.ggml_quantize_chunk(type_id, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), row.ctypes.data, 0, 1,
                               n_per_row, None)
    # (a type that needs an importance matrix keeps zero blocks: its arithmetic costs the same)
    return np.tile(row, n_rows)


def probe_type(layer_types: Dict[str, str], suffix: str, dims: Tuple[int, ...]) -> str:
    """A probe block's tensor's type: the one asked for its name (less "blk.N."), else float."""
    return layer_types.get(suffix, "F32" if len(dims) == 1 else "F16")


def probe_block_bytes(config: ModelConfig, layer_types: Dict[str, str]) -> int:
    """Bytes of one block of a probe GGUF (write_probe_gguf)."""
    return sum(tensor_bytes(probe_type(layer_types, name.split(".", 2)[2], dims), dims)
               for name, dims in block_tensors(config, 0).items())


def write_probe_gguf(config: ModelConfig, layer_types: Dict[str, str], n_blocks: int, with_ends: bool,
                     end_types: Dict[str, str], seed: int = 0) -> str:
    """A temporary GGUF of `n_blocks` random blocks (block j's tensors typed as
    `layer_types[suffix]`, e.g. "attn_q.weight": "Q4_1") and, `with_ends`, the embedding and
    head; the caller removes it."""
    rng = np.random.default_rng(seed)
    tensors: Dict[str, RawTensor] = {}
    for layer in range(n_blocks):
        for name, dims in block_tensors(config, layer).items():
            suffix = name.split(".", 2)[2]
            kind = probe_type(layer_types, suffix, dims)
            tensors[name] = (kind, dims, random_tensor(kind, dims, "norm" in suffix, rng))
    if with_ends:
        for name, dims in end_tensors(config, True, True).items():
            kind = end_types.get(name, "F32" if len(dims) == 1 else "F16")
            tensors[name] = (kind, dims, random_tensor(kind, dims, "norm" in name, rng))
    fd, path = tempfile.mkstemp(prefix="mdi-probe-", suffix=".gguf")
    os.close(fd)
    probe_config = config if n_blocks == config.n_layer else _with_layers(config, n_blocks)
    try:
        return write_gguf(path, probe_config, tensors)
    except BaseException:  # a full disk: no half-written probe left behind
        remove_quietly(path)
        raise


def _with_layers(config: ModelConfig, n: int) -> ModelConfig:
    d = config.to_dict()
    d["n_layer"] = max(1, n)
    return ModelConfig.from_dict(d)
