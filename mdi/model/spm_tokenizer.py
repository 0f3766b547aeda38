"""llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`) for a GGUF "llama" vocabulary (Gemma 3,
Llama 2, TinyLlama), written out here so that its ids are llama.cpp's by construction and its
memory is the vocabulary's: Gemma 3's 262k tokens as a Hugging Face BPE needed 515k merges, held
~100 MB and peaked at ~360 MB while its tokenizer.json parsed; this holds 22 MB.

Encoding, as src/llama-vocab.cpp does it with special tokens parsed:
- control, unknown-type and user-defined tokens are cut out of the raw text first, longest
  (in UTF-8 bytes) first, every occurrence in every piece still raw (tokenizer_st_partition);
- each raw piece gets a space prepended if `add_space_prefix` and it starts the text or follows a
  special token; spaces become "\u2581";
- its characters are then merged pairwise: always the adjacent pair whose concatenation is the
  token with the highest score, the leftmost of equals, until no pair is a token;
- what is left that is not a token becomes its UTF-8 bytes' <0xXX> tokens.
Decoding is llama.cpp's token_to_piece: a normal token with "\u2581" back to spaces, a byte token
its byte, a control or user-defined token its text as it is; with `add_space_prefix` the text's
first space is dropped. (An unused-type token shows as a normal one, where llama.cpp shows nothing.)"""
import heapq
import os
import re
import sys
from array import array
from bisect import bisect_left
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import msgpack

from mdi.model.tokenizer_base import Tokenizer, TokenizerError

VOCAB_FILE = "tokenizer_spm.msgpack"
SPACE = "\u2581"  # SentencePiece's escaped space
_SPACE_BYTES = SPACE.encode("utf-8")
# llama.cpp's token types (its llama_token_type); `types` below are the attributes llama.cpp acts
# on, after it re-types tokens by their text (tokenizer_import decides those, at import).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_PARTITIONED = (UNKNOWN, CONTROL, USER_DEFINED)  # cut out of the text before merging
_SPECIAL = (UNKNOWN, CONTROL)  # never text: a grammar never matches them
_GRAM = 4
_BYTE_TOKEN = re.compile(rb"<0x[0-9A-Fa-f]{2}>")


class _SortedVocab:
    """Token bytes -> id, answering `get` as a dict would, from the vocabulary in sorted order (a
    list of the tokenizer's own bytes objects and an array of their ids). A dict of Gemma 3's
    262k tokens held ~18 MB more (its table, and an int object per id above 256); a lookup
    bisects instead, about 1 us against a dict's 0.06, a few per character encoded."""

    def __init__(self, tokens: List[bytes]) -> None:
        order = sorted(range(len(tokens)), key=tokens.__getitem__)
        self._keys = [tokens[i] for i in order]
        self._ids = array("i", order)

    def repeated(self) -> bool:
        keys = self._keys
        return any(keys[k] == keys[k + 1] for k in range(len(keys) - 1))

    def get(self, key: bytes) -> Optional[int]:
        keys = self._keys
        k = bisect_left(keys, key)
        return self._ids[k] if k < len(keys) and keys[k] == key else None


