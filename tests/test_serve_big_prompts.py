"""A refused prompt costs bounded, returned memory (issue 40 item 7: 16 concurrent ~1 MiB
prompts, each refused with a 400, left the server 1.8 GB larger). A prompt that cannot fit is
refused before it is tokenized where the tokenizer can bound its token count, and what
tokenizing a refused one left behind goes back to the OS."""
import os
import random
import threading

import pytest
import requests

from conftest import CHARS, ServeProcess
from ringconfigs import write_run_config
from mdi.model.tokenizers import PromptTooLong, char_tokenizer, load_tokenizer


def texts():
    rng = random.Random(5)
    yield "The capital of France is Paris. " * 50
    yield "".join(rng.choice("ab \n\t€😀é<|>") for _ in range(3000))
    yield " " * 5000 + "x"
    yield "<|im_start|>user\nhi<|im_end|>" * 40
    yield "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(2000))


def tokenizers(smollm2_dir):
    yield char_tokenizer(CHARS)
    yield load_tokenizer(smollm2_dir)


@pytest.mark.parametrize("which", [0, 1])
def test_the_bound_never_exceeds_the_real_count(which, smollm2_dir):
    tok = list(tokenizers(smollm2_dir))[which]
    assert tok.max_token_bytes() is not None  # both bound their counts
    for text in texts():
        if which == 0:
            text = "".join(c for c in text if c in CHARS)
        assert tok.fewest_tokens(text) <= len(tok.encode(text)), text[:40]


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(smollm2_dir, monkeypatch):
    tok = load_tokenizer(smollm2_dir)

    def never(text):
        raise AssertionError("tokenized")
    monkeypatch.setattr(tok, "_encode", never)
    with pytest.raises(PromptTooLong) as e:
        tok.encode_prompt("word " * 200000, max_tokens=2047)
    assert e.value.at_least > 2047 and e.value.limit == 2047


def rss_mb(pid: int) -> float:
    with open("/proc/%d/statm" % pid) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def test_concurrent_oversized_prompts_leave_the_server_its_size(smollm2_dir, tmp_path):
    config = write_run_config(tmp_path / "serve.yaml", smollm2_dir, quant="auto", runtime={"threads": 1})
    server = ServeProcess(config).wait_ready()
    try:
        before = rss_mb(server.proc.pid)
        # just under the 1 MiB body limit (refused before tokenizing), and 300 kB (tokenized,
        # 66k tokens, then refused): 8 of each at once, through both routes
        big = ("The quick brown fox jumps over the lazy dog. " * 24000)[:(1 << 20) - 4096]
        mid = big[:300000]
        replies = []

        def send(route, text):
            body = {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}
            r = requests.post("%s/v1/%s" % (server.url, route.replace("chat", "chat/completions")), json=body,
                              timeout=300)
            replies.append((r.status_code, r.json()["error"]))
        threads = [threading.Thread(target=send, args=(route, text))
                   for text in (big, mid) for route in ("completions", "chat") for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(replies) == 16
        for status, error in replies:
            assert status == 400 and error["code"] == "context_length_exceeded", error
            assert "maximum context length" in error["message"]
        assert any("at least" in e["message"] for _, e in replies)  # the big ones, without tokenizing
        grown = rss_mb(server.proc.pid) - before
        assert grown < 150, "the server grew %.0f MB refusing 16 prompts" % grown
        ok = requests.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
        assert ok.status_code == 200, ok.text
    finally:
        server.proc.terminate()
        server.proc.wait(30)
