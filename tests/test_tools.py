"""Function calling without a ring: the tools fields' checks, the family each template's
models write calls in, the rendering (the model's own template, or the generic fallback),
parsing calls whole and streamed for each family, and the calls' grammar, compiled and run
by llguidance on SmolLM2's vocabulary. The served side is tests/test_serve_tools.py."""
import json
import os
import subprocess

import pytest

from conftest import BIN
from mdi.model.tokenizers import load_tokenizer
from mdi.runconfig import ConfigError
from mdi.serving.openai_bodies import Reply
from mdi.serving.prompts import ChatTemplate, chat_messages
from mdi.serving.request import Request
from mdi.serving.tool_calls import CallParser, ToolReplies
from mdi.serving.tool_grammar import tool_grammar
from mdi.serving.tools import GENERIC, HERMES, LLAMA3, ToolChoice, ToolFormat, check_tools
from mdi.serving.validation import CHAT, ApiError, parse_options
from mdi.model.sampling import SamplingParams

TEMPLATES = os.path.join(os.path.dirname(__file__), "chat_templates")  # the models' own (public) templates
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = check_tools([WEATHER, ADD], {})
NAMES = ["get_weather", "add"]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]


def template(name, model_dir):
    """SmolLM2's tokenizer (models/smollm2-135m, conftest's smollm2_dir) with `name`'s chat template."""
    tok = load_tokenizer(model_dir)
    if name != "smollm2":
        with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
            tok.chat_template = f.read()
    return ChatTemplate(tok)


def parse(family, text, parallel=True, stream=False, stream_reply=False):
    parser = CallParser(family, NAMES, parallel, stream_reply=stream_reply)
    shown, calls = [], []
    for piece in (list(text) if stream else [text]):
        s, c = parser.feed(piece)
        shown.append(s)
        calls += c
    s, c = parser.finish()
    return "".join(shown + [s]), [(k.name, json.loads(k.arguments)) for k in calls + c]


@pytest.mark.parametrize("name, family, native", [("smollm2", GENERIC, False), ("qwen2.5", HERMES, True),
                                                  ("qwen3", HERMES, True), ("llama3.2", LLAMA3, True)])
def test_each_template_renders_tools_calls_and_results(name, family, native, smollm2_dir):
    tmpl = template(name, smollm2_dir)
    assert (tmpl.tool_format.family, tmpl.tool_format.native) == (family, native)
    prompt = tmpl.render(chat_messages(CONVERSATION), TOOLS)
    assert '"name": "get_weather"' in prompt and "The weather in a city" in prompt  # the tool list
    assert "18 C and sunny" in prompt and "Weather in Paris?" in prompt
    if family == HERMES:  # the template's own words, and the earlier call as the model writes it
        assert "<tools>" in prompt and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ' \
            '"unit": "c"}}\n</tool_call>' in prompt and "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
    elif family == LLAMA3:
        assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}' in prompt
        assert "<|start_header_id|>ipython<|end_header_id|>" in prompt
    else:  # the generic fallback: a system message with the tools and the JSON reply format
        assert prompt.startswith("<|im_start|>system\nYou can call the following tools:") and '"response"' in prompt
        assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]}' in prompt
        assert '{"tool_response": {"tool_call_id": "call_1", "content": "18 C and sunny"}}' in prompt
    # without tools the prompt is as before
    plain = [{"role": "user", "content": "Hi"}]
    assert tmpl.render(chat_messages(plain), None) == tmpl.render(chat_messages(plain))


# Gemma 3's format, which insists on user and assistant taking turns (shipped for GGUFs without a template)
GEMMA3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "chat_templates",
                      "gemma3.jinja")


def test_parallel_calls_results_and_the_next_words_render_in_one_user_turn(smollm2_dir):
    """Each result as a user message of its own made two user turns in a row, which a template
    that insists on turns refused (h37: Gemma 3 answered mdi's own parallel calls with a 400)."""
    tmpl = ChatTemplate.of_config(load_tokenizer(smollm2_dir), GEMMA3)
    calls = [{"id": "call_%d" % i, "type": "function", "function": {"name": "get_weather", "arguments":
                                                                      '{"city": "%s"}' % city}}
             for i, city in enumerate(("Paris", "Oslo"))]
    talk = [{"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
            {"role": "user", "content": "And tomorrow?"}]
    prompt = tmpl.render(chat_messages(talk), [WEATHER])
    turn = prompt.split("<start_of_turn>user\n")[-1]
    assert '"call_0", "content": "18 C"' in turn and '"call_1", "content": "4 C"' in turn and "And tomorrow?" in turn
    assert prompt.count("<start_of_turn>user") == 2 and prompt.endswith("<start_of_turn>model\n")


HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
PARIS, ONE_TWO = ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})


