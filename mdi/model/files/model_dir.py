"""What a prepared model directory (mdi-prepare) holds, by file name: one home for the names,
without torch (a worker resolving weights.path for the ggml backend reads them too), and its
config and stored quantization, read without torch (a ggml starter opens the directory)."""
import json
import os
from typing import Dict

from mdi.model.config import ModelConfig
from mdi.model.layout import CheckpointError, QuantSpec, stored_layout

MDI_CONFIG = "mdi_config.json"  # the model's config (mdi.model.config) and how the weights are stored
MODEL_FILE = "model.safetensors"  # the torch backend's weights, in mdi's canonical names
GGUF_FILE = "model.gguf"  # the ggml backend's: a GGUF, its tensors as stored
FORMAT_VERSION = 1  # of MDI_CONFIG (and a chunked model's manifest)


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


HEADER_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I8": "int8",
                  "U8": "uint8"}  # a safetensors header's dtypes, by name: read without torch


def file_layout(path: str) -> Dict[str, QuantSpec]:
    """The quantized weights of a safetensors file (or an mdi dir's model.safetensors), read
    from its header alone."""
    from safetensors import safe_open

    fn = os.path.join(path, MODEL_FILE) if os.path.isdir(path) else path
    try:
        with safe_open(fn, framework="numpy") as f:  # the header only: no tensor is made
            info = {}
            for k in f.keys():
                sl = f.get_slice(k)
                info[k] = (tuple(sl.get_shape()), HEADER_DTYPES.get(sl.get_dtype()))
    except Exception as e:  # SafetensorError is no OSError or ValueError
        raise CheckpointError("%s is not a readable safetensors file: %s" % (fn, e))
    return stored_layout(info)
