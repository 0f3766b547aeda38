"""PEFT prompt-tuning adapters (learned virtual tokens) on the starter: the same logits as
PeftModel within 1e-4 in float32 for a prefill and cached decode steps, on a GPT-2-shaped
(learned positions) and a Llama-shaped (RoPE) random model; the virtual tokens mix with LoRA
and base samples in one run; a soft prompt for another width is refused."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from mdi.model.adapters.adapter_files import load_any  # noqa: E402
from mdi.model.adapters.lora import AdapterError  # noqa: E402
from mdi.model.row_batch import RowBatch  # noqa: E402
from ringconfigs import parse_run_config  # noqa: E402
from mdi.starter import batch  # noqa: E402
from mdi.starter.frame_rows import virtual_rows  # noqa: E402
from test_adapters import base_chunk, hf_model  # noqa: E402
from test_model_parity import hf_gpt2, hf_llama  # noqa: E402

N_VIRTUAL, PREFILL, DECODE = 5, 12, 8


def make_soft_prompt(tmp_path, make, seed=0):
    torch.manual_seed(seed)
    _, model = make(None)
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "soft")
    model.eval().save_pretrained(base_dir)
    pm = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRTUAL))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "prompt_encoder" in name:
                p.normal_(0, 1.0)
    pm.save_pretrained(adapter_dir)
    return base_dir, adapter_dir


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_soft_prompt_logits_match_peft(make, tmp_path):
    base_dir, adapter_dir = make_soft_prompt(tmp_path, make)
    reference = peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir).eval()
    chunk = base_chunk(base_dir)
    soft = load_any(adapter_dir, chunk.config)
    assert soft.kind == "prompt" and soft.n_virtual == N_VIRTUAL
    ids = torch.randint(0, 400, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids[None]).logits[0, N_VIRTUAL:]  # the real tokens' positions
        chunk.allocate_cache(1, N_VIRTUAL + PREFILL + DECODE)

        class One:  # what the pipeline knows of a sample: its virtual tokens
            virtual, soft_prompt = N_VIRTUAL, soft.embeddings
        window = torch.cat([torch.zeros(N_VIRTUAL, dtype=torch.long), ids])
        got, start = [], 0
        for count in [N_VIRTUAL + PREFILL] + [1] * DECODE:  # prefill, then one token at a time
            batch_ = RowBatch.of([0], [start], [count])
            virtual = virtual_rows([One], [start], [count], False)
            x = chunk.embed_rows(window[start:start + count], batch_.positions, virtual)
            got.append(chunk.head(chunk.forward_rows(x, batch_)))
            start += count
        got = torch.cat(got)[N_VIRTUAL:]
    assert (got - want).abs().max().item() < 1e-4


def test_soft_prompts_lora_and_base_mix_in_one_run(tiny_models, tmp_path):
    from test_adapter_ring import write_peft_lora
    from mdi.model.source import ModelSource
    model = tiny_models["llama"]
    config = ModelSource(model).config
    soft_dir = tmp_path / "soft"
    soft_dir.mkdir()
    from safetensors.torch import save_file
    save_file({"prompt_embeddings": torch.randn(3, config.n_embd)}, str(soft_dir / "adapter_model.safetensors"))
    (soft_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM",
                                                              "num_virtual_tokens": 3, "token_dim": config.n_embd}))
    adapters = {"soft": str(soft_dir), "lora": write_peft_lora(str(tmp_path / "lora"), config, 5)}

    def run(prompts, names):
        cfg = parse_run_config(model, label="t", adapters=adapters, n_tokens=8)
        return [s.token_ids for s in batch.run(cfg, prompts, adapters=names).samples]
    prompts, names = ["Hi there", "Hi there", "Hi there"], ["soft", "lora", "base"]
    together = run(prompts, names)
    assert together == [run([p], [n])[0] for p, n in zip(prompts, names)]
    assert len({tuple(t) for t in together}) == 3  # the soft prompt changes the text


def test_a_soft_prompt_for_another_width_is_refused(tiny_models, tmp_path):
    from mdi.model.source import ModelSource
    config = ModelSource(tiny_models["gpt2"]).config
    from safetensors.torch import save_file
    save_file({"prompt_embeddings": torch.randn(4, config.n_embd + 8)}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4}))
    with pytest.raises(AdapterError, match=r"prompt_embeddings has shape \[4, %d\], the base model needs \[4, %d\]"
                       % (config.n_embd + 8, config.n_embd)):
        load_any(str(tmp_path), config)
    assert os.path.isfile(tmp_path / "adapter_config.json")