class SpmTokenizer(Tokenizer):
    kind = "spm"

    def __init__(self, tokens: Sequence[Union[str, bytes]], scores: Sequence[float], types: Sequence[int],
                 add_space_prefix: bool = False, unknown_id: Optional[int] = None, **meta: Any) -> None:
        n = len(tokens)
        if not n or len(scores) != n or len(types) != n:
            raise TokenizerError("a SentencePiece vocabulary needs as many scores and types as tokens "
                                 "(%d tokens, %d scores, %d types)" % (n, len(scores), len(types)))
        if unknown_id is not None and not 0 <= unknown_id < n:
            raise TokenizerError("unknown token id %d out of range for a vocabulary of %d" % (unknown_id, n))
        # UTF-8 bytes, not str: 10 MB of objects for Gemma 3's vocabulary where str took 19
        self.tokens = [t if isinstance(t, bytes) else t.encode("utf-8", "surrogatepass") for t in tokens]
        self.ids = _SortedVocab(self.tokens)
        if self.ids.repeated():
            raise TokenizerError("the SentencePiece vocabulary repeats a token")
        self.scores = array("f", scores)
        try:
            self.types = bytes(types)
        except (TypeError, ValueError):
            raise TokenizerError("SentencePiece token types must be integers 0-255") from None
        bad = [i for i in range(n) if self.types[i] == BYTE and not _BYTE_TOKEN.fullmatch(self.tokens[i])]
        if bad:
            raise TokenizerError("byte token %d is %r, not <0xXX>" % (bad[0], self.tokens[bad[0]]))
        self.add_space_prefix = bool(add_space_prefix)
        self.unknown_id = unknown_id
        self._byte_ids = [self._byte_token(b) for b in range(256)]
        # llama.cpp's cache_special_tokens order: longest in UTF-8 bytes first (ties: lower id;
        # llama.cpp's sort leaves their order unspecified).
        partitioned = sorted((i for i in range(n) if self.types[i] in _PARTITIONED),
                             key=lambda i: -len(self.tokens[i]))
        self._partition_rank = {i: r for r, i in enumerate(partitioned)}
        self._partition_text = {i: self.tokens[i].decode("utf-8", "surrogatepass") for i in partitioned}
        # Where a text may hold one: the short ones are looked for as they are, the others only
        # where the text has their first _GRAM characters (Gemma 3 has 6249 "<unusedN>" tokens).
        self._short_partitioned = [i for i in partitioned if len(self._partition_text[i]) < _GRAM]
        self._partitioned_by_gram: Dict[str, List[int]] = {}
        for i in partitioned:
            if len(self._partition_text[i]) >= _GRAM:
                self._partitioned_by_gram.setdefault(self._partition_text[i][:_GRAM], []).append(i)
        super().__init__(n, **meta)

    # -- encoding ------------------------------------------------------------------------------

    def _encode(self, text: str, parse_special: bool = True) -> List[int]:
        out: List[int] = []
        prev_special = True
        for piece in self._partition(text, parse_special):
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                piece = " " + piece
            self._merge(piece.replace(" ", SPACE).encode("utf-8", "surrogatepass"), out)
            prev_special = False
        return out

    def _encode_text(self, text: str) -> List[int]:
        return self._encode(text, parse_special=False)

    def _partition(self, text: str, parse_special: bool = True) -> List[Any]:
        """The text cut into raw strings and special token ids, as tokenizer_st_partition
        (without `parse_special`, control and unknown tokens' spellings stay text, as there)."""
        if not text:
            return []
        present = [i for i in self._special_tokens_in(text) if parse_special or self.types[i] == USER_DEFINED]
        pieces: List[Any] = [text]
        for token in present:
            t = self._partition_text[token]
            cut: List[Any] = []
            for piece in pieces:
                if isinstance(piece, int) or t not in piece:
                    cut.append(piece)
                    continue
                parts = piece.split(t)
                for k, part in enumerate(parts):
                    if k:
                        cut.append(token)
                    if part:
                        cut.append(part)
            pieces = cut
        return pieces

    def _special_tokens_in(self, text: str) -> List[int]:
        """The partitioned tokens that occur in `text`, in llama.cpp's order."""
        spelled = self._partition_text
        found = [i for i in self._short_partitioned if spelled[i] in text]
        by_gram = self._partitioned_by_gram
        for gram in {text[at:at + _GRAM] for at in range(len(text) - _GRAM + 1)}.intersection(by_gram):
            found.extend(i for i in by_gram[gram] if spelled[i] in text)
        return sorted(found, key=self._partition_rank.__getitem__)

    def _merge(self, data: bytes, out: List[int]) -> None:
        """llm_tokenizer_spm_session::tokenize on one escaped raw piece in UTF-8, appending its
        ids. A live symbol at byte `at` spans size[at] bytes, so its right neighbour starts at
        at + size[at]; a symbol merged into its left neighbour has size 0. Symbols start as the
        piece's characters."""
        n = len(data)
        ids, scores = self.ids, self.scores
        if data.isascii():
            starts: Sequence[int] = range(n)
            size = [1] * n
            prev = list(range(-1, n - 1))  # the live symbol before each live one (-1: none)
        else:
            starts = [at for at, b in enumerate(data) if b & 0xC0 != 0x80]  # UTF-8 lead bytes
            size, prev = [0] * n, [-1] * n
            for k in range(len(starts)):
                size[starts[k]] = (starts[k + 1] if k + 1 < len(starts) else n) - starts[k]
                if k:
                    prev[starts[k]] = starts[k - 1]
        # (-score, left, bytes of the pair): highest score first, then leftmost, as llama.cpp's
        # queue orders them
        queue: List[Tuple[float, int, int]] = []
        for k in range(len(starts) - 1):
            left = starts[k]
            end = left + size[left] + size[starts[k + 1]]
            i = ids.get(data[left:end])
            if i is not None:
                queue.append((-scores[i], left, end - left))
        heapq.heapify(queue)
        pop, push = heapq.heappop, heapq.heappush
        while queue:
            _, left, width = pop(queue)
            right = left + size[left]
            if size[left] == 0 or right >= n or size[left] + size[right] != width:
                continue  # one of the two was merged since: a stale pair
            size[left] = width
            size[right] = 0
            after = left + width
            if after < n:
                prev[after] = left
                i = ids.get(data[left:after + size[after]])
                if i is not None:
                    push(queue, (-scores[i], left, width + size[after]))
            before = prev[left]
            if before >= 0:
                i = ids.get(data[before:after])
                if i is not None:
                    push(queue, (-scores[i], before, after - before))
        at = 0
        while at < n:
            piece = data[at:at + size[at]]
            i = ids.get(piece)
            if i is not None:
                out.append(i)
            else:  # a character that is no token: its bytes' tokens (llama.cpp's resegment)
                for b in piece:
                    if self._byte_ids[b] < 0:
                        raise TokenizerError("byte 0x%02X has no token and the vocabulary has no unknown "
                                             "token" % b)
                    out.append(self._byte_ids[b])
            at += size[at]

    def _byte_token(self, b: int) -> int:
        """llama.cpp's byte_to_token: <0xXX>, else the byte as a one-character token, else the
        unknown token (llama.cpp would stop there)."""
        i = self.ids.get(b"<0x%02X>" % b)
        if i is None and b < 0x80:
            i = self.ids.get(bytes([b]))
        if i is None:
            i = self.unknown_id
        if i is None:
            return -1
        return i

    # -- decoding ------------------------------------------------------------------------------

    def piece_bytes(self, i: int) -> bytes:
        """Token `i`'s bytes as llama.cpp's token_to_piece gives them (special tokens included)."""
        t, ty = self.tokens[i], self.types[i]
        if ty == BYTE:
            return bytes([int(t[3:5], 16)])
        if ty in (NORMAL, UNUSED):
            return t.replace(_SPACE_BYTES, b" ")
        return t

    def _decode(self, ids: List[int]) -> str:
        text = b"".join(self.piece_bytes(i) for i in ids).decode("utf-8", "replace")
        if self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def special_ids(self) -> List[int]:
        """Control and unknown tokens: never text."""
        return [i for i, ty in enumerate(self.types) if ty in _SPECIAL]

    def max_token_bytes(self) -> Optional[int]:
        # A token matches at most its own spelling's UTF-8 bytes of text ("\u2581": a space or
        # itself; a byte token's spelling is longer than its byte).
        return max(len(t) for t in self.tokens)

    # -- files ---------------------------------------------------------------------------------

    def _save_files(self, model_dir: str) -> None:
        # msgpack, tokens as UTF-8 byte strings and scores as float32 bytes: read back as the
        # objects this holds, with no parse copy beside them (JSON's peaked 30 MB higher).
        vocab = {"tokens": self.tokens, "scores": _little_endian(self.scores).tobytes(), "types": self.types,
                 "add_space_prefix": self.add_space_prefix, "unknown_id": self.unknown_id}
        tmp = os.path.join(model_dir, VOCAB_FILE + ".tmp")
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(vocab, use_bin_type=True))
        os.replace(tmp, os.path.join(model_dir, VOCAB_FILE))


