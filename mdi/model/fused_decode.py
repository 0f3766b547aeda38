"""A decode step over a chunk's blocks as one TorchScript call.

A decode token runs ~40 small ops per block. In eager PyTorch each one also costs Python
argument parsing and a module call, which on SmolLM2-135M int4 (576 wide) takes as long as the
int4 matmuls themselves. The same ops, in the same order, compiled once with `torch.jit.script`
skip that: one block's decode step measured 0.68x the eager time at 2 threads and 0.76x at 1
(see results/README, "Decode as one TorchScript call"). Nothing is fused or reordered, so the
result is the eager path's, bit for bit (tests/test_fused_decode.py checks it).

It covers Llama-family blocks (RMSNorm, RoPE, SiLU-gated MLP; a qkv bias as in Qwen2.5, q/k
norms as in Qwen3) and Gemma 3's (norms after attention and the MLP too, a GELU-gated MLP, a query
scale of its own, sliding-window layers with their own RoPE base) whose linear layers are
float32 or use the CPU int4 packed or int8 integer kernels (the latter through their own module, mdi.model.quantization.qkernels.Int8DynamicLinear), with
float32 activations on the CPU, for frames where every sample brings one row (decode) or where
every row stands for a decode step (a speculative verification, `RowBatch.row_wise`), and no
adapter is in use. Everything else (prefill, GPT-2, the `exact` dequantizing kernels, CUDA,
torch without `torch.rms_norm` such as JetPack 5's 2.0) runs the eager blocks, which stay the
reference. A chunk's `fused_decode` (runtime.fused_decode, sent to every worker in /init and
/profile) turns it off, to compare; `MDI_FUSED_DECODE=0` makes off the default (`default_on`).
"""
import logging
import time
import warnings
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from mdi.model.attention import attend_decode_rows, attend_sample, rotate
from mdi.model.families import family_of
from mdi.model.layers import Linear, QuantLinear, RMSNorm
from mdi.model.torch_settings import FUSED_DECODE_ENV, fused_decode_default

log = logging.getLogger(__name__)

FLOAT, INT4, INT8_AS_INT4 = 0, 1, 2
KERNEL_MODES = {"int4pack-cpu": INT4, "int8-as-2xint4-cpu": INT8_AS_INT4}  # mdi.model.quantization.qkernels names
INTEGER_KERNELS = ("int8dyn-fbgemm", "int8dyn-qnnpack")  # run by their own module (packed["linear"])
ENV_DEFAULT = FUSED_DECODE_ENV
default_on = fused_decode_default  # where the torch side always found it


class _Linear(torch.nn.Module):
    """QuantLinear / Linear's forward for one kernel, as eager computes it."""

    def __init__(self, mode: int, tensors: List[torch.Tensor], bias: Optional[torch.Tensor], group_size: int) -> None:
        super().__init__()
        empty = torch.empty(0)
        self.mode = mode
        self.group_size = group_size
        self.w = tensors[0]
        self.sz = tensors[1] if len(tensors) > 1 else empty
        self.w2 = tensors[2] if len(tensors) > 2 else empty
        self.sz2 = tensors[3] if len(tensors) > 3 else empty
        self.has_bias = bias is not None
        self.bias = bias if bias is not None else empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == 0:
            return F.linear(x, self.w.to(x.dtype), self.bias.to(x.dtype) if self.has_bias else None)
        xb = x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.w, self.group_size, self.sz)
        if self.mode == 2:
            y = y.float() + torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.w2, self.group_size, self.sz2).float()
        y = y.to(x.dtype)
        if self.has_bias:
            y = y + self.bias.to(y.dtype)
        return y


