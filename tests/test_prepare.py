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


def _hf_char_tokenizer(chars):
    """A tokenizer.json tokenizer over single characters (ids in list order), as the HF kind saves it."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import BPE
    return HFTok(BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))


@pytest.fixture(scope="module")
def prepared_with_hf_tokenizer(tmp_path_factory):
    """A prepared tiny llama directory whose tokenizer is the "hf" kind (tokenizer.json beside
    tokenizer_mdi.json) with BOS, EOS, add_bos, a chat template and stop ids: what only
    tokenizer_mdi.json says, as in models/smollm2-135m."""
    from conftest import CHARS, save_test_model, tiny_model
    from mdi.model.tokenizers import HFTokenizer
    path = str(tmp_path_factory.mktemp("hfprepared") / "src")
    model = tiny_model("llama")
    save_test_model(path, model.config, model.state_dict(), "tests/test_prepare.py")
    HFTokenizer(_hf_char_tokenizer(CHARS), bos_id=1, eos_id=2, add_bos=True, chat_template="{{ messages }}",
                stop_ids=[3]).save(path)
    return path


TOKENIZER_META = {"kind": "hf", "bos_id": 1, "eos_id": 2, "add_bos": True, "chat_template": "{{ messages }}",
                  "stop_ids": [3]}


@pytest.mark.parametrize("quant", ["auto", "int8", "q8_0"])
def test_a_prepared_directory_keeps_its_tokenizer_meta(tmp_path, prepared_with_hf_tokenizer, quant):
    """Re-preparing a prepared directory carries its tokenizer_mdi.json over (BOS, EOS, template,
    stop ids), in every --quant mode: its tokenizer.json alone has none of them."""
    if quant == "q8_0":
        from mdi.model.ggml.lib import unavailable_reason
        if unavailable_reason() is not None:
            pytest.skip(unavailable_reason())
    out = tmp_path / "out"
    proc = prepare(prepared_with_hf_tokenizer, "--quant", quant, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "tokenizer_mdi.json").read_text()) == TOKENIZER_META


def test_a_directory_prepared_in_place_keeps_its_tokenizer_meta(tmp_path, prepared_with_hf_tokenizer):
    import shutil
    here = tmp_path / "here"
    shutil.copytree(prepared_with_hf_tokenizer, str(here))
    proc = prepare(str(here), "--quant", "int8", "--out", str(here))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((here / "tokenizer_mdi.json").read_text()) == TOKENIZER_META


def test_an_hf_directory_still_reads_its_own_tokenizer_files(tmp_path):
    """A Hugging Face directory (no mdi_config.json) takes BOS / EOS from tokenizer_config.json
    and stop ids from generation_config.json, as before."""
    from conftest import CHARS
    from mdi.model.files.prepare import source_tokenizer
    _hf_char_tokenizer(CHARS).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": CHARS[5], "eos_token": CHARS[6]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    tok = source_tokenizer(str(tmp_path), None, "llama")
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.stop_ids) == ("hf", 5, 6, [7])  # EOS itself is no extra stop id


def test_the_default_out_is_never_the_source_and_a_failure_leaves_no_half_model(tmp_path):
    """`mdi-prepare models/x --quant int8` with no --out would have written over models/x (its
    float weights lost); a source whose weights are cut short fails in one line naming the file
    and leaves no folder behind that mdi-start would load."""
    import shutil
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(NANOGPT, str(models / "nano"))
    before = sorted(os.listdir(str(models / "nano")))
    proc = subprocess.run([PREPARE, "models/nano", "--quant", "int8"], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 2 and "is the source itself" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(os.listdir(str(models / "nano"))) == before
    weights = models / "nano" / "model.safetensors"
    with open(str(weights), "r+b") as f:
        f.truncate(os.path.getsize(str(weights)) // 2)
    out = tmp_path / "out"
    proc = prepare(str(models / "nano"), "--out", str(out), "--quant", "int8")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("mdi-prepare: error: ") and "Traceback" not in proc.stderr
    assert "model.safetensors" in lines[-1] and not out.exists()


@pytest.mark.parametrize("quant, stop_in", [("q4_0", "save_model_dir"), ("int8", "_torch_mode_gguf")])
def test_a_re_preparation_cut_short_leaves_no_folder_mdi_start_would_load(tmp_path, monkeypatch, quant, stop_in):
    """Over a folder prepared before, an interrupted preparation had left the new model.gguf beside
    the old weights and mdi_config.json, which mdi-start loaded (h79): the config is set aside
    first and written last, or put back where no weight file was replaced yet."""
    from mdi.model.files import prepare as prep
    from mdi.model.source import is_mdi_dir
    out = str(tmp_path / "m")
    prep.prepare(NANOGPT, out, [], None, "auto", None, None)
    assert is_mdi_dir(out)
    target = prep.store if stop_in == "save_model_dir" else prep

    def cut_short(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(target, stop_in, cut_short)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(NANOGPT, out, [], None, quant, None, None)
    # q4_0's model.gguf was replaced before it stopped: not loadable; int8 stopped before any
    # weight file was: the old model, whole again
    assert is_mdi_dir(out) == (stop_in == "_torch_mode_gguf")
    monkeypatch.undo()
    prep.prepare(NANOGPT, out, [], None, quant, None, None)
    assert is_mdi_dir(out)


@pytest.mark.parametrize("stop_in", ["export_gguf", "save_model_dir"])
def test_a_folder_prepared_in_place_that_fails_before_its_weights_are_replaced_is_whole_again(tmp_path, monkeypatch,
                                                                                            stop_in):
    """Prepared in place, the folder is its only copy: a disk full (or Ctrl-C) before any of
    its weight files was replaced had left it without its mdi_config.json, unloadable, and
    mdi-prepare refused to redo it (h80). The old model is whole again; once a weight file is
    replaced, it is not loadable (never half old, half new)."""
    import shutil
    from mdi.model.files import gguf_export, prepare as prep
    from mdi.model.source import ModelSource, is_mdi_dir
    out = str(tmp_path / "m")
    shutil.copytree(NANOGPT, out)
    before = ModelSource(out).config

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    target = gguf_export if stop_in == "export_gguf" else prep.store
    monkeypatch.setattr(target, stop_in, disk_full)
    with pytest.raises(OSError):
        prep.prepare(out, out, [], None, "q8_0" if stop_in == "export_gguf" else "int8", None, None)
    replaced = stop_in == "save_model_dir"  # (int8: the torch-mode model.gguf was written before it)
    assert is_mdi_dir(out) != replaced
    if not replaced:
        assert ModelSource(out).config == before and not os.path.exists(os.path.join(out, "mdi_config.json.replaced"))
