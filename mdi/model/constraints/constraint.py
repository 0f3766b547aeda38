"""Constrained decoding: a request's GrammarSpec (JSON schema, GBNF, Lark, regex) compiled by
llguidance into one matcher per sample, whose token mask the sampler applies to the head's
logits on the starter. The boards never see it: constrained and free samples share frames.

Why llguidance (scripts/bench_constraint.py, results/bench_constraint.json): its mask over
SmolLM2's 49,152 tokens takes tens of microseconds per token, it compiles JSON schemas, Lark
and regexes itself (GBNF through its own converter), and its wheel is one abi3 binary with no
dependencies for Python >= 3.9 on x86_64 and aarch64. xgrammar needs torch, transformers and
triton at run time; outlines-core compiles regexes only (no grammars) and builds its index per
schema up front. Python 3.8 (JetPack 5) has no wheel: `unavailable()` says so and the server
answers these fields with a 400 instead of generating unconstrained text.
"""
import importlib
import json
import logging
import threading
import time
from typing import Any, Callable, List, Optional

import numpy as np

from mdi.model.constraints.grammar_cost import (FAR_PAST, MASK_BUDGET_S, MASK_DEADLINE_S, MAX_REPEAT, MAX_REPEAT_ADDED,
                                               SLOW_WINDOW, spec_repeat)
from mdi.model.constraints.grammar_empty import derives_text
from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.constraints.schema_bounds import bounded
from mdi.model.sampling import SamplingError
from mdi.model.token_bytes import all_token_bytes, special_token_ids
from mdi.model.tokenizers import Tokenizer
from mdi.system.deep_stack import on_deep_stack

log = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 1 << 17  # a schema or grammar this long is almost certainly not meant for one answer
# Tokens the compile walks past the start (the first allowed token each time) before admitting a
# grammar: llguidance meets some limits only a step in (a 10,000-way alternation compiles, then
# its first token fails on "Current row has 10001 items; max is 2000"). Each step is bounded by
# llguidance's per-step limits (lexer fuel, Earley items), so the walk is too.
PROBE_TOKENS = 8
# JSON without free whitespace: a small model left free to write it loops on newlines and
# indents until max_tokens. Separators with one space read as models write JSON. A schema's own
# "x-guidance" options override these.
JSON_DEFAULTS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_options(strict: bool) -> Any:
    """llguidance's JSON options for a schema (its "x-guidance"): JSON_DEFAULTS, and where the
    schema is not strict, keywords it cannot enforce (uniqueItems, not, if/then...) ignored."""
    return dict(JSON_DEFAULTS, lenient=not strict)


