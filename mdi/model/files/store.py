"""The mdi model directory, written by ``mdi-prepare`` and read by every node::

    <dir>/mdi_config.json                       {"format": "mdi-model", "version": 1, "model": {...}, "source": ...,
                                                 "quant": [{"kind", "group_size", "weights"}, ...]}
    <dir>/model.safetensors                     full canonical state dict (tied head stored once); a
                                                quantized weight X as X.qweight, X.scales[, X.mins]
    <dir>/chunks/<partition>/node<k>.safetensors  one contiguous layer chunk per node
    <dir>/chunks/<partition>/manifest.json      layer ranges, sizes and sha256 of the chunk files

Chunk files keep GLOBAL block indices and carry the model config in their safetensors
metadata, so a board can load its chunk without the rest of the directory.
"""
import json
import logging
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch

from mdi.model.config import ModelConfig
from mdi.model.files.convert import StateDict, check_state_dict, short
from mdi.model.files.gguf_layout import is_gguf
from mdi.model.layout import (CheckpointError, QuantSpec, expected_keys, expected_shapes, format_layers,
                              split_layers)
from mdi.model.quantization.quant import Stored, flatten, gather, weights_layout
from mdi.system.files import sha256_file, use_umask, write_json

log = logging.getLogger(__name__)

from mdi.model.files.model_dir import (  # noqa: E402,F401  (their home; named from here too)
    FORMAT_VERSION, HEADER_DTYPES, MDI_CONFIG, MODEL_FILE, file_layout, read_mdi_config)
CHUNKS_DIR = "chunks"
MANIFEST = "manifest.json"


def _save(tensors: Mapping[str, torch.Tensor], path: str, metadata: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path + ".tmp"  # write then rename: a crash never leaves a half-written file
    save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=metadata)
    use_umask(tmp)
    os.replace(tmp, path)


def save_model_dir(path: str, config: ModelConfig, state_dict: Mapping[str, Stored],
                   source: str) -> None:
    """Write mdi_config.json and model.safetensors (the full canonical state dict; its
    quantized weights, `quant.QParts`, as their stored tensors)."""
    check_state_dict(config, state_dict, where="state dict for %s" % path)
    os.makedirs(path, exist_ok=True)
    meta = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
            "layers": "0-%d" % config.n_layer, "with_embedding": "1", "with_head": "1"}
    _save(flatten(state_dict), os.path.join(path, MODEL_FILE), meta)
    counts: Dict[QuantSpec, int] = {}
    for spec in weights_layout(state_dict).values():
        counts[spec] = counts.get(spec, 0) + 1
    quant = [{"kind": s.kind, "group_size": s.group_size, "weights": n} for s, n in sorted(counts.items(), key=str)]
    write_json(os.path.join(path, MDI_CONFIG), {"format": "mdi-model", "version": FORMAT_VERSION,
                                                 "model": config.to_dict(), "source": str(source), "quant": quant})


def write_chunks(path: str, counts: Union[str, Sequence[int]]) -> List[str]:
    """Cut model.safetensors into chunks/<partition>/node<k>.safetensors + manifest.json.

    Node 0 also holds the embeddings, final norm and head. Tensors are read one chunk
    at a time, so peak memory is the largest chunk, not the model.
    """
    from safetensors import safe_open

    config = read_mdi_config(path)
    ranges = split_layers(config.n_layer, counts)
    layout = file_layout(path)
    partition = "-".join(str(b - a) for a, b in ranges)
    out_dir = os.path.join(path, CHUNKS_DIR, partition)
    os.makedirs(out_dir, exist_ok=True)
    files, nodes = [], []
    with safe_open(os.path.join(path, MODEL_FILE), framework="pt") as f:
        have = set(f.keys())
        for k, (first, last) in enumerate(ranges):
            ends = k == 0  # the starter node embeds tokens and produces logits
            keys = expected_keys(config, (first, last), ends, ends, layout)
            missing = [x for x in keys if x not in have]
            if missing:
                raise CheckpointError("%s is missing %s" % (MODEL_FILE, short(missing)))
            fn = os.path.join(out_dir, "node%d.safetensors" % k)
            meta = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
                    "layers": "%d-%d" % (first, last), "with_embedding": str(int(ends)),
                    "with_head": str(int(ends))}
            _save({x: f.get_tensor(x) for x in keys}, fn, meta)
            files.append(fn)
            log.info("cut node %d of %s: %s, %.1f MB", k, partition, format_layers(first, last),
                     os.path.getsize(fn) / 1e6)
            nodes.append({"node": k, "file": os.path.basename(fn), "layers": [first, last],
                          "with_embedding": ends, "with_head": ends,
                          "bytes": os.path.getsize(fn), "sha256": sha256_file(fn)})
    write_json(os.path.join(out_dir, MANIFEST), {"format": "mdi-chunks", "version": FORMAT_VERSION,
                                                  "partition": partition, "n_layer": config.n_layer,
                                                  "nodes": nodes})
    return files


