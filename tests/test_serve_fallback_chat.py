"""Chat with a model that has no chat template of its own (Gemma 3 270M's GGUF carries none):
the fallback's "role: content" lines, and the answer ends where it would start the next turn
("\\nuser:" ...) rather than writing the user's lines too; the client's own stop strings still
count, and a completion (no turns) is not cut."""
import pytest
import requests

from conftest import ServeProcess
from ringconfigs import write_run_config
from mdi.serving.prompts import FALLBACK_STOPS


@pytest.fixture(scope="module")
def gemma_server(gemma3_gguf, tmp_path_factory):
    path = write_run_config(tmp_path_factory.mktemp("fallback-chat") / "gemma.yaml", gemma3_gguf,
                            runtime={"threads": 1, "backend": "ggml"},
                            serve={"max_in_flight": 1, "max_len": 512, "model_name": "gemma"})
    srv = ServeProcess(path).wait_ready()
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.output()


def post(server, route, body):
    r = requests.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_fallback_chat_answer_ends_before_the_next_turn(gemma_server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 80, "temperature": 0}
    answer = post(gemma_server, "/v1/chat/completions", body)["choices"][0]
    assert answer["finish_reason"] == "stop", answer  # measured: it went on "\nuser: Hello\nassistant: ..."
    assert not any(stop in answer["message"]["content"] for stop in FALLBACK_STOPS)
    # the same text as a completion of the rendered prompt, which no turn cuts
    rendered = "user: Hello\nassistant:"
    whole = post(gemma_server, "/v1/completions", {"prompt": rendered, "max_tokens": 80, "temperature": 0})
    text = whole["choices"][0]["text"]
    assert any(stop in text for stop in FALLBACK_STOPS), text
    assert text.startswith(answer["message"]["content"])
