"""runtime.kv_type f32 on the ggml backend: ggml's CPU attention sums the values of a float16
cache in float16 (as llama.cpp does), most of what parts its logits from torch's float32
reference; a float32 cache sums in float32, so a tiny random model's log-probabilities agree
with torch's within 1e-3 on a prompt's tiled pass and on one-row decode passes, and a ring of
3 whose nodes compute with ggml on a float32 cache gives torch's greedy ids."""
import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.source import ModelSource

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

PROMPT_ROWS, DECODE_ROWS = 70, 6  # a pass of 64 rows or more takes ggml's tiled attention kernel


# How close a float32 cache comes to torch: measured 1e-4 on the Llama; Gemma 3's GELU goes
# through ggml's float16 table on a CPU (as llama.cpp's), 2e-3 there
F32_VS_TORCH = {"llama": 1e-3, "gemma3": 5e-3}


@pytest.fixture(scope="module", params=sorted(F32_VS_TORCH))
def tiny(request, tmp_path_factory):
    """(family, path) of a tiny random model (llama: 8 heads 8 wide; gemma3: sliding windows,
    one KV group per 2 heads), its GGUF in float32."""
    return request.param, make_tiny_model(str(tmp_path_factory.mktemp("kv-types") / request.param), request.param)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ggml_logits(source, kv_type, ids):
    """Every position's logits: the prompt in one pass, then one row a pass (decode steps)."""
    chunk = source.ggml_chunk(0, source.config.n_layer, True, True, threads=1, kv_type=kv_type)
    try:
        chunk.allocate_cache(1, source.config.block_size)
        out = [chunk.head(chunk.forward_rows(chunk.embed_rows(ids[:PROMPT_ROWS], None),
                                             PassRows([0], [0], [PROMPT_ROWS])))]
        for at in range(PROMPT_ROWS, len(ids)):
            out.append(chunk.head(chunk.forward_rows(chunk.embed_rows(ids[at:at + 1], None), PassRows([0], [at], [1]))))
        return np.concatenate(out)
    finally:
        chunk.close()


def test_a_float32_cache_gives_torch_s_log_probabilities(tiny):
    family, path = tiny
    source = ModelSource(path)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, source.config.vocab_size, PROMPT_ROWS + DECODE_ROWS).astype(np.int32)
    net = source.load_chunk(0, source.config.n_layer, True, True, torch.float32, "cpu")
    with torch.no_grad():
        want = log_softmax(net.forward_batch(torch.tensor([ids.tolist()]))[0].numpy())
    error = {kv: np.abs(log_softmax(ggml_logits(source, kv, ids)) - want).max() for kv in ("f16", "f32")}
    assert error["f32"] < F32_VS_TORCH[family], error
    assert error["f32"] < error["f16"] / 4, error  # float16 sums: 0.01-0.07 on these models


def test_a_ggml_ring_on_a_float32_cache_gives_torch_s_greedy_ids(tiny, tmp_path):
    """The setting travels to the workers (each node's cache twice a float16 one's bytes), and
    the ring's greedy ids are torch's."""
    import json
    import os
    import subprocess

    from conftest import BIN, ROOT, WorkerProcess, free_ports
    from ringconfigs import write_run_config
    workers = [WorkerProcess(p) for p in free_ports(2)]
    try:
        ring = [w.wait_ready() for w in workers]
        ids, cache_bytes = {}, {}
        for backend, kv_type in (("torch", "f16"), ("ggml", "f16"), ("ggml", "f32")):
            name = backend + "-" + kv_type
            config = write_run_config(tmp_path / (name + ".yaml"), tiny[1], ring, n_tokens=40,
                                      runtime={"threads": 1, "backend": backend, "kv_type": kv_type})
            out = str(tmp_path / (name + ".json"))
            proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--metrics-out", out,
                                   "--temperature", "0", "--prompt", "To be, or not to be", "--prompt", "abc"],
                                  capture_output=True, text=True, timeout=600, cwd=ROOT)
            assert proc.returncode == 0, proc.stderr
            with open(out) as f:
                record = json.load(f)
            assert [n["backend"] for n in record["nodes"]] == [backend] * 3
            ids[name] = [s["token_ids"] for s in record["samples"]]
            cache_bytes[name] = [n["cache_bytes"] for n in record["nodes"]]
        assert cache_bytes["ggml-f32"] == [2 * b for b in cache_bytes["ggml-f16"]]
        assert ids["ggml-f32"] == ids["torch-f16"]
    finally:
        for w in workers:
            w.stop()


def test_kv_type_takes_model_dtypes_spelling_and_refuses_others_in_one_line():
    from mdi.runconfig import ConfigError, parse_config
    for given, kept in (("float16", "f16"), ("f16", "f16"), ("float32", "f32"), ("q8_0", "q8_0"), ("Q8_0", "q8_0"),
                        ("F16", "f16")):
        assert parse_config({"model": {"path": "m"}, "runtime": {"kv_type": given}}, "r.yaml").runtime.kv_type == kept
    with pytest.raises(ConfigError, match=r"^r.yaml: runtime.kv_type: expected one of f16, q8_0, f32, got 'q4_0'$"):
        parse_config({"model": {"path": "m"}, "runtime": {"kv_type": "q4_0"}}, "r.yaml")
