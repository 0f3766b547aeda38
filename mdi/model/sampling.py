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
    """Pick the next token id from 1-D logits; SamplingError if they are not finite.
    Nothing here sorts or scans the vocabulary more than a few times: on a 49152-token
    vocabulary a full sort costs 3.5 ms and torch.multinomial 1 ms per token, more than a
    SmolLM2 layer pass (measured, 1 thread)."""
    logits = logits.float().cpu()
    # One float64 sum finds any NaN or infinity (it cannot overflow on float32 inputs): a
    # tenth of torch.isfinite(logits).all()'s time.
    if not math.isfinite(float(logits.sum(dtype=torch.float64))):
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
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return _draw(probs, gen)


NUCLEUS_FIRST_K = 64  # candidates looked at first; 4x more while their mass is short of top_p


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` with every token outside the top-p nucleus zeroed: tokens in descending order
    are dropped once the mass before them reaches top_p (the first always stays). The nucleus
    is found among the k most probable tokens (topk), k growing only when their mass falls
    short, instead of sorting the whole vocabulary."""
    n = probs.numel()
    k = min(NUCLEUS_FIRST_K, n)
    while True:
        values, order = torch.topk(probs, k)  # descending
        cum = values.cumsum(0)
        if k == n or float(cum[-1]) >= top_p:  # the (k+1)th token and all after it are dropped
            break
        k = min(4 * k, n)
    kept = order[(cum - values) < top_p]
    return torch.zeros_like(probs).index_copy_(0, kept, probs[kept])


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from (unnormalised) probabilities by inverting their cumulative sum with one
    uniform draw from the sample's generator: torch.multinomial's distribution at 1/20 of
    its cost. A token of probability 0 is never drawn (searchsorted's right side skips the
    flat steps of the cumulative sum)."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    u = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.numel():  # u rounded up to the total: the last token that has any probability
        i = int(torch.nonzero(probs).max())
    return i
