"""mdi-train --method prompt (issue 38): prompt tuning through the ring equals a plain
single-process reference, and the prompt it writes serves as peft's PromptTuning model runs it.

The reference is written apart from mdi's training code: the full tiny model's token embeddings
of each window with the prompt concatenated in front (PEFT's inputs_embeds = cat(prompt,
embeds)), GPT-2's positions over both from 0, the blocks' cacheless forward, one cross-entropy
mean over the windows' scored predictions (the virtual rows predict nothing) and torch's AdamW.
Only the initial prompt and the tokenizer are shared."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import CHARS, tiny_model
from ringconfigs import parse_run_config, write_run_config
from test_train import TEXT, _close, _ids
from mdi.model.adapters.prompt_train import PromptSpec, init_prompt, text_init_ids
from mdi.ring.train_request import TrainSetup, read_train_body, train_body
from mdi.starter.train import training
from mdi.starter.train.train_data import step_windows, text_windows

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

STEPS, BATCH, SEQ, N_VIRTUAL, LR = 5, 4, 16, 4, 1e-2
TOL = 1e-4  # losses and the final prompt, relative (the bound)


def _setup(recompute=False):
    return TrainSetup(targets=(), rank=8, alpha=16.0, lr=LR, recompute=recompute)


def _prompt0(family, seed=3):
    return torch.randn(N_VIRTUAL, tiny_model(family).config.n_embd, generator=torch.Generator().manual_seed(seed))


def _loss(model, prompt, batch):
    """The mean next-token cross-entropy of windows `batch` [B, L] behind `prompt`."""
    (b, length), n = batch.shape, prompt.shape[0]
    x = torch.cat([prompt[None].expand(b, n, -1), model.tok_emb(batch)], dim=1)
    if model.config.family == "gpt2":
        x = x + model.pos_emb(torch.arange(n + length))
    for block in model.blocks.values():
        x = block.forward_batch(x, model.rope)
    logits = model.head(x)[:, n:]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def reference(family, prompt, ids, steps=STEPS, clip=None):
    """(losses, final prompt) of plain PyTorch."""
    model = tiny_model(family)
    for p in model.parameters():
        p.requires_grad_(False)
    prompt = prompt.clone().requires_grad_(True)
    opt = torch.optim.AdamW([prompt], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    windows = text_windows(ids, SEQ, "text")
    losses = []
    for step in range(steps):
        loss = _loss(model, prompt, step_windows(windows, step, BATCH))
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([prompt], clip)
        opt.step()
        losses.append(loss.item())
    return losses, prompt.detach()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("train_prompt") / "text.txt"
    path.write_text(TEXT)
    return str(path)


def _options(data_file, micro=1, steps=STEPS, recompute=False, **kw):
    return training.TrainOptions(data_file, _setup(recompute), steps=steps, batch_size=BATCH, micro_batches=micro,
                                 seq_len=SEQ, prompt=PromptSpec(N_VIRTUAL), **kw)


def _assert_same(result, family, prompt0, steps=STEPS, clip=None):
    losses, final = reference(family, prompt0, _ids(), steps, clip)
    got = [s.loss for s in result.steps]
    assert len(got) == steps and all(_close(g, w, TOL) for g, w in zip(got, losses)), (got, losses)
    assert result.pairs == {} and result.prompt is not None
    assert ((result.prompt - final).norm() / final.norm()).item() <= TOL
    moved = (final - prompt0).norm()
    assert moved > 1e-3  # training moved the prompt, so the comparison compared something
    assert ((result.prompt - final).norm() / moved).item() <= 1e-2  # and the move itself agrees


# --- units -------------------------------------------------------------------------------------

def test_text_init_follows_peft():
    assert text_init_ids([5, 6, 7], 8) == [5, 6, 7, 5, 6, 7, 5, 6]
    assert text_init_ids([5, 6, 7], 2) == [5, 6]
    chunk = tiny_model("llama")
    got = init_prompt(chunk, PromptSpec(5, "text", "ab"), 0, [3, 4])
    assert torch.equal(got, chunk.tok_emb(torch.tensor([3, 4, 3, 4, 3])).detach())
    rand = init_prompt(chunk, PromptSpec(5), 7)
    assert rand.shape == (5, chunk.config.n_embd) and torch.equal(rand, init_prompt(chunk, PromptSpec(5), 7))
    assert 0.5 < rand.std().item() < 1.5  # torch.nn.Embedding's N(0, 1), PEFT's RANDOM


def test_a_setup_without_targets_round_trips():
    setup, pairs, state = read_train_body(train_body(_setup(), {}))
    assert setup.targets == () and pairs == {} and state is None


# --- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("micro", [1, 4])
def test_one_node_equals_the_reference(tiny_models, data_file, family, micro):
    prompt0 = _prompt0(family)
    cfg = parse_run_config(tiny_models[family])
    _assert_same(training.run(cfg, _options(data_file, micro), prompt=prompt0), family, prompt0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_three_nodes_equal_the_reference(tiny_models, data_file, workers, family):
    """Workers with no trainable parameter run backward only to pass the gradient on."""
    prompt0 = _prompt0(family)
    for micro in (4, 1):
        cfg = parse_run_config(tiny_models[family], workers[:2], layers=[1, 2, 1], runtime={"ring_timeout": 30})
        _assert_same(training.run(cfg, _options(data_file, micro, recompute=family == "gpt2"), prompt=prompt0),
                     family, prompt0)


def test_clip_and_eval_take_the_prompt_in(tiny_models, data_file, workers):
    """--clip bounds the prompt's gradient as torch's clip_grad_norm_; --eval's held-out loss is
    that of the windows behind the prompt as trained so far."""
    prompt0 = _prompt0("llama")
    cfg = parse_run_config(tiny_models["llama"], workers[:1], layers=[2, 2], runtime={"ring_timeout": 30})
    result = training.run(cfg, _options(data_file, 2, steps=3, clip=0.05, eval_data=data_file), prompt=prompt0)
    _assert_same(result, "llama", prompt0, steps=3, clip=0.05)
    model, windows = tiny_model("llama"), text_windows(_ids(), SEQ, "text")
    with torch.no_grad():
        for e, prompt in zip(result.evals, (prompt0, result.prompt)):
            assert _close(e["loss"], _loss(model, prompt, windows).item(), TOL), (e, result.evals)


# --- against peft, and served -----------------------------------------------------------------

def _hf_pair(tmp_path, family):
    """A random transformers model saved as a Hugging Face dir, and the same weights as a prepared
    mdi dir with the tests' character tokenizer (mdi-train reads that)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from mdi.model.files.checkpoints import read_hf_dir
    from mdi.model.files.store import save_model_dir
    from mdi.model.tokenizers import char_tokenizer
    torch.manual_seed(0)
    if family == "gpt2":  # test_model_parity's shapes, the character vocabulary
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(CHARS), n_positions=128, n_embd=64,
                                                                     n_layer=4, n_head=4))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(CHARS), hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rope_theta=50000.0))
    with torch.no_grad():  # wider than default init, so the loss and greedy ids depend on the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    base_dir, mdi_dir = str(tmp_path / "hf"), str(tmp_path / "mdi")
    model.eval().save_pretrained(base_dir)
    config, weights = read_hf_dir(base_dir)
    save_model_dir(mdi_dir, config, weights, "tests/test_train_prompt.py")
    char_tokenizer(CHARS).save(mdi_dir)
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM
    return mdi_dir, lambda: cls.from_pretrained(base_dir).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trained_prompt_equals_peft_and_serves_as_peft_runs_it(tmp_path, data_file, family):
    """peft's PromptTuning model trained by torch's AdamW from the same prompt: the same losses
    and prompt; the adapter mdi-train writes loads in peft, and mdi serves it with peft's greedy ids."""
    import peft
    from mdi.cli import train_main
    from mdi.model.adapters.prompt_train import save_prompt_adapter
    from mdi.model.source import ModelSource
    from mdi.starter import batch as batch_run
    mdi_dir, hf = _hf_pair(tmp_path, family)
    config = ModelSource(mdi_dir).config
    init_dir = str(tmp_path / "init")
    prompt0 = torch.randn(N_VIRTUAL, config.n_embd, generator=torch.Generator().manual_seed(5))
    save_prompt_adapter(init_dir, config, PromptSpec(N_VIRTUAL), prompt0, mdi_dir)
    out, metrics = tmp_path / "prompt", tmp_path / "m.json"
    config_path = write_run_config(tmp_path / "one.yaml", mdi_dir)
    assert train_main(["--config", str(config_path), "--data", data_file, "--method", "prompt", "--init-adapter",
                       init_dir, "--steps", str(STEPS), "--batch-size", str(BATCH), "--micro-batches", "2",
                       "--seq-len", str(SEQ), "--lr", str(LR), "--out", str(out), "--metrics-out", str(metrics)]) == 0
    got_losses = [s["loss"] for s in json.loads(metrics.read_text())["steps"]]

    pm = peft.get_peft_model(hf(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRTUAL)).eval()
    weight = pm.prompt_encoder["default"].embedding.weight
    with torch.no_grad():
        weight.copy_(prompt0)
    opt = torch.optim.AdamW([weight], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    windows = text_windows(_ids(), SEQ, "text")
    want_losses = []
    for step in range(STEPS):
        ids = step_windows(windows, step, BATCH)
        labels = ids.clone()
        labels[:, 0] = -100  # column 0 is predicted by no real token (mdi's windows score L - 1)
        loss = pm(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    assert all(_close(g, w, TOL) for g, w in zip(got_losses, want_losses)), (got_losses, want_losses)
    from safetensors.torch import load_file
    got = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(got) == ["prompt_embeddings"]
    final = weight.detach()
    assert ((got["prompt_embeddings"] - final).norm() / final.norm()).item() <= TOL
    assert ((got["prompt_embeddings"] - final).norm() / (final - prompt0).norm()).item() <= 1e-2

    # served: mdi's --adapter against peft loading the directory mdi-train wrote
    reference = peft.PeftModel.from_pretrained(hf(), str(out)).eval()
    assert torch.equal(reference.prompt_encoder["default"].embedding.weight.detach(), got["prompt_embeddings"])
    text, n_tokens = "the quick", 8
    cfg = parse_run_config(mdi_dir, adapters={"tuned": str(out)}, n_tokens=n_tokens)
    served = batch_run.run(cfg, [text, text], adapters=["tuned", "base"]).samples
    from mdi.model.tokenizers import char_tokenizer
    ids = torch.tensor(char_tokenizer(CHARS).encode(text))
    with torch.no_grad():
        for _ in range(n_tokens):
            ids = torch.cat([ids, reference(input_ids=ids[None]).logits[0, -1].argmax()[None]])
    want = ids[-n_tokens:].tolist()
    assert served[0].token_ids == want
    assert served[1].token_ids != want  # the trained prompt changes the text


# --- the command line: checkpoints, --resume, text init, bad input ---------------------------

def test_mdi_train_prompt_resumes_and_starts_from_text(tiny_models, data_file, tmp_path, capsys):
    """A run stopped after step 3 of 6 and resumed ends with the uninterrupted run's prompt; the
    checkpoint is itself a servable prompt adapter; --prompt-init text starts from the text's
    token embeddings (PEFT's rule)."""
    from mdi.cli import train_main
    from mdi.model.adapters.adapter_files import load_any
    from safetensors.torch import load_file
    config_path = str(write_run_config(tmp_path / "one.yaml", tiny_models["gpt2"]))
    base = ["--config", config_path, "--data", data_file, "--method", "prompt", "--num-virtual-tokens", "3",
            "--batch-size", "2", "--seq-len", str(SEQ), "--lr", "0.05", "--prompt-init", "text",
            "--prompt-init-text", "ab"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert train_main(base + ["--steps", "6", "--out", str(whole), "--metrics-out", str(tmp_path / "w.json")]) == 0
    assert train_main(base + ["--steps", "3", "--checkpoint-every", "3", "--out", str(part)]) == 0
    checkpoint = part / "checkpoint-3"
    config = tiny_model("gpt2").config
    assert load_any(str(checkpoint), config).n_virtual == 3
    assert json.loads((checkpoint / "adapter_config.json").read_text())["prompt_tuning_init_text"] == "ab"
    assert train_main(base + ["--steps", "6", "--out", str(part), "--metrics-out", str(tmp_path / "p.json"),
                              "--resume", str(checkpoint)]) == 0
    want, got = [load_file(str(d / "adapter_model.safetensors"))["prompt_embeddings"] for d in (whole, part)]
    assert (got - want).abs().max().item() <= 1e-6
    losses = [[s["loss"] for s in json.loads((tmp_path / f).read_text())["steps"]] for f in ("w.json", "p.json")]
    assert len(losses[1]) == 6 and all(_close(a, b, 1e-6) for a, b in zip(*losses))
    # the run that started from "ab": step 0's prompt was the embeddings of a, b, a
    one = tmp_path / "one"
    assert train_main(base + ["--steps", "1", "--lr", "1e-9", "--out", str(one)]) == 0
    ids = torch.tensor([CHARS.index(c) for c in "aba"])
    start = tiny_model("gpt2").tok_emb(ids).detach()
    assert (load_file(str(one / "adapter_model.safetensors"))["prompt_embeddings"] - start).abs().max().item() < 1e-6
    # a LoRA checkpoint's --resume, or a LoRA as --init-adapter, is refused in one line
    assert train_main(["--config", config_path, "--data", data_file, "--steps", "6", "--batch-size", "2",
                       "--seq-len", str(SEQ), "--lr", "0.05", "--resume", str(checkpoint)]) == 2
    from test_adapter_ring import write_peft_lora
    lora = write_peft_lora(str(tmp_path / "lora"), config, 1)
    assert train_main(base + ["--init-adapter", lora]) == 2
    assert train_main(base[:-2] + ["--steps", "1"]) == 2  # --prompt-init text without its text
    assert train_main(base + ["--num-virtual-tokens", "120", "--steps", "1"]) == 2  # 120 + 16 > the context
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mdi: error")]
    assert len(err) == 4, err
    assert "a checkpoint of another run: its num_virtual_tokens is 3, this run's null" in err[0]
    assert "--init-adapter %s: a LoRA, not a prompt-tuning adapter" % lora in err[1]
    assert "--prompt-init-text" in err[2] and "less 120 virtual tokens" in err[3]
