"""Function calling over a real 3-node loopback `--serve` with the official `openai` client:
test_serve's tiny model for the fields' checks, conversations that carry calls and results,
and streamed answers equal to whole ones; SmolLM2 for calls the constrained sampler forces
(tool_choice "required" or a named function) or allows beside text ("auto")."""
import json

import pytest
import requests

from conftest import ServeProcess, worker_pool
from ringconfigs import write_run_config
from test_serve import model, server, sse_events  # noqa: F401 (fixtures)
from test_tools import ADD, CONVERSATION, WEATHER

CHAT = "/v1/chat/completions"


def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_conversation_with_calls_and_results_continues(server):
    r = client(server).chat.completions.create(model="tiny", messages=CONVERSATION, tools=[WEATHER, ADD],
                                               max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    # calls, text, or nothing where max_tokens cut the first call (never the reply's JSON, half written)
    assert choice.message.content or choice.message.tool_calls or choice.finish_reason == "length"
    assert not (choice.message.content or "").lstrip().startswith('{"tool_call'), choice.message
    # tool_choice "none": the tools are not offered and the answer is text
    r = client(server).chat.completions.create(model="tiny", messages=CONVERSATION, tools=[WEATHER, ADD],
                                               tool_choice="none", max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_streamed_answers_with_tools_equal_whole_ones(server):
    body = {"messages": [{"role": "user", "content": "Add 1 and 2"}], "tools": [WEATHER, ADD], "max_tokens": 40,
            "temperature": 0}
    whole = requests.post(server.url + CHAT, json=body, timeout=120).json()["choices"][0]
    with requests.post(server.url + CHAT, json=dict(body, stream=True), stream=True, timeout=120) as r:
        chunks = [json.loads(d) for d in sse_events(r) if d != "[DONE]"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert (content or None) == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 1}}}]},
     "tools[0].function.parameters"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, "messages[0].tool_calls[0]"),
])
def test_bad_tool_values_are_a_400_naming_the_field_and_leave_others_running(server, fields, param):
    stream = requests.post(server.url + "/v1/completions", json={"prompt": "Long", "max_tokens": 200, "stream": True},
                           stream=True, timeout=120)
    try:
        body = dict({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}, **fields)
        r = requests.post(server.url + CHAT, json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "'%s'" % param in error["message"], error
        events = [json.loads(d) for d in sse_events(stream) if d != "[DONE]"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the stream in flight ran to its end
    finally:
        stream.close()


def test_an_answer_cut_inside_its_call_shows_no_half_call_and_stop_strings_leave_a_required_call(server):
    """tool_choice "required": the tiny model's answer is the generic {"tool_calls": [...]}
    reply, cut by max_tokens long before its call completes. It came back as that JSON in
    `content`; now nothing of it shows, whole or streamed. A stop string that the call's JSON
    holds ("name") does not end it: a required answer is all calls, no text to stop."""
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, ADD], "tool_choice": "required",
            "max_tokens": 12, "temperature": 0}
    r = requests.post(server.url + CHAT, json=body, timeout=120).json()
    choice = r["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None} and choice["finish_reason"] == "length", r
    with requests.post(server.url + CHAT, json=dict(body, stream=True), stream=True, timeout=120) as s:
        chunks = [json.loads(d) for d in sse_events(s) if d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") or d.get("tool_calls") for d in deltas), deltas
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = requests.post(server.url + CHAT, json=dict(body, max_tokens=40, stop=["name"]), timeout=120).json()
    choice = r["choices"][0]  # stopped, it would end after '{"tool_calls": [{"name' (22 characters)
    assert choice["finish_reason"] == "tool_calls" or (choice["finish_reason"], r["usage"]["completion_tokens"]) == (
        "length", 40), r


def test_an_answer_sent_back_as_the_sdk_dumps_it_continues_the_conversation(server):
    """The agent loop: `messages.append(resp.choices[0].message.model_dump())` (refusal,
    annotations and audio included, null) was a 400 "unknown key 'annotations'"."""
    c = client(server)
    messages = [{"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "Bye"}]
    assert {"annotations", "audio"} <= set(messages[1])
    r = c.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert r.http_response.status_code == 200 and "X-MDI-Ignored-Fields" not in r.headers
    # a call's answer, and an earlier audio reply's id: ignored, and named
    chat = pytest.importorskip("openai.types.chat")
    answer = chat.ChatCompletionMessage(role="assistant", content=None,
                                        tool_calls=CONVERSATION[1]["tool_calls"]).model_dump()
    messages = [CONVERSATION[0], dict(answer, audio={"id": "audio_abc"}), CONVERSATION[2]]
    r = c.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4)
    assert r.http_response.status_code == 200 and r.headers["X-MDI-Ignored-Fields"] == "messages[].audio"


def test_answers_of_the_sdk_helpers_and_answers_without_content_continue_the_conversation(server):
    """What the openai SDK's parse() and stream() helpers return and agents send back (`parsed`,
    a call's `parsed_arguments` and `index`), an answer cut before its first call (content null,
    no calls) and OpenAI's refusal shape: each was a 400."""
    call = dict(CONVERSATION[1]["tool_calls"][0], index=0)
    call["function"] = dict(call["function"], parsed_arguments={"city": "Paris"})
    parsed = dict(CONVERSATION[1], parsed=None, tool_calls=[call])
    for answer in (parsed, {"role": "assistant", "content": '{"a": 1}', "parsed": {"a": 1}},
                   {"role": "assistant", "content": None},
                   {"role": "assistant", "content": None, "refusal": "I cannot help with that."}):
        messages = [CONVERSATION[0], answer] + ([CONVERSATION[2]] if answer.get("tool_calls") else
                                                [{"role": "user", "content": "Go on"}])
        body = {"messages": messages, "tools": [WEATHER], "max_tokens": 4, "temperature": 0}
        r = requests.post(server.url + CHAT, json=body, timeout=120)
        assert r.status_code == 200, (answer, r.text)
    wrong = dict(CONVERSATION[1], tool_calls=[dict(call, index="0")])
    body = {"messages": [CONVERSATION[0], wrong, CONVERSATION[2]], "tools": [WEATHER], "max_tokens": 4}
    assert requests.post(server.url + CHAT, json=body, timeout=120).status_code == 400


# --------------------------------------------------------------------------- SmolLM2, constrained

@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory, smollm2_dir):
    pytest.importorskip("llguidance")  # the constrained sampler (structured outputs)
    # Workers of its own: test_serve's `server`, alive for this whole module, holds the shared ones.
    for workers in worker_pool(2):
        path = write_run_config(tmp_path_factory.mktemp("tools-cfg") / "ring3.yaml", smollm2_dir, workers,
                                worker_name="board%d", runtime={"threads": 1, "ring_timeout": 60},
                                serve={"max_in_flight": 2, "max_len": 1024, "model_name": "smollm2"})
        srv = ServeProcess(path)
        try:
            yield srv.wait_ready()
        finally:
            code = srv.stop()
            assert code == 0, srv.output()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                                        {"type": "function", "function": {"name": "add"}}]}}])
