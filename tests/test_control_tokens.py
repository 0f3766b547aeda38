"""Control tokens in served text, without a ring: which ids each tokenizer marks as control
(SmolLM2's tokenizer.json, Gemma 3's GGUF vocabulary, a Llama 3 and a Qwen tokenizer built by
test_family_tokenizers), the text a TextStream makes of them (HF's own skip_special_tokens
decode, what vLLM serves), stop strings that meet them, their logprobs, the tool parser's
markers, the request field, and the alternatives a grammar masks. The served side is
tests/test_serve_control_tokens.py."""
import math
import os

import pytest

from conftest import CHARS, GEMMA3_DIR
from mdi.model.sampling import Logprobs, SamplingParams
from mdi.model.tokenizers import char_tokenizer, load_tokenizer
from mdi.serving.control_tokens import ControlTokens
from mdi.serving.logprob_bodies import TokenTexts, chat_logprobs, completion_logprobs
from mdi.serving.streaming import TextStream, TokenLogprob
from mdi.serving.tool_calls import CallParser
from mdi.serving.tools import GENERIC, LLAMA3, ToolFormat, tool_format
from mdi.serving.validation import CHAT, COMPLETIONS, ApiError, parse_options

ENDOFTEXT, IM_START, IM_END = 0, 1, 2  # SmolLM2's first special tokens (IM_END is its EOS)


def streamed(tok, ids, hidden, stops=(), finish="length"):
    """(the text a TextStream hands out for `ids`, the last update's hit_stop)."""
    stream = TextStream(tok, stops, hidden)
    text = ""
    for k, token in enumerate(ids):
        update = stream.push(token, finish if k == len(ids) - 1 else None)
        text += update.text
        if update.hit_stop:
            return text, True
    return text, False


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    return tok, ControlTokens(tok, tool_format(tok.chat_template, tok))


def test_smollm2_s_special_tokens_are_its_control_tokens(smol):
    tok, control = smol
    special = {i for i, t in tok.tk.get_added_tokens_decoder().items() if t.special}
    assert control.ids == special and {ENDOFTEXT, IM_START, IM_END} <= control.ids
    assert control.hidden(True, False) == control.ids and control.hidden(False, False) == frozenset()
    assert not control.markers and not control.python_tag_is_control  # no call markers in its vocabulary


def test_the_text_leaves_out_control_tokens_as_hf_s_skip_special_tokens_decode_does(smol):
    tok, control = smol
    ids = tok.encode("Hello") + [ENDOFTEXT] + tok.encode(" wörld") + [IM_START, IM_START] + tok.encode("\n¡ok!")
    hidden = control.hidden(True, False)
    assert streamed(tok, ids, hidden) == ("Hello wörld\n¡ok!", False)
    assert streamed(tok, ids, hidden)[0] == tok.tk.decode(ids, skip_special_tokens=True)  # what vLLM shows
    # skip_special_tokens false: the text as it always was, control tokens spelled out
    spelled = "Hello<|endoftext|> wörld<|im_start|><|im_start|>\n¡ok!"
    assert streamed(tok, ids, frozenset())[0] == tok.decode(ids) == spelled
    # one character split over byte tokens, a control token between them: HF joins them too
    first, second = tok.encode("\u01c5")  # "ǅ": two byte-level tokens
    assert streamed(tok, [first, ENDOFTEXT, second], hidden)[0] == "\u01c5"


def test_stop_strings_still_end_the_text_at_and_across_control_tokens(smol):
    tok, control = smol
    hidden = control.hidden(True, False)
    ids = tok.encode("Hello") + [ENDOFTEXT] + tok.encode(" world")
    # a stop that is a control token's own text (clients send "<|endoftext|>"): the text before it
    assert streamed(tok, ids, hidden, ["<|endoftext|>"]) == ("Hello", True)
    assert streamed(tok, ids, hidden, ["lo<|endoftext|>"]) == ("Hel", True)  # begun in the held-back text
    assert streamed(tok, ids, hidden, ["endoftext"]) == ("Hello", True)  # inside its text: cut before it
    # the visible text runs on across a control token, and so do stops that span it
    assert streamed(tok, ids, hidden, ["o w"]) == ("Hell", True)
    assert streamed(tok, ids, hidden, ["lo!"]) == ("Hello world", False)  # held back, then released
    assert streamed(tok, ids, frozenset(), ["<|endoftext|>"]) == ("Hello", True)  # as before


def test_a_control_token_s_logprobs_go_out_with_the_next_text_and_name_it(smol):
    tok, control = smol
    ids = tok.encode("Hi") + [ENDOFTEXT] + tok.encode(" there")
    stream = TextStream(tok, (), control.hidden(True, False))
    updates = [stream.push(t, None if k < len(ids) - 1 else "length", Logprobs(t, -0.5, [(t, -0.5)]))
               for k, t in enumerate(ids)]
    entries = [e for u in updates for e in u.logprobs]
    n = len(tok.encode("Hi"))
    assert [e.logprobs.token for e in entries] == ids  # every generated token, the control one too
    assert entries[n].offset == len("Hi")  # where it would start in the answer: zero characters long
    assert updates[n].logprobs == [] and updates[n + 1].logprobs[0] is entries[n]  # out with the next text
    chat = chat_logprobs(entries, TokenTexts(tok))["content"]
    assert chat[n]["token"] == "<|endoftext|>" and chat[n]["bytes"] == list(b"<|endoftext|>")