@pytest.mark.parametrize("family, text, content, calls", [
    (HERMES, HERMES_TWO, "Let me look.", [PARIS, ONE_TWO]),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>', "", [ONE_TWO]),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ONE_TWO]),  # stopped before </tool_call>
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> Paris", "unit": "c"}}\n'
             '</tool_call>', "", [("get_weather", {"city": "</tool_call> Paris", "unit": "c"})]),  # the tag in a string
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "}}</tool_call> John is 30', "", []),  # cut
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call> ok',  # malformed: content
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call> ok', []),
    (HERMES, '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',  # not a tool of the request
     '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', []),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ONE_TWO]),
    (LLAMA3, 'Sure: {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
             '{"name": "add", "parameters": {"a": 1, "b": 2}}', "Sure:", [PARIS, ONE_TWO]),
    (LLAMA3, 'A set {"a": 1} and {"name": "Bob", "age": 3', 'A set {"a": 1} and {"name": "Bob", "age": 3', []),
    (GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
              '{"name": "add", "arguments": {"a": 1, "b": 2}}]}', "", [PARIS, ONE_TWO]),
    (GENERIC, 'Calling.\n{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}', "Calling.", [ONE_TWO]),
    (GENERIC, '{"response": "It is sunny."}', "It is sunny.", []),
    (GENERIC, 'Plain text {not json', "Plain text {not json", []),
])
def test_calls_parse_whole_and_streamed_alike(family, text, content, calls):
    assert parse(family, text) == (content, calls)
    assert parse(family, text, stream=True) == (content, calls)  # one character at a time


def test_parallel_false_keeps_the_first_call():
    assert parse(HERMES, HERMES_TWO, parallel=False) == ("Let me look.", [PARIS])


def test_reply_bodies_stream_delta_tool_calls_that_reassemble_to_the_whole_answer():
    fmt = ToolFormat(HERMES, True, False)
    req = Request([1, 2], 10, SamplingParams())
    whole = Reply([req], "m", True, None, ToolReplies(ToolChoice(TOOLS, "auto", None, True), fmt)).whole(
        [HERMES_TWO], ["stop"], [[]])
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice["message"]["tool_calls"])
    reply = Reply([req], "m", True, None, ToolReplies(ToolChoice(TOOLS, "auto", None, True), fmt))
    bodies = [b for i in range(0, len(HERMES_TWO), 7) for b in reply.chunks(HERMES_TWO[i:i + 7], 0, [])]
    bodies += reply.last_chunks("stop")
    calls, content = {}, ""
    for body in bodies:
        delta = body["choices"][0]["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", []):
            if "id" in part:  # the first delta of a call: id, type and name; arguments follow
                assert part["type"] == "function" and part["function"]["arguments"] == ""
                calls[part["index"]] = {"name": part["function"]["name"], "arguments": ""}
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    assert content == "Let me look." and bodies[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                                 for c in choice["message"]["tool_calls"]]


def _nested_object(depth):
    """An object schema whose one property is the next, `depth` deep."""
    schema = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "x"}, "extra": 1}]}, "tools[0]"),
    ({"tools": [{"type": "code", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested_object(400)}}]},
     "tools[0].function.parameters"),  # (jsonschema's RecursionError was a 500)
    ({"tools": [ADD] * 129}, "tools"),
    ({"tools": "add"}, "tools"),
    ({"tools": [ADD], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": [ADD]}}},
     "tool_choice.allowed_tools.mode"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.allowed_tools.tools"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}}, "tool_choice.allowed_tools.tools[0]"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["add"]}}},
     "tool_choice.allowed_tools.tools[0]"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [ADD]}}, "tool_choice"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        parse_options(dict({"messages": [{"role": "user", "content": "a"}]}, **fields), CHAT, SamplingParams())
    assert e.value.param == param and e.value.status == 400 and "'%s'" % param in e.value.message


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c", "content": None}, "messages[0].content"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
     "messages[0].tool_calls[0]"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
])
def test_bad_tool_messages_are_a_400_naming_the_field(message, param):
    with pytest.raises(ApiError) as e:
        chat_messages([message])
    assert e.value.param == param and e.value.status == 400


