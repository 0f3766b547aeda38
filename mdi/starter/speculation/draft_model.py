"""The `draft: PATH` drafter: a (smaller) model with the target's tokenizer, run whole on the
starter beside its chunk, that drafts greedily for the ring to verify.

It is any model mdi loads (prepared dir, HF dir or GGUF), quantized as the run asks, and its
vocabulary is checked against the target's before any weight moves: a draft of another
vocabulary would propose ids that mean other words, so every draft would miss.

Its KV cache has one slot per target slot: a sample drafts in the slot its target cache uses,
which no other live sample holds. A slot remembers the tokens whose keys and values it holds;
each proposal feeds only what differs from them (the first proposal feeds the whole prompt, in
prefill chunks; after an accepted run, the tokens accepted since; after a rejection, from the
first rejected position on, which overwrites the rows of the guesses that failed: attention
reads a slot only up to each row's own position, so nothing beyond is ever attended).

Greedy drafts are exact for any temperature: verification draws each token as the plain run
does and accepts a guess when the draw equals it (SpecDecoder.verify, decoder.py), which needs
no draft distribution q; a one-hot guess is accepted with probability p(guess), the most any
rule can, and the output stays the plain run's token for token.
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from mdi.model.config import ModelConfig
from mdi.model.ggml.kv_cache import head_dim_unfit
from mdi.model.layout import QuantLayout
from mdi.model.sampling import greedy
from mdi.model.source import ModelSource, read_tokenizer
from mdi.model.spm_tokenizer import SpmTokenizer
from mdi.model.tokenizers import Tokenizer, TokenizerError
from mdi.runconfig import FLAGS_SOURCE, ConfigError, RunConfig
from mdi.starter.pass_compute import inference_mode, pass_inputs, takes_host_arrays
from mdi.starter.planning.capacity import chunk_bytes_needed
from mdi.starter.sample import Sample

if TYPE_CHECKING:  # torch is imported where a draft model computes on torch: a ggml draft never loads it
    import torch

    from mdi.model.transformer import ModelChunk

log = logging.getLogger(__name__)


def token_text(tok: Tokenizer, i: int) -> str:
    """What id `i` stands for, as the tokenizer spells it (a token's own string, not its
    decoded text: byte pieces decode alike)."""
    hf = getattr(tok, "tk", None)
    if hf is not None:
        return str(hf.id_to_token(i))
    enc = getattr(tok, "enc", None)  # tiktoken
    if enc is not None:
        return repr(enc.decode_single_token_bytes(i))
    sp = getattr(tok, "sp", None)
    if sp is not None:
        return str(sp.id_to_piece(i))
    if isinstance(tok, SpmTokenizer):  # a GGUF vocabulary's own spelling, as HF's id_to_token gives it
        return tok.tokens[i].decode("utf-8", "replace")
    return tok.decode([i])


def vocabulary_difference(target: Tokenizer, draft: Tokenizer) -> Optional[str]:
    """The first difference between two vocabularies, in words; None when they agree."""
    if target.vocab_size != draft.vocab_size:
        return "the target's tokenizer has %d tokens, the draft's %d" % (target.vocab_size, draft.vocab_size)
    for i in range(target.vocab_size):
        a, b = token_text(target, i), token_text(draft, i)
        if a != b:
            return "token %d is %r for the target, %r for the draft" % (i, a, b)
    return None


@dataclass
class DraftSource:
    """A draft model checked against the target and not loaded yet, with what it will take."""
    path: str
    source: ModelSource
    quant: QuantLayout
    asked_quant: Optional[str] = None  # the quant mode asked for it (its own, else model.quant), not auto

    @property
    def config(self) -> ModelConfig:
        return self.source.config

    def bytes_needed(self, n_slots: int, max_len: int, dtype: str) -> int:
        """Its weights (as quantized) and its KV cache: the starter holds both beside its chunk."""
        n = self.config.n_layer
        return chunk_bytes_needed(self.config, (0, n), n_slots, draft_len(self.config, max_len), dtype,
                                  with_ends=True, quant=self.quant)


def draft_len(config: ModelConfig, max_len: int) -> int:
    """Positions per draft slot: the target's, unless the draft's context is shorter (it then
    stops drafting past its end)."""
    return min(max_len, config.block_size)


def open_draft(cfg: RunConfig, target: ModelSource) -> Optional[DraftSource]:
    """The run's draft model (method draft), its vocabulary checked against the target's before
    any of its weights is read; None without one. One ConfigError line naming the difference
    (and the config file, as its other settings' errors do)."""
    spec = cfg.generation.speculation
    where = "generation.speculation" if cfg.source == FLAGS_SOURCE else "%s: generation.speculation" % cfg.source
    if spec.method != "draft" or not spec.draft:
        return None
    path = spec.draft
    if not os.path.exists(path):
        raise ConfigError("%s.draft: %s does not exist" % (where, path))
    try:
        tok = read_tokenizer(path)
    except (TokenizerError, OSError, ValueError) as e:
        raise ConfigError("%s.draft: %s: cannot read its tokenizer: %s" % (where, path, e))
    if tok is None or target.tokenizer is None:
        raise ConfigError("%s.draft: %s: no tokenizer to check against the target's (a draft model needs one)"
                          % (where, path))
    diff = vocabulary_difference(target.tokenizer, tok)
    if diff is not None:
        raise ConfigError("%s.draft: %s has another vocabulary than %s: %s" % (where, path, cfg.model.path, diff))
    source = ModelSource(path)
    # Heads padded past the tokenizer differ between sizes of one family (Qwen2.5-0.5B scores
    # 151936 ids, 7B 152064): a smaller head names only ids the target has; a larger one could not.
    if source.config.vocab_size > target.config.vocab_size:
        raise ConfigError("%s.draft: %s scores %d ids, the target %d: its drafts could name ids the target has not"
                          % (where, path, source.config.vocab_size, target.config.vocab_size))
    n = source.config.n_layer
    try:
        quant = source.layout(0, n, True, spec.quant or cfg.model.quant, cfg.model.group_size)
    except ValueError as e:
        raise ConfigError("%s.quant: %s" % (where, e))
    asked = spec.quant or cfg.model.quant
    return DraftSource(path, source, quant, None if asked == "auto" else asked)


@dataclass(frozen=True)
class GgmlDraft:
    """How a draft model computes on ggml: as the starter's chunk does (its threads and device,
    and the run's runtime.kv_type, runtime.repack and runtime.prefill_weights)."""
    threads: int
    kv_type: str
    repack: bool
    device: str = "cpu"
    prefill_weights: str = "quantized"


class DraftModel:
    """A loaded draft model with one cache slot per target slot (see the module's doc)."""

    def __init__(self, chunk: ModelChunk, prefill_chunk: int) -> None:
        self.chunk, self.prefill_chunk = chunk, prefill_chunk
        self.device = chunk.device
        self.held: Dict[int, List[int]] = {}  # slot -> the tokens its positions 0.. hold
        self.owner: Dict[int, int] = {}  # slot -> the drafter whose tokens those are
        self._owners = itertools.count(1)
        self.vocab = chunk.config.vocab_size
        assert chunk.cache is not None, "a draft model drafts in its own KV cache: allocate it first"
        self.max_len = chunk.cache.max_len  # positions per slot

    @classmethod
    def load(cls, draft: DraftSource, n_slots: int, max_len: int,
             torch_dtypes: Callable[[], Tuple[torch.dtype, Optional[torch.dtype]]], device: str,
             prefill_chunk: int, fused_decode: bool = True, ggml: Optional["GgmlDraft"] = None) -> "DraftModel":
        """The draft computes as the starter does: on ggml (`ggml`: the starter's chunk does)
        where the draft has a GGUF, its tensors as stored; else on torch, quantized as its
        `quant` says, in the (weights, compute) dtypes `torch_dtypes` gives (asked for only
        then: a ggml draft never imports torch)."""
        n = draft.config.n_layer
        if ggml is not None and draft.source.gguf_path is not None:
            unfit = head_dim_unfit(ggml.kv_type, draft.config.head_dim)
            if unfit is not None:  # said before its weights load, as the target's is
                raise ConfigError("starter: the draft model %s: runtime.%s" % (draft.path, unfit))
            chunk = draft.source.ggml_chunk(0, n, True, True, ggml.threads, ggml.kv_type, ggml.repack, ggml.device)
            chunk.set_prefill_weights(ggml.prefill_weights)  # its prompts are prefilled as the target's are
            if draft.asked_quant is not None:  # (not its layout: a line of 4.5 KB on Gemma 3)
                log.info("mdi: starter: the draft model computes on ggml, its GGUF as stored: quant %s does not apply",
                         draft.asked_quant)
        else:
            if ggml is not None:
                log.info("mdi: starter: the draft model %s has no GGUF: it computes on torch", draft.path)
            dtype, compute_dtype = torch_dtypes()
            chunk = draft.source.load_chunk(0, n, True, True, dtype, device, compute_dtype, draft.quant, consume=True)
            chunk.fused_decode = fused_decode
        chunk.allocate_cache(n_slots, draft_len(draft.config, max_len))
        model = cls(chunk, prefill_chunk)
        log.info("mdi: starter: draft model %s on %s: %d layers, %d slots of %d positions", draft.path,
                 chunk.backend, n, n_slots, model.max_len)
        return model

    @property
    def backend(self) -> str:
        return str(self.chunk.backend)

    def new_owner(self) -> int:
        return next(self._owners)

    def release(self, slot: int, owner: int) -> None:
        """The sample that drafted in `slot` ended: what the slot holds is nobody's."""
        if self.owner.get(slot) == owner:
            del self.owner[slot]
            self.held.pop(slot, None)

    def _feed(self, slot: int, start: int, tokens: Sequence[int]) -> Any:
        """Run `tokens` at positions start.. through the model in `slot`; the last row's logits."""
        host = takes_host_arrays(self.chunk)
        x = None
        for at in range(0, len(tokens), self.prefill_chunk):
            part = list(tokens[at:at + self.prefill_chunk])
            batch, ids = pass_inputs(host, [slot], [start + at], [len(part)], [0], False, part, self.device)
            x = self.chunk.embed_forward_rows(ids, batch)
        assert x is not None, "nothing to feed"
        return self.chunk.head(x[-1:])[0]

    def propose(self, slot: int, owner: int, tokens: Sequence[int], k: int) -> List[int]:
        """Up to k greedy tokens after `tokens` (positions 0..), drafted in `slot`."""
        n = len(tokens)
        k = min(k, self.max_len - n + 1)  # the last draft is never fed: it may sit one past the slot
        if k < 1 or n < 1:
            return []
        held = self.held.get(slot, []) if self.owner.get(slot) == owner else []
        same = _common_prefix(held, tokens)
        same = min(same, n - 1)  # the last token is fed again: its row's logits draft the first token
        if max(tokens[same:]) >= self.vocab:  # an id past a smaller head's (the target's padding): no draft
            return []
        with inference_mode(self.chunk):
            logits = self._feed(slot, same, tokens[same:])
            now = list(tokens)
            out: List[int] = []
            while True:
                token = greedy(logits)
                out.append(token)
                if len(out) == k:
                    break
                logits = self._feed(slot, len(now), [token])
                now.append(token)
        self.held[slot], self.owner[slot] = now, owner
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case (accepted guesses extend what is held): one compare
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class ModelDrafter:
    """One sample's drafter on a DraftModel: drafts after the sample's window (its cache holds
    the same positions as the target's) and the guesses in flight."""

    def __init__(self, model: DraftModel, sample: Sample) -> None:
        self.model, self.sample = model, sample
        self.owner = model.new_owner()
        # the prompt's prefill, at admission: the first proposal then feeds only its last token
        window = sample.window_tokens(0, sample.window_len)
        if 1 < len(window) <= model.max_len:
            with inference_mode(model.chunk):
                model._feed(sample.slot, 0, window[:-1])
            model.held[sample.slot], model.owner[sample.slot] = window[:-1], self.owner

    def commit(self, tokens: Sequence[int]) -> None:
        """Nothing to do: proposals read the sample's window, which holds them."""

    def propose(self, frontier: Sequence[int], k: int) -> List[int]:
        s = self.sample
        return self.model.propose(s.slot, self.owner, s.window_tokens(0, s.window_len) + list(frontier), k)

    def close(self) -> None:
        self.model.release(self.sample.slot, self.owner)
