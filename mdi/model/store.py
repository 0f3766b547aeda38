"""The mdi model directory, written by ``mdi-prepare`` and read by every node::

    <dir>/mdi_config.json                       {"format": "mdi-model", "version": 1, "model": {...}, "source": ...}
    <dir>/model.safetensors                     full canonical state dict (tied head stored once)
    <dir>/chunks/<partition>/node<k>.safetensors  one contiguous layer chunk per node
    <dir>/chunks/<partition>/manifest.json      layer ranges, sizes and sha256 of the chunk files

Chunk files keep GLOBAL block indices and carry the model config in their safetensors
metadata, so a board can load its chunk without the rest of the directory.
"""
import hashlib
import json
import logging
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from mdi.model.config import ModelConfig
from mdi.model.convert import StateDict, check_state_dict, short
from mdi.model.layout import CheckpointError, expected_keys, expected_shapes, split_layers
from mdi.system.files import use_umask, write_json

log = logging.getLogger("mdi.prepare")

MDI_CONFIG = "mdi_config.json"
MODEL_FILE = "model.safetensors"
CHUNKS_DIR = "chunks"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def _save(tensors: Mapping[str, torch.Tensor], path: str, metadata: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path + ".tmp"  # write then rename: a crash never leaves a half-written file
    save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=metadata)
    use_umask(tmp)
    os.replace(tmp, path)


def save_model_dir(path: str, config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                   source: str) -> None:
    """Write mdi_config.json and model.safetensors (the full canonical state dict)."""
    check_state_dict(config, state_dict, where="state dict for %s" % path)
    os.makedirs(path, exist_ok=True)
    meta = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
            "layers": "0-%d" % config.n_layer, "with_embedding": "1", "with_head": "1"}
    _save(state_dict, os.path.join(path, MODEL_FILE), meta)
    write_json(os.path.join(path, MDI_CONFIG), {"format": "mdi-model", "version": FORMAT_VERSION,
                                                 "model": config.to_dict(), "source": str(source)})


def read_mdi_config(path: str) -> ModelConfig:
    fn = os.path.join(path, MDI_CONFIG)
    try:
        with open(fn) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError("%s: cannot read mdi model config (%s)" % (fn, e))
    if d.get("format") != "mdi-model" or d.get("version") != FORMAT_VERSION:
        raise CheckpointError("%s: not an mdi-model v%d config" % (fn, FORMAT_VERSION))
    return ModelConfig.from_dict(d["model"])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_chunks(path: str, counts: Union[str, Sequence[int]]) -> List[str]:
    """Cut model.safetensors into chunks/<partition>/node<k>.safetensors + manifest.json.

    Node 0 also holds the embeddings, final norm and head. Tensors are read one chunk
    at a time, so peak memory is the largest chunk, not the model.
    """
    from safetensors import safe_open

    config = read_mdi_config(path)
    ranges = split_layers(config.n_layer, counts)
    partition = "-".join(str(b - a) for a, b in ranges)
    out_dir = os.path.join(path, CHUNKS_DIR, partition)
    os.makedirs(out_dir, exist_ok=True)
    files, nodes = [], []
    with safe_open(os.path.join(path, MODEL_FILE), framework="pt") as f:
        have = set(f.keys())
        for k, (first, last) in enumerate(ranges):
            ends = k == 0  # the starter node embeds tokens and produces logits
            keys = expected_keys(config, (first, last), ends, ends)
            missing = [x for x in keys if x not in have]
            if missing:
                raise CheckpointError("%s is missing %s" % (MODEL_FILE, short(missing)))
            fn = os.path.join(out_dir, "node%d.safetensors" % k)
            meta = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
                    "layers": "%d-%d" % (first, last), "with_embedding": str(int(ends)),
                    "with_head": str(int(ends))}
            _save({x: f.get_tensor(x) for x in keys}, fn, meta)
            files.append(fn)
            log.info("cut node %d of %s: layers %d-%d, %.1f MB", k, partition, first, last - 1,
                     os.path.getsize(fn) / 1e6)
            nodes.append({"node": k, "file": os.path.basename(fn), "layers": [first, last],
                          "with_embedding": ends, "with_head": ends,
                          "bytes": os.path.getsize(fn), "sha256": _sha256(fn)})
    write_json(os.path.join(out_dir, MANIFEST), {"format": "mdi-chunks", "version": FORMAT_VERSION,
                                                  "partition": partition, "n_layer": config.n_layer,
                                                  "nodes": nodes})
    return files


def load_weights(path: str, layer_range: Tuple[int, int], with_embedding: bool, with_head: bool,
                 dtype: Optional[torch.dtype] = None, config: Optional[ModelConfig] = None) -> StateDict:
    """Load only the tensors for blocks [first, last) (+ embedding / head) with global names.

    ``path`` is an mdi model directory (reads its model.safetensors) or a chunk file; the
    config comes from ``config``, the file's metadata, or the directory's mdi_config.json.
    ``dtype=None`` keeps the stored dtype.
    """
    from safetensors import safe_open

    fn = os.path.join(path, MODEL_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(fn):
        raise CheckpointError("weights file %s does not exist" % fn)
    with safe_open(fn, framework="pt") as f:
        if config is None:
            meta = f.metadata() or {}
            if "mdi_config" in meta:
                config = ModelConfig.from_dict(json.loads(meta["mdi_config"]))
            else:
                config = read_mdi_config(os.path.dirname(os.path.abspath(fn)))
        shapes = expected_shapes(config, tuple(layer_range), with_embedding, with_head)
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
            sd[k] = t if dtype is None else t.to(dtype)
    return sd