@pytest.mark.parametrize("talk, param", [
    ([CONVERSATION[0], {"role": "tool", "tool_call_id": "zzz", "content": "22 C"}], "messages[1]"),
    (CONVERSATION[:2] + [dict(CONVERSATION[2], tool_call_id="call_2")], "messages[2].tool_call_id"),
    (CONVERSATION[:2] + [{"role": "user", "content": "and?"}, CONVERSATION[2]], "messages[3]"),
    ([{"role": "user", "content": "hi", "name": 5}], "messages[0].name"),
    ([{"role": "user", "content": "hi", "name": "x" * 65}], "messages[0].name"),
])
def test_a_tool_result_that_answers_no_call_and_a_bad_name_are_a_400(talk, param):
    """As OpenAI answers them: a tool message answers a call of the assistant message before it
    (an agent that lost its ids hears so, not a reply to a history the model cannot follow), and
    a participant's name is a short string."""
    with pytest.raises(ApiError) as e:
        chat_messages(talk)
    assert e.value.param == param and e.value.status == 400 and "'%s'" % param in e.value.message


def test_tool_results_after_calls_without_ids_and_named_participants_pass():
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # no id: any answers
    talk = [{"role": "user", "content": "1 + 2?", "name": "alice"}, {"role": "assistant", "content": None,
            "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_9", "content": "3", "name": "add"}]
    out = chat_messages(talk)
    assert out[0] == {"role": "user", "content": "1 + 2?", "name": "alice"} and out[2]["name"] == "add"
    assert chat_messages(CONVERSATION)[2]["tool_call_id"] == "call_1"


def test_an_answer_sent_back_as_the_openai_sdk_dumps_it_continues_the_conversation():
    """The agent loop's `messages.append(resp.choices[0].message.model_dump())`: the SDK's
    message carries refusal, annotations and audio (null here); they render nothing."""
    chat = pytest.importorskip("openai.types.chat")
    call = CONVERSATION[1]["tool_calls"][0]
    answer = chat.ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]).model_dump()
    assert {"refusal", "annotations", "audio"} <= set(answer)  # the SDK's shape
    assert chat_messages([CONVERSATION[0], answer, CONVERSATION[2]]) == chat_messages(CONVERSATION)
    text = chat.ChatCompletionMessage(role="assistant", content="Hello").model_dump()
    assert chat_messages([text])[0] == {"role": "assistant", "content": "Hello"}
    # an earlier answer's citations and audio reply (by id, as OpenAI returns it) are ignored
    cited = dict(text, annotations=[{"type": "url_citation", "url_citation": {"url": "https://example.com"}}],
                 audio={"id": "audio_abc", "data": "", "expires_at": 0, "transcript": "Hello"})
    assert chat_messages([cited])[0] == {"role": "assistant", "content": "Hello"}


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": "x", "annotations": "cite"}, "messages[0].annotations"),
    ({"role": "assistant", "content": "x", "annotations": ["cite"]}, "messages[0].annotations"),
    ({"role": "assistant", "content": "x", "audio": {"voice": "alloy"}}, "messages[0].audio"),
    ({"role": "user", "content": "x", "audio": {"id": "audio_abc"}}, "messages[0].audio"),
    ({"role": "user", "content": "x", "annotations": []}, "messages[0].annotations"),
    ({"role": "user", "content": "x", "refusal": "no"}, "messages[0].refusal"),
])
def test_an_answer_s_keys_are_checked_by_openai_s_shape(message, param):
    with pytest.raises(ApiError) as e:
        chat_messages([message])
    assert e.value.param == param and e.value.status == 400 and "'%s'" % param in e.value.message


def test_content_parts_are_text_and_an_assistant_s_refusal():
    said = [{"role": "user", "content": [{"type": "text", "text": "Do "}, {"type": "text", "text": "it"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}]
    assert chat_messages(said) == [{"role": "user", "content": "Do \nit"},  # one line apart, as llama.cpp and vLLM
                                   {"role": "assistant", "content": "I cannot."}]
    for bad in ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},  # only an answer refuses
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}):
        with pytest.raises(ApiError) as e:
            chat_messages([bad])
        assert e.value.param == "messages[0].content" and e.value.status == 400


