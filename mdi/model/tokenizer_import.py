"""Build a tokenizer from a checkpoint's own files: a Hugging Face directory (tokenizer.json or
tokenizer.model with tokenizer_config.json) or the vocabulary embedded in a GGUF file, the way
transformers builds it, so both give the same ids."""
import os
from typing import Any, Dict, Optional, Sequence

from mdi.model.tokenizers import (HFTokenizer, SentencePieceTokenizer, Tokenizer, TokenizerError, bytes_to_unicode,
                                  read_json_if)

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



def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    cfg = read_json_if(os.path.join(path, "tokenizer_config.json")) or {}
    special_map = read_json_if(os.path.join(path, "special_tokens_map.json")) or {}
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

    spelling = bytes_to_unicode()
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