def test_required_and_named_calls_obey_the_schema(smollm2_server, choice):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    c = client(smollm2_server)
    r = c.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, ADD], tool_choice=choice,
                                  max_tokens=80, temperature=0)
    answer = r.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.tool_calls, answer
    call = answer.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):  # the one named, or allowed (a weather question answered with `add`)
        assert call.function.name == ("get_weather" if choice["type"] == "function" else "add")
    # streamed: delta.tool_calls reassemble to the whole answer's calls
    calls = {}
    for chunk in c.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, ADD],
                                           tool_choice=choice, max_tokens=80, temperature=0, stream=True):
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [{"name": k.function.name, "arguments": k.function.arguments}
                                                 for k in answer.message.tool_calls]
    # the follow-up with the call and its result continues with text
    follow = messages + [answer.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    r = c.chat.completions.create(model="smollm2", messages=follow, tools=[WEATHER, ADD], tool_choice="none",
                                  max_tokens=20, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


# --------------------------------------------------------------------------- OpenAI's whole field set

# Every field of OpenAI's chat/completions request that mdi does not act on, at a valid value.
IGNORED_FIELDS = {
    "store": True, "metadata": {"session": "s1", "team": "agents"}, "service_tier": "auto",
    "prediction": {"type": "content", "content": "Hello"}, "prompt_cache_key": "conversation-1",
    "prompt_cache_retention": "in_memory", "safety_identifier": "user-hash", "verbosity": "low",
    "web_search_options": {}, "reasoning_effort": "low", "user": "u1", "moderation": {"model": "m"},
    "prompt_cache_options": {"mode": "implicit"}, "audio": {"voice": "alloy", "format": "wav"},
}


def test_every_openai_chat_field_is_accepted_and_the_ignored_ones_are_named(server):
    r = client(server).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4, temperature=0,
        modalities=["text"], logit_bias={"5": 1}, logprobs=True, top_logprobs=2, n=1, seed=3,
        frequency_penalty=0, presence_penalty=0, top_p=1, stop=["zz"], parallel_tool_calls=False,
        **IGNORED_FIELDS)
    assert r.http_response.status_code == 200
    assert r.headers["X-MDI-Ignored-Fields"].split(", ") == sorted(IGNORED_FIELDS)
    answer = r.parse()
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
    # streamed, with OpenAI's stream_options keys: the same header, the same text
    with client(server).chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
            store=False, metadata={}) as s:
        assert s.headers["X-MDI-Ignored-Fields"] == "metadata, store"
        text = "".join(c.choices[0].delta.content or "" for c in s.parse() if c.choices)
    assert text == answer.choices[0].message.content
    # the legacy completions route: user only; no header where nothing was ignored
    r = client(server).completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=2, user="u1")
    assert r.headers["X-MDI-Ignored-Fields"] == "user"
    r = requests.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
                      timeout=60)
    assert r.status_code == 200 and "X-MDI-Ignored-Fields" not in r.headers


