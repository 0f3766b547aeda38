"""Llama 3.x and Qwen2.5/Qwen3 tokenizers: tokenizer.json (+ tokenizer_config.json, chat template,
EOS) and the same vocabulary embedded in a GGUF file (`tokenizer.ggml.pre` = "llama-bpe" / "qwen2").

No real Llama 3 or Qwen tokenizer file can be installed from a package registry (they live on the
model hub, and this suite runs without network), so the tokenizers are BUILT here with the
`tokenizers` library: a small byte-level BPE trained on an in-memory corpus with the models' real
pre-tokenizers -- Split(the llama-bpe / qwen2 regex, isolated) + ByteLevel(use_regex=False), Qwen's
NFC normalizer, Llama 3's ignore_merges and BOS post-processor -- and their special tokens in the
real order after the regular vocabulary. The regexes are the ones in transformers'
convert_slow_tokenizer.TikTokenConverter (Llama 3) and models/qwen2/tokenization_qwen2.py (Qwen2),
which llama.cpp's src/llama-vocab.cpp quotes as the "original regex from tokenizer.json".

mdi's ids are compared with transformers' (`AutoTokenizer.from_pretrained(dir)`; for Qwen that is
Qwen2Tokenizer, which rebuilds its pipeline from its own code and so is an independent reference),
and the GGUF path with the tokenizer.json path on the same texts.
"""
import functools
import json
import os
import random
import unicodedata

import pytest

from mdi.model.files.tokenizer_import import GGUF_PRE_TOKENIZERS, tokenizer_from_gguf, tokenizer_from_hf_dir
from mdi.model.tokenizers import TokenizerError, load_tokenizer
from test_tokenizers import write_tokenizer_gguf

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama 3.1's first special tokens (ids 128000.. after the regular vocabulary), in order.
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# Qwen2.5/Qwen3 added tokens (ids 151643..) in order: (content, special). <tool_call>, the FIM tokens
# and Qwen3's <think> are added tokens that are not special (llama.cpp: USER_DEFINED).
QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
              ("<|object_ref_start|>", True), ("<|vision_start|>", True), ("<tool_call>", False),
              ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
              ("<think>", False), ("</think>", False)]
# A vocabulary entry no merge builds (as in vocabularies converted from tiktoken ranks): only
# ignore_merges (Llama 3's tokenizer.json, llama.cpp's llama-bpe) makes " qzxv" that one token.
UNMERGED = "\u0120qzxv"  # " qzxv" in the byte-level alphabet

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's chat template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN_TEMPLATE = (  # Qwen2.5-Instruct's chat template without its tools branch
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

TEXTS = [
    "Hello world", "hello   world", " leading space", "trailing space ", "", " ", "  ", "\n", "\n\n\n",
    "tabs\tand\nnewlines\r\n", "a\t\tb\n\n\nc", "line one\n  line two\n\n    line three   \n",
    "123456789", "3.14159", "1234567 + 89 = 1234656", "0.5e-10 and 1e9", "year 2024, 12:30pm",
    "I'm here", "they'll go", "DON'T STOP", "We've, you'd, she's", "It'S MiXeD", "o'clock 'quoted'",
    "café naïve Zürich", "Ça va? Très bien!", "日本語のテキスト", "中文测试，标点。", "한국어 문장",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧", "🇫🇷🇯🇵", "Ω≈ç√∫˜µ≤≥÷", "\u00a0nbsp\u2003em space",
    "def f(x):\n    return x ** 2  # square\n", "class A:\n\tdef g(self):\n\t\tpass\n",
    "if (a && b) { return 0; }", "for i in range(10):\n    print(i)\n\n", "x=[1,2,3];y={'k':v}",
    "URL: https://example.com/a?b=c&d=e", "a" * 50, "!!!???...", "--- ***", "qzxv qzxv", " qzxv",
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>",
    "<|begin_of_text|>text<|end_of_text|>more", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nhmm\n</think>\n\nyes", "<tool_call>{\"name\": \"f\"}</tool_call>", "<|im_start", "<|eot_id",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hi there!  "},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count: 1 2 3, 日本"}],
]


