"""vLLM's request fields that agent frameworks pass through (`extra_body`), honoured over a real
3-node loopback `--serve` of SmolLM2 (test_serve_tools' smollm2_server): ignore_eos generates
past the end token, min_tokens keeps it from being drawn before then, stop_token_ids end the
answer as the end token does, include_stop_str_in_output keeps the stop string, whole and
streamed, repetition_penalty is llama.cpp's repeat_penalty over every token, and
stream_options.continuous_usage_stats puts the usage so far in every chunk. chat_template_kwargs and an answer's
reasoning_content, which only the template reads, are tests/test_tools.py's."""
import json

import requests

from test_serve import sse_events
from test_serve_tools import smollm2_server  # noqa: F401 (fixture)

HI = [{"role": "user", "content": "Say hi"}]
IM_START_ID = 1  # <|im_start|>: a control token that ends nothing (SmolLM2's end tokens are 0, 2 and 4)


def post(server, route, body, status=200):
    r = requests.post(server.url + route, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def streamed_text(server, route, body):
    with requests.post(server.url + route, json=dict(body, stream=True), stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        chunks = [json.loads(d) for d in sse_events(r) if d != "[DONE]"]
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c["choices"])


def test_ignore_eos_and_min_tokens_generate_past_the_end_token(smollm2_server):
    body = {"messages": HI, "max_tokens": 200, "temperature": 0, "cache_prompt": False}  # each computed whole
    plain = post(smollm2_server, "/v1/chat/completions", body)
    n = plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and n < 150  # it ends with its EOS
    text = plain["choices"][0]["message"]["content"]
    past = post(smollm2_server, "/v1/chat/completions", dict(body, max_tokens=n + 8, ignore_eos=True))
    assert past["choices"][0]["finish_reason"] == "length" and past["usage"]["completion_tokens"] == n + 8
    assert past["choices"][0]["message"]["content"].startswith(text)
    longer = post(smollm2_server, "/v1/chat/completions", dict(body, min_tokens=n + 4))
    assert longer["usage"]["completion_tokens"] >= n + 4
    assert longer["choices"][0]["message"]["content"].startswith(text)  # the same draws up to the end token's
    assert post(smollm2_server, "/v1/chat/completions", dict(body, min_tokens=1))["choices"][0]["message"] == \
        plain["choices"][0]["message"]


def test_stop_token_ids_end_the_answer_as_its_end_token_does(smollm2_server):
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logit_bias": {str(IM_START_ID): 100}}
    assert post(smollm2_server, "/v1/completions", body)["usage"]["completion_tokens"] == 5
    r = post(smollm2_server, "/v1/completions", dict(body, stop_token_ids=[IM_START_ID]))
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == \
        ("", "stop", 1)
    # before min_tokens it is not drawn (the next best is), after it it ends the answer
    r = post(smollm2_server, "/v1/completions", dict(body, stop_token_ids=[IM_START_ID], min_tokens=3))
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop"
    error = post(smollm2_server, "/v1/completions", dict(body, stop_token_ids=[10 ** 6]), status=400)["error"]
    assert error["param"] == "stop_token_ids" and "outside the vocabulary" in error["message"]
    error = post(smollm2_server, "/v1/completions", dict(body, stop_token_ids=["x"]), status=400)["error"]
    assert error["param"] == "stop_token_ids"


def test_include_stop_str_in_output_keeps_the_stop_string_whole_and_streamed(smollm2_server):
    body = {"prompt": "The capital of France is", "max_tokens": 30, "temperature": 0, "cache_prompt": False}
    full = post(smollm2_server, "/v1/completions", body)["choices"][0]["text"]
    stop = full.split()[2]  # a word from inside the answer
    before = full[:full.index(stop)]
    cut = dict(body, stop=[stop])
    assert post(smollm2_server, "/v1/completions", cut)["choices"][0]["text"] == before
    kept = dict(cut, include_stop_str_in_output=True)
    answer = post(smollm2_server, "/v1/completions", kept)["choices"][0]
    assert (answer["text"], answer["finish_reason"]) == (before + stop, "stop")
    assert streamed_text(smollm2_server, "/v1/completions", kept) == before + stop
    assert streamed_text(smollm2_server, "/v1/completions", cut) == before


def test_repetition_penalty_is_repeat_penalty_over_every_token(smollm2_server):
    body = {"prompt": "one one one one one one one", "max_tokens": 12, "temperature": 0, "cache_prompt": False}
    plain = post(smollm2_server, "/v1/completions", body)["choices"][0]["text"]
    vllm = post(smollm2_server, "/v1/completions", dict(body, repetition_penalty=1.8))["choices"][0]["text"]
    llama = post(smollm2_server, "/v1/completions",
                 dict(body, repeat_penalty=1.8, repeat_last_n=-1))["choices"][0]["text"]
    assert vllm == llama != plain
    error = post(smollm2_server, "/v1/completions", dict(body, repetition_penalty=0), status=400)["error"]
    assert error["param"] == "repetition_penalty"


def streamed_chunks(server, route, body):
    with requests.post(server.url + route, json=dict(body, stream=True), stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        return [json.loads(d) for d in sse_events(r) if d != "[DONE]"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(smollm2_server):
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = post(smollm2_server, "/v1/completions", body)
    for route, sent in (("/v1/completions", body),
                        ("/v1/chat/completions", {"messages": HI, "max_tokens": 6, "temperature": 0, "ignore_eos": True})):
        chunks = streamed_chunks(smollm2_server, route, dict(sent, stream_options={
            "include_usage": True, "continuous_usage_stats": True}))
        usages = [c["usage"] for c in chunks]  # every chunk has one, none null
        assert all(u is not None for u in usages), usages
        counts = [u["completion_tokens"] for u in usages]
        assert counts == sorted(counts) and counts[-1] == 6, counts  # grows to the whole answer's
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        assert len(set(u["prompt_tokens"] for u in usages)) == 1
        if route == "/v1/completions":
            assert usages[-1] == whole["usage"]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    plain = streamed_chunks(smollm2_server, "/v1/completions", dict(body, stream_options={
        "continuous_usage_stats": True}))  # without include_usage: no usage at all, as vLLM
    assert all("usage" not in c for c in plain)
