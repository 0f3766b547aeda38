"""The ggml backend through the ring (real worker processes on loopback): a ring of 3 computing
with ggml gives the greedy ids one ggml process gives alone, whatever the samples in flight and
the prompts' chunking; a ring may mix ggml and torch nodes; each node's backend is in the
metrics record; auto decides on each node, once per machine; a node computing with ggml, the
starter included, holds its layers, its cache and little else (never torch)."""
import json
import os
import subprocess

import pytest
import requests

from conftest import BIN, ROOT, ServeProcess, WorkerProcess, free_ports
from ringconfigs import write_run_config
from mdi.lab.cgroups import peak_rss_bytes
from mdi.model.constraints.constraint import unavailable as constraint_unavailable
from mdi.model.ggml import lib

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def two_workers():
    procs = [WorkerProcess(p) for p in free_ports(2)]
    try:
        yield [w.wait_ready() for w in procs]
    finally:
        for w in procs:
            w.stop()


def start(config, tmp_path, *extra, env=None, prompts=PROMPTS):
    out = str(tmp_path / "metrics.json")
    args = [os.path.join(BIN, "mdi-start"), "--config", config, "--metrics-out", out]
    for p in prompts:
        args += ["--prompt", p]
    proc = subprocess.run(args + list(extra), capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f), proc


