"""A Hugging Face checkpoint mdi cannot compute exactly is refused in one line naming the setting
or file; mdi-prepare never writes over the checkpoint it reads, leaves no stale chunks, and a
SIGTERM cleans up as Ctrl-C does (h65's audit)."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import BIN, ROOT
from test_gemma3_torch import _rewrite_config
from mdi.model.config import ModelConfig
from mdi.model.files.checkpoints import read_hf_dir
from mdi.model.files.gguf_export import plan_types
from mdi.model.layout import CheckpointError

PREPARE = os.path.join(BIN, "mdi-prepare")
NANOGPT = os.path.join(ROOT, "models", "nanogpt-shakespeare")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=120, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    _rewrite_config(dst, **changes)
    return dst


@pytest.mark.parametrize("changes, needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"hidden_act": "relu", "model_type": "qwen2"}, "hidden_act 'relu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_size": "64"}, "hidden_size must be an integer"),
])
def test_a_setting_mdi_does_not_compute_is_refused_naming_it(hf_llama, tmp_path, changes, needle):
    path = _copy_with_config(hf_llama, str(tmp_path / "odd"), **changes)
    with pytest.raises(CheckpointError, match="config") as e:
        read_hf_dir(path)
    assert needle in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("changes, needle", [
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"activation_function": "quick_gelu"}, "activation_function 'quick_gelu'"),
    ({"scale_attn_weights": False}, "scale_attn_weights=False"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_gpt2_settings_that_change_its_maths_are_refused(tmp_path, changes, needle):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    path = str(tmp_path / "gpt2")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    read_hf_dir(path)  # as saved: read
    odd = _copy_with_config(path, str(tmp_path / "odd"), **changes)
    with pytest.raises(CheckpointError, match=needle):
        read_hf_dir(odd)


def test_mistral_context_stops_at_its_sliding_window():
    """Within its window Mistral's attention is mdi's full attention; past it, not."""
    hf = dict(model_type="mistral", vocab_size=100, num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32768)
    assert ModelConfig.from_hf(dict(hf, sliding_window=4096)).block_size == 4096
    assert ModelConfig.from_hf(dict(hf, sliding_window=None)).block_size == 32768
    # Qwen2's sliding_window counts only with use_sliding_window, refused by the reader
    assert ModelConfig.from_hf(dict(hf, model_type="qwen2", sliding_window=4096)).block_size == 32768


def test_a_tensor_in_two_files_without_an_index_is_refused(hf_llama, tmp_path):
    """transformers would read model.safetensors alone; mixing both files took each tensor from
    whichever sorted last."""
    path = str(tmp_path / "two")
    shutil.copytree(hf_llama, path)
    save_file({"model.norm.weight": torch.ones(64)}, os.path.join(path, "model_backup.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight is in model.safetensors too"):
        read_hf_dir(path)


def test_unreadable_weight_files_are_one_line_naming_them(hf_llama, tmp_path):
    path = str(tmp_path / "cut")
    shutil.copytree(hf_llama, path)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read"):
        read_hf_dir(path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(CheckpointError, match='index.json: no "weight_map"'):
        read_hf_dir(path)


def test_f16_asked_for_keeps_values_past_its_range_in_f32(hf_llama):
    """float16 would store 1e5 as an infinity, and every logit would be NaN."""
    config, state = read_hf_dir(hf_llama)
    state["blocks.0.mlp.down.weight"][0, 0] = 1e5
    types = plan_types(config, state, "F16")
    assert types["blk.0.ffn_down.weight"] == "F32" and types["blk.1.ffn_down.weight"] == "F16"
    assert plan_types(config, state, None)["blk.0.ffn_down.weight"] == "F32"  # auto, as before


def _prepare(*args, **kw):
    return subprocess.run([PREPARE] + list(args), capture_output=True, text=True, timeout=600, **kw)


def test_prepare_never_writes_over_the_checkpoint_it_reads(hf_llama, tmp_path):
    path = str(tmp_path / "hf")
    shutil.copytree(hf_llama, path)
    before = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}
    proc = _prepare(path, "--out", path + "/", "--quant", "q8_0")
    assert proc.returncode == 2 and "is the source itself" in proc.stderr and "Traceback" not in proc.stderr
    assert {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)} == before


def test_a_new_preparation_removes_the_chunks_cut_from_the_old(tmp_path):
    out = str(tmp_path / "nano")
    assert _prepare(NANOGPT, "--out", out, "--quant", "int8", "--chunks", "2-2").returncode == 0
    assert os.path.isdir(os.path.join(out, "chunks", "2-2"))
    proc = _prepare(NANOGPT, "--out", out, "--quant", "none")
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(os.path.join(out, "chunks"))


def test_sigterm_during_a_preparation_leaves_no_half_model(smollm2_gguf, tmp_path):
    """`timeout`, `kill` and systemd stop with SIGTERM: the fresh folder goes, as on Ctrl-C."""
    out = str(tmp_path / "half")
    proc = subprocess.Popen([PREPARE, smollm2_gguf, "--out", out, "--quant", "q8_0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        while not os.path.exists(out) and proc.poll() is None:  # the folder is made before its weights are written
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted" in err and "Traceback" not in err, err
    assert not os.path.exists(out)


def test_a_prepared_directorys_gguf_is_a_source_with_the_tokenizer_beside_it(hf_llama, tmp_path):
    """mdi writes a model directory's GGUF without a vocabulary when its tokenizer is mdi's own."""
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(list("abcdefgh ")))
    first = str(tmp_path / "first")
    proc = _prepare(hf_llama, "--out", first, "--vocab", str(vocab), "--quant", "q8_0")
    assert proc.returncode == 0, proc.stderr
    proc = _prepare(os.path.join(first, "model.gguf"), "--out", str(tmp_path / "again"))
    assert proc.returncode == 0, proc.stderr
    again = str(tmp_path / "again" / "tokenizer_mdi.json")
    with open(os.path.join(first, "tokenizer_mdi.json")) as a, open(again) as b:
        assert json.load(a) == json.load(b)