def _corpus():
    rnd = random.Random(19)
    words = ("the quick brown fox jumps over lazy dog model token layer board split run serve stream "
             "hello world python return import class def self value print range data where which there "
             "these those through thought example sample generate generation network transformer "
             "attention embedding sequence tokenizer vocabulary merge pretoken pattern regular expression "
             "number digit letter space newline indentation function argument parameter tensor weight "
             "café naïve résumé Zürich straße über größer 日本 中文 한국어 東京 大阪 学习 模型").split()
    code = ["def f(x):\n    return x * 2\n", "for i in range(10):\n    print(i)\n",
            "class Model:\n\tdef __init__(self):\n\t\tself.n = 0\n", "if a and b:\n    pass\n"]
    misc = ["I'm sure they'll say DON'T, we've seen it.", "café naïve Zürich résumé", "日本語 中文 한국어 テキスト",
            "emoji 😀🎉👍 ok", "pi is 3.14159 and e is 2.71828", "\n\n\n", "a\tb\tc", "x = [1, 2, 3]; y = {}"]
    lines = []
    for _ in range(400):
        n = rnd.randint(3, 12)
        line = " ".join(rnd.choice(words) for _ in range(n))
        line += " " + str(rnd.randint(0, 10 ** rnd.randint(1, 9)))
        lines.append(line.capitalize() if rnd.random() < 0.3 else line)
    return lines + code * 20 + misc * 20


def _train(pattern, llama):
    """(vocab, merges) of a small byte-level BPE trained with this pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tk = Tokenizer(BPE())
    if not llama:
        from tokenizers import normalizers
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = BpeTrainer(vocab_size=256 + 450, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         show_progress=False)
    tk.train_from_iterator(_corpus(), trainer)
    model = json.loads(tk.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


@functools.lru_cache(maxsize=None)
def _build(family):
    """A Llama-3- or Qwen2-style tokenizers.Tokenizer, laid out as the real ones are (not to be modified)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    llama = family == "llama3"
    vocab, merges = _train(LLAMA3_PATTERN if llama else QWEN2_PATTERN, llama)
    assert len(merges) > 300
    if llama:
        vocab[UNMERGED] = len(vocab)
    tk = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=llama))
    if not llama:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN if llama else QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    added = [(t, True) for t in LLAMA3_SPECIAL] if llama else QWEN_ADDED
    for content, special in added:  # one at a time: ids in this order, right after the vocabulary
        tok = AddedToken(content, special=special, normalized=False)
        n = tk.add_special_tokens([tok]) if special else tk.add_tokens([tok])
        assert n == 1
    if llama:
        bos = tk.token_to_id("<|begin_of_text|>")
        tk.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A:0",
                                          pair="<|begin_of_text|> $A:0 <|begin_of_text|> $B:1",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


