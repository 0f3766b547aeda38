"""Rotary position embeddings (RoPE) for the Llama and Gemma 3 families: the cos / sin tables, grown as a run's
positions need them, and Llama 3's frequency scaling."""
import math
from typing import Dict, Tuple

import torch
import torch.nn as nn

from mdi.model.attention import rotate
from mdi.model.config import ModelConfig
from mdi.model.row_batch import RowBatch


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face Llama layout). Its tables cover the positions a run
    reaches, not the model's whole context: a file may claim millions of positions (2^22 took
    1.2 GB of tables on every node for a 4-token run), so they grow, by doubling, as the cache
    or a pass asks (`reserve`), never past the context. A position's values do not depend on
    the table's length, so growing changes no result."""

    cos: torch.Tensor  # buffers, declared for mypy
    sin_signed: torch.Tensor
    MIN_POSITIONS = 256  # a first table worth building

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        """`local`: the sliding-window layers' RoPE (Gemma 3): base rope_local_theta, unscaled."""
        super().__init__()
        dim = config.head_dim
        self.is_local = local
        theta = (config.rope_local_theta or config.rope_theta) if local else config.rope_theta
        # On the CPU even where the default device is "meta" (chunks are built there before
        # loading): computing on meta would import torch's Python meta kernels, ~60 MB of RSS.
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        if config.rope_scaling is not None and not local:
            inv_freq = llama3_scaled(inv_freq, config.rope_scaling)
        if config.rope_factors is not None and not local:  # the same scaling, as a GGUF stores it
            inv_freq = inv_freq / torch.tensor(config.rope_factors, dtype=torch.float32, device="cpu")
        self.inv_freq = inv_freq  # not a buffer: tables are always computed on the CPU, bit for bit alike
        # Gemma 3's sliding-window layers rotate with a base of their own: their tables live inside
        # the model's RoPE, so whoever holds (moves, reserves) the chunk's RoPE holds both
        self.local = RotaryEmbedding(config, local=True) if config.sliding_window and not local else None
        self.context = config.block_size
        # Empty until reserved; buffers so that .to(device) says where the tables live.
        self.register_buffer("cos", torch.empty(0, dim, device="cpu"), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0, dim, device="cpu"), persistent=False)

    def reserve(self, n: int) -> None:
        """Tables for positions [0, n)."""
        if self.local is not None:
            self.local.reserve(n)
        have = self.cos.shape[0]
        if n <= have:
            return
        if n > self.context:
            raise ValueError("position %d is beyond the model's context of %d" % (n - 1, self.context))
        n = min(self.context, max(n, 2 * have, self.MIN_POSITIONS))
        device = self.cos.device
        # ordinary tensors even when the first pass to ask runs under inference_mode: a later
        # pass that records gradients (training) could not use inference tensors
        with torch.inference_mode(False), torch.no_grad():
            freqs = torch.outer(torch.arange(n, dtype=torch.float32, device="cpu"), self.inv_freq)
            self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(device)
            # sin with its first half negated: rotate-half becomes a roll (see attention.rotate)
            self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device)

    def of_layer(self, window: int) -> "RotaryEmbedding":
        """The RoPE a layer rotates with: the sliding-window layers' where it has a window."""
        return self.local if window and self.local is not None else self

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        # x: [..., T, head_dim] at positions start..start+T
        T = x.shape[-2]
        self.reserve(start + T)
        return rotate(x, self.cos[start:start + T].to(x.dtype), self.sin_signed[start:start + T].to(x.dtype))

    def at_rows(self, x: torch.Tensor, batch: RowBatch) -> torch.Tensor:
        # x: [rows, heads, head_dim], each row at its own position
        return rotate(x, *self.row_tables(batch, x.dtype))

    def row_tables(self, batch: RowBatch, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) [rows, 1, head_dim] at the batch's positions: gathered once per
        batch, not once per layer and tensor."""
        tables = batch.local_rope_tables if self.is_local else batch.rope_tables
        if tables is None or tables[0].dtype != dtype:
            self.reserve(max(s + c for s, c in zip(batch.starts, batch.counts)))
            tables = (self.cos[batch.positions].to(dtype).unsqueeze(1),
                      self.sin_signed[batch.positions].to(dtype).unsqueeze(1))
            if self.is_local:
                batch.local_rope_tables = tables
            else:
                batch.rope_tables = tables
        return tables


def llama3_scaled(inv_freq: torch.Tensor, scaling: Dict) -> torch.Tensor:
    """Llama 3's RoPE scaling: wavelengths longer than the original context / low_freq_factor
    are stretched by `factor`, those shorter than original / high_freq_factor kept, and the
    band between blended smoothly (as Meta's reference and transformers do)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_context"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(middle, blended, out)
