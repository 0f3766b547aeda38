"""Model configurations: one dataclass for both families and a registry of named configs.

Family "gpt2" covers GPT-2 and NanoGPT (learned positions, LayerNorm, GELU MLP, biases,
tied head); family "llama" covers Llama / TinyLlama / SmolLM2 / Mistral-style models
(RoPE, RMSNorm, SwiGLU, grouped-query attention) and the variants of that block people run:
Llama 3 (RoPE scaled by `rope_scaling` type llama3), Qwen2 / Qwen2.5 (biases on q, k, v:
`qkv_bias`) and Qwen3 (RMSNorm on each head's q and k: `qk_norm`; heads wider than
n_embd / n_head: `head_size`); family "gemma3" covers Gemma 3's text model (four norms a block,
a GELU-gated MLP, scaled embeddings: mdi.model.families; sliding-window layers with their own
RoPE base, a query scale of its own: the fields below).
"""
import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional

import numpy as np

from mdi.model.families import FAMILIES as _FAMILY_TABLE

FAMILIES = tuple(_FAMILY_TABLE)  # mdi.model.families holds what each one's block is made of
MAX_SIZE = 1 << 24  # the largest count a config may give (vocabulary, layers, widths, heads, context)
SIZE_FIELDS = ("vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size", "block_size")
TOKEN_FIELDS = ("bos_token_id", "eos_token_id")