def load_weights(path: str, layer_range: Tuple[int, int], with_embedding: bool, with_head: bool,
                 dtype: Optional[torch.dtype] = None, config: Optional[ModelConfig] = None) -> StateDict:
    """Load only the tensors for blocks [first, last) (+ embedding / head) with global names,
    each quantized weight as one `quant.QParts` under its `.weight` name.

    ``path`` is an mdi model directory (reads its model.safetensors) or a chunk file; the
    config comes from ``config``, the file's metadata, or the directory's mdi_config.json.
    ``dtype`` converts the float tensors (None keeps the stored dtype); quantized ones stay.
    """
    from safetensors import safe_open

    fn = os.path.join(path, MODEL_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(fn):
        raise CheckpointError("weights file %s does not exist" % fn)
    _checked_keys(fn)  # a truncated or bad file: one line naming it
    with safe_open(fn, framework="pt") as f:
        if config is None:
            meta = f.metadata() or {}
            if "mdi_config" in meta:
                config = ModelConfig.from_dict(json.loads(meta["mdi_config"]))
            else:
                config = read_mdi_config(os.path.dirname(os.path.abspath(fn)))
        # tuple(): a caller's [first, last] list works too
        shapes = expected_shapes(config, cast(Tuple[int, int], tuple(layer_range)), with_embedding, with_head,
                                 file_layout(fn))
        have = set(f.keys())
        missing = [k for k in shapes if k not in have]
        if missing:
            raise CheckpointError("%s lacks tensors for layers [%d, %d): %s"
                                  % (fn, layer_range[0], layer_range[1], short(missing)))
        sd = {}
        for k, shape in shapes.items():
            t = f.get_tensor(k)
            if tuple(t.shape) != shape:
                raise CheckpointError("%s: %s has shape %s, expected %s" % (fn, k, tuple(t.shape), shape))
            sd[k] = t if dtype is None or not t.is_floating_point() or k.endswith((".scales", ".mins")) else t.to(dtype)
    return gather(sd)


MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit


def read_tensors_into(fn: str, targets: Mapping[str, torch.Tensor], exact: bool = False) -> None:
    """Fill each tensor of `targets` (name -> preallocated tensor of the expected shape) from
    the safetensors file `fn`, one tensor at a time, converting the dtype where it differs.

    Plain reads straight into the target (or into a one-tensor buffer), no mmap of the whole
    file: peak memory is the targets plus at most the largest tensor, where loading the file
    into a dict first would hold a second copy of every weight (a Jetson shares this RAM with
    its GPU). `exact`: the file must hold these tensors and no others (a pushed chunk).
    CheckpointError names the file and the first problem."""
    have = _checked_keys(fn)
    missing = sorted(set(targets) - have)
    extra = sorted(have - set(targets)) if exact else []
    if missing or extra:
        raise CheckpointError("%s does not hold the expected tensors: missing %s, unexpected %s"
                              % (fn, short(missing), short(extra)))
    with _TensorReader(fn) as reader:
        for name, target in targets.items():
            reader.read(name, target)


def read_tensors(fn: str, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The named tensors of the safetensors file `fn`, each read into a fresh tensor of its
    stored dtype and shape (plain reads as `read_tensors_into`: no mmap left behind)."""
    have = _checked_keys(fn)
    missing = sorted(set(names) - have)
    if missing:
        raise CheckpointError("%s does not hold the expected tensors: missing %s" % (fn, short(missing)))
    with _TensorReader(fn) as reader:
        return {name: reader.read(name) for name in names}


def _checked_keys(fn: str) -> set:
    from safetensors import safe_open

    try:  # the library validates the header (offsets inside the file, sizes, dtypes)
        with safe_open(fn, framework="pt") as f:
            return set(f.keys())
    except Exception as e:  # SafetensorError is no OSError or ValueError
        if is_gguf(fn):
            raise CheckpointError("%s is a GGUF: ggml computes it (backend: ggml); torch reads a prepared model "
                                  "directory or a safetensors chunk (mdi-prepare --chunks)" % fn)
        raise CheckpointError("%s is not a valid safetensors file: %s" % (fn, e))


BOUNCE_BYTES = 16 << 20  # what read_tensors_into converts (dtype, device) at a time


class _TensorReader:
    """One open safetensors file read tensor by tensor with plain reads (its header parsed once)."""

    def __init__(self, fn: str) -> None:
        import struct

        self.fn = fn
        self.f = open(fn, "rb")
        try:
            self.size = os.fstat(self.f.fileno()).st_size
            head = self.f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(MAX_SAFETENSORS_HEADER, self.size - 8):
                raise CheckpointError("%s: bad safetensors header length" % fn)
            try:
                self.header = json.loads(self.f.read(n).decode("utf-8"))
            except ValueError as e:
                raise CheckpointError("%s: bad safetensors header: %s" % (fn, e))
            self.base = 8 + n
        except BaseException:
            self.f.close()
            raise

    def __enter__(self) -> "_TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def _read(self, name: str, buf: torch.Tensor, begin: int, nbytes: int) -> None:
        """`nbytes` from data offset `begin` into the contiguous CPU tensor `buf`."""
        import ctypes

        if nbytes:
            self.f.seek(self.base + begin)
            view = (ctypes.c_char * nbytes).from_address(buf.data_ptr())
            if self.f.readinto(view) != nbytes:
                raise CheckpointError("%s: %s is cut short" % (self.fn, name))

    def read(self, name: str, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor `name` into `target` (its shape; a float dtype is converted), or into a new
        tensor of the stored dtype and shape when `target` is None; returns what was filled."""
        fn, header = self.fn, self.header
        entry = header.get(name, {}) if isinstance(header, dict) else {}  # {}: not there (a KeyError below)
        try:
            dtype = getattr(torch, HEADER_DTYPES[entry["dtype"]])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError("%s: %s has a dtype or layout mdi does not read" % (fn, name))
        if target is not None:
            if shape != tuple(target.shape):
                raise CheckpointError("%s: %s has shape %s, expected %s" % (fn, name, shape, tuple(target.shape)))
            if dtype != target.dtype and not (dtype.is_floating_point and target.dtype.is_floating_point):
                raise CheckpointError("%s: %s is %s, expected %s" % (fn, name, dtype, target.dtype))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0 or self.base + end > self.size:
            raise CheckpointError("%s: %s has data offsets outside its %d bytes" % (fn, name, nbytes))
        direct = target is not None and target.dtype == dtype and target.device.type == "cpu" \
            and target.is_contiguous()
        if direct or target is None or not target.is_contiguous() or not numel:
            buf = target if direct and target is not None else torch.empty(shape, dtype=dtype)
            self._read(name, buf, begin, nbytes)
            if target is None:
                return buf
            if not direct:
                target.copy_(buf)
                del buf
            return target
        # Another dtype or device: through a bounce buffer of at most BOUNCE_BYTES, never a
        # stored-dtype copy of the whole tensor (a float32 head is 262 MB on TinyLlama).
        flat = target.view(-1)
        itemsize = nbytes // numel
        step = max(1, BOUNCE_BYTES // itemsize)
        buf = torch.empty(min(step, numel), dtype=dtype)
        for a in range(0, numel, step):
            n = min(step, numel - a)
            self._read(name, buf[:n], begin + a * itemsize, n * itemsize)
            flat[a:a + n].copy_(buf[:n])
        del buf
        return target
