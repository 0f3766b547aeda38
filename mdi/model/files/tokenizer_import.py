"""Build a tokenizer from a checkpoint's own files: a Hugging Face directory (tokenizer.json or
tokenizer.model with tokenizer_config.json) or the vocabulary embedded in a GGUF file, the way
transformers builds it, so both give the same ids. A GGUF "gpt2" (byte-level BPE) vocabulary gets
the pre-tokenizer its `tokenizer.ggml.pre` names (Llama 3: "llama-bpe", Qwen2/2.5/3: "qwen2", SmolLM:
"smollm", ...), so it tokenizes as llama.cpp does (the model's tokenizer.json's ids, less its
normalizer); an unknown name is an error. A
GGUF "llama" (SentencePiece) vocabulary (Gemma 3, Llama 2, TinyLlama) tokenizes as llama.cpp's
`llm_tokenizer_spm` does."""
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, cast

from mdi.model.files.gguf_layout import open_reader
from mdi.model.spm_tokenizer import CONTROL, NORMAL, USER_DEFINED, SpmTokenizer
from mdi.model.tokenizers import (HFTokenizer, SentencePieceTokenizer, Tokenizer, TokenizerError, bytes_to_unicode,
                                  read_json_if, read_tokenizer_json)

# llama.cpp's `tokenizer.ggml.pre` names the pre-tokenizer a "gpt2" (byte-level BPE) vocabulary was
# trained with. The regexes are the models' own tokenizer.json ones, as transformers uses them
# (TikTokenConverter / gguf_tokenizer_mapping.py for Llama 3, models/qwen2/tokenization_qwen2.py
# PRETOKENIZE_REGEX for Qwen2) and as llama.cpp quotes them (src/llama-vocab.cpp, "original regex
# from tokenizer.json"): Llama 3 groups up to 3 digits, Qwen2 (also Qwen2.5, Qwen3) splits every digit.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFPre(NamedTuple):
    """How one `tokenizer.ggml.pre` value tokenizes."""
    # regex splits before ByteLevel(use_regex=False), each splitting the last one's pieces (several:
    # llama.cpp's "default"); none: GPT-2's regex
    splits: Tuple[str, ...] = ()
    digits: bool = False  # every digit its own pre-token first (SmolLM's tokenizer.json: Digits + ByteLevel)
    ignore_merges: bool = False  # a pre-token that is a whole vocabulary entry is that token (tiktoken, Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2_PRE = GGUFPre()
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (src/llama-vocab.cpp), for "default" and a file without
# the key (converted before it existed): punctuation runs split off first, then GPT-2-like words
# (GPT-2's one regex had given "!!" where llama.cpp gives "!", "!")
_DEFAULT_PRE = GGUFPre(splits=(r"[\p{P}\$\+<=>\^~\|]+",
                               r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                               r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3_PRE = GGUFPre((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)  # llama.cpp's LLAMA3 pre type
GGUF_PRE_TOKENIZERS: Dict[str, GGUFPre] = {
    "default": _DEFAULT_PRE, "gpt-2": _GPT2_PRE, "phi-2": _GPT2_PRE,
    "smollm": GGUFPre(digits=True),
    "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE, "llama-bpe": _LLAMA3_PRE, "falcon3": _LLAMA3_PRE,
    "dbrx": GGUFPre((_LLAMA3_SPLIT,)), "smaug-bpe": GGUFPre((_LLAMA3_SPLIT,)),
    # no NFC for Qwen2 here, though its tokenizer.json has one: llama.cpp normalizes nothing
    "qwen2": GGUFPre((_QWEN2_SPLIT,)), "deepseek-r1-qwen": GGUFPre((_QWEN2_SPLIT,)),
}
# Tokens llama.cpp makes end-of-generation by their text (src/llama-vocab.cpp, special_eog_ids),
# also making them control tokens whatever type the file gives them: Gemma 3's GGUF types "</s>"
# (id 212) normal, yet llama.cpp parses it as a special token and stops at it.
LLAMA_CPP_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
])


# The FIM tokens llama.cpp finds by text where the file names none; each ends generation.
LLAMA_CPP_FIM_TEXTS = {
    "fim_pad": frozenset(["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    "fim_rep": frozenset(["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
    "fim_sep": frozenset(["<|file_sep|>"]),
}


def gguf_pre_tokenizer(pre: Optional[str]) -> GGUFPre:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value (None, a file without the key: llama.cpp's
    "default", as llama.cpp reads it); an unknown name is an error, not a guess."""
    if pre is None:
        return _DEFAULT_PRE
    spec = GGUF_PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise TokenizerError("unsupported GGUF pre-tokenizer tokenizer.ggml.pre %r (supported: %s)"
                             % (pre, ", ".join(sorted(GGUF_PRE_TOKENIZERS))))
    return spec


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    """A Hugging Face directory's tokenizer: tokenizer.json (or tokenizer.model), BOS/EOS and
    add_bos from tokenizer_config.json, the chat template from chat_template.jinja or
    tokenizer_config.json.

    EOS is tokenizer_config.json's `eos_token`, the token the release's chat template ends an
    assistant turn with (Llama 3.1/3.2/3.3 Instruct: <|eot_id|>; Qwen2.5/Qwen3 Instruct:
    <|im_end|>) or a base release's end of text (<|end_of_text|>, <|endoftext|>); without one,
    generation_config.json's first eos_token_id. Every id generation_config.json lists (Llama 3.1
    Instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>) also ends a generation (`stop_ids`)."""
    cfg = read_json_if(os.path.join(path, "tokenizer_config.json")) or {}
    special_map = read_json_if(os.path.join(path, "special_tokens_map.json")) or {}
    meta: Dict[str, Any] = {"chat_template": _chat_template(path, cfg)}
    if "add_bos_token" in cfg:
        meta["add_bos"] = bool(cfg["add_bos_token"])
    tok_json, sp_model = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
    if os.path.isfile(tok_json):
        tk = read_tokenizer_json(tok_json)
        for key in ("bos", "eos"):
            name = _token_content(cfg.get(key + "_token", special_map.get(key + "_token")))
            meta[key + "_id"] = tk.token_to_id(name) if name is not None else None
        listed = _generation_eos(path, tk.get_vocab_size(with_added_tokens=True))
        if meta["eos_id"] is None and listed:
            meta["eos_id"] = listed[0]
        meta["stop_ids"] = listed
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


class NoGgufVocabulary(TokenizerError):
    """A GGUF file without a tokenizer: the files beside it may hold one."""


def tokenizer_from_gguf(path: str) -> Tokenizer:
    """The tokenizer of a GGUF file. "llama" (SentencePiece): llama.cpp's tokenizer (mdi.model.spm_tokenizer).
    "gpt2": the byte-level BPE tokenizer, built as llama.cpp tokenizes it (the pre-tokenizer
    `tokenizer.ggml.pre` names; ids equal the model's tokenizer.json's but for its normalizer, as
    Qwen2's NFC, which llama.cpp does not apply; transformers' `gguf_file=` loader also drops
    Llama 3's ignore_merges and reads a missing name as GPT-2's)."""
    md = _gguf_metadata(path)
    model = md.get("tokenizer.ggml.model")
    if model in (None, "none", "no_vocab"):  # (mdi writes a model directory's GGUF with no vocabulary of its own)
        raise NoGgufVocabulary("GGUF file %s carries no vocabulary (tokenizer.ggml.model %r): give the model's "
                               "tokenizer files beside it" % (path, model))
    if model not in ("gpt2", "llama"):
        raise TokenizerError("unsupported GGUF tokenizer.ggml.model %r in %s (supported: 'gpt2' byte-level "
                             "BPE, 'llama' SentencePiece)" % (model, path))
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF file %s has no tokenizer.ggml.tokens" % path)
    if model == "llama":
        return _spm_tokenizer_from_gguf(path, md, tokens)
    try:
        pre = gguf_pre_tokenizer(md.get("tokenizer.ggml.pre"))
    except TokenizerError as e:
        raise TokenizerError("%s in %s" % (e, path)) from None
    ids: Dict[str, Optional[int]] = {}
    for key in ("bos", "eos", "unknown", "padding"):
        i = md.get("tokenizer.ggml.%s_token_id" % key)
        if i is not None and not 0 <= i < len(tokens):
            raise TokenizerError("GGUF tokenizer.ggml.%s_token_id %d is outside the %d-token vocabulary of %s"
                                 % (key, i, len(tokens), path))
        ids[key] = i
    try:
        tk = byte_level_bpe(tokens, md.get("tokenizer.ggml.merges") or [], md.get("tokenizer.ggml.token_type") or [],
                            md.get("tokenizer.ggml.pre"), [ids[k] for k in ("bos", "eos", "unknown", "padding")])
    except TokenizerError as e:
        raise TokenizerError("%s in %s" % (e, path)) from None
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default for this pre-tokenizer (Llama 3: yes), when there is a BOS
        add_bos = pre.add_bos and ids["bos"] is not None
    for key, on in (("bos", add_bos), ("eos", md.get("tokenizer.ggml.add_eos_token"))):
        if on and ids[key] is None:
            raise TokenizerError("GGUF tokenizer.ggml.add_%s_token is set but %s names no tokenizer.ggml.%s_token_id"
                                 % (key, path, key))
    # EOS is the file's tokenizer.ggml.eos_token_id: llama.cpp's converter takes it from the
    # model's tokenizer_config.json, so an instruct model's is its end of turn (<|eot_id|>, <|im_end|>).
    # llama.cpp's end-of-generation set: EOS plus the end-of-turn / end-of-message ids it names.
    return HFTokenizer(tk, bos_id=ids["bos"], eos_id=ids["eos"], add_bos=bool(add_bos),
                       add_eos=bool(md.get("tokenizer.ggml.add_eos_token")),
                       chat_template=md.get("tokenizer.chat_template"),
                       stop_ids=_llama_cpp_stops(md, tokens, _llama_cpp_eog(tokens)))


def _llama_cpp_stops(md: Dict[str, Any], tokens: Sequence[str], eog: Dict[str, int]) -> List[int]:
    """llama.cpp's end-of-generation set beyond EOS, for every vocabulary type: the eot / eom /
    fim_pad / fim_rep / fim_sep ids the file names, a FIM id it does not name found by its text
    (`LLAMA_CPP_FIM_TEXTS`), and the tokens `_llama_cpp_eog` finds by text. A BPE GGUF had
    stopped at EOS and the named ids alone: SmolLM2's ran on past "<|endoftext|>", where
    llama.cpp stops."""
    found: Dict[str, int] = {}  # each FIM text's first id, in one pass over the vocabulary
    if any(md.get("tokenizer.ggml.%s_token_id" % key) is None for key in LLAMA_CPP_FIM_TEXTS):
        wanted = frozenset().union(*LLAMA_CPP_FIM_TEXTS.values())
        for j, t in enumerate(tokens):
            if t in wanted:
                found.setdefault(t, j)
    stops = []
    for key in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
        i = md.get("tokenizer.ggml.%s_token_id" % key)
        if i is None and key in LLAMA_CPP_FIM_TEXTS:
            i = min((found[t] for t in LLAMA_CPP_FIM_TEXTS[key] if t in found), default=None)
        if isinstance(i, int) and 0 <= i < len(tokens):
            stops.append(i)
    return stops + sorted(eog.values())


def _spm_tokenizer_from_gguf(path: str, md: Dict[str, Any], tokens: List[str]) -> Tokenizer:
    """A "llama" (SentencePiece) GGUF vocabulary as llama.cpp reads it (llama_vocab::impl::load):
    its defaults where a key is missing (BOS 1, EOS 2, unknown 0, add BOS, add a space prefix),
    and its end-of-generation set: EOS, the eot / eom / fim_pad / fim_rep / fim_sep ids the file
    names, and the tokens `LLAMA_CPP_EOG_TEXTS` names (with or without an eot key, as llama.cpp:
    Gemma 3's <end_of_turn> is one by its text)."""
    n = len(tokens)
    scores = md.get("tokenizer.ggml.scores")
    types = md.get("tokenizer.ggml.token_type")
    for key, values in (("scores", scores), ("token_type", types)):
        if values is not None and len(values) < n:  # llama.cpp refuses it too
            raise TokenizerError("GGUF tokenizer.ggml.%s has %d entries for %d tokens in %s"
                                 % (key, len(values), n, path))
    # llama.cpp names an empty token "[EMPTY_<id>]" and refuses a vocabulary with a repeated one.
    tokens = [t if t else "[EMPTY_%d]" % i for i, t in enumerate(tokens)]
    if len(set(tokens)) != n:
        raise TokenizerError("GGUF tokenizer.ggml.tokens of %s repeats a token (llama.cpp refuses it too)" % path)
    ids: Dict[str, Optional[int]] = {}
    for key, default in (("bos", 1), ("eos", 2), ("unknown", 0)):
        i = md.get("tokenizer.ggml.%s_token_id" % key, default if default < n else None)
        if i is not None and not 0 <= i < n:
            raise TokenizerError("GGUF tokenizer.ggml.%s_token_id %d is outside the %d-token vocabulary of %s"
                                 % (key, i, n, path))
        ids[key] = i
    add_prefix = md.get("tokenizer.ggml.add_space_prefix")
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    eog = _llama_cpp_eog(tokens)
    stops = _llama_cpp_stops(md, tokens, eog)
    return SpmTokenizer(tokens, (scores or [0.0] * n)[:n], _llama_cpp_token_types(tokens, types or [NORMAL] * n, eog),
                        add_space_prefix=True if add_prefix is None else bool(add_prefix), unknown_id=ids["unknown"],
                        bos_id=ids["bos"], eos_id=ids["eos"],
                        add_bos=(True if add_bos is None else bool(add_bos)) and ids["bos"] is not None,
                        add_eos=bool(md.get("tokenizer.ggml.add_eos_token")) and ids["eos"] is not None,
                        chat_template=md.get("tokenizer.chat_template"), stop_ids=stops)


def _llama_cpp_token_types(tokens: Sequence[str], types: Sequence[int], eog: Dict[str, int]) -> List[int]:
    """The types llama.cpp acts on: its end-of-generation tokens are control tokens whatever the
    file says, except for _llama_cpp_eog's exceptions: "<|end|>" is then user-defined and "</s>"
    normal. A type outside llama.cpp's 0-6 is read as normal, as llama.cpp leaves it unparsed."""
    out = [ty if isinstance(ty, int) and 0 <= ty <= 6 else NORMAL for ty in types[:len(tokens)]]
    for i, t in enumerate(tokens):
        if t in LLAMA_CPP_EOG_TEXTS:
            out[i] = CONTROL if t in eog else USER_DEFINED if t == "<|end|>" else NORMAL
    return out


def _llama_cpp_eog(tokens: Sequence[str]) -> Dict[str, int]:
    """The tokens llama.cpp makes end-of-generation (and control) by text, with its two
    exceptions: "</s>" stays a normal token beside Gemma 4's "<|tool_response>" or PLaMo's
    "<|plamo:eos|>"; "<|end|>" is no EOG (but user-defined) beside gpt-oss's "<|return|>" and
    "<|call|>" or Solar Open's "<|calls|>" and "<|flush|>"."""
    found = {t: i for i, t in enumerate(tokens) if t in LLAMA_CPP_EOG_TEXTS}
    if "</s>" in found and ("<|tool_response>" in found or "<|plamo:eos|>" in tokens):
        del found["</s>"]
    call = "<|call|>" in found or "<|calls|>" in found
    if "<|end|>" in found and call and ("<|return|>" in found or "<|flush|>" in found):
        del found["<|end|>"]
    return found


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                   pre: Optional[str] = None, named_special_ids: Sequence[Optional[int]] = ()) -> Any:
    """HF `tokenizers.Tokenizer` for llama.cpp's "gpt2" vocabulary, mirroring transformers'
    GGUF conversion: GPT2Tokenizer's BPE + ByteLevel pre-tokenizer/decoder, control tokens as
    special added tokens, user-defined ones as plain added tokens; the pre-tokenizer, normalizer
    and ignore_merges are those `pre` (tokenizer.ggml.pre) names (`gguf_pre_tokenizer`)."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import BPE

    spec = gguf_pre_tokenizer(pre)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet are respelled from their UTF-8 bytes (as transformers does).
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    options: Dict[str, Any] = {"ignore_merges": True} if spec.ignore_merges else {}
    pairs = _merge_pairs(merges)
    try:
        tk = HFTok(BPE(vocab=vocab, merges=pairs, dropout=None,
                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, **options))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a merge it cannot build
        why = str(e).splitlines()[0].replace("Error while initializing BPE: ", "")[:300]
        raise TokenizerError("GGUF tokenizer.ggml.merges do not fit the %d tokenizer.ggml.tokens (%s)"
                             % (len(tokens), why)) from None
    steps: List[Any] = []
    if spec.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.splits:
        steps += [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tk.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types))
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: transformers skips it.
    special = [t for t, ty in typed if ty == CONTROL and set(t) <= alphabet]
    # transformers also registers its named bos/eos/unk/pad tokens as special.
    special += [tokens[i] for i in named_special_ids
                if i is not None and 0 <= i < len(tokens) and tokens[i] in vocab and tokens[i] not in special]
    if special:
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, ty in typed if ty == USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tk


def _merge_pairs(merges: Sequence[Any]) -> List[Tuple[str, str]]:
    """tokenizer.ggml.merges as the (left, right) pairs BPE takes: each entry is "left right"
    (the library answers another shape with a TypeError that names neither key nor entry)."""
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else () for m in merges]
    bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)
    if bad is not None:
        raise TokenizerError("GGUF tokenizer.ggml.merges entry %d (%r) is not two tokens separated by one space"
                             % (bad, merges[bad]))
    return cast(List[Tuple[str, str]], pairs)


def _gguf_metadata(path: str) -> Dict[str, Any]:
    """The `tokenizer.*` key/values of a GGUF file as plain Python values."""
    try:
        reader = open_reader(path)
        return {key: reader.value(key) for key in reader.keys() if key.startswith("tokenizer.")}
    except ImportError:
        raise TokenizerError("reading a GGUF tokenizer needs the gguf package: pip install gguf") from None
    except (OSError, ValueError) as e:
        raise TokenizerError("cannot read GGUF file %s: %s" % (path, e)) from None


def _generation_eos(path: str, vocab_size: int) -> List[int]:
    """generation_config.json's eos_token_id (an id or a list of ids), the valid ones in order."""
    eos = (read_json_if(os.path.join(path, "generation_config.json")) or {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size]


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