def _size(name: str, value: Any) -> int:
    """A positive integer count (a numpy integer from a GGUF counts too), never a bool, a float
    or a string: a model file's "64.5" or "x" is refused here, in one line naming the key."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= int(value) <= MAX_SIZE:
        raise ValueError("%s must be an integer in [1, %d], got %r" % (name, MAX_SIZE, value))
    return int(value)


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError("%s must be a positive finite number, got %r" % (name, value))
    return float(value)


@dataclass
class ModelConfig:
    name: str = "custom"
    family: str = "llama"
    vocab_size: int = 32000
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    n_kv_head: Optional[int] = None  # None = n_head (multi-head attention)
    intermediate_size: Optional[int] = None  # None = 4 * n_embd
    block_size: int = 2048  # maximum context length
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bias: bool = False  # biases on linear layers (GPT-2: True)
    tied_head: bool = True  # LM head shares the token embedding
    gelu_approximate: str = "tanh"  # GPT-2 uses tanh-GELU ("gelu_new"); nanoGPT exact ("none")
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    head_size: Optional[int] = None  # None = n_embd // n_head (Qwen3 sets its own)
    qkv_bias: bool = False  # biases on the q/k/v projections only (Qwen2); `bias` means every linear layer
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_context"}
    rope_scaling: Optional[Dict[str, Any]] = None
    # Per-frequency divisors of RoPE's inverse frequencies, as a GGUF's rope_freqs tensor holds
    # them (llama.cpp writes Llama 3's scaling that way): head_dim / 2 positive numbers.
    rope_factors: Optional[List[float]] = None
    # Sliding-window attention (Gemma 3): layers attend to their last `sliding_window` positions
    # only, except every `sliding_pattern`-th layer (the last of each group), which sees all; the
    # windowed layers rotate with `rope_local_theta` as their base.
    sliding_window: Optional[int] = None
    sliding_pattern: int = 0
    rope_local_theta: Optional[float] = None
    attn_scale: Optional[float] = None  # None: 1 / sqrt(head_dim)

    def __post_init__(self) -> None:
        # Every value is checked here, whatever it came from (config.json, a GGUF's metadata,
        # mdi_config.json, a request): a malformed one is a one-line error, never a traceback.
        if self.family not in FAMILIES:
            raise ValueError("family must be one of %s, got %r" % (FAMILIES, self.family))
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * _size("n_embd", self.n_embd)
        for key in SIZE_FIELDS:
            setattr(self, key, _size(key, getattr(self, key)))
        self.norm_eps = _positive("norm_eps", self.norm_eps)
        self.rope_theta = _positive("rope_theta", self.rope_theta)
        for key in TOKEN_FIELDS:
            value = getattr(self, key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                    raise ValueError("%s must be a token id (an integer >= 0) or absent, got %r" % (key, value))
                setattr(self, key, int(value))
        if self.head_size is None and self.n_embd % self.n_head:
            raise ValueError("n_embd (%d) must be divisible by n_head (%d)" % (self.n_embd, self.n_head))
        rotated = _FAMILY_TABLE[self.family].positions == "rope"
        if self.head_size is None and (self.n_embd // self.n_head) % 2 and rotated:
            # RoPE turns pairs of a head's values (ggml aborts the process on an odd one)
            raise ValueError("n_embd / n_head (%d / %d) must be even: RoPE rotates a head's values in pairs"
                             % (self.n_embd, self.n_head))
        if self.head_size is not None and (not isinstance(self.head_size, int) or not 2 <= self.head_size <= 4096
                                           or self.head_size % 2):
            raise ValueError("head_size must be an even integer in [2, 4096], got %r" % (self.head_size,))
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.rope_factors is not None:
            f = self.rope_factors
            if (not isinstance(f, list) or len(f) != self.head_dim // 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f)):
                raise ValueError("rope_factors must be head_dim / 2 = %d positive numbers" % (self.head_dim // 2))
            if self.rope_scaling is not None:
                raise ValueError("rope_factors and rope_scaling are two forms of one thing: give one")
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError("gelu_approximate must be 'tanh' or 'none'")
        if self.sliding_window is not None:
            self.sliding_window = _size("sliding_window", self.sliding_window)
            if isinstance(self.sliding_pattern, bool) or not isinstance(self.sliding_pattern, int) \
                    or not 1 <= self.sliding_pattern <= MAX_SIZE:
                raise ValueError("sliding_pattern must be a positive integer with sliding_window, got %r"
                                 % (self.sliding_pattern,))
        for key in ("rope_local_theta", "attn_scale"):
            if getattr(self, key) is not None:
                setattr(self, key, _positive(key, getattr(self, key)))
        if self.n_head % self.n_kv_head:
            raise ValueError("n_head (%d) must be a multiple of n_kv_head (%d)" % (self.n_head, self.n_kv_head))

    # n_kv_head and intermediate_size are Optional only until __post_init__ resolves them
    @property
    def kv_heads(self) -> int:
        assert self.n_kv_head is not None
        return self.n_kv_head

    @property
    def ffn_width(self) -> int:
        assert self.intermediate_size is not None
        return self.intermediate_size

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.n_embd // self.n_head

    @property
    def query_scale(self) -> float:
        """What queries are multiplied by, as llama.cpp computes it: 1.0f / sqrtf(d) in float32, d
        the head size or the whole number an attn_scale is 1 / sqrt of. A file's rounded scale (7
        digits) or one computed in double lands a float32 step away for some d (Gemma 3's 128: its
        texts parted from llama.cpp's at near ties)."""
        d = float(self.head_dim)
        if self.attn_scale is not None:
            d = self.attn_scale ** -2
            if abs(d - round(d)) > 1e-4 * d:  # not 1 / sqrt of a whole number: used as given
                return float(np.float32(self.attn_scale))
            d = round(d)
        return float(np.float32(1.0) / np.sqrt(np.float32(d)))

    def layer_window(self, layer: int) -> int:
        """How many positions layer `layer` attends to, its own included: sliding_window on a
        sliding-window layer (Gemma 3: all but the last of every `sliding_pattern`), else 0 (all)."""
        if not self.sliding_window or layer % self.sliding_pattern == self.sliding_pattern - 1:
            return 0
        return self.sliding_window

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            # repr: a key comes from a request body or a file, and a one-line error stays one line
            raise ValueError("unknown model config keys: %s" % ", ".join(repr(k) for k in unknown))
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        if name not in CONFIGS:
            raise ValueError("unknown model %r; known: %s" % (name, ", ".join(sorted(CONFIGS))))
        return cls(**CONFIGS[name])

    @classmethod
    def from_hf(cls, hf: Dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Map a Hugging Face config.json (GPT-2, Llama / Qwen or Gemma 3 layouts) onto ModelConfig."""
        model_type = hf.get("model_type", "")
        if model_type == "gpt2":
            return cls(
                name=name, family="gpt2", vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                n_embd=hf["n_embd"], n_head=hf["n_head"],
                intermediate_size=hf.get("n_inner") or 4 * hf["n_embd"],
                block_size=hf.get("n_positions", 1024),
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), bias=True, tied_head=True,
                gelu_approximate="none" if hf.get("activation_function") == "gelu" else "tanh",
                bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            )
        if model_type in ("llama", "mistral", "qwen2", "qwen3"):
            eos = hf.get("eos_token_id")
            head_dim = hf.get("head_dim")
            return cls(
                name=name, family="llama", vocab_size=hf["vocab_size"],
                n_layer=hf["num_hidden_layers"], n_embd=hf["hidden_size"],
                n_head=hf["num_attention_heads"],
                n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"],
                block_size=_llama_context(hf),
                norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf),
                bias=bool(hf.get("attention_bias", False)) and model_type != "qwen3",
                qkv_bias=model_type == "qwen2",
                qk_norm=model_type == "qwen3",
                head_size=head_dim if head_dim and head_dim != hf["hidden_size"] // hf["num_attention_heads"] else None,
                rope_scaling=_rope_scaling(hf),
                tied_head=bool(hf.get("tie_word_embeddings", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        if model_type == "gemma3":  # the multimodal model's config: its text part (mdi reads no vision tower)
            text = hf.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("model_type gemma3 without a text_config")
            text = dict(text, model_type="gemma3_text")
            for key in TOKEN_FIELDS:
                if text.get(key) is None and hf.get(key) is not None:
                    text[key] = hf[key]
            return cls.from_hf(text, name)
        if model_type == "gemma3_text":
            return cls(name=name, **_gemma3_from_hf(hf))
        raise ValueError("unsupported Hugging Face model_type %r" % model_type)


def _llama_context(hf: Dict[str, Any]) -> int:
    """The context a Llama-layout config allows. Mistral's sliding_window (4096 in Mistral-7B
    v0.1) hides positions further back than it, which mdi's full attention would see: within the
    window the two are the same function, so the context stops there."""
    context = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    return min(context, window) if window else context


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_context")


def check_rope_scaling(scaling: Any) -> None:
    """Only Llama 3's scaling is modelled: anything else is refused, naming what it got."""
    if not isinstance(scaling, dict) or scaling.get("type") != "llama3":
        raise ValueError("rope_scaling: only type llama3 is supported, got %r" % (scaling,))
    for key in ROPE_SCALING_KEYS:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError("rope_scaling.%s must be a positive number, got %r" % (key, value))
    if sorted(scaling) != sorted(("type",) + ROPE_SCALING_KEYS):
        raise ValueError("rope_scaling: expected the keys type, %s" % ", ".join(ROPE_SCALING_KEYS))
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")


def _rope_params(hf: Dict[str, Any]) -> Dict[str, Any]:
    # transformers >= 5 writes rope_parameters; before, rope_theta and rope_scaling
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict):
        return rope
    out = dict(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        out["rope_theta"] = hf["rope_theta"]
    return out


def _rope_theta(hf: Dict[str, Any]) -> float:
    return float(_rope_params(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rope = _rope_params(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError("rope type %r is not supported (only default and llama3)" % kind)
    return {"type": "llama3", "factor": rope["factor"], "low_freq_factor": rope["low_freq_factor"],
            "high_freq_factor": rope["high_freq_factor"],
            "original_context": rope["original_max_position_embeddings"]}


# transformers' Gemma3TextConfig defaults: a config.json (a multimodal model's text_config above
# all) leaves out what it does not change
GEMMA3_DEFAULTS: Dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
    query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1000000.0, rope_local_base_freq=10000.0)
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA3_SWA_PATTERN = 6  # transformers' and llama.cpp's default: every 6th layer global
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # transformers' names of tanh-approximated GELU


def _gemma3_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a Gemma 3 text model's config.json (model_type gemma3_text), with
    transformers' defaults; what mdi does not model (soft-capping, scaled RoPE, bidirectional
    attention, layer kinds in another order than every Nth global) is refused naming it."""
    g = dict(GEMMA3_DEFAULTS)
    g.update({k: v for k, v in hf.items() if v is not None or k in ("sliding_window",)})
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError("%s = %r: logit soft-capping is not supported" % (key, hf[key]))
    if g.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: bidirectional attention is not supported")
    act = g.get("hidden_activation") or g.get("hidden_act")
    if act not in TANH_GELUS + ("gelu",):
        raise ValueError("hidden_activation %r is not supported (only %s, gelu)" % (act, ", ".join(TANH_GELUS)))
    # RoPE: transformers >= 5 writes rope_parameters per layer kind, before rope_theta,
    # rope_local_base_freq and rope_scaling (the global layers')
    rope = g.get("rope_parameters")
    if isinstance(rope, dict) and any(k in rope for k in GEMMA3_LAYER_TYPES):
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full = dict(g.get("rope_scaling") or {})
        full.update(rope if isinstance(rope, dict) else {})
        local = {}
    full.setdefault("rope_theta", g["rope_theta"])
    local.setdefault("rope_theta", g["rope_local_base_freq"])
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError("rope type %r (%s layers) is not supported (only default)" % (rope_type, kind))
    n_layer = g["num_hidden_layers"]
    window = g.get("sliding_window")
    pattern = _gemma3_pattern(g, n_layer) if window else 0
    n_head, head_dim, hidden = g["num_attention_heads"], g["head_dim"], g["hidden_size"]
    eos = g.get("eos_token_id")
    return dict(
        family="gemma3", vocab_size=g["vocab_size"], n_layer=n_layer, n_embd=hidden, n_head=n_head,
        n_kv_head=g.get("num_key_value_heads") or n_head, intermediate_size=g["intermediate_size"],
        block_size=g["max_position_embeddings"], norm_eps=g["rms_norm_eps"], rope_theta=float(full["rope_theta"]),
        bias=bool(g.get("attention_bias")), qk_norm=True,
        head_size=head_dim if head_dim and head_dim * n_head != hidden else None,
        tied_head=bool(g.get("tie_word_embeddings", True)),
        gelu_approximate="none" if act == "gelu" else "tanh",
        bos_token_id=g.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
        sliding_window=window or None, sliding_pattern=pattern,
        rope_local_theta=float(local["rope_theta"]) if window else None,
        attn_scale=_positive("query_pre_attn_scalar", g["query_pre_attn_scalar"]) ** -0.5)


def _gemma3_pattern(g: Dict[str, Any], n_layer: int) -> int:
    """Every Nth layer global (layer % N == N - 1): N from layer_types (transformers >= 4.53)
    or sliding_window_pattern; layer kinds in another order are refused."""
    types = g.get("layer_types")
    if types is None:
        return g.get("sliding_window_pattern", g.get("_sliding_window_pattern", GEMMA3_SWA_PATTERN))
    if not isinstance(types, list) or len(types) != n_layer or any(t not in GEMMA3_LAYER_TYPES for t in types):
        raise ValueError("layer_types must list %d of %s" % (n_layer, ", ".join(GEMMA3_LAYER_TYPES)))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    pattern = full[0] + 1 if full else n_layer + 1
    if types != ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(n_layer)]:
        raise ValueError("layer_types: only every Nth layer global is modelled, got %s" % types)
    return pattern


def _gpt2(n_layer: int, n_embd: int, n_head: int, **kw: Any) -> Dict[str, Any]:
    d = dict(family="gpt2", vocab_size=50257, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
             block_size=1024, bias=True, tied_head=True, eos_token_id=50256)
    d.update(kw)
    return d


def _llama(**kw: Any) -> Dict[str, Any]:
    d = dict(family="llama", bias=False)
    d.update(kw)
    return d


def _llama3(n_layer: int, n_embd: int, n_head: int, n_kv_head: int, intermediate: int, factor: float,
            **kw: Any) -> Dict[str, Any]:
    return _llama(vocab_size=128256, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head,
                  intermediate_size=intermediate, block_size=131072, norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_context": 8192},
                  bos_token_id=128000, eos_token_id=128001, **kw)


def _qwen(version: int, n_layer: int, n_embd: int, n_head: int, n_kv_head: int, intermediate: int,
          **kw: Any) -> Dict[str, Any]:
    d = _llama(vocab_size=151936, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head,
               intermediate_size=intermediate, block_size=32768, norm_eps=1e-6, rope_theta=1000000.0,
               eos_token_id=151643)
    if version == 2:
        d["qkv_bias"] = True
    else:
        d.update(qk_norm=True, head_size=128)
    d.update(kw)
    return d


CONFIGS: Dict[str, Dict[str, Any]] = {
    # GPT-2 flavours
    "gpt2": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    # NanoGPT sizes (character level: the vocabulary comes from the checkpoint)
    "nanogpt-shakespeare-char": _gpt2(6, 384, 6, vocab_size=65, block_size=256, eos_token_id=None,
                                      gelu_approximate="none"),
    "nanogpt-small": _gpt2(4, 256, 4, vocab_size=96, block_size=256, eos_token_id=None,
                           gelu_approximate="none"),
    # Llama family
    "tinyllama-1.1b": _llama(vocab_size=32000, n_layer=22, n_embd=2048, n_head=32, n_kv_head=4,
                             intermediate_size=5632, block_size=2048, norm_eps=1e-5,
                             tied_head=False, bos_token_id=1, eos_token_id=2),
    "llama-2-7b": _llama(vocab_size=32000, n_layer=32, n_embd=4096, n_head=32, n_kv_head=32,
                         intermediate_size=11008, block_size=4096, norm_eps=1e-5,
                         tied_head=False, bos_token_id=1, eos_token_id=2),
    "smollm2-135m": _llama(vocab_size=49152, n_layer=30, n_embd=576, n_head=9, n_kv_head=3,
                           intermediate_size=1536, block_size=8192, norm_eps=1e-5,
                           rope_theta=100000.0, tied_head=True, bos_token_id=1, eos_token_id=2),
    # Llama 3.x (RoPE scaled: llama3 type, original context 8192)
    "llama-3.2-1b": _llama3(16, 2048, 32, 8, 8192, factor=32.0, tied_head=True),
    "llama-3.2-3b": _llama3(28, 3072, 24, 8, 8192, factor=32.0, tied_head=True),
    "llama-3.1-8b": _llama3(32, 4096, 32, 8, 14336, factor=8.0, tied_head=False),
    # Qwen2.5 (biases on q/k/v) and Qwen3 (q/k norms, 128-wide heads)
    "qwen2.5-0.5b": _qwen(2, 24, 896, 14, 2, 4864, tied_head=True),
    "qwen2.5-1.5b": _qwen(2, 28, 1536, 12, 2, 8960, tied_head=True),
    "qwen2.5-3b": _qwen(2, 36, 2048, 16, 2, 11008, tied_head=True),
    "qwen2.5-7b": _qwen(2, 28, 3584, 28, 4, 18944, tied_head=False, vocab_size=152064),
    "qwen3-0.6b": _qwen(3, 28, 1024, 16, 8, 3072, tied_head=True, block_size=40960),
    "qwen3-1.7b": _qwen(3, 28, 2048, 16, 8, 6144, tied_head=True, block_size=40960),
    "qwen3-4b": _qwen(3, 36, 2560, 32, 8, 9728, tied_head=True, block_size=40960),
    "qwen3-8b": _qwen(3, 36, 4096, 32, 8, 12288, tied_head=False, block_size=40960),
    # Like the MDI-LLM thesis' NanoLlama: a Llama-shaped ~304M model
    "nanollama-304m": _llama(vocab_size=32000, n_layer=12, n_embd=1024, n_head=16, n_kv_head=16,
                             intermediate_size=5632, block_size=2048, norm_eps=1e-5,
                             tied_head=False, bos_token_id=1, eos_token_id=2),
}