class ConstraintError(ValueError):
    """A grammar that cannot be compiled; `field` is the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def unavailable() -> Optional[str]:
    """Why constrained decoding cannot run here (one line), or None when it can."""
    try:
        importlib.import_module("llguidance")
    except ImportError as e:
        return "llguidance is not installed (%s; it needs Python >= 3.9: pip install llguidance)" % e
    return None


def check_repeats(spec: GrammarSpec) -> None:
    """ConstraintError, naming spec.field, where its counted repetitions would make every
    request's steps wait for its token masks (grammar_cost)."""
    repeat = spec_repeat(spec.kind, spec.text)
    if repeat.largest > MAX_REPEAT:
        raise ConstraintError(spec.field, "a counted repetition of %d (nested counts multiplied) is more than %d: "
                              "its token masks would slow every request" % (repeat.largest, MAX_REPEAT))
    if repeat.added > MAX_REPEAT_ADDED:
        raise ConstraintError(spec.field, "its counted repetitions add %d copies in all, more than %d: its token "
                              "masks would slow every request" % (repeat.added, MAX_REPEAT_ADDED))


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each token's bytes, the
    special ids, and a way to tokenize text (strings only: bytes are refused, so it passes str)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.bos_token_id = tok.bos_id
        self.tokens = all_token_bytes(tok)
        self.special_token_ids = special_token_ids(tok)
        self.end_ids = list(tok.end_ids)
        if not self.end_ids:  # llguidance needs an end token: one past the vocabulary, never drawn
            self.end_ids = [len(self.tokens)]
            self.tokens.append(b"<end>")
            self.special_token_ids.append(self.end_ids[0])
        self.eos_token_id = self.end_ids[0]

    def __call__(self, text: Any) -> List[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self.tok.encode_plain(text)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; built once per server (about 0.3 s for 49k
    tokens). `width`: the head's logits per row (a model may pad its vocabulary past the
    tokenizer's; those ids are never allowed). `mask_deadline_s`: the CPU time any token mask
    may take during generation (`grammar_cost`)."""

    def __init__(self, tok: Tokenizer, width: int, mask_deadline_s: float = MASK_DEADLINE_S) -> None:
        import llguidance
        t0 = time.perf_counter()
        self.llg = llguidance
        self.width = int(width)
        self.mask_deadline_s = mask_deadline_s
        self.mask_budget_s = MASK_BUDGET_S  # the probed mask a request may cost to be admitted
        self.vocab = tok.vocab_size  # ids past it (a padded head's) are never allowed
        view = _TokenizerView(tok)
        self.end_ids = list(view.end_ids)
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=len(view.tokens),
                                                eos_token=view.end_ids)
        self.limits = _limits(llguidance)
        log.info("mdi: constrained decoding ready: %d tokens in %.2f s", tok.vocab_size, time.perf_counter() - t0)

    def grammar_text(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for `spec`; ConstraintError for what it cannot even convert."""
        m = self.llg.LLMatcher
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise ConstraintError(spec.field, "longer than %d characters" % MAX_GRAMMAR_CHARS)
        check_repeats(spec)
        try:
            if spec.kind == "json_object":
                return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
            if spec.kind == "json_schema":  # digits and time fractions bounded (schema_bounds)
                return m.grammar_from_json_schema(bounded(json.loads(spec.text)), defaults=json_options(spec.strict))
            if spec.kind == "regex":
                return m.grammar_from_regex(spec.text)
            lark = self._lark(spec)
            if derives_text(lark) is False:  # llguidance would find it only past the first token
                raise ConstraintError(spec.field, "no text satisfies it (its start rule never ends in text)")
            return m.grammar_from_lark(lark)
        except ConstraintError:
            raise
        except Exception as e:  # the converters raise ValueError, AssertionError, KeyError... on bad input
            raise ConstraintError(spec.field, _one_line(str(e) or type(e).__name__)) from None

    @staticmethod
    def _lark(spec: GrammarSpec) -> str:
        if spec.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark
            return gbnf_to_lark(spec.text)
        return spec.text

    def compile(self, spec: GrammarSpec, choices: int = 1) -> "Constraint":
        """A fresh matcher for `spec`; ConstraintError (naming spec.field) if it does not compile,
        or if `choices` masks a step (a request's samples: prompts x n) would cost more than the mask budget."""
        grammar = self.grammar_text(spec)
        matcher = self._matcher(grammar)
        if matcher.is_error():
            error = _one_line(matcher.get_error())
            if "Unimplemented keys" in error and spec.kind == "json_schema":
                error += " (keywords a strict schema may not use here; with strict false they are ignored)"
            raise ConstraintError(spec.field, error)
        constraint = Constraint(lambda: self._matcher(grammar), matcher, self.width, min(self.width, self.vocab), spec,
                                deadline_s=float("inf"))
        # The first mask, here on the request's thread (the scheduler reuses it; it also builds
        # the lexer's first states, paid once): a grammar no text satisfies (a rule with no base
        # case, a schema that is only a $ref to itself, an empty character class) shows as a
        # start where nothing may follow, not even the end.
        first = constraint.allowed()
        if constraint.dead(first):
            raise ConstraintError(spec.field, "no text satisfies it (nothing it accepts can even start)")
        spent = self._probe(constraint, first)
        if spent * choices > self.mask_budget_s:
            per_step = "" if choices == 1 else " (%d samples: %.0f ms a step)" % (choices, spent * choices * 1e3)
            raise ConstraintError(spec.field, "one token mask takes %.0f ms%s, more than the %.0f ms this server "
                                  "allows (a long counted repetition?)"
                                  % (spent * 1e3, per_step, self.mask_budget_s * 1e3))
        # Copies (a request's other choices) start from this warm start state: a new matcher
        # would build its lexer again, on the scheduler's thread.
        start = matcher.deep_copy()
        constraint.new_matcher = start.deep_copy
        constraint.deadline_s = self.mask_deadline_s
        return constraint

    def _matcher(self, grammar: str) -> Any:
        if self.limits is None:
            return self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        return self.llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)

    def _probe(self, constraint: "Constraint", first: np.ndarray) -> float:
        """CPU seconds of one mask past the start, on a copy: the cost every later token pays on the
        scheduler's thread (the first mask also builds the lexer's states, paid once, here).
        The copy then walks on, up to PROBE_TOKENS tokens: a grammar llguidance cannot run past
        its start (a resource limit) is a ConstraintError with llguidance's own message, here,
        rather than a failed sample once the request holds a slot."""
        ends = set(self.end_ids)
        probe = Constraint(constraint.new_matcher, constraint.matcher.deep_copy(), constraint.width,
                           constraint.vocab, constraint.spec, deadline_s=float("inf"))
        allowed, spent = first, 0.0
        for step in range(PROBE_TOKENS):
            token = next((t for t in np.flatnonzero(allowed).tolist() if t not in ends), None)
            if token is None:
                break
            if not probe.take(token):
                break
            # CPU time of this thread: what the mask costs, not how busy the machine is (a wall
            # clock refused plain schemas on a loaded box)
            t0 = time.thread_time()
            allowed = probe.allowed()
            if step == 0:
                spent = time.thread_time() - t0
            if probe.matcher.is_error():
                break
        if probe.matcher.is_error() and probe.matcher.get_error().strip():
            raise ConstraintError(constraint.spec.field, "llguidance cannot run it: %s" % probe.error)
        return spent