def test_ignored_fields_sent_as_null_are_accepted_and_not_named(server):
    """Null counts as absent: `"user": null` was a 400 "unrecognized request argument"."""
    for route, body in ((CHAT, {"messages": [{"role": "user", "content": "Hi"}]}),
                        ("/v1/completions", {"prompt": "Hi"})):
        names = IGNORED_FIELDS if route == CHAT else {"user": "u1"}
        r = requests.post(server.url + route, json=dict(body, max_tokens=2, **dict((n, None) for n in names)),
                          timeout=60)
        assert r.status_code == 200 and "X-MDI-Ignored-Fields" not in r.headers, r.text


@pytest.mark.parametrize("fields, param", [
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": dict(("k%d" % i, "v") for i in range(17))}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"service_tier": 1}, "service_tier"),
    ({"prediction": {"type": "content"}}, "prediction"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": []}, "web_search_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options"),
    ({"functions": [{"name": "a b"}]}, "functions[0].name"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": [ADD], "functions": [{"name": "f"}]}, "functions"),
    ({"made_up_field": 1}, "made_up_field"),
    # strict tools as OpenAI means it: every object closed, every property required
    ({"tools": [dict(ADD, function=dict(ADD["function"], strict=True))]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}}}]},
     "tools[0].function.parameters"),
])
def test_wrong_values_of_accepted_fields_are_a_400_naming_the_field(server, fields, param):
    body = dict({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}, **fields)
    r = requests.post(server.url + CHAT, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_legacy_functions_are_called_and_answered_in_the_legacy_shape(smollm2_server):
    functions = [WEATHER["function"], ADD["function"]]
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    c = client(smollm2_server)
    r = c.chat.completions.create(model="smollm2", messages=messages, functions=functions,
                                  function_call={"name": "get_weather"}, max_tokens=60, temperature=0)
    answer = r.choices[0]
    assert answer.finish_reason == "function_call" and answer.message.tool_calls is None, answer
    call = answer.message.function_call
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    # streamed: delta.function_call pieces reassemble to it
    name, arguments, reasons = "", "", []
    for chunk in c.chat.completions.create(model="smollm2", messages=messages, functions=functions,
                                           function_call={"name": "get_weather"}, max_tokens=60, temperature=0,
                                           stream=True):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        if delta.function_call:
            name += delta.function_call.name or ""
            arguments += delta.function_call.arguments or ""
    assert (name, arguments, reasons[-1]) == (call.name, call.arguments, "function_call")
    # a follow-up with the legacy call and a `role: "function"` result continues with text
    follow = messages + [{"role": "assistant", "content": None, "function_call": {"name": call.name,
                                                                                  "arguments": call.arguments}},
                         {"role": "function", "name": call.name, "content": '{"temperature": 18}'}]
    r = c.chat.completions.create(model="smollm2", messages=follow, functions=functions, function_call="none",
                                  max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.function_call is None


PING = {"type": "function", "function": {"name": "ping", "description": "Check that the server answers",
                                         "parameters": {"type": "object", "properties": {}}}}


def _no_closing_bracket(model_dir):
    """logit_bias pushing every token holding "]" far down (not banned: where the grammar allows
    nothing else, one is still drawn), so a list of calls goes on as long as it may."""
    from mdi.model.tokenizers import load_tokenizer
    tok = load_tokenizer(model_dir)
    return dict((str(i), -99) for i in range(tok.vocab_size) if "]" in tok.decode([i]))


def test_parallel_calls_default_to_the_template_s_and_a_cut_answer_keeps_its_complete_calls(smollm2_server,
                                                                                            smollm2_dir):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Ping the server."}], "tools": [PING],
            "tool_choice": "required", "temperature": 0, "max_tokens": 60,
            "logit_bias": _no_closing_bracket(smollm2_dir)}
    # SmolLM2's template has no tool format: one call, whatever the model would add
    r = requests.post(smollm2_server.url + CHAT, json=body, timeout=120).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and len(r["message"]["tool_calls"]) == 1, r
    # asked for parallel calls, the list runs to max_tokens: the complete calls come back as calls
    r = requests.post(smollm2_server.url + CHAT, json=dict(body, parallel_tool_calls=True), timeout=120).json()
    choice = r["choices"][0]
    assert r["usage"]["completion_tokens"] == 60 and choice["finish_reason"] == "tool_calls", r
    assert len(choice["message"]["tool_calls"]) >= 2 and choice["message"]["content"] is None, choice
    assert all(c["function"]["name"] == "ping" and isinstance(json.loads(c["function"]["arguments"]), dict)
               for c in choice["message"]["tool_calls"])
    # streamed the same
    calls = []
    with requests.post(smollm2_server.url + CHAT, json=dict(body, parallel_tool_calls=True, stream=True),
                       stream=True, timeout=120) as s:
        for d in sse_events(s):
            if d != "[DONE]":
                calls += [t for t in json.loads(d)["choices"][0]["delta"].get("tool_calls") or [] if "id" in t]
    assert len(calls) == len(choice["message"]["tool_calls"])


def test_auto_answers_with_tools_that_are_not_strict_are_a_valid_call_or_text(smollm2_server):
    """tool_choice auto (the default) with a non-strict tool: the constrained sampler allows a
    call whose arguments obey the parameters, or text; SmolLM2 greedily calls (it answered in
    prose, never calling, while auto answers were parsed only). A text answer would come back
    as content (the generic reply's {"response": ...}), never as a call's unparsed JSON."""
    jsonschema = pytest.importorskip("jsonschema")
    c = client(smollm2_server)
    answers = []
    for prompt in ("What is 17 plus 25?", "Add 1234 and 4321.", "Say hello to me."):
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}], tools=[ADD],
                                      max_tokens=60, temperature=0)
        answer = r.choices[0]
        for call in answer.message.tool_calls or []:
            assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
        if not answer.message.tool_calls:  # text, never a call's JSON that failed to parse
            assert answer.finish_reason == "stop" and answer.message.content
            assert not answer.message.content.lstrip().startswith("{"), answer.message.content
        else:
            assert answer.finish_reason == "tool_calls" and answer.message.content is None
        answers.append((answer.message.content,
                        [(k.function.name, json.loads(k.function.arguments)) for k in answer.message.tool_calls or []]))
    # greedy: the prompts that invite a call get one, its numbers copied from the prompt
    # (seen: add(17, 25), add(123, 4321), and for "Say hello" add(1, 2): valid, if pointless)
    assert answers[0] == (None, [("add", {"a": 17, "b": 25})]) and answers[1][1], answers


