"""A sample: one prompt's generation as the starter tracks it (its tokens, its cache slot, what
every node's cache holds of it), and why it ended."""
import logging
from dataclasses import dataclass, field
from typing import AbstractSet, Any, List, Optional

import numpy as np

from mdi.model.sampling import Generator, Logprobs, SamplingError, SamplingParams, draw, host_array, sample_generator
from mdi.runconfig import SpeculationSpec
from mdi.starter.generation_options import GenerationOptions
from mdi.system.str_enum import StrEnum

log = logging.getLogger(__name__)


class FinishReason(StrEnum):
    """Why a sample, or the request it serves, ended: one vocabulary for the pipeline, the
    metrics record and the API (whose finish_reason says "stop" for EOS)."""
    EOS = "eos"  # an end-of-generation token
    LENGTH = "length"  # its token budget
    CONTEXT = "context"  # the model's context is full (without generation.context_shift)
    CANCELLED = "cancelled"  # its client went away, or asked to stop
    ERROR = "error"  # it failed (alone, or with the ring)
    STOP = "stop"  # serving: an end-of-generation token, a stop string or a complete grammar


@dataclass
class Sample:
    index: int
    prompt: str
    prompt_ids: List[int]
    max_new_tokens: int
    rng: Generator
    slot: int = -1  # KV cache slot on every node; defaults to the index
    params: Optional[SamplingParams] = None  # per-sample sampling (serving); None: the run's
    token_ids: List[int] = field(default_factory=list)
    token_times: List[float] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None  # why this sample alone failed (finish_reason "error")
    cancelled: bool = False  # set from any thread; takes effect when the sample's pass returns
    fed: int = 0  # tokens of its window already sent through the ring: in every node's cache
    # Context shifts: the window is the first `keep` tokens of prompt + generated (set at the
    # first shift), then those after `dropped` more
    keep: int = 0
    dropped: int = 0
    shifts: List[int] = field(default_factory=list)  # len(token_ids) at each context shift
    adapter: int = 0  # the LoRA adapter it runs with on every node (0: the base model alone)
    # Speculation (mdi.starter.speculation): the current epoch of its passes (frames of older
    # epochs are stale), its drafting state, and a request's own setting (None: the run's).
    epoch: int = 0
    spec: Optional[Any] = None  # its mdi.starter.speculation.SpecState, while it may draft
    speculation: Optional[SpeculationSpec] = None
    # A prompt-tuning adapter's virtual tokens [n, n_embd]: prompt_ids starts with n placeholder
    # ids whose embeddings these replace (positions 0..n-1), on every pass that covers them.
    soft_prompt: Optional[np.ndarray] = None  # a prompt-tuning adapter's embeddings [n, n_embd] (lora.SoftPrompt's)
    soft_adapter: int = 0  # the prompt-tuning adapter they are (0: none)
    # Prefix cache (mdi.starter.prefix_cache): whether it may start from positions the nodes hold
    # already (a request's cache_prompt), and how many it did.
    reuse_prefix: bool = True
    cached_tokens: int = 0
    # Serving: each drawn token's log-probability and this many alternatives, kept in
    # `logprobs` as they are drawn (None: none kept).
    top_logprobs: Optional[int] = None
    logprobs: List[Logprobs] = field(default_factory=list)
    # Serving: a grammar its output must obey (an mdi.model.constraints.constraint.Constraint), or None.
    constraint: Optional[Any] = None
    # Serving: its request's options, the very value the request holds (None: a run's sample,
    # built from the fields above). `for_options` copies the ones the pipeline reads into them.
    options: Optional[GenerationOptions] = None

    @classmethod
    def for_options(cls, index: int, prompt_ids: List[int], options: GenerationOptions, rng: Generator,
                    slot: int = -1, constraint: Optional[Any] = None, prompt: str = "") -> "Sample":
        """A sample that runs with `options`: the one place an option's name maps to the
        sample's field (max_tokens -> max_new_tokens, cache_prompt -> reuse_prefix). `rng` is
        drawn from options.seed by the caller (which picks one when it is None); `constraint` is
        options.grammar compiled, a state of this sample alone. The stop strings are the
        request's text stream's; the adapter reaches `adapter` through the engine's
        prepare_sample (a prompt-tuning adapter's sample runs as the base, id 0)."""
        return cls(index, prompt, list(prompt_ids), options.max_tokens, rng, slot=slot, params=options.params,
                   speculation=options.speculation, top_logprobs=options.top_logprobs,
                   reuse_prefix=options.cache_prompt, constraint=constraint, options=options)

    def take(self, token: int, at: float, end_ids: AbstractSet[int], max_len: int,
             context_shift: bool) -> Optional[SamplingError]:
        """Keep `token`, drawn `at` seconds into the run, and see whether this sample ends: at an
        end id, a complete grammar or its token limit; past its cache slot of `max_len`
        positions it shifts its window (`context_shift`) or ends. The error that ends it, if any."""
        self.token_ids.append(token)
        self.token_times.append(at)
        grammar, end = self.constraint, self.is_end(token, end_ids)
        if grammar is not None and not end and not grammar.take(token):
            return SamplingError("token %d breaks its grammar: %s" % (token, grammar.error))
        if end and grammar is not None and not grammar.accepting:
            # llguidance allows only the end once nothing valid can follow: the output is not one
            # the grammar accepts, so the sample fails rather than report a "stop".
            return SamplingError("no text its grammar accepts continues this output: %s" % grammar.error)
        if end:
            self.finish_reason = FinishReason.EOS
        elif grammar is not None and grammar.complete:
            self.finish_reason = FinishReason.STOP  # its grammar allows only an end token: spare that pass
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.window_len > max_len:  # its next position is past the slot
            if context_shift:
                self.shift_context(max_len)
            else:
                self.finish_reason = FinishReason.CONTEXT
        return None

    def is_end(self, token: int, end_ids: AbstractSet[int]) -> bool:
        """Whether `token` ends this sample: one of the model's end tokens (unless its request
        ignores them; a grammar's end always counts), or one of its request's stop_token_ids."""
        options = self.options
        if options is None:
            return token in end_ids
        if token in end_ids:
            return not options.ignore_eos or self.constraint is not None
        return token in options.stop_token_ids

    @property
    def virtual(self) -> int:
        return 0 if self.soft_prompt is None else int(self.soft_prompt.shape[0])

    @property
    def cache_key(self) -> int:
        """What the prefix cache keeps its positions under: its adapter, or its prompt-tuning
        adapter, whose placeholder ids are real token ids (0) that stand for its own embeddings
        (keyed as the base, one soft prompt's positions were reused for another's, and for a
        base prompt starting with those ids)."""
        return self.soft_adapter or self.adapter

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.index

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def window_len(self) -> int:
        """Tokens the caches hold (or will): the prompt and the generated tokens not shifted out."""
        return len(self.prompt_ids) + len(self.token_ids) - self.dropped

    @property
    def window_prompt_len(self) -> int:
        """Tokens of its window that are prompt: all of the prompt's, less those a context shift dropped."""
        return self.keep + max(0, len(self.prompt_ids) - self.keep - self.dropped)

    def window_tokens(self, start: int, count: int) -> List[int]:
        """Tokens [start, start + count) of that window, without building all of it."""
        head = self._history(start, min(count, self.keep - start)) if start < self.keep else []
        tail = max(start, self.keep)
        return head + self._history(tail + self.dropped, start + count - tail)

    def _history(self, start: int, count: int) -> List[int]:
        """Tokens [start, start + count) of its prompt and generated tokens, all of them."""
        prompt = self.prompt_ids[start:start + count]
        rest = count - len(prompt)
        if rest <= 0:
            return prompt
        first = max(0, start - len(self.prompt_ids))
        return prompt + self.token_ids[first:first + rest]

    @property
    def cached_len(self) -> int:
        """Positions of its window whose KV every node's slot holds once its passes are back:
        what it fed, less its last token (never fed). Rows past it (a rejected draft's) are
        written again by whatever comes next."""
        return max(0, min(self.fed, self.window_len - 1))

    @property
    def drafted(self) -> bool:
        """Whether it ever drafted (speculation): its passes may have written up to ROWS_AHEAD rows
        past what its slot keeps (mdi.model.sliding_cache); any other sample's, one row at most."""
        return self.spec is not None

    @property
    def verifying(self) -> bool:
        """Whether its passes in flight are speculative ones (every row comes back to be verified)."""
        return self.spec is not None and bool(self.spec.passes)

    @property
    def unsent(self) -> int:
        """Tokens its next pass still has to send: the rest of the prompt, or the last token."""
        return self.window_len - self.fed

    def shift_context(self, context: int) -> None:
        """Keep the window's head, its prompt up to half the `context`, drop the older half of
        the rest, and send what is left again from position 0: every node rebuilds this
        sample's cache from the shorter window, so its positions (RoPE or learned) stay within
        the context. (llama.cpp keeps n_keep tokens, by default none but BOS, and moves its KV
        cache; keeping a whole prompt that nearly filled the context, each shift here freed a
        token or two and cost a prefill of the whole window: now each frees a quarter of it.)"""
        if not self.shifts:  # (a soft prompt's rows stay whole: they are positions 0..N-1)
            self.keep = min(len(self.prompt_ids), max(context // 2, self.virtual))
        self.dropped += max(1, (self.window_len - self.keep) // 2)
        self.shifts.append(len(self.token_ids))
        self.fed = 0


def draw_next(sample: Sample, logits: Any, params: SamplingParams, end_ids: AbstractSet[int] = frozenset()) -> int:
    """`sample`'s next token from its row of logits (the pipeline's one way to draw). The
    penalties read the tokens it has taken so far: in a speculative verification, also those
    taken from the rows before, so each draw is the plain run's. Its request's logprobs are
    kept in `sample.logprobs`, one entry per draw (the scheduler's on_token reads the last).
    Before its request's min_tokens, no token that would end it (`end_ids`, its stop ids) is drawn.
    Any fault in drawing it is a SamplingError: it ends this sample, never the ring the others share."""
    try:
        return _draw_next(sample, logits, params, end_ids)
    except SamplingError:
        raise
    except Exception as e:  # a fault of ours for some request's settings: logged whole, said in one line
        log.exception("mdi: sample %s: its next token could not be drawn", sample.index)
        raise SamplingError("its next token could not be drawn (%s: %s)" % (type(e).__name__, e)) from None


def _draw_next(sample: Sample, logits: Any, params: SamplingParams, end_ids: AbstractSet[int]) -> int:
    allowed = sample.constraint.allowed() if sample.constraint is not None else None
    if allowed is not None and len(allowed) > len(logits):  # the head's padding, cut from the logits (drawable)
        allowed = allowed[:len(logits)]
    options = sample.options
    if options is not None and len(sample.token_ids) < options.min_tokens:
        allowed = np.ones(len(logits), bool) if allowed is None else host_array(allowed, bool).copy()
        ends = [t for t in set(end_ids) | set(options.stop_token_ids) if t < len(allowed)]
        allowed[ends] = False
    drawn = draw(logits, params, sample.rng, sample.token_ids, sample.prompt_ids, sample.top_logprobs, allowed)
    if drawn.logprobs is not None:
        sample.logprobs.append(drawn.logprobs)
    return drawn.token


def make_samples(prompts: List[str], prompt_ids: List[List[int]], max_new_tokens: int,
                 seed: int) -> List[Sample]:
    return [Sample(i, p, ids, max_new_tokens, sample_generator(seed, i))
            for i, (p, ids) in enumerate(zip(prompts, prompt_ids))]
