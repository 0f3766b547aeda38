"""mdi-prepare checks what it can before writing anything, writes files as any other program
would (the umask decides their mode) and says what is missing."""
import json
import os
import stat
import subprocess

import pytest
import torch

from conftest import BIN, ROOT

PREPARE = os.path.join(BIN, "mdi-prepare")
NANOGPT = os.path.join(ROOT, "models", "nanogpt-shakespeare")


def prepare(*args, umask=None):
    return subprocess.run([PREPARE] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


@pytest.mark.parametrize("chunks, needle", [("1-1", "summing to n_layer=4"), ("2-x", "bad partition"),
                                            ("0-4", "bad partition")])
def test_bad_chunks_are_refused_before_anything_is_written(tmp_path, chunks, needle):
    out = tmp_path / "out"
    proc = prepare(NANOGPT, "--out", str(out), "--chunks", "2-2", "--chunks", chunks)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_follow_the_umask(tmp_path, umask):
    out = tmp_path / "out"
    proc = prepare(NANOGPT, "--out", str(out), "--chunks", "2-2", umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert "cut node 1 of 2-2" in proc.stderr  # progress per chunk
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files) and any(p.name == "node1.safetensors" for p in files)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p


def test_a_folder_without_tokenizer_files_says_what_is_missing(tmp_path):
    from safetensors.torch import save_file
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 40, "max_position_embeddings": 32,
        "tie_word_embeddings": True}))
    names = {"model.embed_tokens.weight": (40, 16), "model.norm.weight": (16,),
             "model.layers.0.input_layernorm.weight": (16,), "model.layers.0.post_attention_layernorm.weight": (16,),
             "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (16, 16),
             "model.layers.0.self_attn.v_proj.weight": (16, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
             "model.layers.0.mlp.gate_proj.weight": (32, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
             "model.layers.0.mlp.down_proj.weight": (16, 32)}
    save_file({k: torch.zeros(s) for k, s in names.items()}, str(hf / "model.safetensors"))
    proc = prepare(str(hf), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    for needle in ("tokenizer.json", "tokenizer.model", "--vocab", str(hf)):
        assert needle in proc.stderr, (needle, proc.stderr)
    assert not (tmp_path / "out").exists()