def test_an_answer_s_audio_is_named_as_ignored():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "audio": None},
                {"role": "user", "content": "Bye"}]
    opts, _ = parse_options({"messages": messages}, CHAT, SamplingParams())
    assert list(opts.ignored) == []
    messages[1]["audio"] = {"id": "audio_abc"}
    opts, _ = parse_options({"messages": messages, "user": "u1"}, CHAT, SamplingParams())
    assert list(opts.ignored) == ["messages[].audio", "user"]


def llg_tokenizer(model_dir):
    llguidance = pytest.importorskip("llguidance")
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        return llguidance, llguidance.LLTokenizer(f.read())


@pytest.mark.parametrize("family", [HERMES, LLAMA3, GENERIC])
def test_required_and_named_grammars_take_calls_in_the_family_format_and_nothing_else(family, smollm2_dir):
    llguidance, tok = llg_tokenizer(smollm2_dir)
    call = {HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
            LLAMA3: '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
            GENERIC: '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]}'}[family]
    bad_args = call.replace('"c"', '"k"')  # outside the enum
    for mode, name in (("required", None), ("named", "get_weather")):
        spec = tool_grammar(ToolChoice(TOOLS, mode, name, False), ToolFormat(family, False, False))
        assert (spec.kind, spec.field) == ("lark", "tools")

        def takes(text):
            matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(spec.text))
            assert not matcher.is_error(), matcher.get_error()
            ids = tok.tokenize_str(text)
            return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
        assert takes(call) and parse(family, call)[1] == [PARIS]
        assert not takes(bad_args) and not takes("Hello, I cannot call.") and not takes(call + call)
    named_add = tool_grammar(ToolChoice(TOOLS, "named", "add", True), ToolFormat(family, False, False))
    assert '"get_weather"' not in named_add.text
    for mode in ("auto", "required"):  # allowed_tools: every tool in the prompt, some in the answer
        allowed = tool_grammar(ToolChoice(TOOLS, mode, None, True, allowed=("add",)), ToolFormat(family, False, False))
        assert '"get_weather"' not in allowed.text and '"add"' in allowed.text


def test_allowed_tools_is_read_as_openai_sends_it():
    """OpenAI's tool_choice {"type": "allowed_tools", ...} was refused as not a function."""
    from mdi.serving.tools import tool_choice_of
    ask = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [ADD]}}  # (a whole tool, too)
    opts, fields = parse_options({"messages": [{"role": "user", "content": "a"}], "tools": [WEATHER, ADD],
                                  "tool_choice": ask, "stop": ["x"]}, CHAT, SamplingParams())
    choice = tool_choice_of(fields, ToolFormat(HERMES, True, False))
    assert (choice.mode, [f["name"] for f in choice.functions], len(choice.tools)) == ("required", ["add"], 2)
    assert opts.stop == ()  # the answer is calls only: no stop string may cut one


AUTO_CALLS = {  # a call to the non-strict `add`, valid and with arguments outside its schema
    HERMES: ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', '"a": "one"'),
    LLAMA3: ('{"name": "add", "parameters": {"a": 1, "b": 2}}', '"a": "one"'),
    GENERIC: ('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}', '"a": "one"'),
}
AUTO_TEXT = {HERMES: "I can answer that without tools.", LLAMA3: "I can answer that without tools.",
             GENERIC: '{"response": "I can answer that without tools."}'}


def matcher_for(llguidance, tok, spec):
    def takes(text, whole=True):
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(spec.text))
        assert not matcher.is_error(), matcher.get_error()
        ids = tok.tokenize_str(text)
        if not whole:  # a prefix the grammar may still complete
            return matcher.validate_tokens(ids) == len(ids)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
    return takes