# --------------------------------------------------------------------------- LangChain's ChatOpenAI

def chat_model(server, **kwargs):
    """LangChain's ChatOpenAI against the served ring, as its docs set it up for an OpenAI-compatible server."""
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                                       max_retries=0, timeout=120, **kwargs)


def test_langchain_invokes_and_streams(smollm2_server):
    llm = chat_model(smollm2_server, max_tokens=16)
    whole = llm.invoke("Name a color.")
    assert isinstance(whole.content, str) and whole.content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(llm.stream("Name a color."))
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == whole.content


def _city_model():
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and the country it is in."""
        city: str = Field(description="the city's name", max_length=24)
        country: str = Field(description="the country's name", max_length=24)
        population: int = Field(description="how many people live there")
    return City


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output_parses_in_each_method(smollm2_server, method):
    City = _city_model()
    llm = chat_model(smollm2_server, max_tokens=80).with_structured_output(City, method=method, include_raw=True)
    prompt = "Tell me about Paris, France."
    if method == "json_mode":  # JSON mode holds to no schema: the prompt shows it (as LangChain's docs do)
        prompt += ' Answer in JSON like {"city": "Rome", "country": "Italy", "population": 2750000}.'
    out = llm.invoke(prompt)
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], City) and out["parsed"].city, out


@pytest.mark.parametrize("tool_choice", [None, "add"], ids=["auto", "named"])
def test_langchain_bind_tools_without_strict_calls_valid_tools(smollm2_server, tool_choice):
    jsonschema = pytest.importorskip("jsonschema")
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers a and b."""
        return a + b

    llm = chat_model(smollm2_server, max_tokens=60)
    bound = llm.bind_tools([add]) if tool_choice is None else llm.bind_tools([add], tool_choice=tool_choice)
    answer = bound.invoke("What is 17 plus 25?")
    assert answer.tool_calls and answer.response_metadata["finish_reason"] == "tool_calls", answer
    assert not answer.invalid_tool_calls, answer
    schema = add.tool_call_schema.model_json_schema()
    for call in answer.tool_calls:
        assert call["name"] == "add" and call["id"]
        jsonschema.validate(call["args"], schema)
    assert add.invoke(answer.tool_calls[0]["args"]) == sum(answer.tool_calls[0]["args"].values())


