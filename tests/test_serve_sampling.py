"""The sampling fields and log-probabilities of `--serve` over a real 3-node loopback ring
(test_serve's server and model): logprobs are the log-softmax of the logits that drew each
token, streamed as whole; n gives n choices, each the single request with its derived seed;
penalties, logit_bias and min_p act as defined; each bad value is one 400 naming its field."""
import json
import math

import pytest
import requests
import torch

from conftest import LOGPROBS_VS_TORCH
from test_serve import BLOCK, SLOTS, model, reference, server, sse_events, tiny_serve_net  # noqa: F401 (fixtures)
from mdi.model.tokenizers import load_tokenizer
from mdi.serving.validation import CHAT, COMPLETIONS, ApiError, parse_options
from mdi.model.sampling import SamplingParams

_nets = {}


def model_logits(model, ids):
    """Every position's logits from a one-node, one-pass run of test_serve's model (rebuilt
    from its seed in this process): row i scores the token after ids[i]."""
    if "net" not in _nets:
        net = tiny_serve_net()
        net.allocate_cache(1, BLOCK)
        _nets["net"] = net
    net = _nets["net"]
    with torch.no_grad():
        ids_t = torch.tensor(ids, dtype=torch.long)
        return net.head(net.forward_blocks(net.embed(ids_t, 0), 0, 0)).float()


def post(server, route, body, stream=False):
    r = requests.post(server.url + route, json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    return [json.loads(d) for d in sse_events(r) if d != "[DONE]"]


def test_completion_logprobs_are_the_log_softmax_of_the_logits_that_drew_each_token(server, model):
    tok = load_tokenizer(model)
    prompt = "The quick brown fox"
    # cache_prompt false: both requests computed whole (from the prefix cache, logits agree
    # within float32 rounding, not bit for bit, and the streamed copy is compared exactly)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 5, "cache_prompt": False}
    choice = post(server, "/v1/completions", body)["choices"][0]
    assert choice["text"] == reference(model, prompt, 16)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 16
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(16)]
    ids = tok.encode(prompt) + tok.encode(choice["text"])
    want = torch.log_softmax(model_logits(model, ids), -1)[len(tok.encode(prompt)) - 1:-1]
    for i, (token, value, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        t = tok.encode(token)[0]
        assert abs(value - float(want[i, t])) < LOGPROBS_VS_TORCH, i
        assert len(top) == 5 and max(top.values()) == value  # greedy: the chosen token is the best
        best = torch.topk(want[i], 5)
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=LOGPROBS_VS_TORCH)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    # streamed: the same tokens and values, chunk by chunk
    chunks = post(server, "/v1/completions", dict(body, stream=True), stream=True)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    joined = dict((k, [v for s in streamed for v in s[k]]) for k in lp)
    assert joined == lp


def test_completion_top_logprobs_always_hold_the_drawn_token(server):
    """OpenAI's legacy completions list the drawn token's logprob among the top ones even when
    sampling drew one outside them: up to `logprobs` + 1 entries."""
    body = {"prompt": "Seeded", "max_tokens": 24, "temperature": 2.0, "seed": 3, "logprobs": 1, "cache_prompt": False}
    lp = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # drawn outside the top 1 (temperature 2)


def test_several_prompts_give_each_its_choices_in_prompt_order(server):
    """OpenAI's completions take a list of prompts (LangChain's OpenAI LLM batches that way):
    n choices each, index prompt * n + choice, each the single request's (its seed + choice),
    whole and streamed; the usage counts each prompt once."""
    prompts = ["Seeded", "Once upon", [5, 6, 7]]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 1.0, "seed": 4, "n": 2, "cache_prompt": False}
    r = post(server, "/v1/completions", body)
    assert [c["index"] for c in r["choices"]] == list(range(6))
    singles = [post(server, "/v1/completions", dict(body, prompt=p, n=1, seed=4 + j))["choices"][0]["text"]
               for p in prompts for j in range(2)]
    assert [c["text"] for c in r["choices"]] == singles
    assert r["usage"]["prompt_tokens"] == len("Seeded") + len("Once upon") + 3
    assert r["usage"]["completion_tokens"] == 36
    chunks = post(server, "/v1/completions", dict(body, stream=True), stream=True)
    assert ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
            for i in range(6)] == singles
    langchain_openai = pytest.importorskip("langchain_openai")  # its completions LLM batches prompts so
    llm = langchain_openai.OpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", temperature=0,
                                  max_tokens=5, max_retries=0)
    greedy = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 5, "temperature": 0})["choices"][0]["text"]
              for p in prompts[:2]]
    assert [g[0].text for g in llm.generate(prompts[:2]).generations] == greedy