@pytest.mark.parametrize("family", [HERMES, LLAMA3, GENERIC])
@pytest.mark.parametrize("tools", [[ADD], [WEATHER, ADD]], ids=["non-strict", "mixed"])
def test_auto_answers_are_a_valid_call_or_text_never_a_half_call(family, tools, smollm2_dir):
    """tool_choice auto constrains whatever `strict` says (llama.cpp's rule): a call whose
    arguments obey the (non-strict) function's parameters, or text that holds no call."""
    llguidance, tok = llg_tokenizer(smollm2_dir)
    spec = tool_grammar(ToolChoice(check_tools(tools, {}), "auto", None, False), ToolFormat(family, False, False))
    takes = matcher_for(llguidance, tok, spec)
    call, bad = AUTO_CALLS[family]
    assert takes(call) and parse(family, call)[1] == [("add", {"a": 1, "b": 2})]
    assert takes(AUTO_TEXT[family]) and parse(family, AUTO_TEXT[family]) == ("I can answer that without tools.", [])
    assert not takes(call.replace('"a": 1', bad), whole=False)  # arguments outside the schema
    assert not takes(call.replace('"name": "add"', '"name": "sub"'), whole=False)  # no such function
    half = call[:len(call) // 2]
    assert not takes(half)  # a call cut halfway is no answer
    if family == HERMES:  # text, then a call; nothing that reads as a call after it
        assert takes("Let me add them.\n" + call) and not takes(call + "\n<tool_call>\n{")
    elif family == LLAMA3:  # text may not hold a call, nor open like one
        assert not takes('Sure: {"name": "add", "parameters": {"a": "x"}}') and not takes("{}")
    else:  # the reply is JSON: prose outside it is refused
        assert not takes("Hello", whole=False)


@pytest.mark.parametrize("family", [HERMES, LLAMA3, GENERIC])
def test_auto_text_follows_response_format_and_a_client_grammar_leaves_the_answer_to_it(family, smollm2_dir):
    from mdi.model.constraints.grammar_spec import GrammarSpec
    llguidance, tok = llg_tokenizer(smollm2_dir)
    fmt, choice = ToolFormat(family, False, False), ToolChoice(check_tools([ADD], {}), "auto", None, True)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    spec = tool_grammar(choice, fmt, GrammarSpec("json_schema", json.dumps(schema), "response_format"))
    takes = matcher_for(llguidance, tok, spec)
    reply = '{"answer": 3}' if family != GENERIC else '{"response": {"answer": 3}}'
    assert takes(AUTO_CALLS[family][0]) and takes(reply) and not takes(AUTO_TEXT[family], whole=False)
    assert not takes(reply.replace("3", '"3"'), whole=False)
    content, calls = parse(family, reply)
    assert json.loads(content) == {"answer": 3} and calls == []
    assert tool_grammar(choice, fmt, GrammarSpec("regex", "[a-z]+", "regex")) is None  # the client's own


def test_a_schema_llguidance_cannot_compile_is_a_400_naming_tools():
    pytest.importorskip("llguidance")
    bad = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}], {})  # look-behind
    with pytest.raises(ApiError) as e:
        tool_grammar(ToolChoice(bad, "required", None, True), ToolFormat(HERMES, True, False))
    assert e.value.param == "tools"


@pytest.mark.parametrize("family, text", [
    (GENERIC, '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": '
              '{"a": 3, "b": 4}}, {"name": "add", "argu'),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
             '{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n<tool_call>\n{"name": "ad'),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_inside_its_calls_keeps_the_complete_ones(family, text, stream):
    assert parse(family, text, stream=stream) == ("", [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})])