def _write_hf_dir(path, family, tk):
    os.makedirs(path, exist_ok=True)
    tk.save(os.path.join(path, "tokenizer.json"))
    added = {str(tk.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": s}
             for t, s in ([(t, True) for t in LLAMA3_SPECIAL] if family == "llama3" else QWEN_ADDED)}
    if family == "llama3":  # Llama 3.1-8B-Instruct's tokenizer_config.json (abridged)
        cfg = {"added_tokens_decoder": added, "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE,
               "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
               "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        gen = {"bos_token_id": tk.token_to_id("<|begin_of_text|>"),
               "eos_token_id": [tk.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]}
    else:  # Qwen2.5-Instruct's tokenizer_config.json (abridged)
        cfg = {"add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
               "chat_template": QWEN_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
               "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
               "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
        gen = {"bos_token_id": tk.token_to_id("<|endoftext|>"),
               "eos_token_id": [tk.token_to_id("<|im_end|>"), tk.token_to_id("<|endoftext|>")]}
    for name, obj in (("tokenizer_config.json", cfg), ("generation_config.json", gen)):
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
    return path


def _write_gguf(path, tk, pre, bos, eos, add_bos=None, pad_to=None, padding=None, template=None, add_eos=None):
    """The tokenizer as llama.cpp's convert_hf_to_gguf.py writes a "gpt2" vocabulary: tokens in id
    order (byte-level spelling), added special tokens CONTROL (3), other added tokens USER_DEFINED
    (4), the vocabulary padded to the embedding size with [PADn] UNUSED (5) tokens."""
    data = json.loads(tk.to_str())
    added = {t["id"]: t for t in data["added_tokens"]}
    n = tk.get_vocab_size(with_added_tokens=True)
    tokens = [tk.id_to_token(i) for i in range(n)]
    types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(n)]
    for i in range(n, pad_to or n):
        tokens.append("[PAD%d]" % i)
        types.append(5)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    write_tokenizer_gguf(path, "gpt2", tokens, merges, types, pre=pre, bos=bos, eos=eos, template=template,
                         add_bos=add_bos, padding=padding, add_eos=add_eos)
    return path


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def family(request, tmp_path_factory):
    """(name, tokenizers.Tokenizer, HF dir, GGUF path) for one family."""
    name = request.param
    tk = _build(name)
    root = tmp_path_factory.mktemp(name)
    hf_dir = _write_hf_dir(str(root / "hf"), name, tk)
    if name == "llama3":  # no add_bos_token key: llama.cpp's llama-bpe default (add BOS) applies
        gguf_path = _write_gguf(str(root / "llama3.gguf"), tk, "llama-bpe", tk.token_to_id("<|begin_of_text|>"),
                                tk.token_to_id("<|eot_id|>"), template=LLAMA3_TEMPLATE)
    else:  # as llama.cpp writes Qwen2.5: BOS = PAD = <|endoftext|>, add_bos_token false, padded vocabulary
        endoftext = tk.token_to_id("<|endoftext|>")
        gguf_path = _write_gguf(str(root / "qwen2.gguf"), tk, "qwen2", endoftext, tk.token_to_id("<|im_end|>"),
                                add_bos=False, pad_to=tk.get_vocab_size() + 32, padding=endoftext,
                                template=QWEN_TEMPLATE)
    return name, tk, hf_dir, gguf_path


@pytest.fixture(scope="module")
def reference(family):
    pytest.importorskip("transformers", reason="transformers (test-only reference) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(family[2])


def _body(tok, ids):
    """ids without the BOS that add_bos put in front."""
    return ids[1:] if tok.add_bos else ids


# ---------------------------------------------------------------------------------------------
# tokenizer.json


def test_hf_dir_matches_transformers(family, reference):
    name, _, hf_dir, _ = family
    ours = tokenizer_from_hf_dir(hf_dir)
    if name == "qwen2":
        assert type(reference).__name__ == "Qwen2Tokenizer"  # rebuilt from code: an independent pipeline
    for text in TEXTS + ["Cafe\u0301 n\u0303"]:  # + decomposed accents: Qwen normalizes to NFC
        assert ours.encode(text) == reference(text)["input_ids"], text


def test_hf_dir_metadata(family):
    name, tk, hf_dir, _ = family
    tok = tokenizer_from_hf_dir(hf_dir)
    if name == "llama3":
        # Llama 3 adds <|begin_of_text|> (its post-processor does); an instruct turn ends with <|eot_id|>.
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (tk.token_to_id("<|begin_of_text|>"),
                                                         tk.token_to_id("<|eot_id|>"), True)
        assert tok.encode("hi")[0] == tok.bos_id
    else:
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (None, tk.token_to_id("<|im_end|>"), False)
    assert tok.chat_template == (LLAMA3_TEMPLATE if name == "llama3" else QWEN_TEMPLATE)
    assert tok.vocab_size == tk.get_vocab_size(with_added_tokens=True)
    # every id generation_config.json lists ends a generation too
    ends = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>") if name == "llama3" else ("<|im_end|>", "<|endoftext|>")
    assert sorted(tok.end_ids) == sorted(tk.token_to_id(t) for t in ends)


def test_hf_dir_round_trip(family):
    tok = tokenizer_from_hf_dir(family[2])
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(_body(tok, ids)) == text
    assert tok.decode(_body(tok, tok.encode("Cafe\u0301"))) == ("Caf\u00e9" if family[0] == "qwen2" else "Cafe\u0301")


def test_special_tokens_are_whole(family):
    name, tk, hf_dir, _ = family
    tok = tokenizer_from_hf_dir(hf_dir)
    marks = LLAMA3_SPECIAL if name == "llama3" else [t for t, _ in QWEN_ADDED]
    for t in marks:
        assert _body(tok, tok.encode("x" + t + "y"))[1:-1] == [tk.token_to_id(t)], t
    assert len(_body(tok, tok.encode("<|eot_id"))) > 1  # a prefix of a special token is plain text


def test_digit_rules(family):
    """Llama 3 groups up to three digits, Qwen splits every digit (visible with any vocabulary)."""
    tok = tokenizer_from_hf_dir(family[2])
    pieces = [tok.decode([i]) for i in _body(tok, tok.encode("123456789"))]
    if family[0] == "llama3":
        assert all(len(p) <= 3 for p in pieces) and "".join(pieces) == "123456789"
    else:
        assert pieces == list("123456789")


def test_ignore_merges(family):
    """Llama 3's tokenizer.json has ignore_merges: a pre-token that is a vocabulary entry is that token."""
    if family[0] != "llama3":
        pytest.skip("Qwen2's tokenizer.json applies merges to every pre-token")
    tok = tokenizer_from_hf_dir(family[2])
    assert _body(tok, tok.encode(" qzxv")) == [family[1].token_to_id(UNMERGED)]


def test_save_load_keeps_pipeline(family, tmp_path):
    tok = tokenizer_from_hf_dir(family[2])
    tok.save(str(tmp_path))
    again = load_tokenizer(str(tmp_path))
    assert (again.bos_id, again.eos_id, again.add_bos, again.chat_template) == \
        (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template)
    for text in TEXTS + ["Cafe\u0301"]:
        assert again.encode(text) == tok.encode(text)


def test_chat_template_ids_match_transformers(family, reference):
    pytest.importorskip("jinja2")
    from mdi.serving.prompts import ChatTemplate

    tok = tokenizer_from_hf_dir(family[2])
    template = ChatTemplate(tok)
    assert template.source == "model"
    for messages in MESSAGES:
        ids = tok.encode(template.render(messages))
        ref = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert ids == list(ref)
        # the prompt ends by opening the assistant's turn
        tail = "<|start_header_id|>assistant<|end_header_id|>\n\n" if family[0] == "llama3" \
            else "<|im_start|>assistant\n"
        assert tok.decode(ids).endswith(tail)
        if tok.add_bos:  # the template's own bos_token is dropped: one BOS, the tokenizer's
            assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id


def test_eos_from_generation_config_when_tokenizer_names_none(family, tmp_path):
    name, tk, hf_dir, _ = family
    path = str(tmp_path / "noeos")
    os.makedirs(path)
    for f in ("tokenizer.json", "generation_config.json"):
        with open(os.path.join(hf_dir, f), "rb") as src, open(os.path.join(path, f), "wb") as dst:
            dst.write(src.read())
    with open(os.path.join(hf_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    del cfg["eos_token"]
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    # generation_config.json lists several: the first is used
    first = "<|end_of_text|>" if name == "llama3" else "<|im_end|>"
    assert tokenizer_from_hf_dir(path).eos_id == tk.token_to_id(first)


# ---------------------------------------------------------------------------------------------
# GGUF (tokenizer.ggml.pre = llama-bpe / qwen2)


def test_gguf_matches_tokenizer_json(family):
    name, _, hf_dir, gguf_path = family
    ours, hf = tokenizer_from_gguf(gguf_path), tokenizer_from_hf_dir(hf_dir)
    for text in TEXTS + ["Cafe\u0301 n\u0303"]:
        # but for Qwen2's NFC normalizer: llama.cpp reads a GGUF's text as it is
        want = ours.encode(unicodedata.normalize("NFC", text)) if name == "qwen2" else ours.encode(text)
        assert want == hf.encode(text), text
        assert ours.decode(_body(ours, ours.encode(text))) == text


def test_gguf_metadata(family):
    name, tk, _, gguf_path = family
    tok = tokenizer_from_gguf(gguf_path)
    if name == "llama3":
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (tk.token_to_id("<|begin_of_text|>"),
                                                         tk.token_to_id("<|eot_id|>"), True)
        assert tok.chat_template == LLAMA3_TEMPLATE
        assert tok.vocab_size == tk.get_vocab_size(with_added_tokens=True)
    else:
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (tk.token_to_id("<|endoftext|>"),
                                                         tk.token_to_id("<|im_end|>"), False)
        assert tok.chat_template == QWEN_TEMPLATE
        assert tok.vocab_size == tk.get_vocab_size(with_added_tokens=True) + 32  # padded like the embedding


def test_gguf_save_load(family, tmp_path):
    tok = tokenizer_from_gguf(family[3])
    tok.save(str(tmp_path))
    again = load_tokenizer(str(tmp_path))
    for text in TEXTS + ["Cafe\u0301"]:
        assert again.encode(text) == tok.encode(text)


def test_gguf_add_bos_flag_wins(tmp_path_factory):
    tk = _build("llama3")
    path = _write_gguf(str(tmp_path_factory.mktemp("nobos") / "x.gguf"), tk, "llama-bpe",
                       tk.token_to_id("<|begin_of_text|>"), tk.token_to_id("<|eot_id|>"), add_bos=False)
    tok = tokenizer_from_gguf(path)
    assert not tok.add_bos and tok.encode("hi")[0] != tok.bos_id


def test_gguf_wrong_pre_changes_ids(family, tmp_path):
    """The pre-tokenizer matters: the same vocabulary read with GPT-2's splits gives other ids."""
    name, tk, hf_dir, _ = family
    path = _write_gguf(str(tmp_path / "gpt2pre.gguf"), tk, "gpt-2", 0, 1, add_bos=False)
    wrong, right = tokenizer_from_gguf(path), tokenizer_from_hf_dir(hf_dir)
    text = "x 123456789 DON'T\n\n\n(self.value)"
    assert wrong.encode(text) != _body(right, right.encode(text))


@pytest.mark.parametrize("pre", ["llama-bpf", "qwen3", "tekken"])
def test_gguf_unknown_pre_is_an_error(pre, tmp_path):
    tk = _build("qwen2") if pre == "qwen3" else _build("llama3")
    path = _write_gguf(str(tmp_path / "x.gguf"), tk, pre, 0, 1)
    with pytest.raises(TokenizerError) as e:
        tokenizer_from_gguf(path)
    msg = str(e.value)
    assert "tokenizer.ggml.pre %r" % pre in msg and path in msg and "\n" not in msg


def test_gguf_pre_names():
    for name in ("llama-bpe", "llama3", "qwen2", "smollm", "gpt-2", "default"):
        assert name in GGUF_PRE_TOKENIZERS


def test_gguf_default_pre_tokenizer_is_llama_cpps(tmp_path):
    """"default", or no tokenizer.ggml.pre (a GGUF converted before the key): llama.cpp's four
    regexes, punctuation runs split off first, not GPT-2's one (whose "'t" had parted the ids)."""
    tk = _build("llama3")
    text = "Hello, world!! I don't 12345"
    want = ["Hello", ",", " world", "!!", " I", " don", "'", "t", " ", "123", "45"]
    for pre in ("default", None):
        path = _write_gguf(str(tmp_path / ("%s.gguf" % pre)), tk, pre, None, tk.token_to_id("<|eot_id|>"),
                           add_bos=False)
        pieces = tokenizer_from_gguf(path).tk.pre_tokenizer.pre_tokenize_str(text)
        assert [p for p, _ in pieces] == [w.replace(" ", "\u0120") for w in want], pre
    gpt2 = _write_gguf(str(tmp_path / "gpt2.gguf"), tk, "gpt-2", None, tk.token_to_id("<|eot_id|>"), add_bos=False)
    assert "'t" in [p for p, _ in tokenizer_from_gguf(gpt2).tk.pre_tokenizer.pre_tokenize_str(text)]


def test_gguf_add_eos_token_ends_a_prompt_with_eos(tmp_path):
    tk = _build("llama3")
    eot = tk.token_to_id("<|eot_id|>")
    path = _write_gguf(str(tmp_path / "eos.gguf"), tk, "llama-bpe", tk.token_to_id("<|begin_of_text|>"), eot,
                       add_eos=True)
    tok = tokenizer_from_gguf(path)
    ids = tok.encode("hi there")
    assert ids[0] == tok.bos_id and ids[-1] == eot and tok.encode_plain("hi there") == ids[1:-1]
    tok.save(str(tmp_path / "saved"))
    assert load_tokenizer(str(tmp_path / "saved")).encode("hi there") == ids