def test_one_call_of_many_prompts_shares_the_slots_with_a_later_call(server):
    """A free slot goes to the call holding the fewest: a short request sent while a call of 16
    prompts holds every slot starts at the next free one, not after all 16 (first come, first
    served by sample). Counted in finished choices, not seconds: it holds on any machine."""
    import threading
    big = {"prompt": ["Once upon %d" % i for i in range(16)], "max_tokens": 24, "temperature": 0,
           "stream": True, "cache_prompt": False}
    # Its headers come once all 16 are queued: the short request, sent at once, queues behind
    # them (before any can have finished, however slow this client is to read the stream).
    resp = requests.post(server.url + "/v1/completions", json=big, timeout=300, stream=True)
    assert resp.status_code == 200, resp.text
    finished, small_done_at = set(), []
    events = sse_events(resp)

    def small():
        post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        small_done_at.append(len(finished))
    asker = threading.Thread(target=small)
    asker.start()
    for data in events:
        if data != "[DONE]":
            choice = (json.loads(data)["choices"] or [{}])[0]
            if choice.get("finish_reason"):
                finished.add(choice["index"])
    asker.join(120)
    assert len(finished) == 16 and small_done_at and small_done_at[0] < 8, (small_done_at, len(finished))


def test_more_samples_than_may_wait_is_a_400_naming_the_field(server):
    """prompts x n beyond serve.max_queue could never be queued: a 400 (a 429 would be retried
    by every client, forever), and nothing of it is queued."""
    body = {"prompt": ["x"] * 200, "max_tokens": 1, "n": 2}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "400 samples (prompts x n) in one request, more than the 256" in r.json()["error"]["message"]
    state = requests.get(server.url + "/v1/mdi/state", timeout=30).json()
    assert state["queue_length"] == 0 and state["in_flight"] == 0, state


def test_chat_logprobs_streamed_equal_whole_with_sampling_and_bytes(server, model):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "temperature": 0.9, "seed": 7,
            "logprobs": True, "top_logprobs": 3, "cache_prompt": False}  # computed whole both times (above)
    choice = post(server, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"] and len(content) == 20
    for c in content:
        assert c["bytes"] == list(c["token"].encode("utf-8")) and len(c["top_logprobs"]) == 3
        assert c["logprob"] <= 0 and sum(math.exp(t["logprob"]) for t in c["top_logprobs"]) <= 1 + 1e-6
        assert [t["logprob"] for t in c["top_logprobs"]] == sorted((t["logprob"] for t in c["top_logprobs"]),
                                                                   reverse=True)
    chunks = post(server, "/v1/chat/completions", dict(body, stream=True), stream=True)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        choice["message"]["content"]
    # without logprobs: null, as before
    assert post(server, "/v1/chat/completions", dict(body, logprobs=False, top_logprobs=None)
                )["choices"][0]["logprobs"] is None


def test_n_choices_are_the_single_requests_with_derived_seeds(server):
    body = {"prompt": "Seeded", "max_tokens": 20, "temperature": 1.0, "seed": 11}
    r = post(server, "/v1/completions", dict(body, n=3))
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    singles = [post(server, "/v1/completions", dict(body, seed=11 + i))["choices"][0]["text"] for i in range(3)]
    assert texts == singles
    assert r["usage"]["completion_tokens"] == 60 and r["usage"]["prompt_tokens"] == len("Seeded")
    chunks = post(server, "/v1/completions", dict(body, n=3, stream=True), stream=True)
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                for i in range(3)]
    assert streamed == texts
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == 3
    # chat: the role first for every choice
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                                                 "n": 2, "temperature": 0})
    assert [c["message"]["content"] for c in chat["choices"]] == [chat["choices"][0]["message"]["content"]] * 2


def greedy_with_penalties(model, prompt, n, presence=0.0, frequency=0.0, bias=None):
    """The greedy answer written out: OpenAI's penalty formula applied to one-pass logits."""
    tok = load_tokenizer(model)
    ids = tok.encode(prompt)
    out = []
    for _ in range(n):
        logits = model_logits(model, ids + out)[-1].clone()
        for t in set(out):
            logits[t] -= out.count(t) * frequency + presence
        for t, b in (bias or {}).items():
            logits[t] += b
        out.append(int(logits.argmax()))
    return tok.decode(out)


