"""A sample's tokens as the text its client sees: detokenized as they arrive, control tokens
left out (`control_tokens`), cut before the first stop string, and never showing the start of a
stop string that may still complete; each token's log-probabilities go out with the text that
shows the token's first character."""
from dataclasses import dataclass, field
from typing import AbstractSet, List, Optional, Sequence

from mdi.model.sampling import Logprobs
from mdi.model.tokenizers import StreamDecoder, Tokenizer
from mdi.starter.sample import FinishReason, Sample

# what a request's finish_reason can be (the metrics count each)
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.ERROR)


def finish_reason_of(sample: Sample) -> FinishReason:
    """OpenAI's name for why a finished sample ended: its end-of-sequence token is a "stop"."""
    if sample.finish_reason is None:
        raise ValueError("sample %d has not finished" % sample.index)
    return FinishReason.STOP if sample.finish_reason == FinishReason.EOS else sample.finish_reason


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(text), len(s) - 1), best, -1):
            if s.startswith(text[-k:]):
                best = k
                break
    return best


@dataclass(frozen=True)
class TokenLogprob:
    offset: int  # where the token's text starts in the answer, in characters (text_offset)
    logprobs: Logprobs


@dataclass
class TextUpdate:
    text: str  # to send now ("" for nothing)
    hit_stop: bool  # a stop string appeared: `text` is what came before it and the request is over
    logprobs: List[TokenLogprob] = field(default_factory=list)  # of the tokens `text` shows first


class TextStream:
    """One request's text, fed one token at a time (scheduler thread only). `hidden`: the ids
    that show no text (control tokens); the text is then the tokenizer's decode of the others,
    as vLLM's skip_special_tokens gives it. A stop string still ends the text at a hidden token
    whose own text holds it (a client's stop "<|im_end|>"), as it did when that text showed."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], hidden: AbstractSet[int] = frozenset(),
                 include_stop: bool = False) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.hidden = hidden
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the text ends with the stop string
        self.pending = ""  # decoded text held back: it may be the start of a stop string
        self.sent = 0  # characters handed out
        self.waiting: List[TokenLogprob] = []  # logprobs of tokens whose text is not out yet

    def push(self, token: int, sample_finish: Optional[str], logprobs: Optional[Logprobs] = None) -> TextUpdate:
        """`sample_finish` is the sample's finish_reason after this token (None: more follow).
        A token's `logprobs` leave with the update that shows its first character (at the end,
        with the last update), never for text cut at a stop string, nor for the EOS token,
        which shows no text (as OpenAI's answers leave out their end token)."""
        if logprobs is not None and sample_finish != "eos":
            self.waiting.append(TokenLogprob(self.sent + len(self.pending), logprobs))
        update = self._text(token, sample_finish)
        self.sent += len(update.text)
        if self.waiting:
            over = update.hit_stop or sample_finish is not None
            update.logprobs = [w for w in self.waiting if w.offset < self.sent or over and not update.hit_stop]
            self.waiting = [] if over else self.waiting[len(update.logprobs):]
        return update

    def _text(self, token: int, sample_finish: Optional[str]) -> TextUpdate:
        eos = sample_finish == "eos"  # EOS shows no text
        hidden = not eos and token in self.hidden
        if hidden and self.stops:
            cut = self._stop_at_hidden(token)
            if cut is not None:
                text, self.pending = self.pending[:cut], ""
                return TextUpdate(text, True)
        piece = "" if eos or hidden else self.decoder.push(token)
        if sample_finish is not None:
            piece += self.decoder.flush()
        text, self.pending = self.pending + piece, ""
        if self.stops:
            found = [(text.find(s), -len(s)) for s in self.stops]  # -len: the longest first where two start alike
            cuts = [(at, minus_length) for at, minus_length in found if at >= 0]
            if cuts:
                at, minus_length = min(cuts)  # the first stop string
                return TextUpdate(text[:at - minus_length] if self.include_stop else text[:at], True)
            if sample_finish is None:
                keep = held_back(text, self.stops)
                if keep:
                    text, self.pending = text[:len(text) - keep], text[len(text) - keep:]
        return TextUpdate(text, False)

    def _stop_at_hidden(self, token: int) -> Optional[int]:
        """Where in the held-back text a stop string that reaches into hidden `token`'s own
        text starts (cut there, at most before the token); None where none does."""
        spelled = self.pending + self.decoder.tok.decode([token])
        cuts = [i for i in (spelled.find(s) for s in self.stops) if i >= 0]
        return min(min(cuts), len(self.pending)) if cuts else None