def test_langchain_tools_with_nested_models_call_validly(smollm2_server):
    """A Pydantic model holding another one: its JSON schema refers to "#/$defs/...", which must
    resolve inside a call's arguments (they were refused: the pointer did not exist there)."""
    jsonschema = pytest.importorskip("jsonschema")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    class Team(BaseModel):
        """A team and its lead."""
        team: str
        lead: Person

    out = chat_model(smollm2_server, max_tokens=80).with_structured_output(
        Team, method="function_calling", include_raw=True).invoke("The Falcons are led by Ann, who is 34.")
    assert out["parsing_error"] is None and isinstance(out["parsed"].lead, Person), out
    jsonschema.validate(out["raw"].tool_calls[0]["args"], Team.model_json_schema())


def test_langchain_function_calling_with_an_optional_field_and_a_function_without_parameters(smollm2_server):
    """Arguments hold the listed properties only, as llama.cpp's grammar (the schemas here say
    nothing of others): left open, SmolLM2 wrote key after key past an optional field until
    max_tokens, and gave a function without parameters arguments it does not take."""
    from typing import Optional
    from pydantic import BaseModel, Field

    class Town(BaseModel):
        """Information about a city."""
        name: str = Field(description="the city's name")
        country: str
        population: Optional[int] = None
    out = chat_model(smollm2_server, max_tokens=300).with_structured_output(
        Town, method="function_calling", include_raw=True).invoke("Tell me about Paris. Answer in JSON.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Town), out
    assert set(out["raw"].tool_calls[0]["args"]) <= {"name", "country", "population"}, out
    # no parameters; {} and {"type": "object"} (MCP tools without input) take none either: SmolLM2
    # filled them with {"arg1": "some_value"}, and strict mode let {} through
    for parameters in (None, {}, {"type": "object"}, {"type": "object", "description": "none"}):
        for strict in (False, True):
            now = {"type": "function", "function": {"name": "now", "description": "The time now.", "strict": strict}}
            if parameters is not None:
                now["function"]["parameters"] = parameters
            r = requests.post(smollm2_server.url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": "What time is it now?"}], "tools": [now],
                "tool_choice": "required", "temperature": 0, "max_tokens": 60})
            assert r.status_code == 200, (parameters, strict, r.text)
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            assert calls and all(json.loads(c["function"]["arguments"]) == {} for c in calls), (parameters, calls)


def test_a_function_whose_parameters_no_text_satisfies_is_a_400(smollm2_server):
    """Inside the call's grammar such parameters were found only once a sample reached them: a
    503 after seconds of holding a slot, where the same schema as json_schema was a 400."""
    loop = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}
    for choice in ("required", "auto"):
        body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, loop], "tool_choice": choice,
                "max_tokens": 8}
        r = requests.post(smollm2_server.url + CHAT, json=body, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools" and "function 'loop''s parameters: no text satisfies it" in error["message"]
