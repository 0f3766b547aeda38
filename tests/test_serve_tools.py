"""Function calling over a real 3-node loopback `--serve` with the official `openai` client:
test_serve's tiny model for the fields' checks, conversations that carry calls and results,
and streamed answers equal to whole ones; SmolLM2 for calls the constrained sampler forces
(tool_choice "required" or a named function)."""
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
    assert choice.message.content or choice.message.tool_calls
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


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
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
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
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
