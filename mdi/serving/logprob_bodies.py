"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and the completions' legacy `logprobs` (tokens, token_logprobs, top_logprobs
dicts, text_offset), with each token's text and bytes read from the tokenizer once.

The alternatives are those that could have been drawn: a grammar's mask (response_format,
forced tool calls) gives every token it refuses probability 0 in the distribution the token is
drawn from, so where it allows fewer tokens than asked for, fewer are listed (only the token
drawn, at 0.0, where it allows no other), never masked tokens at FLOOR that would read as real,
very unlikely choices. A control token is named by its own text ("<|im_end|>"), though the answer's
text leaves it out (`control_tokens`)."""
import math
from typing import Any, Dict, List, Sequence, Tuple

from mdi.model.token_bytes import is_byte_level, token_bytes
from mdi.model.tokenizers import Tokenizer
from mdi.serving.streaming import TokenLogprob

FLOOR = -9999.0  # what OpenAI reports for a token that cannot be drawn (JSON has no -Infinity)


class TokenTexts:
    """Each token's text and UTF-8 bytes as OpenAI's logprobs show them (a byte-level token
    that is part of a character has its bytes; its text shows U+FFFD), cached by id."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.cache: Dict[int, Tuple[str, List[int]]] = {}
        self.byte_level = is_byte_level(tok)

    def of(self, token: int) -> Tuple[str, List[int]]:
        if token not in self.cache:
            raw = token_bytes(self.tok, token, self.byte_level)
            self.cache[token] = (raw.decode("utf-8", "replace"), list(raw))
        return self.cache[token]


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def _drawable(top: Sequence[Tuple[int, float]]) -> List[Tuple[int, float]]:
    """The alternatives with a chance to be drawn (a masked token's logprob is -inf)."""
    return [(t, lp) for t, lp in top if lp > -math.inf]


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> Dict[str, Any]:
    """A choice's (or a chunk's) `logprobs`: {"content": [...], "refusal": null}."""
    def one(token: int, logprob: float) -> Dict[str, Any]:
        text, raw = texts.of(token)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}

    content = []
    for e in entries:
        item = one(e.logprobs.token, e.logprobs.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in _drawable(e.logprobs.top)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> Dict[str, Any]:
    """The legacy completions shape; top_logprobs maps token text to logprob (tokens that
    share a text keep the likelier one's) and always holds the drawn token, so up to
    `logprobs` + 1 entries, as OpenAI's (and vLLM's) legacy completions."""
    top: List[Dict[str, float]] = []
    for e in entries:
        best: Dict[str, float] = {}
        for t, lp in _drawable(e.logprobs.top):
            best.setdefault(texts.of(t)[0], lp)
        best.setdefault(texts.of(e.logprobs.token)[0], _value(e.logprobs.logprob))
        top.append(best)
    return {"tokens": [texts.of(e.logprobs.token)[0] for e in entries],
            "token_logprobs": [_value(e.logprobs.logprob) for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}