class LazyGrammars:
    """The server's GrammarCompiler, built at the first grammar it compiles and not before: its
    token tables cost memory in proportion to the vocabulary (Gemma 3's 262k tokens: ~110 MB
    and over a second to build; SmolLM2's 49k: ~22 MB), which a server that never constrains
    an answer should not hold. `make` builds it."""

    def __init__(self, make: Callable[[], GrammarCompiler]) -> None:
        self._make = make
        self._compiler: Optional[GrammarCompiler] = None
        self._lock = threading.Lock()  # request threads compile at once

    def compile(self, spec: GrammarSpec, choices: int = 1) -> "Constraint":
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make()
        compiler = self._compiler
        # llguidance recurses once per rule it follows: a long chain of rules overflowed an HTTP
        # thread's stack and killed the server (mdi.system.deep_stack)
        return on_deep_stack(lambda: compiler.compile(spec, choices))


def server_grammars(tok: Tokenizer, width: int, mask_deadline_s: float) -> Optional[LazyGrammars]:
    """A server's grammars (GrammarCompiler's arguments), or None, said once in the log, where
    llguidance is missing."""
    missing = unavailable()
    if missing is not None:
        log.warning("mdi: serve: structured outputs (response_format, json_schema, grammar, regex) are off: %s",
                    missing)
        return None
    return LazyGrammars(lambda: GrammarCompiler(tok, width, mask_deadline_s))


def _limits(llguidance: Any) -> Any:
    """llguidance's parser limits, its defaults but for verbose errors: those dump the parser's
    state and the grammar into the message, which a client then gets back (None where this
    llguidance has no such option: its defaults then)."""
    try:
        return llguidance.LLParserLimits(verbose_errors=False)
    except (AttributeError, TypeError):
        return None


