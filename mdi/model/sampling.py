"""Next-token sampling on the starter: greedy, temperature, top-k, top-p, seeded per sample.

Each sample owns its own torch.Generator seeded from the run seed and the sample index, so a
sample's text does not depend on how many other samples run, in what order their tokens come
back from the ring, or how the model is partitioned.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 1000003 + int(sample_index)) % (2 ** 63))
    return gen


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Pick the next token id from 1-D logits."""
    logits = logits.float().cpu()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p; the first always stays.
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
