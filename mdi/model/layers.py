"""The layers a transformer block is made of: linear layers (float, or quantized with a kernel
chosen by measurement) with their low-rank adapters, embeddings and norms.

Their own module so that both the eager blocks (mdi.model.transformer) and the scripted decode
blocks (mdi.model.fused_decode, which reads these layers' weights and kernels) import them
without importing each other.
"""
import contextlib
import threading
from typing import TYPE_CHECKING, Iterator, Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from mdi.model.config import ModelConfig
from mdi.model.families import family_of
from mdi.model.layout import QuantSpec
from mdi.model.quantization.layouts import HEAD_WEIGHTS
from mdi.model.quantization.quant import dequantize

if TYPE_CHECKING:  # imported when a kernel is chosen (pick_kernel)
    from mdi.model.quantization.qkernels import Kernel


# Weights may be stored in a narrower dtype than the activations (float16 storage with
# float32 compute on GPUs without fast half arithmetic): layers cast their weights to the
# activations' dtype, which is free when the two already match.

class LoraDeltas:
    """The low-rank adapters a chunk holds, and which rows use which during one forward.

    `adapters[id][name] = (A.T [in, r], B.T [r, out])`, both contiguous, for the linear layer
    `name` (e.g. "blocks.3.attn.qkv"; the scale is folded into B): stored transposed, the two
    small matmuls read their rows in order (measured 0.8x the time of A [r, in] / B [out, r]
    read through .t() on SmolLM2's fused qkv and gate_up shapes). During `ModelChunk.forward_rows`,
    `groups` lists (id, rows: a slice or indices) for every adapter some sample of the batch uses: each
    linear layer runs once over every row, then adds x[rows] @ A.T @ B.T per adapter (the
    Punica / S-LoRA gather), so the cost grows with the adapters in a batch, not its samples."""

    def __init__(self) -> None:
        self.adapters: Dict[int, Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = {}
        self.groups: List[Tuple[int, Any]] = []  # (adapter id, slice or row indices)

    def add(self, x: torch.Tensor, y: torch.Tensor, name: str) -> torch.Tensor:
        # The ring's rows are 2-D already; each skipped op is µs per layer and adapter
        flat_x, flat_y = (x, y) if x.dim() == 2 else (x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
        for adapter, rows in self.groups:
            ab = self.adapters[adapter].get(name)
            if ab is not None:
                at, bt = ab if ab[0].dtype == x.dtype else (ab[0].to(x.dtype), ab[1].to(x.dtype))
                if isinstance(rows, slice):  # consecutive rows: views, one in-place addmm, no copies
                    flat_y[rows].addmm_(flat_x[rows] @ at, bt)
                else:
                    flat_y.index_add_(0, rows, (flat_x[rows] @ at) @ bt)
        return y


class Linear(nn.Linear):
    lora: Optional[LoraDeltas] = None  # set by the chunk that holds this layer
    lora_name = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        y = F.linear(x, self.weight.to(x.dtype), bias)
        return self.lora.add(x, y, self.lora_name) if self.lora is not None and self.lora.groups else y


_decode_only = threading.local()  # .on: decode_kernels() is in force on this thread


@contextlib.contextmanager
def decode_kernels() -> Iterator[None]:
    """Within it, on this thread, every quantized layer runs its decode kernel whatever a pass's
    row count: a speculative verification's rows must give the logits of the decode steps they
    stand for bit for bit (so the output is the plain run's), and a prefill kernel multiplies in
    other arithmetic (fbgemm's int8 activations against the bfloat16 int4 kernel)."""
    before = getattr(_decode_only, "on", False)
    _decode_only.on = True
    try:
        yield
    finally:
        _decode_only.on = before


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantized (`QuantSpec`). Loading fills the canonical
    tensors (qweight, scales[, mins]); `pick_kernel` then chooses how to multiply by measurement
    (mdi.model.quantization.kernel_choice) and keeps only what that kernel reads: never a float copy of the weight."""

    qweight: Optional[torch.Tensor]  # a buffer, declared for mypy; None once the packed form replaces it

    def __init__(self, n_in: int, n_out: int, bias: bool, spec: QuantSpec) -> None:
        super().__init__()
        self.n_in, self.n_out, self.spec = n_in, n_out, spec
        for suffix, (shape, dtype) in spec.tensor_shapes(n_out, n_in).items():
            self.register_buffer(suffix, torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.kernel: Optional[Kernel] = None  # chosen by pick_kernel
        self.packed: Dict[str, Any] = {}  # tensors, or an engine's packed weight (a module)
        # A second kernel for passes of `prefill_from` rows or more, where one is faster there
        # and the node spares its copy (kernel_choice.choose_kernels); None: `kernel` for all.
        self.prefill_kernel: Optional[Kernel] = None
        self.prefill_packed: Dict[str, Any] = {}
        self.prefill_from = 0
        self.opaque_nbytes = 0  # bytes the kernel holds outside tensors (not in buffers())
        self.lora: Optional[LoraDeltas] = None  # set by the chunk that holds this layer
        self.lora_name = ""

    def canonical(self) -> Dict[str, torch.Tensor]:
        return {s: getattr(self, s) for s in self.spec.tensor_shapes(1, self.spec.group_size)}

    def pick_kernel(self, where: str, keep_canonical: bool = False, resident: Sequence[torch.Tensor] = ()) -> None:
        """`resident`: the chunk's other tensors, read between timed calls (kernel_timing.time_call)."""
        from mdi.model.quantization import kernel_choice
        canonical = self.canonical()
        # The head multiplies each sample's last row of a prefill pass (the pipeline samples only
        # those): its passes are decode-sized, and timing it on many rows costs seconds at load.
        many_rows = where.rsplit(".", 1)[-1] not in HEAD_WEIGHTS
        # once per load, before the packed form replaces the canonical tensors
        assert self.qweight is not None, "pick_kernel needs the loaded canonical tensors"
        choice = kernel_choice.choose_kernels(canonical, self.spec, self.n_in, self.qweight.device, where, resident,
                                              many_rows, keep_canonical)
        self.kernel, self.packed = choice.kernel, choice.packed
        self.prefill_kernel, self.prefill_from = choice.prefill_kernel, choice.prefill_from
        self.prefill_packed = choice.prefill_packed or {}
        kernels = [self.kernel] + ([choice.prefill_kernel] if choice.prefill_kernel is not None else [])
        if not (any(k.needs_canonical for k in kernels) or keep_canonical):
            for suffix in canonical:
                setattr(self, suffix, None)  # the packed form replaces it
        self.opaque_nbytes = 0
        for prefix, kernel, packed in (("packed_", self.kernel, self.packed),
                                       ("prefill_packed_", choice.prefill_kernel, self.prefill_packed)):
            for name, t in packed.items():  # registered so memory reports count them
                if not isinstance(t, torch.Tensor):  # an engine's packed weight: its size as the kernel states it
                    self.opaque_nbytes += kernel.held_bytes(self.spec, self.n_out, self.n_in)
                elif not any(t is c for c in canonical.values()):
                    self.register_buffer(prefix + name, t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError("quantized layer used before its kernel was chosen")
        kernel, packed = self.kernel, self.packed
        if self.prefill_kernel is not None and x.numel() >= self.prefill_from * self.n_in \
                and not getattr(_decode_only, "on", False):  # a pass of many rows, not a verification's
            kernel, packed = self.prefill_kernel, self.prefill_packed
        if x.dim() == 2:  # [rows, n_in], the ring's shape: no reshapes (each op costs µs per token)
            y = kernel.run(x, packed, self.spec, self.n_in)
        else:
            y = kernel.run(x.reshape(-1, self.n_in), packed, self.spec, self.n_in)
            y = y.reshape(x.shape[:-1] + (self.n_out,))
        y = y + self.bias.to(y.dtype) if self.bias is not None else y
        return self.lora.add(x, y, self.lora_name) if self.lora is not None and self.lora.groups else y


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        # A chunk is built on "meta" and loaded afterwards (mdi.model.source._empty_chunk): a
        # random initialisation there is thrown away, and normal_ on meta imports torch's
        # Python meta kernels (~60 MB of RSS).
        if not self.weight.is_meta:
            super().reset_parameters()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head: x @ embedding.T."""
        return F.linear(x, self.weight.to(x.dtype))


class QuantEmbedding(QuantLinear):
    """A quantized token embedding: a lookup dequantizes only the rows it reads; as the tied
    head it multiplies like any QuantLinear (keeping the canonical rows for lookups)."""

    def __init__(self, n_vocab: int, n_embd: int, spec: QuantSpec) -> None:
        super().__init__(n_embd, n_vocab, False, spec)

    def pick_kernel(self, where: str, keep_canonical: bool = True, resident: Sequence[torch.Tensor] = ()) -> None:
        super().pick_kernel(where, True, resident)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = {s: t[ids.reshape(-1)] for s, t in self.canonical().items()}
        return dequantize(rows, self.spec, self.n_in).reshape(ids.shape + (self.n_in,))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return QuantLinear.forward(self, x)


def held_bytes(module: nn.Module) -> int:
    """What a module's weights hold: its tensors, and what its kernels keep outside them."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers())) \
        + sum(getattr(m, "opaque_nbytes", 0) for m in module.modules())


def make_linear(n_in: int, n_out: int, bias: bool, spec: Optional[QuantSpec]) -> nn.Module:
    return Linear(n_in, n_out, bias=bias) if spec is None else QuantLinear(n_in, n_out, bias, spec)


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


# torch >= 2.4 (feature-detected; torch 2.0 keeps the hand-written path). With the RoPE tables
# gathered once per batch: SmolLM2 int4 decode 0.96x the time per token (3 alternating runs).
_fused_rms_norm = getattr(F, "rms_norm", None)


class RMSNorm(nn.Module):
    """x / rms(x) * weight. The weight is the multiplier as applied: Gemma's checkpoints store
    it less one (their norm computes 1 + w), mdi's state dicts hold 1 + w (mdi.model.files.convert).
    `weight_in_float`: multiply in float32, then cast (Gemma's order); else cast the normalised
    rows, then multiply (Llama's). The same in float32."""

    # Hand-written: torch.nn.RMSNorm does not exist in torch 2.0 (JetPack 5).
    def __init__(self, dim: int, eps: float, weight_in_float: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight_in_float = weight_in_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_rms_norm is not None and x.dtype == torch.float32 and self.weight.dtype == x.dtype:
            return _fused_rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one op instead of six
        # Normalise in fp32 like the reference implementations, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float:
            return (xf * self.weight.float()).to(x.dtype)
        return self.weight.to(x.dtype) * xf.to(x.dtype)


def make_norm(config: ModelConfig, dim: Optional[int] = None) -> nn.Module:
    """The family's norm (mdi.model.families) over `dim` values (default n_embd)."""
    family = family_of(config.family)
    dim = config.n_embd if dim is None else dim
    if family.norm == "layer":
        return LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps, family.norm_weight_in_float)
