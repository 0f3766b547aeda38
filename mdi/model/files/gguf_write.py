"""Write GGUF files with the `gguf` package: a node's part of a model copied block for block
(the weights a starter pushes to a worker computing with ggml), random tensors of a model's
real shapes and types (what a node times before any weight is sent), and the tests' damaged
copies of a model. (`mdi-prepare`'s GGUF of a checkpoint: mdi.model.files.gguf_export, on this metadata.)

Tensors go in as raw bytes of their ggml type, never converted here; the metadata is the
architecture's keys llama.cpp reads, so the file is a GGUF llama.cpp can open too.
"""
import logging
import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple, Union

import numpy as np

from mdi.model.config import ModelConfig
from mdi.model.families import family_of
from mdi.model.files.gguf_config import gemma3_attn_scale
from mdi.model.ggml.tensors import tensor_bytes

log = logging.getLogger(__name__)

# mdi family -> general.architecture written for it (qwen2/qwen3 are "llama" family: their own arch names)
def arch_of(config: ModelConfig) -> str:
    if config.family == "llama":
        if config.qk_norm:
            return "qwen3"
        if config.qkv_bias:
            return "qwen2"
        return "llama"
    return config.family


def add_model_metadata(writer, config: ModelConfig, arch: str) -> None:
    """The keys llama.cpp reads for `arch` (gguf_config.read_gguf_model reads them back)."""
    fam = family_of(config.family)
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if fam.norm == "layer":
        writer.add_layer_norm_eps(config.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(config.norm_eps)
    if fam.positions == "rope":
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_rope_dimension_count(config.head_dim)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
        writer.add_uint32("%s.attention.sliding_window_pattern" % arch, config.sliding_pattern)
        if config.rope_local_theta:
            writer.add_float32("%s.rope.freq_base_swa" % arch, config.rope_local_theta)
    if config.attn_scale is not None:
        # llama.cpp's attention.scale key: mdi reads it back; llama.cpp's gemma3 derives its scale from the
        # sizes instead (gguf_config), which a query_pre_attn_scalar of another value does not give
        writer.add_float32("%s.attention.scale" % arch, config.attn_scale)
        derived = gemma3_attn_scale(config.n_embd, config.n_head, config.head_dim, config.n_layer)
        if config.family == "gemma3" and abs(derived - config.attn_scale) > 1e-6 * derived:
            log.warning("mdi: the queries' scale %.6g is not the %.6g llama.cpp derives for %s: llama.cpp "
                        "computes this GGUF otherwise (mdi reads the scale it holds)",
                        config.attn_scale, derived, config.family)
    writer.add_vocab_size(config.vocab_size)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_id is not None:
        writer.add_eos_token_id(config.eos_token_id)


@dataclass(frozen=True)
class FileBytes:
    """A tensor's `nbytes` bytes at `offset` of the file `path`, read when the tensor is written,
    one tensor at a time, with plain reads: a starter that pushes a worker's layers never maps
    them, so its memory holds none of them (mapped, every page it wrote stayed resident)."""
    path: str
    offset: int
    nbytes: int

    def read(self) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise OSError("%s: %d bytes at offset %d are cut short" % (self.path, self.nbytes, self.offset))
        return np.frombuffer(data, dtype=np.uint8)


# (ggml type name, dims in ggml order, the bytes: in memory, or read from a file when written)
RawTensor = Tuple[str, Tuple[int, ...], Union[np.ndarray, FileBytes]]


def write_gguf(path: str, config: ModelConfig, tensors: Mapping[str, RawTensor], arch: Optional[str] = None,
               extra: Optional[Mapping[str, object]] = None) -> str:
    """A GGUF at `path` holding `tensors` as given, with `config`'s metadata."""
    from gguf import GGMLQuantizationType, GGUFWriter

    arch = arch or arch_of(config)
    quiet = logging.getLogger("gguf")  # it says "Writing the following files" for every file
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        _write(GGUFWriter(path, arch), config, tensors, arch, extra or {}, GGMLQuantizationType)
    finally:
        quiet.setLevel(level)
    return path


def _write(writer: Any, config: ModelConfig, tensors: Mapping[str, RawTensor], arch: str,
           extra: Mapping[str, object], GGMLQuantizationType: Any) -> None:
    add_model_metadata(writer, config, arch)
    for key, value in extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
    # Every tensor's info first, then the data a tensor at a time (read then, where it is a FileBytes)
    written: List[Tuple[Union[np.ndarray, FileBytes], Tuple[int, ...]]] = []
    for name, (kind, dims, data) in tensors.items():
        if isinstance(data, FileBytes):
            shape: Tuple[int, ...] = _byte_rows(dims, data.nbytes)
            dtype, nbytes = np.dtype(np.uint8), data.nbytes
        else:
            data = np.ascontiguousarray(data)
            if kind in ("F32", "F16") and data.dtype != np.uint8:
                data = data.reshape(tuple(reversed(dims)))
            else:
                data = data.view(np.uint8).reshape(_byte_rows(dims, data.nbytes))
            shape, dtype, nbytes = data.shape, data.dtype, data.nbytes
        if nbytes != tensor_bytes(kind, dims):  # what a reader takes for it: the tensors after it would move
            raise ValueError("GGUF tensor %s: %d bytes of data for %s %s, which hold %d"
                             % (name, nbytes, kind, list(dims), tensor_bytes(kind, dims)))
        writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=GGMLQuantizationType[kind])
        written.append((data, shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data, shape in written:
        writer.write_tensor_data(data.read().reshape(shape) if isinstance(data, FileBytes) else data)
    writer.close()


def _byte_rows(dims: Tuple[int, ...], nbytes: int) -> Tuple[int, ...]:
    """A tensor's bytes as [outer dims..., bytes per row] (gguf derives the element shape from
    them and its ggml type)."""
    rows = tuple(reversed(dims[1:]))
    return rows + (nbytes // max(1, int(np.prod(rows))) if rows else nbytes,)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
