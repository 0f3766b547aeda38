"""A GGUF file's model, as its metadata describes it: the ModelConfig and the facts about the
file itself both compute backends need (its architecture, whether llama.cpp's converter
permuted q/k for its RoPE layout).

Architectures: llama, qwen2, qwen3 (the "llama" family), gemma3 and gpt2, with llama.cpp's
metadata keys and defaults. What is not modelled (other architectures, linear / YaRN RoPE
scaling, partial rotary embeddings, experts, per-layer sizes) is refused naming the key.
No torch here: a node computing with ggml reads its model without it.
"""
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mdi.model.config import GEMMA3_SWA_PATTERN, ModelConfig
from mdi.model.files.gguf_layout import GGUFFile, GGUFLayoutError, open_reader
from mdi.model.layout import CheckpointError, first_line

# general.architecture -> the mdi family its block is (mdi.model.families)
ARCHITECTURES = {"llama": "llama", "qwen2": "llama", "qwen3": "llama", "gemma3": "gemma3", "gpt2": "gpt2"}
# Only llama's converter permutes q/k rows (LlamaModel.permute): RoPE then rotates adjacent
# pairs (ggml's normal mode); every other architecture keeps HF's halves (ggml's neox mode).
PERMUTED_QK = ("llama",)
GGUF_NAMES = {  # llama.cpp tensor name -> HF Llama / Qwen name (prefix-stripped)
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa default


def unpermuted_rows(n: int, n_head: int) -> Any:
    """The row order that inverts convert_hf_to_gguf's ``LlamaModel.permute`` of q/k rows (as
    transformers' ``_reverse_permute_weights``): llama.cpp interleaves the two rotate-half
    halves of each head; this restores HF's [first half, second half]. Each head is n / n_head
    rows (head_dim, whatever n_embd / n_head is); biases are rows too."""
    import numpy as np
    return np.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(0, 2, 1).reshape(n)


@dataclass
class GgufModel:
    config: ModelConfig
    arch: str
    permuted_qk: bool  # q/k rows in llama.cpp's interleaved RoPE layout


def gguf_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    try:
        return reader.value(key, default)
    except GGUFLayoutError as e:  # e.g. a string that is not UTF-8: names the file and key
        raise CheckpointError(str(e)) from None


def open_gguf(path: str) -> GGUFFile:
    """open_reader, its failures one CheckpointError naming the file once."""
    try:
        return open_reader(path)
    except Exception as e:  # the reader raises assorted errors for non-GGUF input
        why = first_line(e)
        why = why[len(path) + 2:] if why.startswith(path + ": ") else why  # (it had named the file twice)
        raise CheckpointError("%s: not a readable GGUF file (%s)" % (path, why)) from None


def gemma3_attn_scale(n_embd: int, n_head: int, head_dim: int, n_layer: int) -> float:
    """llama.cpp's gemma3 queries' scale, from the sizes: 1/sqrt(head_dim), 1/sqrt(n_embd / n_head)
    for the 27B (62 layers)."""
    return (n_embd / n_head if n_layer == 62 else head_dim) ** -0.5


def gguf_architecture(reader: GGUFFile, path: str) -> str:
    """A GGUF's general.architecture, one mdi reads; CheckpointError naming the file otherwise,
    and for one part of a split file (its other parts lack the metadata: named as no architecture)."""
    parts = gguf_value(reader, "split.count")
    if parts not in (None, 0, 1):
        raise CheckpointError("%s: one part of a GGUF split into %s files (llama-gguf-split): mdi reads one file; "
                              "merge them first: llama-gguf-split --merge FIRST-PART OUT.gguf" % (path, parts))
    arch = gguf_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError("%s: GGUF general.architecture %r is not supported (only %s)"
                              % (path, arch, ", ".join(ARCHITECTURES)))
    return str(arch)


def read_gguf_model(reader: GGUFFile, path: str, read_floats: Optional[Any] = None) -> GgufModel:
    """The model a GGUF's metadata and tensor list describe. `read_floats(tensor)`: a float
    tensor's values as a flat list (Llama 3's rope_freqs); None reads them with numpy."""
    arch = gguf_architecture(reader, path)

    def opt(key: str, default: Any = None) -> Any:
        return gguf_value(reader, "%s.%s" % (arch, key), default)

    def meta(key: str, default: Any = None) -> Any:
        v = opt(key, default)
        if v is None:
            raise CheckpointError("%s: GGUF metadata %s.%s is missing" % (path, arch, key))
        if isinstance(v, list):  # per-layer values (head counts, feed-forward sizes)
            raise CheckpointError("%s: GGUF metadata %s.%s has per-layer values, which mdi does not model"
                                  % (path, arch, key))
        return v

    def refuse(key: str, value: Any, what: str) -> None:
        raise CheckpointError("%s: GGUF metadata %s.%s = %r: %s is not supported" % (path, arch, key, value, what))

    def count(key: str, default: Any = None) -> int:
        v = meta(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CheckpointError("%s: GGUF metadata %s.%s = %r: not a positive integer" % (path, arch, key, v))
        return v

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
    if opt("final_logit_softcapping") or opt("attn_logit_softcapping"):
        refuse("final_logit_softcapping", opt("final_logit_softcapping") or opt("attn_logit_softcapping"),
               "logit soft-capping")

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError("%s: GGUF has no token_embd.weight" % path)
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF dims innermost-first: [n_embd, n_vocab]
    n_embd, n_head = count("embedding_length"), count("attention.head_count")
    n_kv_head = count("attention.head_count_kv", n_head)
    if n_embd % n_head and opt("attention.key_length") is None:
        refuse("attention.head_count", n_head, "a head count that does not divide embedding_length %d" % n_embd)
    head_dim = count("attention.key_length", n_embd // n_head)  # Qwen3's and Gemma's heads are wider
    if count("attention.value_length", head_dim) != head_dim:
        refuse("attention.value_length", opt("attention.value_length"),
               "a value head size other than attention.key_length %d" % head_dim)
    rot = count("rope.dimension_count", head_dim)
    if rot != head_dim and arch != "gpt2":
        refuse("rope.dimension_count", rot, "partial rotary embeddings (head size %d)" % head_dim)

    def has(part: str) -> bool:
        return any(re.match(r"^blk\.\d+\.%s$" % re.escape(part), n) for n in tensors)

    rope_factors = None
    if "rope_freqs.weight" in tensors:  # one [head_dim / 2] tensor for all layers (Llama 3's scaling)
        t = tensors["rope_freqs.weight"]
        if t.tensor_type.name != "F32":
            raise CheckpointError("%s: tensor rope_freqs.weight is %s, not F32" % (path, t.tensor_type.name))
        values = read_floats(t) if read_floats is not None else [float(x) for x in t.data.reshape(-1).tolist()]
        rope_factors = None if all(x == 1.0 for x in values) else [float(x) for x in values]

    # float32 metadata -> the shortest decimal that reads back as the same float32 (9.999999747e-06 -> 1e-05)
    f32 = lambda x: float(str(np.float32(x)))  # noqa: E731
    family = ARCHITECTURES[arch]
    extra = {}  # type: dict
    if arch == "gemma3":
        window = opt("attention.sliding_window")
        if window:
            pattern = opt("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
            if isinstance(pattern, list):
                refuse("attention.sliding_window_pattern", pattern, "a per-layer window pattern")
            extra.update(sliding_window=count("attention.sliding_window"),
                         sliding_pattern=count("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN),
                         rope_local_theta=f32(opt("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)))
        scale = opt("attention.scale")  # mdi writes it (gguf_write); llama.cpp's own files do not
        extra["attn_scale"] = f32(scale if scale else gemma3_attn_scale(n_embd, n_head, head_dim,
                                                                        count("block_count")))
    try:
        config = ModelConfig(
            name=os.path.splitext(os.path.basename(path))[0], family=family, vocab_size=vocab,
            n_layer=count("block_count"), n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head,
            intermediate_size=meta("feed_forward_length"), block_size=meta("context_length", 2048),
            norm_eps=f32(meta("attention.layer_norm_epsilon" if family == "gpt2"
                              else "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=f32(meta("rope.freq_base", 10000.0)),
            bias=family == "gpt2" or has("attn_output.bias"),  # Llama's attention_bias: q, k, v and o
            qkv_bias=has("attn_q.bias") and not has("attn_output.bias"),  # Qwen2
            qk_norm=family == "gemma3" or (arch not in PERMUTED_QK and has("attn_q_norm.weight")),  # Qwen3
            head_size=head_dim if head_dim * n_head != n_embd else None,
            rope_factors=rope_factors,
            tied_head="output.weight" not in tensors,
            bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=gguf_value(reader, "tokenizer.ggml.eos_token_id"),
            **extra)
    except (TypeError, ValueError) as e:
        raise CheckpointError("%s: GGUF metadata describes no model mdi can build (%s)" % (path, first_line(e)))
    return GgufModel(config, arch, arch in PERMUTED_QK)


def rope_permuted(reader: GGUFFile, path: str) -> bool:
    """Whether a GGUF's q/k rows are in llama.cpp's interleaved RoPE layout (its architecture's
    converter permuted them), read off general.architecture alone: a node's part of a model
    pushed to it has no embedding to read a whole config from."""
    arch = gguf_architecture(reader, path)
    return arch in PERMUTED_QK


def rope_mode_of(permuted_qk: bool) -> int:
    """ggml's RoPE mode for a GGUF: adjacent pairs where llama.cpp's converter permuted q/k."""
    from mdi.model.ggml import lib
    return lib.ROPE_NORMAL if permuted_qk else lib.ROPE_NEOX