def _little_endian(scores: "array[float]") -> "array[float]":
    if sys.byteorder == "little":
        return scores
    swapped = array("f", scores)
    swapped.byteswap()
    return swapped


def load_spm_tokenizer(path: str, **meta: Any) -> SpmTokenizer:
    """The tokenizer a prepared directory's tokenizer_spm.msgpack holds, or a one-line
    TokenizerError naming the file."""
    try:
        with open(path, "rb") as f:
            vocab = msgpack.unpackb(f.read(), raw=False, strict_map_key=True)
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise TokenizerError("%s: cannot read a SentencePiece vocabulary (%s)" % (path, e)) from None
    if not isinstance(vocab, dict):
        raise TokenizerError("%s: expected a map" % path)
    unknown = sorted(str(k) for k in set(vocab) - {"tokens", "scores", "types", "add_space_prefix", "unknown_id"})
    if unknown:
        raise TokenizerError("%s: unknown keys %s" % (path, ", ".join(unknown)))
    tokens, scores, types = vocab.get("tokens"), vocab.get("scores"), vocab.get("types")
    if not (isinstance(tokens, list) and all(isinstance(t, bytes) for t in tokens)):
        raise TokenizerError("%s: 'tokens' must be a list of byte strings" % path)
    if not isinstance(scores, bytes) or len(scores) % 4:
        raise TokenizerError("%s: 'scores' must be float32 bytes" % path)
    if not isinstance(types, bytes):
        raise TokenizerError("%s: 'types' must be bytes" % path)
    unknown_id = vocab.get("unknown_id")
    if unknown_id is not None and (not isinstance(unknown_id, int) or isinstance(unknown_id, bool)):
        raise TokenizerError("%s: 'unknown_id' must be an integer or null" % path)
    floats = array("f")
    floats.frombytes(scores)
    try:
        tok = SpmTokenizer(tokens, _little_endian(floats), types,
                           add_space_prefix=bool(vocab.get("add_space_prefix")), unknown_id=unknown_id, **meta)
    except TokenizerError as e:
        raise TokenizerError("%s: %s" % (path, e)) from None
    except UnicodeDecodeError:
        raise TokenizerError("%s: a special token is not UTF-8" % path) from None
    return tok