def test_penalties_and_logit_bias_change_the_answer_as_defined(server, model):
    tok = load_tokenizer(model)
    prompt = "To be, or not to be"
    plain = reference(model, prompt, 20)
    for fields in ({"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"presence_penalty": -2.0}):
        want = greedy_with_penalties(model, prompt, 20, fields.get("presence_penalty", 0.0),
                                     fields.get("frequency_penalty", 0.0))
        got = post(server, "/v1/completions", dict({"prompt": prompt, "max_tokens": 20, "temperature": 0}, **fields))
        assert got["choices"][0]["text"] == want, fields
    assert greedy_with_penalties(model, prompt, 20, frequency=2.0) != plain  # they matter here
    # -100 bans a token: the greedy answer's most used character never appears
    banned = max(set(plain), key=plain.count)
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": 1,
            "logit_bias": {str(tok.encode(banned)[0]): -100}}
    text = post(server, "/v1/completions", body)["choices"][0]["text"]
    assert banned not in text and len(text) == 40
    # and a bias shifts the greedy choice as its definition says
    bias = {tok.encode("q")[0]: 3.0}
    got = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                           "logit_bias": dict((str(k), v) for k, v in bias.items())})
    assert got["choices"][0]["text"] == greedy_with_penalties(model, prompt, 10, bias=bias)
    # speculation keeps penalised answers exact (each verified token drawn with the tokens before it)
    spec = post(server, "/v1/completions", {"prompt": "abcabcabcabc", "max_tokens": 30, "temperature": 0,
                                            "frequency_penalty": 0.3, "speculation": {"method": "ngram",
                                                                                      "ngram_min": 1}})
    assert spec["choices"][0]["text"] == greedy_with_penalties(model, "abcabcabcabc", 30, frequency=0.3)


def test_min_p_one_keeps_only_the_best_token(server, model):
    body = {"prompt": "Once upon a time", "max_tokens": 15, "temperature": 1.5, "min_p": 1.0, "seed": 4}
    assert post(server, "/v1/completions", body)["choices"][0]["text"] == reference(model, "Once upon a time", 15)


@pytest.mark.parametrize("route,fields,name", [
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": SLOTS + 1}, "n"),
    ("/v1/completions", {"n": 1.5}, "n"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repeat_penalty": 0}, "repeat_penalty"),
    ("/v1/completions", {"repeat_last_n": -2}, "repeat_last_n"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": True}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_each_bad_value_is_a_400_naming_its_field(server, route, fields, name):
    body = dict({"prompt": "a"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]},
                max_tokens=2, **fields)
    r = requests.post(server.url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and "'%s'" % name in error["message"] and "\n" not in error["message"], error


def test_the_field_table_builds_the_sampling_params():
    opts, _ = parse_options({"prompt": "a", "min_p": 0.1, "presence_penalty": 1, "frequency_penalty": -0.5,
                             "repeat_penalty": 1.1, "repeat_last_n": -1, "logit_bias": {"7": -100, "3": 2},
                             "n": 3, "logprobs": 2}, COMPLETIONS, SamplingParams(0.7, 40, None))
    assert opts.params == SamplingParams(0.7, 40, None, 0.1, 1.0, -0.5, 1.1, -1, {7: -100.0, 3: 2.0})
    assert (opts.n, opts.top_logprobs) == (3, 2)
    opts, _ = parse_options({"messages": [], "logprobs": True}, CHAT, SamplingParams())
    assert opts.top_logprobs == 0 and opts.params == SamplingParams()
    opts, _ = parse_options({"messages": [], "logprobs": False, "top_logprobs": 0}, CHAT, SamplingParams())
    assert opts.top_logprobs is None
    with pytest.raises(ApiError, match="'top_logprobs': only allowed with logprobs: true"):
        parse_options({"messages": [], "top_logprobs": 1}, CHAT, SamplingParams())


def test_the_openai_client_reads_logprobs_and_choices(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2, n=2, seed=3,
                                       presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": -100})
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert content[0].top_logprobs[0].logprob == content[0].logprob and len(content[0].top_logprobs) == 2
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0, logprobs=3)
    assert r.choices[0].text == reference(model, "Hello there", 8)
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text and len(r.choices[0].logprobs.top_logprobs[0]) == 3
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, stream=True,
                                                 presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": -100}))
    assert [c.token for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content] \
        == [c.token for c in content]


def test_token_bytes_of_a_byte_level_vocabulary_rebuild_the_text(smollm2_dir):
    """SmolLM2's byte-level tokens: a character split over two tokens shows U+FFFD in each
    token's text, and its bytes are the real ones, so the bytes concatenate to the text."""
    from mdi.serving.logprob_bodies import TokenTexts
    tok = load_tokenizer(smollm2_dir)
    texts = TokenTexts(tok)
    text = "Hello, w\u00f6rld! \U0001F600 na\u00efve"
    parts = [texts.of(i) for i in tok.encode(text)]
    assert b"".join(bytes(raw) for _, raw in parts).decode("utf-8") == text
    assert any("\ufffd" in t for t, _ in parts) and parts[0] == ("Hello", list(b"Hello"))