def no_torch_env(tmp_path, *also):
    """Environment for a process whose `import torch` fails, and the import of each module
    `also` names: a package of that name that raises comes first on its path."""
    root = tmp_path / "-".join(("no-torch",) + also)
    for name in ("torch",) + also:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text("raise ImportError('a starter computing with ggml imported %s')\n" % name)
    return {"PYTHONPATH": os.pathsep.join([str(root), ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def ids(record):
    return [s["token_ids"] for s in record["samples"]]


def test_a_ring_of_three_on_ggml_gives_one_ggml_process_s_greedy_ids(smollm2_dir, two_workers, tmp_path):
    alone = write_run_config(tmp_path / "alone.yaml", smollm2_dir, n_tokens=16,
                             runtime={"threads": 1, "backend": "ggml"})
    ring = write_run_config(tmp_path / "ring.yaml", smollm2_dir, two_workers, n_tokens=16,
                            runtime={"threads": 1, "backend": "ggml", "prefill_chunk": 3})
    solo, _ = start(alone, tmp_path)
    assert "Paris" in solo["samples"][0]["text"]
    ringed, proc = start(ring, tmp_path)
    assert ids(ringed) == ids(solo)  # three samples in flight, prompts in passes of 3 tokens
    assert [n["backend"] for n in ringed["nodes"]] == ["ggml"] * 3
    assert "mdi: backends: starter ggml, w1 ggml, w2 ggml" in proc.stderr
    one, _ = start(ring, tmp_path, prompts=PROMPTS[1:2])  # alone in the ring
    assert ids(one)[0] == ids(solo)[1]


def test_gemma3_s_sliding_window_layers_keep_rings_on_every_node_and_the_same_text(gemma3_gguf, two_workers,
                                                                                  tmp_path):
    """A prompt longer than the rings of Gemma 3's sliding-window layers (512 + 512 positions:
    mdi.model.sliding_cache): a ring of 3 keeping rings on each node, its prompt in passes of 16,
    gives the ids of one process in passes of 512 (a ring's size is the model's alone), and
    holds 15 of its 18 layers' caches in rings."""
    text = " ".join("Line %d: the quick brown fox jumps over the lazy dog number %d." % (i, i * 7 % 13)
                    for i in range(70))  # about 1,270 tokens
    alone = write_run_config(tmp_path / "alone.yaml", gemma3_gguf, n_tokens=12,
                             runtime={"threads": 1, "backend": "ggml", "prefill_chunk": 512})
    ring = write_run_config(tmp_path / "ring.yaml", gemma3_gguf, two_workers, n_tokens=12,
                            runtime={"threads": 1, "backend": "ggml", "prefill_chunk": 16})
    solo, proc = start(alone, tmp_path, prompts=[text])
    assert "sliding-window layers keep 1024 positions a slot" in proc.stderr
    assert "Line 70" in solo["samples"][0]["text"]
    ringed, proc = start(ring, tmp_path, prompts=[text])
    assert ids(ringed) == ids(solo)
    assert "sliding-window layers keep 1024 positions a slot" in proc.stderr
    position_bytes = 2 * 256 * 2  # K and V of one 256-wide head in float16
    max_len = len(solo["samples"][0]["prompt_ids"]) + 12  # a slot's positions: the prompt and its tokens
    kept = (15 * 1024 + 3 * max_len) * position_bytes  # not 18 * max_len
    assert sum(n["cache_bytes"] for n in ringed["nodes"]) == solo["nodes"][0]["cache_bytes"] == kept


def test_a_ring_may_mix_ggml_and_torch_nodes(smollm2_dir, two_workers, tmp_path):
    config = write_run_config(tmp_path / "mixed.yaml", smollm2_dir, two_workers, n_tokens=12,
                              runtime={"threads": 1, "kv_type": "q8_0"},
                              dtype="float16",
                              node_options={0: {"backend": "ggml", "quant": "int4"}, 1: {"backend": "torch"},
                                            2: {"backend": "ggml", "quant": "int8"}})
    record, proc = start(config, tmp_path)
    assert [n["backend"] for n in record["nodes"]] == ["ggml", "torch", "ggml"]
    # a ggml node's quant is torch's, a torch node's KV type ggml's: said, not silently dropped
    assert "w2: quant int8 is torch's: ggml computes the GGUF's tensors as stored" in proc.stderr, proc.stderr
    assert "starter: quant int4 is torch's: ggml computes the GGUF's tensors as stored (mdi-prepare --quant writes " \
        "other types); dtype float16 is torch's" in proc.stderr, proc.stderr
    assert "w1: runtime.kv_type q8_0 is ggml's" in proc.stderr and "w2: runtime.kv_type" not in proc.stderr
    assert "Paris" in record["samples"][0]["text"]
    assert all(len(s["token_ids"]) == 12 for s in record["samples"])


def test_auto_decides_on_each_node_once_per_machine(smollm2_dir, two_workers, tmp_path):
    """runtime.backend auto: every node measures both backends on its own shapes (a child process
    each, one machine at a time), says what it chose and why, and a second run recalls it."""
    config = write_run_config(tmp_path / "auto.yaml", smollm2_dir, two_workers, n_tokens=8,
                              runtime={"threads": 1, "backend": "auto"})
    first, proc = start(config, tmp_path)
    lines = [n["backend_line"] for n in first["nodes"]]
    assert all(line.startswith(("ggml (auto", "torch (auto")) for line in lines), lines
    assert all("ms per block" in line for line in lines), lines
    second, _ = start(config, tmp_path)
    for before, now in zip(first["nodes"], second["nodes"]):
        # A measurement taken while the machine was busy is taken again once it is quiet (the
        # load average moves on its own between the two runs); any other is recalled as it was.
        if "busy" in before["backend_line"] and "measured" in now["backend_line"]:
            continue
        assert "recalled" in now["backend_line"], (before["backend_line"], now["backend_line"])
        assert now["backend"] == before["backend"]


def test_a_ggml_worker_holds_its_layers_its_cache_and_little_else(smollm2_dir, tmp_path):
    """A worker computing with ggml never loads torch: its peak memory is its layers' GGUF bytes
    (memory-mapped, only its own tensors read), its KV cache and the Python runtime, within 150 MB
    of the first two. Fresh workers: one that computed with torch before keeps torch's libraries."""
    from mdi.model.source import ModelSource
    workers = [WorkerProcess(p) for p in free_ports(2)]
    try:
        for w in workers:
            w.wait_ready()
        config = write_run_config(tmp_path / "mem.yaml", smollm2_dir, workers, n_tokens=16,
                                  runtime={"threads": 1, "backend": "ggml"})
        record, _ = start(config, tmp_path)
        source = ModelSource(smollm2_dir)
        for node, worker in zip(record["nodes"][1:], workers):
            own = source.gguf_bytes(node["layers"][0], node["layers"][1], False, False) + node["cache_bytes"]
            assert node["peak_memory_bytes"] <= own + 150 * 2 ** 20, \
                (node["name"], node["peak_memory_bytes"] >> 20, own >> 20)
            # a stray training request, whatever its body, is refused before torch is imported
            for method in ("POST", "GET", "DELETE"):
                reply = requests.request(method, "http://127.0.0.1:%d/train" % worker.port, data=b"x" * 64, timeout=60)
                assert reply.status_code == 400 and "training" in reply.json()["error"], reply.text
            with open("/proc/%d/maps" % worker.proc.pid) as f:
                assert "libtorch" not in f.read()
        # layers: auto times every node on ggml first (a profile cache of its own: measured
        # here, not recalled): neither the workers nor the starter load torch for it.
        env = dict(no_torch_env(tmp_path), MDI_PROFILE_CACHE=str(tmp_path / "profiles"))
        auto = write_run_config(tmp_path / "auto.yaml", smollm2_dir, workers, layers="auto", n_tokens=8,
                                runtime={"threads": 1, "backend": "ggml"})
        record, proc = start(auto, tmp_path, env=env)
        assert "timing board" in proc.stderr or "timing w1" in proc.stderr, proc.stderr
        assert all(len(s["token_ids"]) == 8 for s in record["samples"])
        for worker in workers:
            with open("/proc/%d/maps" % worker.proc.pid) as f:
                assert "libtorch" not in f.read()
    finally:
        for w in workers:
            w.stop()


def test_a_ggml_starter_never_loads_torch_and_holds_its_layers_and_little_else(smollm2_dir, two_workers, tmp_path):
    """A starter computing with ggml embeds, samples (temperature, top-k, top-p) and
    pushes its workers' layers without torch, whose import fails here (a `torch` that raises is
    first on its path): its peak memory is its own layers' GGUF bytes (embedding, blocks and
    head), its KV cache and the Python runtime, within 150 MB. Pushing a worker's layers leaves
    none of them in its memory (they were read through its map of the file, all resident).
    Standalone and as a ring of 3's starter, with a prompt long enough to need a real cache.
    Alone it never imports requests either (12 MB resident for a client it has no use for)."""
    from mdi.model.source import ModelSource
    env = no_torch_env(tmp_path)
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 50)
    sampled = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3}
    source = ModelSource(smollm2_dir)
    alone = write_run_config(tmp_path / "alone.yaml", smollm2_dir, n_tokens=24, generation=sampled,
                             runtime={"threads": 1, "backend": "ggml"})
    ring = write_run_config(tmp_path / "ring.yaml", smollm2_dir, two_workers, n_tokens=24, generation=sampled,
                            runtime={"threads": 1, "backend": "ggml"})
    raw = write_run_config(tmp_path / "raw.yaml", os.path.join(smollm2_dir, "model.gguf"), n_tokens=24,
                           generation=sampled, runtime={"threads": 1, "backend": "ggml"})  # the GGUF as model.path
    for config, run_env in ((alone, no_torch_env(tmp_path, "requests")), (raw, env), (ring, env)):
        record, _ = start(config, tmp_path, env=run_env, prompts=[prompt, "Once upon a time"])
        assert all(len(s["token_ids"]) == 24 for s in record["samples"])
        starter = record["nodes"][0]
        first, last = starter["layers"]
        own = source.gguf_bytes(first, last, True, True) + starter["cache_bytes"]
        assert starter["backend"] == "ggml" and starter["cache_bytes"] > 0
        assert starter["peak_memory_bytes"] <= own + 150 * 2 ** 20, (starter["peak_memory_bytes"] >> 20, own >> 20)
    # --check too: its kernel lines say ggml's blocks apply, not torch's kernels
    check = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", ring, "--check"], capture_output=True,
                           text=True, timeout=600, cwd=ROOT, env=dict(os.environ, **env))
    assert check.returncode == 0 and "check: all nodes ready" in check.stdout, check.stdout + check.stderr
    assert "kernels: ggml's" in check.stdout and "kernel copies" not in check.stdout, check.stdout
    # Serving too: sampling fields, logprobs, a JSON schema, speculation's pass costs, /metrics, /v1/mdi/state
    served = write_run_config(tmp_path / "serve.yaml", smollm2_dir, runtime={"threads": 1, "backend": "ggml"},
                              serve={"max_in_flight": 2})
    server = ServeProcess(served, env=dict(os.environ, **env)).wait_ready()
    try:
        body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0.7, "seed": 1,
                "top_p": 0.9, "frequency_penalty": 0.5, "logit_bias": {"28": 2}, "logprobs": True, "top_logprobs": 2}
        r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["content"]) == 8
        if constraint_unavailable() is None:  # a grammar's masks are numpy too
            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                      "additionalProperties": False}
            body = {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 12, "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
            r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            if r.json()["choices"][0]["finish_reason"] == "stop":
                assert isinstance(json.loads(text)["n"], int), text
            else:  # cut at max_tokens: still the schema's start
                assert text.startswith('{"'), text
        assert server.get("/metrics").ok and server.get("/v1/mdi/state").json()["state"] == "up"
        # served, within the bound too (grammar tables, built at the first grammar, counted)
        node = server.get("/v1/mdi/state").json()["nodes"][0]
        peak = peak_rss_bytes(server.proc.pid)
        own = source.gguf_bytes(node["layers"][0], node["layers"][1], True, True) + node["cache_bytes"]
        assert peak is not None and peak <= own + 150 * 2 ** 20, (peak, own >> 20)
    finally:
        server.stop()
    assert "imported torch" not in server.output(), server.output()


def test_a_ggml_starter_drafts_on_ggml_without_torch(smollm2_dir, tmp_path):
    """A draft model with a GGUF computes on ggml beside a ggml starter, torch never imported
    (its import fails here), and the greedy ids are the plain run's."""
    env = no_torch_env(tmp_path)
    runtime = {"threads": 1, "backend": "ggml"}
    prompts = ["def add(a, b):\n    return a + b\n\nHere is the same code again:\n"]
    plain = write_run_config(tmp_path / "plain.yaml", smollm2_dir, n_tokens=24, runtime=runtime)
    drafted = write_run_config(tmp_path / "draft.yaml", smollm2_dir, n_tokens=24, runtime=runtime,
                               generation={"speculation": {"draft": smollm2_dir}})
    want, _ = start(plain, tmp_path, env=env, prompts=prompts)
    got, _ = start(drafted, tmp_path, env=env, prompts=prompts)
    assert ids(got) == ids(want)
    record = got["nodes"][0]["speculation"]
    assert record["draft_backend"] == "ggml" and record["drafted"] > 0, record


def test_a_ggml_ring_runs_a_lora_and_a_soft_prompt_without_torch(smollm2_dir, two_workers, tmp_path):
    """Adapter files (a PEFT LoRA and a prompt-tuning adapter) are read, installed on every
    node's layers and sent to the workers with torch never imported on a ggml ring (its import
    fails here): each adapter changes the text, and a sample's ids are its ids alone."""
    import numpy as np
    from safetensors.numpy import save_file

    from mdi.lab.random_lora import write_random_lora
    from mdi.model.source import ModelSource
    config = ModelSource(smollm2_dir).config
    lora = write_random_lora(str(tmp_path / "lora"), config, seed=3, rank=4, std=0.05)
    soft = tmp_path / "soft"
    soft.mkdir()
    embeddings = np.random.default_rng(1).standard_normal((3, config.n_embd)).astype(np.float32) * 0.05
    save_file({"prompt_embeddings": embeddings}, str(soft / "adapter_model.safetensors"))
    (soft / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM",
                                                          "num_virtual_tokens": 3, "token_dim": config.n_embd}))
    cfg = write_run_config(tmp_path / "adapters.yaml", smollm2_dir, two_workers, n_tokens=12,
                           runtime={"threads": 1, "backend": "ggml"}, adapters={"lora": lora, "soft": str(soft)})
    env = no_torch_env(tmp_path)
    names = ["base", "lora", "soft"]
    together, _ = start(cfg, tmp_path, *[a for n in names for a in ("--adapter", n)], env=env, prompts=[PROMPTS[0]] * 3)
    assert len({tuple(t) for t in ids(together)}) == 3, ids(together)  # each adapter changes the text
    for name, want in zip(names, ids(together)):
        alone, _ = start(cfg, tmp_path, "--adapter", name, env=env, prompts=[PROMPTS[0]])
        assert ids(alone) == [want], name
    # served: a scaled LoRA (a mix of one: numpy too) and the soft prompt by name
    served = write_run_config(tmp_path / "serve-adapters.yaml", smollm2_dir, runtime={"threads": 1, "backend": "ggml"},
                              serve={"max_in_flight": 2}, adapters={"lora": lora, "soft": str(soft)})
    server = ServeProcess(served, env=dict(os.environ, **env)).wait_ready()
    try:
        for extra in ({"lora": [{"id": 0, "scale": 0.5}]}, {"model": "soft"}):
            r = requests.post(server.url + "/v1/completions", json=dict({"prompt": PROMPTS[0], "max_tokens": 4,
                                                                       "temperature": 0}, **extra), timeout=120)
            assert r.status_code == 200, (extra, r.text)
    finally:
        server.stop()
    assert "imported torch" not in server.output(), server.output()