@pytest.mark.parametrize("family, text, content, calls", [
    # cut (max_tokens, a stop string) before its first call completed: nothing of the call shows
    (GENERIC, '{"tool_calls": [{"name": "', "", []),
    (GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa', "", []),
    (GENERIC, '{"tool_call": {"name": "add", "argu', "", []),
    (GENERIC, '{"tool_ca', "", []),
    (GENERIC, '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ONE_TWO]),  # before its "}"
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "ad', "Let me look.", []),
    (HERMES, 'Let me look.\n<tool_c', "Let me look.", []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_ca', "", [ONE_TWO]),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 1', "", []),
    (LLAMA3, 'Sure: {"name": "add", "parameters": {"a": 1', "Sure:", []),
    (LLAMA3, 'Sure: {"name": "ad', "Sure:", []),
    # a generic text reply cut: its text so far, unwrapped (a cut escape left out)
    (GENERIC, '{"response": "2 + 2 =', "2 + 2 =", []),
    (GENERIC, '{"response": "caf\\u00e9 au lait\\nou th\\u00', "caf\u00e9 au lait\nou th", []),
    (GENERIC, '{"response": {"city": "Pa', '{"city": "Pa', []),  # response_format's JSON, as written so far
    # not a cut call: malformed JSON, or JSON naming no tool, stays content
    (GENERIC, '{"tool_calls": [{"name": "add",}', '{"tool_calls": [{"name": "add",}', []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}',
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,}', []),
    (LLAMA3, 'Sure: {"name": "Bob", "age": 3', 'Sure: {"name": "Bob", "age": 3', []),
    (GENERIC, 'Use a dict: {', "Use a dict: {", []),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_before_a_call_completed_shows_no_half_call(family, text, content, calls, stream):
    assert parse(family, text, stream=stream) == (content, calls)


@pytest.mark.parametrize("family, text", [
    (HERMES, HERMES_TWO),
    (GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"ris\\u00e9", "unit": "c"}}, '
              '{"name": "add", "arguments": {"a": 1, "b": 2}}]}'),
    (GENERIC, '{"response": "It is \\"sunny\\" \\ud83d\\ude00 today."}'),
    (LLAMA3, 'Sure: {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
             '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
])
def test_every_cut_of_an_answer_parses_whole_and_streamed_alike_and_shows_no_call(family, text):
    for k in range(len(text) + 1):
        whole = parse(family, text[:k])
        assert whole == parse(family, text[:k], stream=True), text[:k]
        assert whole == parse(family, text[:k], stream=True, stream_reply=True), text[:k]
        assert not any(mark in whole[0] for mark in ('"name"', "tool_call", "<|", '"response"', "\\")), text[:k]


@pytest.mark.parametrize("text", ['{"response": "It is \\"sunny\\" \\ud83d\\ude00 today,\\n  caf\\u00e9 open. "}',
                                  '{ "response" :"  Two words "}', '{"response": ""}'])
def test_a_constrained_generic_reply_streams_its_text_as_it_is_written(text):
    """Under the tool grammar a generic {"response": "..."} reply is text as it comes (the
    grammar closes the reply after its string), not one chunk at its end; the pieces make the
    whole answer's text, and no piece holds a cut escape or half a surrogate pair."""
    parser = CallParser(GENERIC, NAMES, True, stream_reply=True)
    pieces = [parser.feed(c)[0] for c in text] + [parser.finish()[0]]
    assert "".join(pieces) == parse(GENERIC, text)[0]
    words = parse(GENERIC, text)[0]
    if len(words) > 4:  # its text came before the reply closed
        assert sum(1 for p in pieces[:text.rindex('"')] if p) >= 2, pieces  # in pieces, before it closed
        assert all("\\" not in p and not any("\ud800" <= ch <= "\udfff" for ch in p) for p in pieces), pieces
    unconstrained = CallParser(GENERIC, NAMES, True)  # a reply that may still become other JSON: held whole
    assert not "".join(unconstrained.feed(c)[0] for c in text[:-2])


def test_a_served_reply_under_the_tool_grammar_streams_content_deltas_as_tokens_come():
    text = '{"response": "Paris is the capital of France."}'
    req = Request([1, 2], 10, SamplingParams())
    choice, fmt = ToolChoice(TOOLS, "auto", None, False), ToolFormat(GENERIC, False, False)
    for constrained in (True, False):
        reply = Reply([req], "m", True, None, ToolReplies(choice, fmt, constrained=constrained))
        bodies = [b for i in range(0, len(text), 4) for b in reply.chunks(text[i:i + 4], 0, [])]
        bodies += reply.last_chunks("stop")
        contents = [b["choices"][0]["delta"].get("content") for b in bodies]
        assert "".join(c or "" for c in contents) == "Paris is the capital of France."
        assert (sum(1 for c in contents if c) > 3) == constrained, contents  # else one chunk at the end


@pytest.mark.parametrize("text", ['{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa',
                                  '{"response": "2 + 2 ='])
def test_a_cut_call_leaves_a_reply_without_calls_or_wrapper_whole_and_streamed(text):
    fmt = ToolFormat(GENERIC, False, False)
    req = Request([1, 2], 10, SamplingParams())
    choice = ToolChoice(TOOLS, "auto", None, False)
    whole = Reply([req], "m", True, None, ToolReplies(choice, fmt)).whole([text], ["length"], [[]])["choices"][0]
    content = "2 + 2 =" if "response" in text else None  # null: all it said was the cut call
    assert whole["message"] == {"role": "assistant", "content": content} and whole["finish_reason"] == "length"
    reply = Reply([req], "m", True, None, ToolReplies(choice, fmt))
    bodies = [b for i in range(0, len(text), 3) for b in reply.chunks(text[i:i + 3], 0, [])]
    bodies += reply.last_chunks("length")
    deltas = [b["choices"][0]["delta"] for b in bodies]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    assert not any("tool_calls" in d for d in deltas) and bodies[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fields, stops", [
    ({"tools": [ADD], "tool_choice": "required"}, []),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}}, []),
    ({"functions": [ADD["function"]], "function_call": {"name": "add"}}, []),
    ({"tools": [ADD]}, ["Paris"]),  # auto: the answer may be text, which the stop string ends
    ({"tools": [ADD], "tool_choice": "none"}, ["Paris"]),
    ({"functions": [ADD["function"]]}, ["Paris"]),
])
def test_stop_strings_end_text_and_do_not_apply_to_an_answer_that_must_be_calls(fields, stops):
    body = dict({"messages": [{"role": "user", "content": "Weather in Paris?"}], "stop": ["Paris"]}, **fields)
    opts, _ = parse_options(body, CHAT, SamplingParams())
    assert list(opts.stop) == stops


