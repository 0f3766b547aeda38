"""Control tokens and masked alternatives over a real 3-node loopback `--serve` of SmolLM2
(test_serve_tools' smollm2_server): a generated control token shows no text on either route,
whole or streamed, unless the request sets vLLM's skip_special_tokens false; its logprobs still
name it; a stop string that is its text still ends the answer; and under a grammar the
top_logprobs list only tokens the grammar allows, never masked ones at -9999.
The pieces without a ring are tests/test_control_tokens.py."""
import json

import requests

from test_serve import sse_events
from test_serve_tools import smollm2_server  # noqa: F401 (fixture)

# SmolLM2's id 1: a control token that ends nothing (<|endoftext|>, id 0, ends generation as in
# llama.cpp, beside its EOS <|im_end|>)
IM_START = "<|im_start|>"
FORCE_IT = {"1": 100}  # logit_bias: every token drawn is <|im_start|>
HI = [{"role": "user", "content": "Say hi"}]


def post(server, route, body):
    r = requests.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, route, body):
    with requests.post(server.url + route, json=dict(body, stream=True), stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        return [json.loads(d) for d in sse_events(r) if d != "[DONE]"]


def test_a_generated_control_token_shows_no_text_and_its_logprobs_name_it(smollm2_server):
    srv = smollm2_server
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logit_bias": FORCE_IT, "logprobs": 2}
    choice = post(srv, "/v1/completions", body)["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [IM_START] * 3 and choice["logprobs"]["text_offset"] == [0, 0, 0]
    chunks = streamed(srv, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ""
    assert [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
            for t in c["choices"][0]["logprobs"]["tokens"]] == [IM_START] * 3
    # vLLM's skip_special_tokens false: spelled out, as before
    assert post(srv, "/v1/completions", dict(body, skip_special_tokens=False))["choices"][0]["text"] == IM_START * 3
    chat = {"messages": HI, "max_tokens": 3, "temperature": 0, "logit_bias": FORCE_IT, "logprobs": True,
            "top_logprobs": 1}
    answer = post(srv, "/v1/chat/completions", chat)["choices"][0]
    assert answer["message"]["content"] == "" and [c["token"] for c in answer["logprobs"]["content"]] == [IM_START] * 3
    chunks = streamed(srv, "/v1/chat/completions", chat)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == ""
    answer = post(srv, "/v1/chat/completions", dict(chat, skip_special_tokens=False))["choices"][0]
    assert answer["message"]["content"] == IM_START * 3


def test_a_stop_string_that_is_a_control_token_s_text_still_ends_the_answer(smollm2_server):
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logit_bias": FORCE_IT, "stop": [IM_START]}
    r = post(smollm2_server, "/v1/completions", body)
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("", "stop")
    assert r["usage"]["completion_tokens"] == 1


def test_plain_answers_are_the_same_text_either_way(smollm2_server):
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}
    shown = [post(smollm2_server, "/v1/chat/completions", dict(body, skip_special_tokens=skip))["choices"][0]
             for skip in (True, False)]
    assert shown[0]["message"]["content"] == shown[1]["message"]["content"] != ""


def test_top_logprobs_under_a_grammar_list_only_the_tokens_it_allows(smollm2_server):
    """A schema whose answer is one text: each token is forced, so each lists itself alone
    (they listed 4 masked tokens at -9999 each)."""
    schema = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    body = {"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 30, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "response_format": fmt}
    answer = post(smollm2_server, "/v1/chat/completions", body)["choices"][0]
    assert json.loads(answer["message"]["content"]) == {"city": "Paris"}
    content = answer["logprobs"]["content"]
    tops = [t for c in content for t in c["top_logprobs"]]
    assert tops and all(t["logprob"] > -9999 for t in tops)
    assert any(len(c["top_logprobs"]) < 5 for c in content)  # where the grammar allows fewer than asked
    for c in content:  # the token drawn is among its alternatives, the likeliest under greedy
        assert c["top_logprobs"][0]["token"] == c["token"] and c["logprob"] > -9999
    legacy = post(smollm2_server, "/v1/completions", {"prompt": "Where?", "max_tokens": 30, "temperature": 0,
                                                      "logprobs": 5, "response_format": fmt})["choices"][0]
    assert all(v > -9999 for top in legacy["logprobs"]["top_logprobs"] for v in top.values())
    assert any(len(top) < 5 for top in legacy["logprobs"]["top_logprobs"])