@pytest.fixture(scope="module")
def gemma():
    if not os.path.isfile(os.path.join(GEMMA3_DIR, "tokenizer_mdi.json")):
        pytest.skip("models/gemma3-270m is not prepared (scripts/setup_env.sh test prepares it)")
    tok = load_tokenizer(GEMMA3_DIR)
    return tok, ControlTokens(tok, tool_format(tok.chat_template, tok))


def test_gemma3_s_control_tokens_and_media_markers_are_left_out_and_its_other_user_defined_ones_stay(gemma):
    tok, control = gemma
    start_of_image, end_of_image, end_of_turn, unused0, newline = 255999, 256000, 106, 6, 107
    assert {end_of_turn, unused0} <= control.ids and tok.types[unused0] == 3  # GGUF control tokens
    # user-defined in the GGUF, special in Gemma's tokenizer_config.json (what vLLM reads)
    assert tok.types[start_of_image] == tok.types[end_of_image] == 4 and {start_of_image, end_of_image} <= control.ids
    assert tok.types[newline] == 4 and newline not in control.ids  # user-defined: text, as llama.cpp shows it
    assert len(control.ids) == sum(t == 3 for t in tok.types) + 2
    ids = tok.encode_plain("Look:") + [start_of_image, newline] + tok.encode_plain("A cat")
    assert streamed(tok, ids, control.hidden(True, False))[0] == "Look:\nA cat"
    assert streamed(tok, ids, frozenset())[0] == "Look:<start_of_image>\nA cat"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A Llama 3 and a Qwen tokenizer, from test_family_tokenizers' tokenizer.json builds."""
    from test_family_tokenizers import _build, _write_hf_dir
    from mdi.model.files.tokenizer_import import tokenizer_from_hf_dir
    out = {}
    for name in ("llama3", "qwen2"):
        out[name] = tokenizer_from_hf_dir(_write_hf_dir(str(tmp_path_factory.mktemp(name)), name, _build(name)))
    return out


def test_llama3_s_python_tag_stays_for_the_tool_parser_and_leaves_the_content(built):
    tok = built["llama3"]
    fmt = tool_format(tok.chat_template, tok)
    assert tok.add_bos and fmt.family == LLAMA3 and fmt.python_tag  # one token, though encode() adds BOS
    control = ControlTokens(tok, fmt)
    tag = tok.encode_plain("<|python_tag|>")[0]
    assert control.markers == {tag} and control.python_tag_is_control
    assert tag in control.hidden(True, False) and tag not in control.hidden(True, True)
    call = tok.encode_plain('{"name": "add", "parameters": {"a": 1}}')
    text, _ = streamed(tok, [tag] + call, control.hidden(True, True))
    parser = CallParser(LLAMA3, ["add"], True, hide_tag=True)
    shown, calls = parser.feed(text)
    rest, more = parser.finish()
    assert shown + rest == "" and [(c.name, c.arguments) for c in calls + more] == [("add", '{"a": 1}')]
    # a tag that opens no call: the content leaves it out (hide_tag), or shows it as before
    for hide, content in ((True, "print(1)"), (False, "<|python_tag|>print(1)")):
        parser = CallParser(LLAMA3, ["add"], True, hide_tag=hide)
        shown, _ = parser.feed("<|python_tag|>print(1)")
        rest, _ = parser.finish()
        assert shown + rest == content


def test_qwen_s_tool_call_tags_are_text_and_its_chat_markers_control(built):
    tok = built["qwen2"]
    control = ControlTokens(tok, tool_format(tok.chat_template, tok))
    spelled = {tok.decode([i]) for i in control.ids}
    assert {"<|im_end|>", "<|im_start|>", "<|endoftext|>"} <= spelled and "<tool_call>" not in spelled
    assert not control.markers  # <tool_call> is no control token here: it is text anyway


def test_a_tokenizer_without_control_tokens_hides_nothing():
    tok = char_tokenizer(CHARS)
    control = ControlTokens(tok, ToolFormat(GENERIC, False, False))
    assert control.hidden(True, True) == frozenset() and streamed(tok, tok.encode("a<b>"), frozenset())[0] == "a<b>"


def test_skip_special_tokens_is_vllm_s_field_on_both_routes_true_by_default():
    for route, body in ((CHAT, {"messages": []}), (COMPLETIONS, {"prompt": "a"})):
        assert parse_options(body, route, SamplingParams())[0].skip_special_tokens is True
        assert parse_options(dict(body, skip_special_tokens=False), route, SamplingParams())[0].skip_special_tokens \
            is False
        with pytest.raises(ApiError, match="'skip_special_tokens': expected true or false, got 0"):
            parse_options(dict(body, skip_special_tokens=0), route, SamplingParams())


def test_alternatives_a_grammar_masks_are_left_out_not_listed_at_minus_9999(smol):
    tok, _ = smol
    texts = TokenTexts(tok)
    a, b = tok.encode("{")[0], tok.encode(" {")[0]
    forced = TokenLogprob(0, Logprobs(a, 0.0, [(a, 0.0), (b, -math.inf), (7, -math.inf)]))  # the one allowed
    two = TokenLogprob(1, Logprobs(b, -0.1, [(b, -0.1), (a, -2.4), (9, -math.inf)]))  # two allowed of three asked
    chat = chat_logprobs([forced, two], texts)["content"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in chat] == [["{"], [" {", "{"]]
    assert chat[0]["top_logprobs"][0]["logprob"] == 0.0 and chat[1]["top_logprobs"][1]["logprob"] == -2.4
    legacy = completion_logprobs([forced, two], texts)
    assert legacy["top_logprobs"] == [{"{": 0.0}, {" {": -0.1, "{": -2.4}]
    assert legacy["token_logprobs"] == [0.0, -0.1]
