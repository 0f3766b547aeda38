"""`mdi-start --serve` with real processes: a 3-node loopback ring (the starter-server and two
`mdi-worker`s), concurrent streaming clients, cancellation, the official `openai` client,
request validation and the shared secret. Assertions compare texts and event order, never
durations (the machine is shared)."""
import dataclasses
import json
import os
import re
import subprocess
import threading
import time

import pytest
import requests
import torch

from conftest import BIN, CHARS, ON_TORCH, free_ports, save_test_model, tiny_config
from conftest import ServeProcess as Server
from ringconfigs import parse_run_config, write_run_config
from mdi.starter import batch
from mdi.model.transformer import full_model
from mdi.serving.streaming import TextStream, held_back
from mdi.serving.openai_fields import ignored_names
from mdi.serving.validation import CHAT, COMPLETIONS, FIELDS, NEUTRAL, ApiError, parse_options
from mdi.model.sampling import SamplingParams
from mdi.model.tokenizers import char_tokenizer

BLOCK = 1024  # context of the test model: long enough for streams that outlast the others
SLOTS = 4


def tiny_serve_net():
    """The network behind `model`, built from its seed (test_serve_sampling rebuilds it in process)."""
    torch.manual_seed(3)
    net = full_model(dataclasses.replace(tiny_config("llama"), name="tiny-llama-1k", block_size=BLOCK))
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return net


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama with a character tokenizer and a 1024-token context."""
    path = str(tmp_path_factory.mktemp("serve") / "llama1k")
    net = tiny_serve_net()
    save_test_model(path, net.config, net.state_dict(), "tests/test_serve.py")
    char_tokenizer(CHARS).save(path)
    return path


@pytest.fixture(scope="module")
def server(model, workers, tmp_path_factory):
    path = write_run_config(tmp_path_factory.mktemp("serve-cfg") / "ring3.yaml", model, workers[:2],
                            layers=[2, 1, 1], worker_name="board%d", runtime={"threads": 1, "ring_timeout": 30},
                            serve={"max_in_flight": SLOTS, "model_name": "tiny"},
                            generation={"context_shift": True})  # said to apply to batch runs only
    srv = Server(path)
    try:
        yield srv.wait_ready()
    finally:
        code = srv.stop()
        assert code == 0, srv.output()


_references = {}


def reference(model, prompt, n_tokens):
    """The text of a standalone (one-node, one-sample) greedy run of the same prompt."""
    key = (prompt, n_tokens)
    if key not in _references:
        cfg = parse_run_config(model, label="reference", n_tokens=n_tokens, runtime={"threads": 1})
        _references[key] = batch.run(cfg, [prompt]).texts[0]
    return _references[key]


def sse_events(resp):
    """Parsed `data:` payloads of a server-sent event stream, as they arrive."""
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.decode("utf-8").splitlines():
                if line.startswith("data: "):
                    yield line[len("data: "):]


class Stream(threading.Thread):
    """One streaming /v1/completions client; logs ("first"|"done"|"closed", name) in order."""

    def __init__(self, url, name, prompt, max_tokens, log, lock, close=None):
        super().__init__(daemon=True)
        self.url, self.name, self.prompt, self.max_tokens = url, name, prompt, max_tokens
        self.log, self.lock, self.close = log, lock, close
        self.text, self.finish_reason, self.usage, self.error = "", None, None, None
        self.started = threading.Event()

    def note(self, what):
        with self.lock:
            self.log.append((what, self.name))

    def run(self):
        try:
            body = {"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=(5, 120)) as r:
                assert r.status_code == 200, r.text
                for data in sse_events(r):
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if not event["choices"]:  # the usage, in a chunk of its own after the last choice's
                        self.usage = event["usage"]
                        continue
                    choice = event["choices"][0]
                    assert event.get("usage", "absent") is None, event  # null in every other chunk, as OpenAI's
                    if choice["text"]:
                        if not self.text:
                            self.note("first")
                            self.started.set()
                        self.text += choice["text"]
                    if choice["finish_reason"]:
                        self.finish_reason = choice["finish_reason"]
                        self.note("done")
                    if self.close is not None and self.close.is_set():
                        self.note("closed")
                        return  # leaving the with-block drops the connection
        except Exception as e:  # reported by the test
            self.error = e


PROMPTS = ["The quick brown fox", "Hi", "To be, or not to be, that is the question", "0123",
           "abc def ghi jkl mno", "Once upon a time", "x", "Lorem ipsum dolor sit amet"]
LENGTHS = [5, 40, 12, 90, 3, 60, 25, 150]


def test_eight_concurrent_streams_match_standalone(server, model):
    """8 clients, 4 slots: requests queue, slots are reused, every greedy text is the
    standalone text of its prompt and each client gets its own usage counts."""
    log, lock = [], threading.Lock()
    clients = [Stream(server.url, i, p, n, log, lock) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=120)
    for c, prompt, n in zip(clients, PROMPTS, LENGTHS):
        assert c.error is None, c.error
        assert c.finish_reason == "length"
        assert c.text == reference(model, prompt, n), "client %d" % c.name
        cached = c.usage.pop("prompt_tokens_details")["cached_tokens"]  # the prefix cache's (tests/test_prefix_cache.py)
        assert c.usage == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        assert 0 <= cached < len(prompt)
    m = server.metrics()
    assert m["mdi_slots"] == SLOTS and m["mdi_samples_in_flight"] == 0 and m["mdi_queue_length"] == 0
    assert m["mdi_generated_tokens_total"] >= sum(LENGTHS)
    assert m['mdi_node_step_seconds{node="starter"}'] > 0
    assert all(m['mdi_node_up{node="%s"}' % n] == 1 for n in ("board1", "board2"))
    backends = sorted(k for k in m if k.startswith("mdi_node_backend{"))  # what each node computes with, named
    assert [k.split('node="')[1].split('"')[0] for k in backends] == ["board1", "board2", "starter"], backends
    assert all(m[k] == 1 and k.split('backend="')[1].split('"')[0] in ("ggml", "torch") for k in backends), backends
    assert all(m['mdi_node_frames_total{node="%s"}' % n] > 0 for n in ("board1", "board2"))
    assert all(m['mdi_node_step_seconds{node="%s"}' % n] > 0 for n in ("board1", "board2"))
    assert "mdi_tokens_per_second" in m
    # Whether concurrent requests shared forwards here depends on when they arrived (each one
    # admitted alone leaves in a frame of its own); tests/test_batching.py shows that they do.
    assert m['mdi_node_samples_per_forward{node="starter"}'] >= 1
    assert all(m['mdi_node_forwards_total{node="%s"}' % n] > 0 for n in ("starter", "board1", "board2"))


def test_late_request_streams_before_running_ones_finish(server, model):
    log, lock, close = [], threading.Lock(), threading.Event()
    long_ones = [Stream(server.url, "long%d" % i, PROMPTS[i], BLOCK - 64, log, lock, close) for i in range(3)]
    for c in long_ones:
        c.start()
    for c in long_ones:
        assert c.started.wait(60), c.error
    late = Stream(server.url, "late", "Hi there", 8, log, lock)
    late.start()
    late.join(timeout=60)
    close.set()  # the long streams are not needed any more: hang up (this cancels them)
    for c in long_ones:
        c.join(timeout=60)
        assert c.error is None, c.error
    assert late.error is None and late.text == reference(model, "Hi there", 8)
    order = [e for e in log if e[0] != "closed"]
    late_first = order.index(("first", "late"))
    assert all(e != ("done", c.name) for e in order[:late_first] for c in long_ones), order
    assert order.index(("done", "late")) < min(
        [order.index(("done", c.name)) for c in long_ones if ("done", c.name) in order] or [len(order)])
    _wait_in_flight(server, 0)


def _wait_in_flight(server, n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["mdi_samples_in_flight"] == n:
            return m
        time.sleep(0.2)
    raise AssertionError("samples in flight did not come down to %d: %s" % (n, m))


def test_cancelled_stream_frees_its_slot(server, model):
    before = server.metrics()['mdi_requests_total{finish_reason="cancelled"}']
    log, lock, close = [], threading.Lock(), threading.Event()
    c = Stream(server.url, "c", "Cancel me", BLOCK - 64, log, lock, close)
    c.start()
    assert c.started.wait(60), c.error
    assert server.metrics()["mdi_samples_in_flight"] == 1
    close.set()
    c.join(timeout=30)
    assert ("closed", "c") in log and ("done", "c") not in log
    m = _wait_in_flight(server, 0)
    assert m['mdi_requests_total{finish_reason="cancelled"}'] == before + 1
    # Every slot is usable again.
    r = requests.post(server.url + "/v1/completions", json={"prompt": "After", "max_tokens": 10}, timeout=60)
    assert r.json()["choices"][0]["text"] == reference(model, "After", 10)


EXTREME_SAMPLING = [{"temperature": 1e-45}, {"temperature": 1e-40, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-45},
                    {"temperature": 1.0, "top_k": 1}, {"temperature": 2.0, "top_p": 1e-45, "seed": 3}]


def test_extreme_sampling_settings_do_not_disturb_other_requests(server, model):
    """A request whose temperature underflows (1e-45) used to turn the shared scheduler step
    into NaN and fail every request in flight; now it behaves as greedy and its neighbours
    stream on, unchanged, with the ring healthy throughout."""
    log, lock = [], threading.Lock()
    others = [Stream(server.url, i, PROMPTS[i], 60, log, lock) for i in range(2)]
    for c in others:
        c.start()
    for c in others:
        assert c.started.wait(60), c.error
    for params in EXTREME_SAMPLING:
        body = dict({"model": "tiny", "prompt": "Hi", "max_tokens": 6}, **params)
        r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (params, r.text)
        if params.get("top_k") == 1 or params.get("top_p") == 1e-45 or params["temperature"] < 1e-30:
            assert r.json()["choices"][0]["text"] == reference(model, "Hi", 6), params  # the best token each time
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
    for c, prompt in zip(others, PROMPTS):
        c.join(timeout=120)
        assert c.error is None and c.finish_reason == "length", c.error
        assert c.text == reference(model, prompt, 60)
    assert server.metrics()['mdi_requests_total{finish_reason="error"}'] == 0
    for raw in ('NaN', 'Infinity', '-Infinity'):  # Python's json would accept these
        body = '{"prompt": "Hi", "max_tokens": 2, "temperature": %s}' % raw
        r = requests.post(server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                          timeout=30)
        assert r.status_code == 400 and "temperature" in r.text, (raw, r.text)


def test_a_request_that_speculates_gets_the_plain_text(server, model):
    """Per-request speculation (mdi's `speculation` field): streamed tokens are only accepted
    ones, the greedy text is the standalone one, and /metrics counts what was drafted."""
    prompt = "abcabcabcabcabcabc"
    want = reference(model, prompt, 60)
    for stream in (False, True):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0, "stream": stream,
                "speculation": {"method": "ngram", "max_draft": 6, "ngram_min": 1}}  # any char recurs
        r = requests.post(server.url + "/v1/completions", json=body, timeout=120, stream=stream)
        assert r.status_code == 200, r.text
        text = "".join(json.loads(d)["choices"][0]["text"] for d in sse_events(r) if d != "[DONE]") \
            if stream else r.json()["choices"][0]["text"]
        assert text == want
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    drafted = int(float(re.search(r"^mdi_speculation_drafted_total (\S+)$", metrics, re.M).group(1)))
    assert drafted > 0 and "mdi_node_passes_cancelled_total{node=" in metrics


def test_a_page_rebinding_its_name_to_loopback_is_refused_and_the_dashboard_still_works(server):
    """Without a secret, a page in a browser here whose name resolved to 127.0.0.1 read
    /v1/mdi/state and served itself completions (h38): it names its own host in Host."""
    body = {"prompt": "Hi", "max_tokens": 2}
    r = requests.post(server.url + "/v1/completions", json=body, headers={"Host": "rebind.evil.test"}, timeout=30)
    assert r.status_code == 403 and "rebinding" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "forbidden_host"  # not a key's fault: the server has none
    assert requests.get(server.url + "/v1/mdi/state", headers={"Host": "evil.test:%d" % server.port},
                        timeout=30).status_code == 403
    page = {"Origin": server.url, "Sec-Fetch-Site": "same-origin"}  # the dashboard's own fetches
    assert requests.get(server.url + "/v1/mdi/state", headers=page, timeout=30).ok
    assert requests.post(server.url + "/v1/completions", json=body, headers={"Host": "localhost"}, timeout=60).ok


def test_client_gone_cancels_a_non_streaming_request(server):
    import socket
    before = server.metrics()['mdi_requests_total{finish_reason="cancelled"}']
    body = json.dumps({"prompt": "Hang up", "max_tokens": BLOCK - 64}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while server.metrics()["mdi_samples_in_flight"] != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    sock.close()
    m = _wait_in_flight(server, 0)
    assert m['mdi_requests_total{finish_reason="cancelled"}'] == before + 1


def test_openai_client(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]

    ref = reference(model, "Hello there", 12)
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0)
    assert r.choices[0].text == ref and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 12, 23)
    chunks = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref

    # Stop strings end the text before them, streamed or not.
    stop = ref[4:7]
    want = ref[:ref.index(stop)]
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert all(c.choices and c.usage is None for c in chunks)  # usage only where asked for, as OpenAI's

    # Chat: the model has no chat template, so the documented fallback is used.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat_ref = reference(model, "system: Be brief.\nuser: Hi\nassistant:", 10)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == chat_ref and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens

    # A seed makes sampling repeatable; a different seed changes it.
    texts = [client.completions.create(model="tiny", prompt="Seeded", max_tokens=20, temperature=1.0, seed=s)
             .choices[0].text for s in (5, 5, 6)]
    assert texts[0] == texts[1] != texts[2]

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=BLOCK)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:  # the field the request set is the one named
        client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=BLOCK)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_completion_tokens"


@pytest.mark.parametrize("route,body,status,needle", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b"[" * 50000 + b"]" * 50000, 400, "nested"),
    ("/v1/completions", {"prompt": "a", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"prompt": "a", "n": SLOTS + 1}, 400, "'n'"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "expected a string or a list of token ids"),
    ("/v1/completions", {"prompt": []}, 400, "expected a string or a list of token ids"),
    ("/v1/completions", {"prompt": ["a", [1, 100000]]}, 400, "'prompt[1]': token ids"),
    ("/v1/completions", {"prompt": [1, 100000]}, 400, "token ids"),
    ("/v1/completions", {"prompt": "\u00e9t\u00e9"}, 400, "tokenize"),
    ("/v1/completions", {"prompt": "a", "max_tokens": BLOCK}, 400, "context length"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "a", "speculation": "medusa"}, 400, "speculation.method: expected one of"),
    ("/v1/completions", {"prompt": "a", "speculation": {"method": "ngram", "max_draft": 0}}, 400, "max_draft"),
    ("/v1/completions", {"prompt": "a", "speculation": 3}, 400, "speculation"),
    ("/v1/nothing", {}, 404, "no such route"),
    ("/v1/completions", b"x" * ((1 << 20) + 1), 413, "larger than"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "surrogate"),
])
def test_bad_requests_get_openai_shaped_errors(server, route, body, status, needle):
    if isinstance(body, bytes):
        r = requests.post(server.url + route, data=body, headers={"Content-Type": "application/json"}, timeout=10)
    else:
        r = requests.post(server.url + route, json=body, timeout=10)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}


@pytest.mark.skipif(not hasattr(__import__("sys"), "set_int_max_str_digits"), reason="no integer digit limit here")
def test_a_number_past_python_s_digit_limit_is_said_plainly(server):
    """CPython's refusal had reached the client naming its own setting, sys.set_int_max_str_digits (h78)."""
    body = b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"
    r = requests.post(server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                      timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body holds a number of more than 4300 digits"


def test_a_chunked_body_over_the_limit_is_413(server):
    # No Content-Length: the limit must still be enforced on what arrives, not by truncation.
    def body():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = requests.post(server.url + "/v1/completions", data=body(), headers={"Content-Type": "application/json"},
                      timeout=30)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"], r.text
    # and a small chunked body still works
    r = requests.post(server.url + "/v1/completions", data=iter([b'{"prompt": "Hi", ', b'"max_tokens": 2}']),
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def test_wrong_method_and_content_type(server):
    r = requests.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/completions", data="prompt=a", timeout=10)
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]


def test_held_back_keeps_possible_stop_prefixes():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("ab", ["b!", "ab?"]) == 2


def test_text_stream_cuts_at_stop_strings_and_holds_back_their_starts():
    tok = char_tokenizer(CHARS)

    def feed(stream, text, finish=None):
        return [(u.text, u.hit_stop) for u in (stream.push(t, finish) for t in tok.encode(text))]

    stream = TextStream(tok, ["lo w", ""])
    assert feed(stream, "helox") == [("h", False), ("e", False), ("", False), ("", False), ("lox", False)]
    assert feed(stream, "lo w") == [("", False), ("", False), ("", False), ("", True)]
    stream = TextStream(tok, ["zz"])
    assert feed(stream, "az") == [("a", False), ("", False)]
    assert feed(stream, "y", "length") == [("zy", False)]  # the last token releases what was held


@pytest.mark.parametrize("route,body,message", [
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "'max_tokens': expected an integer >= 1"),
    (COMPLETIONS, {"prompt": "a", "top_p": 0}, "'top_p': expected a number in (0, 1]"),
    (COMPLETIONS, {"prompt": "a", "temperature": 2.5}, "'temperature': expected a number in [0, 2]"),
    (COMPLETIONS, {"prompt": "a", "top_k": 1.5}, "'top_k': expected an integer, got 1.5"),
    (COMPLETIONS, {"prompt": "a", "top_k": -2}, "'top_k': expected an integer >= -1"),
    (COMPLETIONS, {"prompt": "a", "stream": 1}, "'stream': expected true or false, got 1"),
    (COMPLETIONS, {"prompt": "a", "echo": True}, "'echo': only false is supported"),
    (COMPLETIONS, {"prompt": "a", "tools": []}, "unrecognized request argument: 'tools'"),
    (CHAT, {"messages": [], "max_completion_tokens": -1}, "'max_completion_tokens': expected an integer >= 1"),
    (CHAT, {"messages": "hi"}, "'messages': expected a non-empty list of messages, got \"hi\""),
    (CHAT, {"messages": [], "stream": True, "stream_options": {"x": 1}}, "'stream_options': unknown key 'x'"),
    (CHAT, {"messages": [], "stop": ["a", 1]}, "'stop': expected a string or a list of strings"),
    (COMPLETIONS, {}, "'prompt': expected a string, token ids, or a list of either"),
])
def test_the_field_table_names_the_field_and_what_was_expected(route, body, message):
    with pytest.raises(ApiError) as err:
        parse_options(body, route, SamplingParams(0.8, None, None))
    assert err.value.status == 400 and err.value.message == message


@pytest.mark.parametrize("route, body", [(CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
                                         (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})])
def test_fields_sent_as_null_count_as_absent_the_ignored_ones_too(route, body):
    """The ignored fields were a 400 "unrecognized request argument" as null ("user": null)."""
    names = ignored_names(route) + [f.name for f in FIELDS if route in f.routes and f.name not in body] + \
        [n.name for n in NEUTRAL if route in n.routes]
    assert "user" in names and ("store" in names) == (route == CHAT)
    for name in names:  # each alone, as a client sets one
        opts, _ = parse_options(dict(body, **{name: None}), route, SamplingParams(0.8, None, None))
        assert list(opts.ignored) == [], name
    opts, _ = parse_options(dict(body, **dict((n, None) for n in names)), route, SamplingParams(0.8, None, None))
    assert list(opts.ignored) == [] and opts.max_tokens == 2
    if route == COMPLETIONS:  # a field that is not the route's stays refused, null or not
        with pytest.raises(ApiError, match="unrecognized request argument: 'store'"):
            parse_options(dict(body, store=None), route, SamplingParams(0.8, None, None))


def test_the_field_table_fills_defaults():
    defaults = SamplingParams(0.7, 40, 0.9)
    opts, fields = parse_options({"messages": [], "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0,
                                  "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                                  "n": 1, "tool_choice": "none", "user": "u"}, CHAT, defaults)
    assert (opts.max_tokens, opts.params, opts.stop, opts.stream, opts.include_usage) == (
        7, SamplingParams(0.0, 40, 0.9), ["x"], True, True)
    opts, fields = parse_options({"prompt": [1, 2], "seed": None}, COMPLETIONS, defaults)
    assert (opts.max_tokens, opts.params, opts.seed, list(opts.stop), opts.stream, opts.include_usage) == (
        None, defaults, None, [], False, False)
    assert fields["prompt"] == [1, 2]


def test_shared_secret_and_public_bind(model, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDI_TOKEN")}
    path = tmp_path / "one.yaml"
    path.write_text("model: {path: %s}\nruntime: {threads: 1}\nserve: {max_in_flight: 2, max_len: 64}\n" % model)
    # No secret: refuse a non-loopback address before loading anything.
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", str(path), "--serve", "--host", "0.0.0.0",
                           "--port", str(free_ports(1)[0])], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "without a shared secret" in proc.stderr
    srv = Server(str(path), env=dict(env, MDI_TOKEN="s3cret"), token="s3cret").wait_ready()
    try:
        for route in ("/v1/models", "/metrics"):
            r = requests.get(srv.url + route, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                          headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0},
                          headers=srv.headers, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(model, "Hi", 4)
        scraped = requests.get(srv.url + "/metrics", headers=srv.headers, timeout=10)
        assert re.search(r"^mdi_slots 2$", scraped.text, re.M)
        assert scraped.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"  # charset once
        card = requests.get(srv.url + "/v1/models", headers=srv.headers, timeout=10).json()["data"][0]
        assert abs(card["created"] - time.time()) < 3600  # when it began serving, as OpenAI's Unix seconds
        # Issue 58 (5): the token is checked before a byte of the body is read, on every route
        # that takes one: a client announcing 8 MiB it never sends gets its 401 at once.
        for route in ("/v1/mdi/train", "/v1/mdi/adapters", "/v1/completions", "/v1/chat/completions"):
            for auth in ("", "Authorization: Bearer wrong\r\n"):
                status, body = _announce_body(srv.port, route, auth, 8 << 20)
                assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (route, body)
        # ... and with the token the routes read the body and answer it
        r = requests.post(srv.url + "/v1/mdi/train", json={"data": "/etc/passwd"}, headers=srv.headers, timeout=30)
        error = r.json()["error"]  # (a ring on ggml refuses training itself first, in one line)
        assert r.status_code == 400 and (error["param"] == "data" if ON_TORCH else "cannot train" in error["message"]), \
            r.text
        assert requests.get(srv.url + "/v1/mdi/train", headers=srv.headers, timeout=30).status_code == 404
        assert requests.get(srv.url + "/v1/mdi/train", timeout=30).status_code == 401
        r = requests.post(srv.url + "/v1/mdi/adapters", json={"name": "x", "path": "/etc"}, headers=srv.headers,
                          timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        assert "/etc" not in r.json()["error"]["message"] and model not in r.json()["error"]["message"]
        r = requests.post(srv.url + "/v1/mdi/adapters", json={"name": "x", "path": "/etc"}, timeout=30)
        assert r.status_code == 401, r.text
    finally:
        assert srv.stop() == 0, srv.output()


def _announce_body(port, route, auth, length):
    """POST `route` with headers announcing `length` bytes of JSON and no byte of the body:
    (status, body) of the answer, which must come without the body."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(("POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s"
                      "Content-Length: %d\r\n\r\n" % (route, auth, length)).encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), body.decode()


def _length(data):
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    match = re.search(r"content-length: *(\d+)", head)
    return int(match.group(1)) if match else 0


@pytest.mark.parametrize("source,needle", [
    ("{{ 'x' * 10**8 }}", "repetition"), ("{{ ([1] * 10**8) | length }}", "repetition"),
    ("{{ 10**8 * ['ab'] }}", "repetition"), ("{% set n = 100000000 %}{{ 7 ** n }}", "power"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "wrote more than"),
    # loops that write nothing: only the clock can stop them
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer than"),
    ("{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "ran longer than")])
def test_a_hostile_chat_template_is_bounded(source, needle):
    # A model file's chat template runs for every chat request: Jinja's sandbox bounds `range`
    # only, and 'x' * 10**8 built 100 MB per request. Sizes and output are bounded: a 400.
    import time
    from mdi.model.tokenizers import char_tokenizer
    from mdi.serving.prompts import ChatTemplate
    from mdi.serving.validation import ApiError
    tok = char_tokenizer([chr(c) for c in range(32, 127)] + ["\n"])
    tok.chat_template = source
    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        ChatTemplate(tok).render([{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and needle in e.value.message and time.monotonic() - t0 < 10
    tok.chat_template = "{% for m in messages %}{{ m['content'] * 2 }}{% endfor %}{{ 2 ** 10 }}"
    assert ChatTemplate(tok).render([{"role": "user", "content": "hi"}]) == "hihi1024"  # small ones still work


def test_a_request_for_the_draft_model_of_a_server_without_one_is_a_400(server):
    r = requests.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "speculation": "draft"},
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation", r.text
    assert "no draft model" in r.json()["error"]["message"]


def test_top_k_0_or_minus_1_turns_it_off_even_where_the_yaml_sets_one():
    """As llama.cpp and vLLM read them: refused, a client could turn a YAML's top_k off only by
    sending the vocabulary's size (h37)."""
    yaml = SamplingParams(0.8, 50, 1.0)
    for off in (0, -1):
        assert parse_options({"prompt": "a", "top_k": off}, COMPLETIONS, yaml)[0].params.top_k is None
    assert parse_options({"prompt": "a", "top_k": 5}, COMPLETIONS, yaml)[0].params.top_k == 5
    assert parse_options({"prompt": "a"}, COMPLETIONS, yaml)[0].params.top_k == 50


def test_a_setting_serving_does_not_read_is_said_at_start(server):
    """generation.context_shift was read and ignored: a served request's max_tokens is held to
    what its slot has left, so its window never rolls."""
    assert "mdi: generation.context_shift is for batch runs" in server.output(), server.output()


def test_a_burst_on_free_slots_is_served_and_only_what_must_wait_counts_against_max_queue(tmp_path, tiny_models):
    """Samples about to take a free slot do not wait: 20 requests at once on 8 idle slots and a
    queue of 4 had got 15 refusals (each counted as waiting until the scheduler admitted it, h78).
    Requests still running hold their slots, so however fast the ring is, every one of 6 sent at
    once on 4 slots and a queue of 2 is taken."""
    path = write_run_config(tmp_path / "q.yaml", tiny_models["llama"], runtime={"threads": 1},
                            serve={"max_in_flight": 4, "max_queue": 2, "model_name": "tiny"})
    server = Server(path).wait_ready()
    try:
        codes = []

        def ask(i):
            body = {"prompt": "Once upon %d" % i, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            codes.append(requests.post(server.url + "/v1/completions", json=body, timeout=120).status_code)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert sorted(codes) == [200] * 6, codes
    finally:
        assert server.stop() == 0, server.output()