class _Int8Dynamic(torch.nn.Module):
    """QuantLinear's forward with an integer kernel (mdi.model.quantization.qkernels.Int8DynamicLinear)."""

    def __init__(self, linear: torch.nn.Module, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.linear = linear
        self.has_bias = bias is not None
        self.bias = bias if bias is not None else torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.has_bias:
            y = y + self.bias.to(y.dtype)
        return y


class _Block(torch.nn.Module):
    """transformer.Block's forward for decode rows (attend_sample with one row, or
    attend_decode_rows for several samples), op for op. Gemma 3's block too: norms after
    attention and the MLP, a GELU-gated MLP, its own query scale and, on sliding-window layers,
    the window and the local RoPE tables (`cos_l`, `sin_l`) and decode mask (`mask_l`)."""

    def __init__(self, block: Any, linears: List[torch.nn.Module]) -> None:  # _Linear or _Int8Dynamic
        super().__init__()
        attn = block.attn
        self.H, self.KV, self.D = attn.n_head, attn.n_kv_head, attn.head_dim
        self.C = int(block.norm1.weight.shape[0])
        self.eps1, self.eps2 = float(block.norm1.eps), float(block.norm2.eps)
        self.n1, self.n2 = block.norm1.weight, block.norm2.weight
        self.qkv, self.proj, self.gate_up, self.down = linears
        self.qk_norm = bool(attn.qk_norm)
        empty = torch.empty(0)
        self.q_norm = attn.q_norm.weight if self.qk_norm else empty
        self.k_norm = attn.k_norm.weight if self.qk_norm else empty
        self.q_eps = float(attn.q_norm.eps) if self.qk_norm else 0.0
        self.k_eps = float(attn.k_norm.eps) if self.qk_norm else 0.0
        self.post_norms = bool(block.post_norms)
        self.pa = block.post_attn_norm.weight if self.post_norms else empty
        self.pm = block.post_mlp_norm.weight if self.post_norms else empty
        self.pa_eps = float(block.post_attn_norm.eps) if self.post_norms else 0.0
        self.pm_eps = float(block.post_mlp_norm.eps) if self.post_norms else 0.0
        self.geglu = block.mlp.kind == "geglu"
        self.approximate = str(block.mlp.gelu_approximate)
        self.window = int(attn.window)
        self.scale = float(attn.scale) if attn.scale is not None else 0.0  # 0: SDPA's own

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slot: int, start: int, slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                several: bool, row_slots: List[int], row_positions: List[int],
                cos_l: torch.Tensor, sin_l: torch.Tensor, mask_l: torch.Tensor) -> torch.Tensor:
        R = x.shape[0]
        H, KV, D = self.H, self.KV, self.D
        scale: Optional[float] = None
        if self.scale > 0:
            scale = self.scale
        qkv = self.qkv(torch.rms_norm(x, [self.C], self.n1, self.eps1)).view(R, H + 2 * KV, D)
        qk, vv = qkv[:, :H + KV], qkv[:, H + KV:]
        if self.qk_norm:
            qk = torch.cat((torch.rms_norm(qk[:, :H], [D], self.q_norm, self.q_eps),
                            torch.rms_norm(qk[:, H:], [D], self.k_norm, self.k_eps)), dim=1)
        if self.window > 0:
            qk = rotate(qk, cos_l, sin_l)
        else:
            qk = rotate(qk, cos, sin)
        if len(row_slots) > 0:  # a verification: each row attends as its own decode step
            ys = []
            for r in range(R):
                ys.append(attend_sample(qk[r:r + 1], vv[r:r + 1], k[row_slots[r]], v[row_slots[r]], row_positions[r],
                                        H, KV, D, None, self.window, scale))
            y = torch.cat(ys)
        elif several:
            y = attend_decode_rows(qk, vv, k, v, slots, positions, mask_l if self.window > 0 else mask, H, KV, D, 1,
                                   scale)
        else:
            y = attend_sample(qk, vv, k[slot], v[slot], start, H, KV, D, None, self.window, scale)
        if self.post_norms:
            x = x + torch.rms_norm(self.proj(y), [self.C], self.pa, self.pa_eps)
        else:
            x = x + self.proj(y)
        gate, up = self.gate_up(torch.rms_norm(x, [self.C], self.n2, self.eps2)).chunk(2, dim=-1)
        if self.geglu:
            h = self.down(F.gelu(gate, approximate=self.approximate) * up)
        else:
            h = self.down(F.silu(gate) * up)
        if self.post_norms:
            return x + torch.rms_norm(h, [self.C], self.pm, self.pm_eps)
        return x + h


class _Blocks(torch.nn.Module):
    def __init__(self, blocks: List[_Block]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slot: int, start: int, slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                several: bool, row_slots: List[int], row_positions: List[int],
                cos_l: torch.Tensor, sin_l: torch.Tensor, mask_l: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, k[i], v[i], cos, sin, slot, start, slots, positions, mask, several, row_slots, row_positions,
                      cos_l, sin_l, mask_l)
        return x


def _linear(layer: Any) -> Optional[torch.nn.Module]:
    """The scripted form of a Linear or QuantLinear, or None when its kernel is not covered."""
    if isinstance(layer, Linear):
        if layer.weight.dtype != torch.float32 or layer.weight.device.type != "cpu" \
                or (layer.bias is not None and layer.bias.dtype != torch.float32):
            return None
        return _Linear(FLOAT, [layer.weight], layer.bias, 0)
    if isinstance(layer, QuantLinear) and layer.kernel is not None and layer.kernel.name in INTEGER_KERNELS:
        return _Int8Dynamic(layer.packed["linear"], layer.bias)
    if isinstance(layer, QuantLinear) and layer.kernel is not None and layer.kernel.name in KERNEL_MODES:
        mode = KERNEL_MODES[layer.kernel.name]
        names = ("w", "sz") if mode == INT4 else ("w", "sz", "w2", "sz2")
        return _Linear(mode, [layer.packed[n] for n in names], layer.bias, layer.spec.group_size)
    return None


