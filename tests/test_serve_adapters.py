"""LoRA adapters under --serve on a real 3-node ring: GET /v1/models lists them, a request
picks one by "model" or llama.cpp's "lora", two adapters stream at once through the official
openai client, and loading one while requests stream disturbs none of them."""
import os
import threading
import time

import pytest
import requests
import torch

from conftest import ServeProcess
from ringconfigs import parse_run_config, write_run_config
from mdi.model.source import ModelSource
from mdi.starter import batch
from test_adapter_ring import write_peft_lora

PROMPT = "The quick brown fox"
N = 12


@pytest.fixture(scope="module")
def setup(tiny_models, workers, tmp_path_factory):
    model = tiny_models["llama"]
    config = ModelSource(model).config
    # Adapters under the model's folder: where POST /v1/mdi/adapters may load from.
    base = os.path.dirname(model)
    dirs = {name: write_peft_lora(os.path.join(base, "lora-" + name), config, seed)
            for seed, name in enumerate(["chat", "tools", "late"], start=11)}
    path = write_run_config(tmp_path_factory.mktemp("serve-adapters") / "ring3.yaml", model, workers[:2],
                            layers=[1, 1, 2], worker_name="board%d",
                            adapters={"chat": dirs["chat"], "tools": dirs["tools"]},
                            runtime={"threads": 1, "ring_timeout": 30},
                            serve={"max_in_flight": 4, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        yield server, model, dirs
    finally:
        server.proc.terminate()
        server.proc.wait(30)


def alone(model, dirs, name):
    cfg = parse_run_config(model, label="alone", adapters=dirs, n_tokens=N)
    return batch.run(cfg, [PROMPT], adapters=[name]).texts[0]


def complete(server, **body):
    r = requests.post(server.url + "/v1/completions", json=dict({"prompt": PROMPT, "max_tokens": N}, **body),
                      timeout=120)
    return r


def test_models_lists_the_adapters_and_requests_pick_them(setup):
    server, model, dirs = setup
    ids = [m["id"] for m in server.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "chat", "tools"]
    want = {name: alone(model, {"chat": dirs["chat"], "tools": dirs["tools"]}, name)
            for name in ("base", "chat", "tools")}
    assert len(set(want.values())) == 3
    assert complete(server, model="tiny").json()["choices"][0]["text"] == want["base"]
    chat = complete(server, model="chat").json()
    assert chat["choices"][0]["text"] == want["chat"]
    assert chat["model"] == "chat"  # the model asked for, as OpenAI echoes it (it said "tiny")
    tools = complete(server, lora=[{"id": 1, "scale": 1}]).json()
    assert tools["choices"][0]["text"] == want["tools"] and tools["model"] == "tiny"
    bad = complete(server, model="nope")
    assert bad.status_code == 404 and "tiny, chat, tools" in bad.json()["error"]["message"]
    assert complete(server, lora=[{"id": 7}]).status_code == 400
    for bad_lora in ([{"id": 0, "scale": "x"}], [{"id": 0, "scale": 1e9}], [{"id": 0}, {"id": 0, "scale": 2}]):
        assert complete(server, lora=bad_lora).status_code == 400, bad_lora


def write_mixed_peft(path, parts):
    """The PEFT LoRA that adds sum scale_i * delta_i, written by hand from the parts' own files
    (ranks side by side, each part's alpha / r and scale folded into its B, lora_alpha = r):
    the reference for a request's lora mix."""
    import json
    from safetensors.torch import load_file, save_file
    loaded = []
    for d, scale in parts:
        with open(os.path.join(d, "adapter_config.json")) as f:
            cfg = json.load(f)
        assert not cfg.get("use_rslora") and not cfg.get("fan_in_fan_out")
        loaded.append((cfg, load_file(os.path.join(d, "adapter_model.safetensors")), scale))
    tensors, rank = {}, sum(cfg["r"] for cfg, _, _ in loaded)
    for key in loaded[0][1]:
        if key.endswith(".lora_A.weight"):
            tensors[key] = torch.cat([t[key] for _, t, _ in loaded])
        else:
            tensors[key] = torch.cat([t[key] * (s * cfg["lora_alpha"] / cfg["r"]) for cfg, t, s in loaded], dim=1)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(loaded[0][0], r=rank, lora_alpha=rank), f)
    return path


def test_lora_scales_and_mixes(setup, tmp_path):
    server, model, dirs = setup
    chat_id, tools_id = 0, 1  # their places in GET /v1/models' adapters
    mixed = write_mixed_peft(str(tmp_path / "mix"), [(dirs["chat"], 0.5), (dirs["tools"], -1.5)])
    want = alone(model, {"mix": mixed}, "mix")
    lora = [{"id": chat_id, "scale": 0.5}, {"id": tools_id, "scale": -1.5}]
    assert complete(server, lora=lora).json()["choices"][0]["text"] == want
    # the same mix again (listed the other way round) reuses the one loaded; it is never listed
    assert complete(server, lora=lora[::-1]).json()["choices"][0]["text"] == want
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny", "chat", "tools"]
    base = alone(model, {"chat": dirs["chat"]}, "base")
    assert complete(server, lora=[{"id": chat_id, "scale": 0}]).json()["choices"][0]["text"] == base
    half = write_mixed_peft(str(tmp_path / "half"), [(dirs["chat"], 0.5)])
    assert complete(server, lora=[{"id": chat_id, "scale": 0.5}]).json()["choices"][0]["text"] == \
        alone(model, {"half": half}, "half")


def test_two_adapters_stream_at_once_through_openai(setup):
    openai = pytest.importorskip("openai")
    server, model, dirs = setup
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = {}

    def stream(name):
        parts = [c.choices[0].text for c in client.completions.create(model=name, prompt=PROMPT, max_tokens=N,
                                                                       temperature=0, stream=True)]
        texts[name] = "".join(parts)
    threads = [threading.Thread(target=stream, args=(n,)) for n in ("chat", "tools")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    configured = {"chat": dirs["chat"], "tools": dirs["tools"]}
    assert texts == {n: alone(model, configured, n) for n in ("chat", "tools")}


def adapter_bytes(workers):
    return [requests.get("http://127.0.0.1:%d/status" % w.port, timeout=10).json()["memory"]["adapter_bytes"]
            for w in workers[:2]]


def test_loading_an_adapter_while_requests_stream(setup, workers):
    server, model, dirs = setup
    results = {}

    def run(i):
        results[i] = complete(server, model="chat", max_tokens=40).json()["choices"][0]["text"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    r = requests.post(server.url + "/v1/mdi/adapters", json={"name": "late", "path": dirs["late"]}, timeout=120)
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    cfg = parse_run_config(model, label="alone", adapters={"chat": dirs["chat"]}, n_tokens=40)
    want = batch.run(cfg, [PROMPT], adapters=["chat"]).texts[0]
    assert results == {0: want, 1: want, 2: want}
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny", "chat", "tools", "late"]
    late = complete(server, model="late").json()["choices"][0]["text"]
    assert late == alone(model, {"late": dirs["late"]}, "late")
    outside = requests.post(server.url + "/v1/mdi/adapters", json={"name": "x", "path": "/etc"}, timeout=30)
    assert outside.status_code == 400
    # a mix with "late" in it is held by the workers until "late" is unloaded, then dropped with it
    with_late = adapter_bytes(workers)
    assert complete(server, lora=[{"id": 0, "scale": 1}, {"id": 2, "scale": 0.25}]).status_code == 200
    with_mix = adapter_bytes(workers)
    assert all(m > w for m, w in zip(with_mix, with_late))
    assert requests.delete(server.url + "/v1/mdi/adapters/late", timeout=30).status_code == 200
    assert complete(server, model="late").status_code == 404
    assert all(a < w for a, w in zip(adapter_bytes(workers), with_late))  # late and its mix both gone


def test_unloading_an_adapter_while_requests_name_it_fails_no_other_request(setup):
    # DELETE while clients keep asking for the adapter: from then on requests naming it are
    # refused (503: being unloaded, then 404: unknown model), those running finish, and it
    # leaves the nodes between two steps of the ring. The base model's requests, in flight all
    # along, never notice, and the ring is never rebuilt.
    server, model, dirs = setup
    base_want = complete(server, model="tiny").json()["choices"][0]["text"]
    tools_want = alone(model, {"tools": dirs["tools"]}, "tools")
    stop = threading.Event()
    got = {"tiny": [], "tools": []}

    def client(name):
        while not stop.is_set():
            r = complete(server, model=name)
            body = r.json()
            text = body["choices"][0]["text"] if r.status_code == 200 and body.get("choices") else None
            got[name].append((r.status_code, text, body.get("choices", [{}])[0].get("finish_reason")
                              if r.status_code == 200 else body.get("error", {}).get("message")))
    threads = [threading.Thread(target=client, args=(name,)) for name in ("tiny", "tiny", "tools", "tools", "tools")]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120  # bounds a hang: a busy machine answers slowly
        while not all(any(g[0] == 200 for g in list(got[n])) for n in got) and time.monotonic() < deadline:
            time.sleep(0.05)  # until both have had an answer, with more in flight
        r = requests.delete(server.url + "/v1/mdi/adapters/tools", timeout=90)
        assert r.status_code == 200, r.text
        before = len(got["tools"]), len(got["tiny"])
        while time.monotonic() < deadline:  # the clients go on asking for a while after the unload
            if len(got["tools"]) > before[0] + 3 and len(got["tiny"]) > before[1] + 3:
                break
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert got["tiny"] and all(g == (200, base_want, "length") for g in got["tiny"]), got["tiny"][:5]
    assert (200, tools_want, "length") in got["tools"]
    for status, text, detail in got["tools"]:
        assert (status, text) == (200, tools_want) or status == 404 and "unknown model" in detail \
            or status == 503 and "being unloaded" in detail, (status, text, detail)
    assert got["tools"][-1][0] == 404  # once unloaded, an unknown model (OpenAI's model_not_found)
    assert "the ring failed" not in server.output()
    # loaded again, it answers as before
    r = requests.post(server.url + "/v1/mdi/adapters", json={"name": "tools", "path": dirs["tools"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert complete(server, model="tools").json()["choices"][0]["text"] == tools_want


def test_after_the_last_adapter_is_unloaded_unknown_names_are_still_refused(setup):
    server, model, dirs = setup
    bad = requests.post(server.url + "/v1/mdi/adapters", json={"name": "late\n", "path": dirs["late"]}, timeout=30)
    assert bad.status_code == 400 and "name" in bad.json()["error"]["message"]  # matched whole, newline too
    bad = requests.post(server.url + "/v1/mdi/adapters", json={"name": "late", "path": dirs["late"] + "\0x"},
                        timeout=30)
    assert bad.status_code == 400 and "NUL" in bad.json()["error"]["message"], bad.text
    loaded = [m["id"] for m in server.get("/v1/models").json()["data"]][1:]
    for name in loaded:
        assert requests.delete(server.url + "/v1/mdi/adapters/" + name, timeout=90).status_code == 200
    try:
        assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny"]
        for name in (loaded[0], "gpt-4o"):  # a name it served, and one it never knew
            r = complete(server, model=name)
            assert r.status_code == 404 and "unknown model" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["code"] == "model_not_found"
            assert server.get("/v1/models/" + name).status_code == 404  # OpenAI's retrieve: not listed
        assert complete(server, model="tiny").status_code == 200
        assert server.get("/v1/models/tiny").json() == server.get("/v1/models").json()["data"][0]
    finally:
        for name in loaded:
            requests.post(server.url + "/v1/mdi/adapters", json={"name": name, "path": dirs[name]}, timeout=120)


def test_a_full_mix_table_makes_room_from_the_mix_given_out_longest_ago(setup, workers):
    # Any client can ask for a new mix: with the table full (MAX_MIXES), the mix given out
    # longest ago that no request uses leaves every node for the new one, instead of every
    # other client's new mix being refused; an evicted mix asked for again is simply remade.
    from mdi.starter.adapter_set import MAX_MIXES
    server, model, dirs = setup
    lora = [[{"id": 0, "scale": 1}, {"id": 1, "scale": round(0.05 * (k + 1), 2)}] for k in range(MAX_MIXES + 3)]
    first = complete(server, lora=lora[0], max_tokens=4)
    assert first.status_code == 200, first.text
    for k, mix in enumerate(lora[1:], start=1):
        r = complete(server, lora=mix, max_tokens=4)
        assert r.status_code == 200, r.text
        if k == MAX_MIXES - 1:
            full = adapter_bytes(workers)  # the table full of these mixes (older ones made room)
    assert adapter_bytes(workers) == full  # three more mixes, no more memory on the workers
    again = complete(server, lora=lora[0], max_tokens=4)  # evicted, then made again: the same text
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_with_every_mix_in_use_a_new_mix_waits_for_one_to_end(setup):
    # MAX_MIXES requests, each with a mix of its own, hold the whole table (4 run, the rest wait
    # in the queue with their mixes); a request for another mix waits until one of them ends and
    # then runs, instead of the 400 it used to get. The mixes are made first (one token each),
    # so the held requests all enter at once, long before any of them ends.
    import threading

    from mdi.starter.adapter_set import MAX_MIXES
    server, _, _ = setup
    mixes = [[{"id": 0, "scale": 1}, {"id": 1, "scale": round(0.9 - 0.03 * k, 2)}] for k in range(MAX_MIXES)]
    for lora in mixes:
        assert complete(server, max_tokens=1, lora=lora).status_code == 200
    streams = [None] * MAX_MIXES

    def hold(k):  # returns once its request is queued, with its mix
        streams[k] = requests.post(server.url + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 100, "stream": True, "lora": mixes[k]}, stream=True, timeout=120)

    holders = [threading.Thread(target=hold, args=(k,)) for k in range(MAX_MIXES)]
    try:
        for t in holders:
            t.start()
        for t in holders:
            t.join(60)
        assert all(r is not None and r.status_code == 200 for r in streams)
        late = complete(server, max_tokens=4, lora=[{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.5}])
        assert late.status_code == 200, late.text
        for r in streams:  # the held requests ran to their ends
            assert r.content.rstrip().endswith(b"data: [DONE]")
    finally:
        for r in streams:
            if r is not None:
                r.close()


def test_adapter_errors_name_paths_relative_to_the_models_folder(setup, tmp_path):
    """Loaders name the files they read by their full paths; a client is shown them relative
    to the models folder (issue 58, 6), never the server's own layout."""
    server, model, dirs = setup
    base = os.path.dirname(os.path.realpath(model))
    broken = os.path.join(base, "lora-broken")
    os.makedirs(broken, exist_ok=True)
    with open(os.path.join(broken, "adapter_config.json"), "w") as f:
        f.write("{not json")
    for path in (os.path.join(base, "no-such-lora"), broken):
        r = requests.post(server.url + "/v1/mdi/adapters", json={"name": "x", "path": path}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        message = r.json()["error"]["message"]
        assert os.path.basename(path) in message and base not in message, message


def test_soft_prompts_never_share_cached_positions_with_each_other_or_the_base(setup):
    """A soft prompt's placeholder ids are real token ids: cached as the base's, one soft
    prompt's positions were reused for another's (its text then the other's) and for a base
    prompt that starts with those ids."""
    import json
    from safetensors.torch import save_file
    server, model, dirs = setup
    config = ModelSource(model).config
    names = []
    try:
        for seed, name in enumerate(["soft-a", "soft-b"]):
            folder = os.path.join(os.path.dirname(model), name)
            os.makedirs(folder, exist_ok=True)
            torch.manual_seed(seed)
            save_file({"prompt_embeddings": torch.randn(3, config.n_embd)},
                      os.path.join(folder, "adapter_model.safetensors"))
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump({"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": 3}, f)
            r = requests.post(server.url + "/v1/mdi/adapters", json={"name": name, "path": folder}, timeout=120)
            assert r.status_code == 200, r.text
            names.append(name)
        text = {}
        for name in names + ["tiny"]:  # each after the other: the one before is in the cache
            prompt = PROMPT if name != "tiny" else [0, 0, 0] + ModelSource(model).tokenizer.encode(PROMPT)
            warm, cold = (complete(server, model=name, prompt=prompt, cache_prompt=c) for c in (True, False))
            assert warm.status_code == cold.status_code == 200, (warm.text, cold.text)
            text[name] = warm.json()["choices"][0]["text"]
            assert text[name] == cold.json()["choices"][0]["text"], name
        assert text["soft-a"] != text["soft-b"]
    finally:
        for name in names:
            requests.delete(server.url + "/v1/mdi/adapters/" + name, timeout=90)


def test_a_server_with_adapters_answers_503_for_them_while_its_ring_is_not_up():
    """Before the ring is up (or while it is rebuilt) no engine holds the adapters: GET
    /v1/models and a request naming one (by `model` or `lora`) get a 503 saying so, not a list
    without them or a 404 "unknown model" (h97); the base model is still served by name, and a
    server that never had adapters lists its model."""
    from types import SimpleNamespace
    from mdi.serving.adapter_routes import AdapterControl
    from mdi.serving.validation import ApiError
    sched = SimpleNamespace(engine=None, state="starting")
    control = AdapterControl(sched, None, "tiny", True, lambda name: False, lambda path: False)
    for call in (control.loaded, lambda: control.adapter_of({"model": "chat", "lora": []}),
                 lambda: control.adapter_of({"model": None, "lora": [{"id": 0, "scale": 1.0}]})):
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 503 and "the ring is starting" in e.value.message
    assert control.adapter_of({"model": "tiny", "lora": []}) == 0
    plain = AdapterControl(sched, None, "tiny", False, lambda name: False, lambda path: False)
    assert plain.loaded() == [] and plain.adapter_of({"model": "anything", "lora": []}) == 0
