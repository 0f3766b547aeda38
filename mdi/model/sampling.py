"""Next-token sampling on the starter: greedy, temperature, top-k, top-p, min-p, seeded per
sample, with OpenAI's and llama.cpp's repetition penalties, logit biases, and the
log-probabilities of the drawn token.

Each sample owns its own random generator (numpy's PCG64) seeded from the run seed and the
sample index, so a sample's text does not depend on how many other samples run, in what order
their tokens come back from the ring, or how the model is partitioned.

Everything here is numpy, whichever backend computed the logits: a starter computing with ggml
never loads torch (~180 MB of its memory), and numpy's SIMD reductions are as fast as torch's
on a vocabulary row (torch tensors are taken too, read as numpy).

The logits pass, in order: logit_bias, repeat_penalty, frequency and presence penalties (as
llama.cpp's chain: bias, then its penalties sampler), temperature, top-k, min-p, top-p. The
log-probabilities reported are those of the distribution after temperature and before the
truncating filters (see `Logprobs`).
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np


class SamplingError(ValueError):
    """One sample's next token cannot be drawn (its logits are not finite); only that sample
    fails, never the others sharing the step."""


BAN = -100.0  # a logit_bias of -100 bans the token outright (OpenAI: "-100 should result in a ban")


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: float = 0.0  # keep tokens of probability >= min_p * the best one's (after temperature)
    # OpenAI's: a token's logit loses frequency_penalty per time it was generated before, and
    # presence_penalty once if it was (the sample's generated tokens, not the prompt).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's: a token among the last repeat_last_n of prompt + generated tokens has its
    # logit divided by repeat_penalty when positive, multiplied when negative (-1: all of them).
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: Dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        # NaN passes every comparison, and Python's json accepts NaN and Infinity: check finiteness.
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if self.top_p is not None and not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError("%s must be in [-2, 2]" % name)
        if not 0 < self.repeat_penalty <= MAX_REPEAT_PENALTY:
            raise ValueError("repeat_penalty must be in (0, %g]" % MAX_REPEAT_PENALTY)
        if self.repeat_last_n < -1:
            raise ValueError("repeat_last_n must be >= -1")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError("logit_bias: token ids >= 0, biases in [-100, 100]")
        # Built once, not per token: the ids and what is added to their logits (-inf bans).
        self._bias = (np.array(sorted(self.logit_bias), dtype=np.int64),
                      np.array([float("-inf") if self.logit_bias[t] <= BAN else float(self.logit_bias[t])
                                for t in sorted(self.logit_bias)], dtype=np.float32))

    @property
    def adjusts(self) -> bool:
        """Some field moves logits before temperature (they depend on the sample's tokens)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or (self.repeat_penalty != 1 and self.repeat_last_n != 0)


MAX_REPEAT_PENALTY = 10.0


@dataclass
class Logprobs:
    """A drawn token's log-probability and the `top` most probable tokens' (id, logprob), best
    first, from the log-softmax of the logits the token was drawn from after logit_bias, the
    penalties and temperature (temperature 1 when greedy), before top-k/top-p/min-p truncate
    them: the model's confidence as this request shaped it, finite for every alternative."""
    token: int
    logprob: float
    top: List[Tuple[int, float]]


@dataclass
class Drawn:
    token: int
    logprobs: Optional[Logprobs] = None  # when asked for


Generator = np.random.Generator  # a sample's own random generator (sample_generator)


def sample_generator(seed: int, sample_index: int) -> Generator:
    return np.random.Generator(np.random.PCG64((int(seed) * 1000003 + int(sample_index)) % (2 ** 63)))


def sample_next(logits: Any, params: SamplingParams, gen: Generator,
                generated: Sequence[int] = (), prompt: Sequence[int] = ()) -> int:
    """The next token id from 1-D logits (`draw` without log-probabilities)."""
    return draw(logits, params, gen, generated, prompt).token


def host_array(values: Any, dtype: Any = np.float32) -> np.ndarray:
    """A numpy array of `values`: a numpy array as it is (in `dtype`), a torch tensor (a torch
    chunk's logits, a GPU's too; an adapter's matrices) read on the host without importing torch
    here."""
    if isinstance(values, np.ndarray):
        return np.asarray(values, dtype=dtype)
    t = values.detach().cpu()
    return np.asarray((t if dtype is bool else t.float()).numpy(), dtype=dtype)  # numpy has no bfloat16


def draw(logits: Any, params: SamplingParams, gen: Generator, generated: Sequence[int] = (),
         prompt: Sequence[int] = (), top_logprobs: Optional[int] = None, allowed: Any = None) -> Drawn:
    """Pick the next token id from 1-D logits (a numpy array, as a ggml starter's graph gives
    them, or a torch tensor); SamplingError if they are not finite.
    `generated` and `prompt` are the sample's tokens so far (the penalties read them);
    `top_logprobs`: also report the token's log-probability and that many alternatives.
    `allowed`: bool [vocab] (numpy or torch), the only tokens that may be drawn (a grammar's
    mask): the others get -inf before anything else, so penalties, temperature and logprobs
    see what may be drawn.
    Nothing here sorts or scans the vocabulary more than a few times: on a 49152-token
    vocabulary a full sort costs 3.5 ms and torch.multinomial 1 ms per token, more than a
    SmolLM2 layer pass (measured, 1 thread). Fields at their neutral values cost nothing."""
    values = host_array(logits)
    # The largest and the smallest find any NaN or infinity, in numpy's SIMD reductions: a
    # greedy draw on 49152 logits takes 29 us with them and numpy's argmax, 175 with torch's
    # float64 sum and argmax (1 thread). A plain greedy draw's argmax stands for the largest
    # (it stops at the first NaN, and finds +inf): one pass less, on a step that runs cold.
    # (ufuncs' reduce, not .max(): that goes through numpy's Python wrapper, which runs cold here)
    plain = params.temperature == 0 and allowed is None and not params.adjusts and top_logprobs is None
    token = greedy(values) if plain else -1
    if not (math.isfinite(values[token] if plain else np.maximum.reduce(values, axis=None))
            and math.isfinite(np.minimum.reduce(values, axis=None))):
        raise SamplingError("the model produced non-finite logits (%d of %d values are NaN or infinite)"
                            % (int((~np.isfinite(values)).sum()), values.size))
    if plain:
        return Drawn(token)  # nothing else: a decode step's draw runs cold after its graph
    if allowed is not None:
        mask = host_array(allowed, bool)
        if not mask.any():
            raise SamplingError("the grammar allows no next token")
        with np.errstate(divide="ignore"):  # log(1) = 0 added where allowed, log(0) = -inf elsewhere:
            values = values + np.log(mask.astype(np.float32))  # branch-free (np.where: 7x as long on a grammar's mask)
    if params.adjusts:
        values = _adjusted(values, params, generated, prompt)
    if params.temperature == 0:
        token = greedy(values)
        return Drawn(token, None if top_logprobs is None else _logprobs(values, token, top_logprobs))
    scaled = _scaled(values, params.temperature)
    exp = np.exp(scaled)  # the best is exp(0) = 1: nothing overflows
    # top-k and min-p keep the tokens at or above a threshold of `scaled`: a mask multiplied in
    # (numpy's where and masked writes took 15-30x as long on a vocabulary row, measured)
    keep = None
    if params.top_k is not None and params.top_k < scaled.size:
        kth = np.partition(scaled, scaled.size - params.top_k)[scaled.size - params.top_k]  # the k-th largest
        keep = scaled >= kth
    if params.min_p > 0:
        # The best logit is 0, so p / p_max = exp(logit): one threshold, no softmax first.
        above = scaled >= np.float32(math.log(params.min_p))
        keep = above if keep is None else keep & above
    if keep is None:
        probs = whole = exp / np.add.reduce(exp)  # the softmax of `scaled`: the logprobs' too, for free
    else:
        probs, whole = exp * keep, None  # (logprobs, if asked, from `scaled`'s logsumexp)
        probs /= np.add.reduce(probs)
    if params.top_p is not None and params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    token = _draw(probs, gen)
    return Drawn(token, None if top_logprobs is None else _logprobs(scaled, token, top_logprobs, whole))


def greedy(logits: Any) -> int:
    """The first index of the largest of 1-D logits, as torch.argmax gives it. On the CPU with
    numpy's argmax, which runs in SIMD: 8 us where torch's took 130 (49152 tokens, 1 thread),
    and a decode step samples with the head's output in no cache. A torch tensor (a torch
    chunk's logits) on a GPU takes its argmax there and sends one number to the host."""
    if isinstance(logits, np.ndarray):
        return int(logits.argmax())  # the method: np.argmax is Python wrapping it
    if logits.device.type != "cpu":
        return int(logits.argmax())
    return int(logits.detach().float().numpy().argmax())


def _scaled(values: np.ndarray, temperature: float) -> np.ndarray:
    """(values - their largest) / temperature, in float32. Shifted so the best is 0 before
    dividing: every value stays <= 0, so no temperature, however tiny, can overflow to
    inf - inf = NaN; a tiny one gives the argmax, as greedy does (the others overflow to -inf:
    probability 0). One below float32's smallest (it rounds to 0) is that argmax outright."""
    shifted = values - np.maximum.reduce(values)
    with np.errstate(over="ignore"):  # (a huge one rounds to inf: every value 0, uniform)
        t = np.float32(temperature)
        if t == 0:
            return np.where(shifted == 0, np.float32(0), np.float32(-np.inf))
        shifted /= t
    return shifted


def _adjusted(values: np.ndarray, params: SamplingParams, generated: Sequence[int],
              prompt: Sequence[int]) -> np.ndarray:
    """The logits after logit_bias and the penalties: a new array (the caller's row is a view
    of the frame's logits), touching only the tokens named, never the whole vocabulary twice."""
    values = values.copy()
    if params.logit_bias:
        ids, bias = params._bias
        if int(ids[-1]) >= values.size:
            raise SamplingError("logit_bias names token %d; the vocabulary has %d" % (int(ids[-1]), values.size))
        values[ids] += bias  # the ids are distinct (a dict's keys)
        if not math.isfinite(float(np.maximum.reduce(values))):
            raise SamplingError("logit_bias bans every token")
    if params.repeat_penalty != 1 and params.repeat_last_n != 0:
        recent = _last_tokens(prompt, generated, params.repeat_last_n)
        if recent:
            ids = np.unique(np.array(recent, dtype=np.int64))
            picked = values[ids]
            values[ids] = np.where(picked > 0, picked / np.float32(params.repeat_penalty),
                                   picked * np.float32(params.repeat_penalty))
    if (params.frequency_penalty or params.presence_penalty) and generated:
        ids, counts = np.unique(np.array(generated, dtype=np.int64), return_counts=True)
        values[ids] += (counts.astype(np.float32) * np.float32(-params.frequency_penalty)
                        - np.float32(params.presence_penalty))
    return values


def _last_tokens(prompt: Sequence[int], generated: Sequence[int], n: int) -> List[int]:
    """The last n tokens of prompt + generated (n -1: all), without joining the whole lists."""
    if n < 0:
        return list(prompt) + list(generated)
    tail = list(generated[-n:]) if generated else []
    need = n - len(tail)
    return (list(prompt[-need:]) if need > 0 and prompt else []) + tail


def _top(values: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """(values, ids) of the k largest, best first (ties: the lower id first), without sorting
    the whole vocabulary."""
    n = values.size
    ids = np.argpartition(values, n - k)[n - k:] if k < n else np.arange(n)
    ids = ids[np.lexsort((ids, -values[ids]))]
    return values[ids], ids


def _logprobs(scaled: np.ndarray, token: int, top: int, probs: Optional[np.ndarray] = None) -> Logprobs:
    """`token`'s log-softmax value among `scaled` logits and the `top` best (see Logprobs);
    from `probs`, their softmax, where the draw already computed it (a logsumexp saved)."""
    best: List[Tuple[int, float]] = []
    if probs is not None:
        if top > 0:
            values, ids = _top(probs, min(top, probs.size))
            best = [(int(i), math.log(float(v)) if v > 0 else -math.inf) for i, v in zip(ids, values)]
        p = float(probs[token])
        return Logprobs(token, math.log(p) if p > 0 else -math.inf, best)
    peak = float(np.maximum.reduce(scaled))
    total = peak + math.log(float(np.add.reduce(np.exp(scaled - np.float32(peak)), dtype=np.float64)))
    if top > 0:
        values, ids = _top(scaled, min(top, scaled.size))
        best = [(int(i), float(v) - total) for i, v in zip(ids, values)]
    return Logprobs(token, float(scaled[token]) - total, best)


NUCLEUS_FIRST_K = 64  # candidates looked at first; 4x more while their mass is short of top_p


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """`probs` with every token outside the top-p nucleus zeroed: tokens in descending order
    are dropped once the mass before them reaches top_p (the first always stays). The nucleus
    is found among the k most probable tokens, k growing only when their mass falls short,
    instead of sorting the whole vocabulary."""
    n = probs.size
    k = min(NUCLEUS_FIRST_K, n)
    while True:
        values, order = _top(probs, k)  # descending
        cum = np.cumsum(values, dtype=np.float64).astype(np.float32)  # summed in float64, as torch's CPU cumsum
        if k == n or float(cum[-1]) >= top_p:  # the (k+1)th token and all after it are dropped
            break
        k = min(4 * k, n)
    keep = (cum - values) < np.float32(top_p)
    keep[0] = True  # (a top_p below float32's least value rounds to 0, which nothing is below)
    kept = order[keep]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out


def _uniform(gen: Any) -> float:
    """One uniform draw in [0, 1) from a sample's generator; a torch.Generator (what samples
    drew with before numpy: a caller may still make its own) is read through torch."""
    if isinstance(gen, np.random.Generator):
        return float(gen.random())
    import torch
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


DRAW_BLOCK = 256  # tokens summed together before the cumulative sum (numpy's cumsum runs a value at a time)


def _draw(probs: np.ndarray, gen: Generator) -> int:
    """One token from (unnormalised) probabilities by inverting their cumulative sum with one
    uniform draw from the sample's generator: first over blocks of DRAW_BLOCK tokens (their
    sums, in float64), then within the block drawn; 30 us on 49152 tokens where one cumulative
    sum of them all took 560 (numpy's cumsum is not vectorised). A token of probability 0 is
    never drawn (searchsorted's right side skips the flat steps of a cumulative sum)."""
    pad = (-probs.size) % DRAW_BLOCK
    padded = np.concatenate((probs, np.zeros(pad, probs.dtype))) if pad else probs
    blocks = np.cumsum(np.add.reduce(padded.reshape(-1, DRAW_BLOCK), axis=1, dtype=np.float64))
    u = _uniform(gen) * blocks[-1]
    b = int(np.searchsorted(blocks, u, side="right"))
    if b >= blocks.size:  # u rounded up to the total: the last block with any probability
        b = int(np.flatnonzero(np.diff(blocks, prepend=0.0)).max())
    part = padded[b * DRAW_BLOCK:(b + 1) * DRAW_BLOCK]
    within = np.cumsum(part, dtype=np.float64)
    i = int(np.searchsorted(within, u - (blocks[b - 1] if b else 0.0), side="right"))
    if i >= DRAW_BLOCK:  # past the block's own sum (summed in another order): its last token that has any
        i = int(np.flatnonzero(part).max())
    return b * DRAW_BLOCK + i