def why_not(chunk: Any) -> str:
    """Why this chunk's blocks cannot decode as one call ("" when they can)."""
    if not chunk.fused_decode:
        return "turned off (runtime.fused_decode: false)"
    if not hasattr(torch, "rms_norm") or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch has no torch.rms_norm or int4 packed kernel"
    family = family_of(chunk.config.family)
    if family.norm != "rms" or family.positions != "rope" or family.mlp not in ("swiglu", "geglu") \
            or chunk.rope is None:
        return "not a Llama- or Gemma-3-style chunk with blocks (family %s)" % family.name
    if chunk.compute_dtype not in (None, torch.float32):
        return "activations are not float32"
    for name, block in chunk.blocks.items():
        norms = [block.norm1, block.norm2] + ([block.attn.q_norm, block.attn.k_norm] if block.attn.qk_norm else []) \
            + ([block.post_attn_norm, block.post_mlp_norm] if block.post_norms else [])
        if not all(isinstance(n, RMSNorm) and n.weight.dtype == torch.float32 and n.weight.device.type == "cpu"
                   for n in norms):
            return "block %s: norms are not float32 on the CPU" % name
        for layer in (block.attn.qkv, block.attn.proj, block.mlp.gate_up, block.mlp.down):
            if _linear(layer) is None:
                how = layer.kernel.name if getattr(layer, "kernel", None) is not None else "its %s weight" % layer.weight.dtype
                return "%s multiplies with %s" % (layer.lora_name, how)
    return ""


def _covered(layer: Any) -> torch.nn.Module:
    """_linear's form of a layer that why_not found covered."""
    module = _linear(layer)
    assert module is not None  # why_not checked every block's layers
    return module


def build(chunk: Any) -> Optional[torch.jit.ScriptModule]:
    """The chunk's blocks as one scripted module, or None (logged) when they are not covered
    or this torch cannot script them."""
    reason = why_not(chunk)
    if not reason:
        try:
            blocks = [_Block(b, [_covered(l) for l in (b.attn.qkv, b.attn.proj, b.mlp.gate_up, b.mlp.down)])
                      for b in chunk.blocks.values()]
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript's deprecation notice: the fallback is eager
                scripted = torch.jit.script(_Blocks(blocks))
            # debug: a run's stderr is its output and errors (one line each), not its internals
            log.debug("layers [%d, %d): decode steps as one TorchScript call (scripted in %.2f s)",
                     chunk.first, chunk.last, time.perf_counter() - t0)
            return scripted
        except Exception as e:  # an older or newer TorchScript that rejects this code: eager it is
            reason = "TorchScript failed: %s" % str(e).splitlines()[0][:120]
    log.debug("decode steps of layers [%d, %d) run eagerly: %s", chunk.first, chunk.last, reason)
    return None


def forward(scripted: torch.jit.ScriptModule, chunk: Any, x: torch.Tensor, batch: Any,
            in_one_call: bool) -> Optional[torch.Tensor]:
    """The blocks over a decode frame's rows, or a verification's (`batch.row_wise`: each row
    attends as the decode step it stands for, as the eager blocks do it), or None when the
    frame is neither (prefill, adapters, rows that are not float32 on the CPU, several
    samples that the eager blocks would not attend `in_one_call` either)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or chunk.lora.groups:
        return None
    row_wise = batch.row_wise and batch.rows > len(batch.slots)
    if not row_wise and not all(count == 1 for count in batch.counts):
        return None
    cache = chunk.cache
    several = len(batch.slots) > 1 and not row_wise  # one-row samples, attending in one SDPA call
    if several and not in_one_call:
        return None
    cos, sin = chunk.rope.row_tables(batch, x.dtype)
    window = chunk.config.sliding_window or 0  # Gemma 3's sliding-window layers: their own tables and mask
    cos_l, sin_l = chunk.rope.local.row_tables(batch, x.dtype) if chunk.rope.local is not None else (cos[:0], cos[:0])
    row_slots, row_positions = [], []  # type: List[int], List[int]
    if row_wise:  # each row's slot, and its position as the batch has it
        row_slots = [slot for slot, count in zip(batch.slots, batch.counts) for _ in range(count)]
        row_positions = batch.positions.tolist()
    # TorchScript's optimizing executor spends ~0.5 s on its passes at the second call and,
    # with nothing here it may fuse, gains nothing: the plain executor runs (a per-thread flag).
    with torch.jit.optimized_execution(False):
        empty = cos[:0]
        if several:
            slots, positions, mask = batch.decode_index(x.device)
            mask_l = batch.decode_index(x.device, window)[2] if window else empty
            return scripted(x, cache.k, cache.v, cos, sin, 0, 0, slots, positions, mask, True, row_slots, row_positions,
                            cos_l, sin_l, mask_l)
        return scripted(x, cache.k, cache.v, cos, sin, batch.slots[0], batch.starts[0], empty, empty, empty, False,
                        row_slots, row_positions, cos_l, sin_l, empty)
