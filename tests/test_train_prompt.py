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
from mdi.model.prompt_train import PromptSpec, init_prompt, text_init_ids
from mdi.ring.train_request import TrainSetup, read_train_body, train_body
from mdi.starter import training
from mdi.starter.train_data import step_windows, text_windows

STEPS, BATCH, SEQ, N_VIRTUAL, LR = 5, 4, 16, 4, 1e-2
TOL = 1e-4  # losses and the final prompt, relative (the bound)


def _setup(recompute=False):
    return TrainSetup(targets=(), rank=8, alpha=16.0, lr=LR, recompute=recompute)


def _prompt0(family, seed=3):
    return torch.randn(N_VIRTUAL, tiny_model(family).config.n_embd, generator=torch.Generator().manual_seed(seed))


def reference(family, prompt, ids, steps=STEPS, clip=None):
    """(losses, final prompt) of plain PyTorch."""
    model = tiny_model(family)
    for p in model.parameters():
        p.requires_grad_(False)
    prompt = prompt.clone().requires_grad_(True)
    opt = torch.optim.AdamW([prompt], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    windows = text_windows(ids, SEQ, "text")
    n = prompt.shape[0]
    losses = []
    for step in range(steps):
        batch = step_windows(windows, step, BATCH)
        b, length = batch.shape
        x = torch.cat([prompt[None].expand(b, n, -1), model.tok_emb(batch)], dim=1)
        if model.config.family == "gpt2":
            x = x + model.pos_emb(torch.arange(n + length))
        for block in model.blocks.values():
            x = block.forward_batch(x, model.rope)
        logits = model.head(x)[:, n:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
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


def test_clip_bounds_the_prompt_s_gradient_as_torch_does(tiny_models, data_file, workers):
    prompt0 = _prompt0("llama")
    cfg = parse_run_config(tiny_models["llama"], workers[:1], layers=[2, 2], runtime={"ring_timeout": 30})
    result = training.run(cfg, _options(data_file, 2, steps=3, clip=0.05), prompt=prompt0)
    _assert_same(result, "llama", prompt0, steps=3, clip=0.05)


# --- against peft, and served -----------------------------------------------------------------

def _hf_pair(tmp_path, family):
    """A random transformers model saved as a Hugging Face dir, and the same weights as a prepared
    mdi dir with the tests' character tokenizer (mdi-train reads that)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from mdi.model.checkpoints import read_hf_dir
    from mdi.model.store import save_model_dir
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
    from mdi.model.prompt_train import save_prompt_adapter
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
