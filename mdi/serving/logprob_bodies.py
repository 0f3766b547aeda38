"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and the completions' legacy `logprobs` (tokens, token_logprobs, top_logprobs
dicts, text_offset), with each token's text and bytes read from the tokenizer once."""
import math
import re
from typing import Any, Dict, List, Sequence, Tuple

from mdi.model.tokenizers import GPT2Tokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer
from mdi.serving.streaming import TokenLogprob

FLOOR = -9999.0  # what OpenAI reports for a token that cannot be drawn (JSON has no -Infinity)
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_chars() -> Dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that spells each byte."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


UNBYTE = _byte_level_chars()


class TokenTexts:
    """Each token's text and UTF-8 bytes as OpenAI's logprobs show them (a byte-level token
    that is part of a character has its bytes; its text shows U+FFFD), cached by id."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.cache: Dict[int, Tuple[str, List[int]]] = {}
        self.byte_level = isinstance(tok, HFTokenizer) and type(tok.tk.decoder).__name__ == "ByteLevel"

    def of(self, token: int) -> Tuple[str, List[int]]:
        if token not in self.cache:
            raw = self._bytes(token)
            self.cache[token] = (raw.decode("utf-8", "replace"), list(raw))
        return self.cache[token]

    def _bytes(self, token: int) -> bytes:
        tok = self.tok
        if isinstance(tok, GPT2Tokenizer):
            return bytes(tok.enc.decode_single_token_bytes(token))
        piece = tok.tk.id_to_token(token) if isinstance(tok, HFTokenizer) else \
            tok.sp.id_to_piece(token) if isinstance(tok, SentencePieceTokenizer) else None
        if piece is not None:
            byte = BYTE_TOKEN.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            if self.byte_level and all(c in UNBYTE for c in piece):
                return bytes(UNBYTE[c] for c in piece)
            if not self.byte_level and "\u2581" in piece:  # SentencePiece's space
                return piece.replace("\u2581", " ").encode("utf-8")
        return tok.decode([token]).encode("utf-8", "surrogatepass")


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> Dict[str, Any]:
    """A choice's (or a chunk's) `logprobs`: {"content": [...], "refusal": null}."""
    def one(token: int, logprob: float) -> Dict[str, Any]:
        text, raw = texts.of(token)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}

    content = []
    for e in entries:
        item = one(e.logprobs.token, e.logprobs.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in e.logprobs.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> Dict[str, Any]:
    """The legacy completions shape; top_logprobs maps token text to logprob (tokens that
    share a text keep the likelier one's)."""
    top: List[Dict[str, float]] = []
    for e in entries:
        best: Dict[str, float] = {}
        for t, lp in e.logprobs.top:
            best.setdefault(texts.of(t)[0], _value(lp))
        top.append(best)
    return {"tokens": [texts.of(e.logprobs.token)[0] for e in entries],
            "token_logprobs": [_value(e.logprobs.logprob) for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}
