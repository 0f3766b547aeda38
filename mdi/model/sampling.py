"""Next-token sampling on the starter: greedy, temperature, top-k, top-p, seeded per sample.

Each sample owns its own torch.Generator seeded from the run seed and the sample index, so a
sample's text does not depend on how many other samples run, in what order their tokens come
back from the ring, or how the model is partitioned.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch


class SamplingError(ValueError):
    """One sample's next token cannot be drawn (its logits are not finite); only that sample
    fails, never the others sharing the step."""


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        # NaN passes every comparison, and Python's json accepts NaN and Infinity: check finiteness.
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if self.top_p is not None and not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 1000003 + int(sample_index)) % (2 ** 63))
    return gen


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Pick the next token id from 1-D logits; SamplingError if they are not finite."""
    logits = logits.float().cpu()
    if not bool(torch.isfinite(logits).all()):
        raise SamplingError("the model produced non-finite logits (%d of %d values are NaN or infinite)"
                            % (int((~torch.isfinite(logits)).sum()), logits.numel()))
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # Shift so the best logit is 0 before dividing: every value stays <= 0, so no temperature,
    # however tiny, can overflow to inf - inf = NaN; a tiny one gives the argmax, as greedy does.
    logits = (logits - logits.max()) / params.temperature
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
