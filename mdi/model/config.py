"""Model configurations: one dataclass for both families and a registry of named configs.

Family "gpt2" covers GPT-2 and NanoGPT (learned positions, LayerNorm, GELU MLP, biases,
tied head); family "llama" covers Llama / TinyLlama / SmolLM2 / Mistral-style models
(RoPE, RMSNorm, SwiGLU, grouped-query attention).
"""
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional

FAMILIES = ("gpt2", "llama")


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

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError("family must be one of %s, got %r" % (FAMILIES, self.family))
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.n_embd % self.n_head:
            raise ValueError("n_embd (%d) must be divisible by n_head (%d)" % (self.n_embd, self.n_head))
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError("gelu_approximate must be 'tanh' or 'none'")
        if self.n_head % self.n_kv_head:
            raise ValueError("n_head (%d) must be a multiple of n_kv_head (%d)" % (self.n_head, self.n_kv_head))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError("unknown model config keys: %s" % ", ".join(unknown))
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        if name not in CONFIGS:
            raise ValueError("unknown model %r; known: %s" % (name, ", ".join(sorted(CONFIGS))))
        return cls(**CONFIGS[name])

    @classmethod
    def from_hf(cls, hf: Dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Map a Hugging Face config.json (GPT-2 or Llama layouts) onto ModelConfig."""
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
        if model_type in ("llama", "mistral"):
            if hf.get("rope_scaling"):
                raise ValueError("rope_scaling is not supported yet (config %s)" % name)
            eos = hf.get("eos_token_id")
            return cls(
                name=name, family="llama", vocab_size=hf["vocab_size"],
                n_layer=hf["num_hidden_layers"], n_embd=hf["hidden_size"],
                n_head=hf["num_attention_heads"],
                n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"],
                block_size=hf.get("max_position_embeddings", 2048),
                norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=hf.get("rope_theta", 10000.0),
                bias=bool(hf.get("attention_bias", False)),
                tied_head=bool(hf.get("tie_word_embeddings", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        raise ValueError("unsupported Hugging Face model_type %r" % model_type)


def _gpt2(n_layer: int, n_embd: int, n_head: int, **kw: Any) -> Dict[str, Any]:
    d = dict(family="gpt2", vocab_size=50257, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
             block_size=1024, bias=True, tied_head=True, eos_token_id=50256)
    d.update(kw)
    return d


def _llama(**kw: Any) -> Dict[str, Any]:
    d = dict(family="llama", bias=False)
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
    # Like the MDI-LLM thesis' NanoLlama: a Llama-shaped ~304M model
    "nanollama-304m": _llama(vocab_size=32000, n_layer=12, n_embd=1024, n_head=16, n_kv_head=16,
                             intermediate_size=5632, block_size=2048, norm_eps=1e-5,
                             tied_head=False, bos_token_id=1, eos_token_id=2),
}
