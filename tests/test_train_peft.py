"""An adapter mdi-train writes (--out) is a PEFT adapter: `peft.PeftModel.from_pretrained` on a
transformers model of the same random weights loads it without a warning about missing or
unexpected keys, and its logits equal mdi's serving that directory as `--adapter` does
(mdi.model.adapters.adapter_files.load_adapter + the chunk's adapter slot) within 1e-4, float32.

The base is a random Hugging Face model (tests/test_model_parity's makers) saved with
save_pretrained; mdi trains on the same weights converted into an mdi directory with a
character tokenizer, so both sides compute one model."""
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from conftest import CHARS  # noqa: E402
from ringconfigs import write_run_config  # noqa: E402
from test_adapters import base_chunk, hf_gemma3, hf_model, run  # noqa: E402
from test_model_parity import hf_gpt2, hf_llama  # noqa: E402
from mdi.cli import train_main  # noqa: E402
from mdi.model.adapters.adapter_files import load_adapter  # noqa: E402
from mdi.model.files.checkpoints import read_hf_dir  # noqa: E402
from mdi.model.files.store import save_model_dir  # noqa: E402
from mdi.model.tokenizers import char_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

MAKERS = {"llama": hf_llama, "gpt2": hf_gpt2, "gemma3": hf_gemma3}
TEXT = "".join(CHARS[(i * 11 + i // 3) % (len(CHARS) - 1)] for i in range(600)) + "\n"


def bases(tmp_path, family):
    """(HF directory, mdi directory) of one random model."""
    torch.manual_seed(3)
    _, model = MAKERS[family](None)
    hf_dir, mdi_dir = str(tmp_path / "hf"), str(tmp_path / "mdi")
    model.eval().save_pretrained(hf_dir)
    config, weights = read_hf_dir(hf_dir)
    save_model_dir(mdi_dir, config, weights, hf_dir)
    char_tokenizer(CHARS).save(mdi_dir)
    return hf_dir, mdi_dir


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_mdi_train_adapter_loads_in_peft_with_mdi_s_logits(tmp_path, family):
    hf_dir, mdi_dir = bases(tmp_path, family)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "lora"
    argv = ["--config", write_run_config(tmp_path / "one.yaml", mdi_dir), "--data", str(data), "--steps", "3",
            "--batch-size", "2", "--seq-len", "16", "--rank", "4", "--alpha", "8", "--lr", "0.05", "--out", str(out)]
    assert train_main(argv) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    with warnings.catch_warnings(record=True) as seen:
        # peft warns (not raises) when saved keys do not match the model's modules
        warnings.simplefilter("always")
        reference = peft.PeftModel.from_pretrained(hf_model(hf_dir), str(out)).eval()
    assert not [str(w.message) for w in seen if "key" in str(w.message).lower()]
    loaded = {n for n, p in reference.named_parameters() if "lora_" in n}
    from safetensors.torch import load_file
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert len(loaded) == len(saved) > 0
    for name, t in saved.items():  # every saved tensor landed in the module it names, float32
        assert t.dtype == torch.float32
        module = name.replace(".weight", ".default.weight")
        assert module in loaded, name
        assert torch.equal(reference.get_parameter(module).detach(), t), name
    ids = torch.tensor(char_tokenizer(CHARS).encode_plain(TEXT[:40]), dtype=torch.long)
    with torch.no_grad():
        want = reference(input_ids=ids[None]).logits[0]
        base = hf_model(hf_dir)(input_ids=ids[None]).logits[0]
        assert (want - base).abs().max() > 1e-3  # training moved the adapter off PEFT's identity start
        chunk = base_chunk(hf_dir)
        chunk.set_adapter(1, load_adapter(str(out), chunk.config).weights)
        got = run(chunk, ids, 1)
    assert (got - want).abs().max() <= 1e-4