def test_parallel_calls_default_to_what_the_template_supports(smollm2_dir):
    from mdi.serving.tools import tool_choice_of
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": None, "functions": []}
    assert [tool_choice_of(fields, template(name, smollm2_dir).tool_format).parallel
            for name in ("smollm2", "qwen2.5", "llama3.2")] == [False, True, False]
    assert tool_choice_of(dict(fields, parallel_tool_calls=True), ToolFormat(GENERIC, False, False)).parallel
    named = dict(fields, tool_choice={"type": "function", "function": {"name": "add"}})
    qwen = template("qwen2.5", smollm2_dir).tool_format
    assert not tool_choice_of(named, qwen).parallel  # one call of the function named, as OpenAI answers...
    assert tool_choice_of(dict(named, parallel_tool_calls=True), qwen).parallel  # ... unless asked for several


def test_legacy_functions_map_onto_tools_and_their_messages_onto_tool_messages():
    _, fields = parse_options({"messages": [{"role": "user", "content": "a"}], "functions": [ADD["function"]],
                               "function_call": {"name": "add"}}, CHAT, SamplingParams())
    from mdi.serving.tools import tool_choice_of
    choice = tool_choice_of(fields, ToolFormat(HERMES, True, False))
    assert (choice.mode, choice.name, choice.parallel, choice.legacy) == ("named", "add", False, True)
    messages = chat_messages([{"role": "assistant", "content": None,
                               "function_call": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
                              {"role": "function", "name": "add", "content": "3"}])
    assert messages == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "add", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "add", "content": "3"}]