class Constraint:
    """One sample's grammar state. The mask is computed for the state after the tokens taken
    so far and cached until the next one is taken; tokens are taken one at a time, only once
    accepted (a speculative pass's guesses never reach it), so nothing is ever rolled back.
    Masks past `deadline_s` of CPU time end the sample (`allowed` raises): two of them within
    SLOW_WINDOW masks, or one past FAR_PAST times it."""

    def __init__(self, new_matcher: Callable[[], Any], matcher: Any, width: int, vocab: int,
                 spec: GrammarSpec, deadline_s: float = MASK_DEADLINE_S) -> None:
        self.new_matcher, self.matcher = new_matcher, matcher
        self.width, self.vocab, self.spec = width, vocab, spec
        self.deadline_s = deadline_s
        self._allowed: Optional[np.ndarray] = None
        self._overrun: Optional[str] = None  # why its masks stopped: they were too slow
        self._last_slow: Optional[int] = None  # the last mask past the deadline (its number)
        self.mask_seconds = 0.0  # time spent computing masks (the benchmark reports it per token)
        self.masks = 0

    def fresh(self) -> "Constraint":
        """The same grammar from its start, for another sample (a request's other choices)."""
        return Constraint(self.new_matcher, on_deep_stack(self.new_matcher), self.width, self.vocab, self.spec,
                          self.deadline_s)

    def allowed(self) -> np.ndarray:
        """Bool [width] (numpy, on either backend: a starter computing with ggml never loads
        torch for a grammar): the tokens that keep the output valid (the end tokens once it may end).
        SamplingError once its masks took more CPU time than the deadline allows (see the class)."""
        if self._overrun is not None:
            raise SamplingError(self._overrun)
        if self._allowed is None:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            cpu = time.thread_time() - cpu0
            # One mask a little past it is let go (a rare one costs 100x the grammar's typical mask:
            # the lexer builds new states); a second within SLOW_WINDOW masks, or one far past it,
            # is the grammar.
            slow = cpu > self.deadline_s
            again = slow and self._last_slow is not None and self.masks - self._last_slow < SLOW_WINDOW
            if slow:
                self._last_slow = self.masks
            if again or cpu > FAR_PAST * self.deadline_s:
                self._overrun = ("its %s's token mask took %.0f ms of CPU, more than the %.0f ms a step allows "
                                 "(serve.mask_deadline_ms): the grammar grew too costly"
                                 % (self.spec.field, cpu * 1e3, self.deadline_s * 1e3))
                raise SamplingError(self._overrun)
            allowed = np.zeros(self.width, dtype=bool)
            allowed[:self.vocab] = bits[:self.vocab]
            self._allowed = allowed
            self.mask_seconds += time.perf_counter() - t0
            self.masks += 1
        return self._allowed

    def take(self, token: int) -> bool:
        """Advance past an accepted token; False if the grammar does not allow it, or if nothing
        valid can follow it (`error` says why)."""
        self._allowed = None
        return bool(self.matcher.consume_token(int(token))) and not self.matcher.is_error()

    def dead(self, allowed: np.ndarray) -> bool:
        """True when no text the grammar accepts continues the output so far: the matcher failed
        (llguidance then allows only the end token), or it allows no token and may not end."""
        return bool(self.matcher.is_error()) or (not bool(allowed.any()) and not self.accepting)

    @property
    def error(self) -> str:
        # llguidance's first line says why; the lines after it dump its parser state
        text = self.matcher.get_error().strip()
        return _one_line(text.splitlines()[0]) if text else "no text it accepts continues this output"

    @property
    def accepting(self) -> bool:
        """The output so far is one the grammar accepts: it may end here."""
        return bool(self.matcher.is_accepting()) and not self.matcher.is_error()

    @property
    def complete(self) -> bool:
        """Nothing but an end token may follow and the output is whole (a failed matcher is
        stopped too, but its output is not whole)."""
        return bool(self.matcher.is_stopped()) and self.accepting


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
