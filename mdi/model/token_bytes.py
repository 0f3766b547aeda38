"""Each token's own bytes (not the text a decode of it shows: a byte-level token that is part
of a character is that byte), and which tokens are special (control tokens, never text).
Log-probabilities show these bytes; the constrained sampler matches grammars against them."""
import re
from typing import Dict, List

from mdi.model.spm_tokenizer import SpmTokenizer
from mdi.model.tokenizers import GPT2Tokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer

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


def is_byte_level(tok: Tokenizer) -> bool:
    return isinstance(tok, HFTokenizer) and type(tok.tk.decoder).__name__ == "ByteLevel"


def token_bytes(tok: Tokenizer, token: int, byte_level: bool) -> bytes:
    """The bytes `token` stands for (`byte_level`: is_byte_level(tok), asked once by callers)."""
    if isinstance(tok, GPT2Tokenizer):
        return bytes(tok.enc.decode_single_token_bytes(token))
    if isinstance(tok, SpmTokenizer):
        return tok.piece_bytes(token)
    piece = tok.tk.id_to_token(token) if isinstance(tok, HFTokenizer) else \
        tok.sp.id_to_piece(token) if isinstance(tok, SentencePieceTokenizer) else None
    if piece is not None:
        byte = BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if byte_level and all(c in UNBYTE for c in piece):
            return bytes(UNBYTE[c] for c in piece)
        if not byte_level and "\u2581" in piece:  # SentencePiece's space
            return piece.replace("\u2581", " ").encode("utf-8")
    return tok.decode([token]).encode("utf-8", "surrogatepass")


def special_token_ids(tok: Tokenizer) -> List[int]:
    """Control tokens (chat markers, BOS/EOS, unknown): a grammar over text never matches them."""
    ids = set(tok.end_ids) | ({tok.bos_id} if tok.bos_id is not None else set())
    if isinstance(tok, HFTokenizer):
        ids |= {i for i, t in tok.tk.get_added_tokens_decoder().items() if t.special}
    elif isinstance(tok, SentencePieceTokenizer):
        ids |= {i for i in range(tok.vocab_size) if tok.sp.IsControl(i) or tok.sp.IsUnknown(i)}
    elif isinstance(tok, GPT2Tokenizer):
        ids |= {tok.enc.encode_single_token(t) for t in tok.enc.special_tokens_set}
    elif isinstance(tok, SpmTokenizer):
        ids |= set(tok.special_ids())
    return sorted(i for i in ids if 0 <= i < tok.vocab_size)


def all_token_bytes(tok: Tokenizer) -> List[bytes]:
    """Every token's bytes, by id (~0.2 s for a 49k vocabulary)."""
    byte_level = is_byte_level(tok)
    return [token_bytes(tok, i, byte_level) for i in range(tok.vocab_size)]