@pytest.mark.parametrize("family", [HERMES, LLAMA3, GENERIC])
def test_a_tool_s_references_resolve_inside_its_call(family, smollm2_dir):
    """A function's parameters refer to their own root ("#/$defs/..." as Pydantic writes a
    nested model, "#"): inside a call they resolve to the parameters' definitions and root (they
    were refused: the pointers did not exist in the call's JSON)."""
    llguidance, tok = llg_tokenizer(smollm2_dir)
    params = {"$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
              "type": "object", "required": ["lead", "next"],
              "properties": {"lead": {"$ref": "#/$defs/person"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    tools = check_tools([{"type": "function", "function": {"name": "team", "parameters": params}}], {})
    spec = tool_grammar(ToolChoice(tools, "required", None, False), ToolFormat(family, False, False))
    args = '{"lead": {"name": "Ann"}, "next": {"lead": {"name": "Bo"}, "next": null}}'
    call = {HERMES: '<tool_call>\n{"name": "team", "arguments": %s}\n</tool_call>',
            LLAMA3: '{"name": "team", "parameters": %s}',
            GENERIC: '{"tool_calls": [{"name": "team", "arguments": %s}]}'}[family]
    for text, ok in ((call % args, True), (call % args.replace('"Bo"', '7'), False)):
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(spec.text))
        assert not matcher.is_error(), matcher.get_error()
        ids = tok.tokenize_str(text)
        assert (matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
                and matcher.is_accepting()) is ok, text


def test_chat_template_kwargs_and_an_answer_s_reasoning_reach_the_template(smollm2_dir):
    """vLLM's chat_template_kwargs are more names for the template (Qwen3's enable_thinking
    writes an empty thinking block); an assistant message's reasoning_content (or vLLM's newer
    `reasoning`) reaches it as reasoning_content, which Qwen3's template shows in the turns
    after the last user message; both are refused by name where they cannot mean anything."""
    qwen3 = template("qwen3", smollm2_dir)
    hi = chat_messages([{"role": "user", "content": "hi"}])
    assert qwen3.render(hi).endswith("<|im_start|>assistant\n")
    assert qwen3.render(hi, None, {"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for key in ("reasoning_content", "reasoning"):
        answered = chat_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", key: "R"}])
        assert "<think>\nR\n</think>\n\nA<|im_end|>" in qwen3.render(answered)
    with pytest.raises(ApiError, match=r"messages\[0\]\.reasoning_content': expected a string in an assistant"):
        chat_messages([{"role": "user", "content": "q", "reasoning_content": "R"}])
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"not a name": 1}):
        with pytest.raises(ApiError, match="chat_template_kwargs") as e:
            parse_options({"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": kwargs}, CHAT,
                          SamplingParams())
        assert e.value.param == "chat_template_kwargs"


def test_a_template_that_fails_on_a_request_s_values_is_that_request_s_400(smollm2_dir, tmp_path):
    """A template doing 'Today: ' + date_string with a number raised TypeError, and a request
    replacing Jinja's own `namespace` broke the template: both were 500s (only TemplateError
    was caught)."""
    path = tmp_path / "dated.jinja"
    path.write_text("{% set ns = namespace(n=0) %}Today: {{ 'x' + date_string }}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    dated = ChatTemplate.of_config(load_tokenizer(smollm2_dir), str(path))
    hi = chat_messages([{"role": "user", "content": "hi"}])
    assert dated.render(hi, None, {"date_string": "1 May"}).startswith("Today: x1 May")
    for kwargs, field, needle in (({"date_string": 5}, "messages", "TypeError"),
                                  ({"date_string": "1 May", "namespace": 1}, "chat_template_kwargs", "namespace"),
                                  ({"date_string": "1 May", "strftime_now": "x"}, "chat_template_kwargs", "strftime_now")):
        with pytest.raises(ApiError) as e:
            dated.render(hi, None, kwargs)
        assert e.value.status == 400 and e.value.param == field and needle in e.value.message, e.value.message


def test_a_chat_template_file_replaces_the_model_s_and_a_bad_one_is_one_line(smollm2_dir, tmp_path):
    tok = load_tokenizer(smollm2_dir)
    gemma = ChatTemplate.of_config(tok, GEMMA3)
    assert gemma.source == "config" and gemma.tool_format.native is False
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    bos = "" if tok.add_bos else gemma.bos  # (the template writes BOS where the tokenizer does not add it)
    assert gemma.render(chat_messages(talk)) == bos + (  # the system message heads the first user turn
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert ChatTemplate.of_config(tok, None).source == "model"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for path, says in ((str(tmp_path / "missing.jinja"), "cannot read"), (str(broken), "not a Jinja chat template")):
        with pytest.raises(ConfigError) as e:
            ChatTemplate.of_config(tok, path)
        assert path in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_the_cli_takes_a_chat_template_with_serve_only(smollm2_dir, tmp_path):
    start = os.path.join(BIN, "mdi-start")
    missing = str(tmp_path / "missing.jinja")
    for extra, says in ((["--prompt", "x"], "--chat-template goes with --serve"),
                        (["--serve", "--port", "1"], "serve.chat_template: cannot read %s" % missing)):
        proc = subprocess.run([start, "--model", smollm2_dir, "--chat-template", missing] + extra, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr


def test_parameters_that_say_nothing_of_keys_take_none_and_others_stay_as_given():
    """{} and {"type": "object"} (MCP tools without input) had been left open, and the model
    filled them; a schema that constrains its keys any other way (const, enum, $dynamicRef...)
    keeps them: closing it to {} would break the client's own schema."""
    def params(schema, strict=False):
        fn = {"name": "f", "strict": strict}
        if schema is not None:
            fn["parameters"] = schema
        return check_tools([{"type": "function", "function": fn}], {})[0]["function"]["parameters"]
    for schema in (None, {}, {"type": "object"}, {"type": "object", "description": "no input"}):
        for strict in (False, True):
            assert params(schema, strict)["properties"] == {}, (schema, strict)
    for kept in ({"type": "object", "const": {"a": 1}}, {"type": "object", "enum": [{"a": 1}]},
                 {"type": "object", "maxProperties": 1}, {"type": "object", "dependentRequired": {"a": ["b"]}}):
        assert params(kept) == kept, kept
