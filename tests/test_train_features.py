"""mdi-train's data formats and run features (issue 38): JSONL prompt/completion and chat
examples (scored-token masks), --shuffle, --clip, --eval, --init-adapter and
--checkpoint-every / --resume, each against the plain PyTorch reference of tests/test_train.py."""
import dataclasses
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import CHARS, ROOT, tiny_model
from ringconfigs import parse_run_config, write_run_config
from test_train import TEXT, WEIGHT_TOL, _close, _setup, reference
from mdi.model.adapters.lora_train import init_pairs
from mdi.model.tokenizers import CharTokenizer
from mdi.runconfig import ConfigError
from mdi.starter.train import training
from mdi.starter.train.train_checkpoint import checkpoint_path, load_checkpoint
from mdi.starter.train.train_data import load_windows, step_index

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

SEQ, BATCH = 16, 4
EXAMPLES = [{"prompt": "Q: 2+2? ", "completion": "A: 4"},
            {"prompt": "Say hi. ", "completion": "hi there"},
            {"prompt": "x" * 20, "completion": "never scored"},  # the prompt fills the window: dropped
            {"prompt": "abc", "completion": "a completion longer than one window of sixteen"},
            {"prompt": "Name a colour: ", "completion": "red"},
            {"prompt": "1, 2, 3, ", "completion": "4, 5"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_features")
    text = d / "text.txt"
    text.write_text(TEXT)
    held = d / "held.txt"
    held.write_text(TEXT[::-1][:300])
    jsonl = d / "pc.jsonl"
    jsonl.write_text("\n".join(json.dumps(e) for e in EXAMPLES) + "\n")
    return {"text": str(text), "held": str(held), "jsonl": str(jsonl), "dir": d}


def _worst(got, want):
    worst = 0.0
    for key, (a, b) in want.items():
        for g, w in zip(got[key], (a, b)):
            worst = max(worst, ((g - w).norm() / max(w.norm(), 1e-12)).item())
    return worst


def _assert_matches(result, losses, final):
    got = [s.loss for s in result.steps]
    assert all(_close(g, w) for g, w in zip(got, losses)) and len(got) == len(losses), (got, losses)
    assert set(result.pairs) == set(final) and _worst(result.pairs, final) <= WEIGHT_TOL


# --- data --------------------------------------------------------------------------------------

def test_text_the_tokenizer_cannot_encode_is_a_config_error_naming_the_file(files):
    """(POST /v1/mdi/train answers it as a 400 naming `data`, not a 500.)"""
    from mdi.runconfig import ConfigError
    tok = CharTokenizer(CHARS, eos_id=CHARS.index("\n"))
    for name, text in (("odd.txt", "abc \u2603 def" * 10), ("odd.jsonl", json.dumps({"prompt": "\u2603", "completion": "a"}))):
        path = files["dir"] / name
        path.write_text(text)
        with pytest.raises(ConfigError, match="--data %s: " % path):
            load_windows(tok, str(path), SEQ)


def test_prompt_completion_windows_score_the_completion_and_eos_only(files, caplog):
    tok = CharTokenizer(CHARS, eos_id=CHARS.index("\n"))
    w = load_windows(tok, files["jsonl"], SEQ)
    assert len(w) == 5 and "1 example(s) have no scored token" in caplog.text
    ids, scored = w.ids[0].tolist(), w.scored[0].tolist()
    want = tok.encode_plain("Q: 2+2? A: 4") + [tok.eos_id]
    assert ids[:len(want)] == want and ids[len(want):] == [tok.eos_id] * (SEQ - len(want))  # padded with EOS
    assert scored == [False] * 8 + [True] * 5 + [False] * (SEQ - 13)  # "A: 4" and its EOS
    # truncated at --seq-len: the first L tokens kept, every completion token in them scored
    assert w.ids[2].tolist() == tok.encode_plain(("abc" + EXAMPLES[3]["completion"])[:SEQ])
    assert w.scored[2].tolist() == [False] * 3 + [True] * (SEQ - 3)
    assert w.n_scored == 5 + 8 + (SEQ - 3) + 1 + 5  # "hi there" loses its EOS, "red" all but "r"


def test_prompt_completion_gets_bos_by_the_tokenizer_s_rule(files):
    tok = CharTokenizer(CHARS, bos_id=0, eos_id=CHARS.index("\n"), add_bos=True)
    w = load_windows(tok, files["jsonl"], SEQ)
    assert w.ids[0, 0].item() == 0 and not w.scored[0, :9].any() and w.scored[0, 9:14].all()


def test_chat_examples_score_the_assistant_turns_only(tmp_path):
    from mdi.cli.train import chat_renderer
    tok = CharTokenizer(CHARS, eos_id=CHARS.index("\n"))  # no template: serving's fallback ("role: content\n")
    path = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    w = load_windows(tok, str(path), 64, chat_renderer(tok))
    ids, scored = w.ids[0], w.scored[0]
    text = tok.decode(ids[:len("user: hi\nassistant: hello\nuser: more\nassistant: ok\n")].tolist())
    assert text == "user: hi\nassistant: hello\nuser: more\nassistant: ok\n"
    assert tok.decode(ids[scored].tolist()) == " hello\n ok\n"  # each turn and its end, nothing else
    with pytest.raises(ConfigError, match="no assistant message"):
        path.write_text(json.dumps({"messages": msgs[:1]}) + "\n")
        load_windows(tok, str(path), 64, chat_renderer(tok))


def test_chat_examples_with_smollm2_s_template(tmp_path):
    import os
    model = os.path.join(ROOT, "models", "smollm2-135m")
    if not os.path.isdir(model):
        pytest.skip("models/smollm2-135m is not here")
    from mdi.cli.train import chat_renderer
    from mdi.model.source import ModelSource
    tok = ModelSource(model).tokenizer
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello there"}]}) + "\n")
    w = load_windows(tok, str(path), 64, chat_renderer(tok))
    assert tok.decode(w.ids[0][w.scored[0]].tolist()) == "Hello there<|im_end|>\n"


def test_shuffle_is_a_seeded_permutation_per_epoch():
    a = torch.cat([step_index(10, s, 5, True, 7) for s in range(4)])
    assert sorted(a[:10].tolist()) == list(range(10)) and sorted(a[10:].tolist()) == list(range(10))
    assert a[:10].tolist() != list(range(10)) and a[:10].tolist() != a[10:].tolist()
    assert torch.equal(step_index(10, 3, 5, True, 7), a[15:]) and not torch.equal(step_index(10, 0, 5, True, 8), a[:5])


# --- exactness ---------------------------------------------------------------------------------

def _opts(data, setup, **kw):
    kw.setdefault("steps", 3)
    return training.TrainOptions(data, setup, batch_size=BATCH, seq_len=SEQ, **kw)


def test_jsonl_shuffled_clipped_on_a_ring_equals_the_reference(tiny_models, files, workers):
    family = "llama"
    setup = _setup(family)
    cfg = parse_run_config(tiny_models[family], workers[:1], layers=[2, 2], runtime={"ring_timeout": 30})
    tok = CharTokenizer(CHARS)
    w = load_windows(tok, files["jsonl"], SEQ)
    clip = 0.05  # below the gradients' norm: every step clips (checked below)
    opts = _opts(files["jsonl"], setup, micro_batches=2, shuffle=True, clip=clip, seed=3)
    result = training.run(cfg, opts)
    config = tiny_model(family).config
    losses, final = reference(family, setup, init_pairs(config, setup.spec, 3), None, 3,
                              batches=lambda s: (lambda b: (b.ids, b.scored))(w.take(step_index(len(w), s, BATCH,
                                                                                                   True, 3))),
                              clip=clip)
    _assert_matches(result, losses, final)
    _, unclipped = reference(family, setup, init_pairs(config, setup.spec, 3), None, 3,
                             batches=lambda s: (lambda b: (b.ids, b.scored))(w.take(step_index(len(w), s, BATCH,
                                                                                                  True, 3))))
    assert _worst(result.pairs, unclipped) > 1e-3  # the clip changed the result
    assert [s.scored for s in result.steps] == [int(w.take(step_index(len(w), s, BATCH, True, 3)).scored.sum())
                                                for s in range(3)]


def _peft_pairs(path, family):
    """The PEFT directory's tensors by mdi-train's keys, read here apart from mdi's reader."""
    from safetensors.torch import load_file
    blocks = {"llama": "model.layers", "gpt2": "transformer.h"}[family]
    pairs = {}
    for name, t in load_file(str(path / "adapter_model.safetensors")).items():
        m = re.match(r"base_model\.model\.%s\.(\d+)\.(.+)\.lora_([AB])\.weight" % re.escape(blocks), name)
        pairs.setdefault("%s.%s" % (m.group(1), m.group(2)), [None, None])[m.group(3) == "B"] = t
    return {k: (a, b) for k, (a, b) in pairs.items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_five_steps_from_an_init_adapter_on_1_2_3_nodes_equal_the_reference(tiny_models, files, workers, family,
                                                                          tmp_path):
    from mdi.lab.random_lora import write_random_lora
    from mdi.model.adapters.lora_train import read_peft_pairs
    from mdi.ring.train_request import TrainSetup
    config = tiny_model(family).config
    path = tmp_path / "init"
    write_random_lora(str(path), config, seed=5, rank=4, std=0.05)
    spec, pairs = read_peft_pairs(str(path), config)
    assert spec.rank == 4 and spec.alpha == 8.0 and len(spec.targets) == 7
    setup = TrainSetup(targets=spec.targets, rank=spec.rank, alpha=spec.alpha, lr=1e-2)
    losses, final = reference(family, setup, _peft_pairs(path, family), torch.tensor(
        CharTokenizer(CHARS).encode_plain(TEXT)), steps=5)
    for n_workers, layers, micro in ((0, None, 1), (1, [2, 2], 4), (2, [1, 2, 1], 4)):
        cfg = parse_run_config(tiny_models[family], workers[:n_workers], layers=layers,
                               runtime={"ring_timeout": 30}) if n_workers else parse_run_config(tiny_models[family])
        result = training.run(cfg, _opts(files["text"], setup, steps=5, micro_batches=micro), pairs=pairs)
        _assert_matches(result, losses, final)


def test_resume_equals_an_uninterrupted_run_and_eval_is_the_held_out_mean(tiny_models, files, workers, tmp_path):
    family = "llama"
    setup = _setup(family)
    cfg = parse_run_config(tiny_models[family], workers[:1], layers=[2, 2], runtime={"ring_timeout": 30})
    whole = training.run(cfg, _opts(files["text"], setup, steps=6, micro_batches=2, eval_data=files["held"],
                                    eval_every=3))
    out = str(tmp_path / "out")
    first = _opts(files["text"], setup, steps=3, micro_batches=2, eval_data=files["held"], eval_every=3,
                  checkpoint_every=3, checkpoint_dir=out)
    training.run(cfg, first)
    rest = _opts(files["text"], setup, steps=6, micro_batches=2, eval_data=files["held"], eval_every=3,
                 checkpoint_every=3, checkpoint_dir=out)
    config = tiny_model(family).config
    cp = load_checkpoint(checkpoint_path(out, 3), config, training.fingerprint(cfg, rest))
    assert cp.steps_done == 3 and cp.optimizer.steps == 3 and len(cp.optimizer.moments) == 2 * len(cp.pairs)
    resumed = training.run(cfg, rest, resume=cp)
    assert [s.step for s in resumed.steps] == list(range(6))
    assert all(_close(a.loss, b.loss, 1e-6) for a, b in zip(resumed.steps, whole.steps))
    assert _worst(resumed.pairs, whole.pairs) <= 1e-6
    assert [e["step"] for e in resumed.evals] == [0, 3, 6] and all(
        _close(a["loss"], b["loss"], 1e-6) for a, b in zip(resumed.evals, whole.evals))
    # eval at step 0 is the base model's mean loss over every held-out prediction (B = 0 at init)
    model = tiny_model(family)
    held = load_windows(CharTokenizer(CHARS), files["held"], SEQ).ids
    with torch.no_grad():
        logits = model.forward_batch(held)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), held[:, 1:].reshape(-1)).item()
    assert _close(whole.evals[0]["loss"], want) and whole.evals[0]["tokens"] == held[:, 1:].numel()
    assert whole.evals[-1]["loss"] < whole.evals[0]["loss"]
    # another run's checkpoint (another learning rate) is refused, naming what differs
    other = _opts(files["text"], dataclasses.replace(setup, lr=0.5), steps=6)
    with pytest.raises(ConfigError, match="another run: its lr"):
        load_checkpoint(checkpoint_path(out, 3), config, training.fingerprint(cfg, other))


def test_mdi_train_cli_checkpoints_and_refuses_an_adapter_of_another_base(tiny_models, files, tmp_path, capsys):
    from mdi.cli import train_main
    from mdi.lab.random_lora import write_random_lora
    config_path = str(write_run_config(tmp_path / "one.yaml", tiny_models["llama"]))
    out, metrics = tmp_path / "lora", tmp_path / "m.json"
    base = ["--config", config_path, "--data", files["jsonl"], "--batch-size", "2", "--seq-len", str(SEQ),
            "--rank", "2", "--out", str(out), "--metrics-out", str(metrics)]
    assert train_main(base + ["--steps", "4", "--checkpoint-every", "2", "--eval", files["jsonl"], "--clip", "1.0",
                              "--shuffle"]) == 0
    record = json.loads(metrics.read_text())
    assert [e["step"] for e in record["eval"]] == [0, 2, 4] and (out / "checkpoint-2" / "optimizer.safetensors").is_file()
    assert train_main(base + ["--steps", "4", "--checkpoint-every", "2", "--eval", files["jsonl"], "--clip", "1.0",
                              "--shuffle", "--resume", str(out / "checkpoint-2")]) == 0
    again = json.loads(metrics.read_text())
    assert [s["loss"] for s in again["steps"]] == pytest.approx([s["loss"] for s in record["steps"]], rel=1e-6)
    gpt2 = tmp_path / "gpt2-lora"
    write_random_lora(str(gpt2), tiny_model("gpt2").config, seed=1, rank=2)
    capsys.readouterr()
    fresh = [a if a != str(out) else str(tmp_path / "fresh") for a in base]
    assert train_main(fresh + ["--init-adapter", str(gpt2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpt2-lora" in err[0]
    assert train_main(base + ["--steps", "4", "--lr", "0.5", "--resume", str(out / "checkpoint-2")]) == 2
    assert "another run" in capsys.readouterr().err
    assert train_main(fresh + ["--method", "prompt"]) == 2  # base says --rank 2: a LoRA's, ignored silently before
    assert "--rank goes with --method lora, and --method prompt trains a soft prompt" in capsys.readouterr().err
    assert train_main(fresh + ["--num-virtual-tokens", "4"]) == 2  # a soft prompt's, ignored silently before
    assert "--num-virtual-tokens goes with --method prompt, and --method lora trains a LoRA" in capsys.readouterr().err
    assert train_main(base + ["--eval-every", "2"]) == 2  # without --eval it evaluated nothing, silently
    assert "--eval-every goes with --eval FILE" in capsys.readouterr().err
    # an adapter already there, the model's folder: never written over
    assert train_main(base + ["--steps", "1"]) == 2
    assert "already holds an adapter (adapter_config.json)" in capsys.readouterr().err
    before = {f: f.read_bytes() for f in out.iterdir() if f.is_file()}
    model_dir = tiny_models["llama"]
    for bad in (model_dir, os.path.join(model_dir, "lora"), os.path.dirname(model_dir)):
        assert train_main([a if a != str(out) else str(bad) for a in base] + ["--steps", "1"]) == 2, bad
        assert "training must not write over the files runs read" in capsys.readouterr().err
    assert {f: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    assert not os.path.exists(os.path.join(model_dir, "adapter_config.json"))


@pytest.mark.parametrize("quant,within", [("int8", 0.02), ("int4", 0.1)])
def test_a_quantized_base_trains_with_exact_kernels(tiny_models, files, workers, quant, within):
    """QLoRA's way: int8 or int4 frozen weights on every node (the fast integer kernels have no
    backward, so mdi-train runs the exact ones), float32 adapters; the first loss is the
    float base's within the quantization's rounding, and training lowers it."""
    setup = _setup("llama")
    float_cfg = parse_run_config(tiny_models["llama"])
    quant_cfg = parse_run_config(tiny_models["llama"], workers[:1], layers=[2, 2], quant=quant,
                                 runtime={"ring_timeout": 30, "quant_kernel": "fast"})
    want = training.run(float_cfg, _opts(files["text"], setup, steps=1)).steps[0].loss
    got = training.run(quant_cfg, _opts(files["text"], setup, steps=4, micro_batches=2))
    assert abs(got.steps[0].loss - want) <= within * want and got.steps[-1].loss < got.steps[0].loss


def test_eval_and_clip_frames_round_trip_and_are_validated():
    from mdi.ring.wire import Frame, FrameError, FrameKind, TrainTag, decode, encode
    x = torch.randn(2 * 5, 64)
    got = decode(encode(Frame(FrameKind.EVAL, 7, [0, 1], [0, 0], [5, 5], x, train=TrainTag(2, 0, 3))), run=7,
                 hidden=64, max_len=16)
    assert got.kind == FrameKind.EVAL and got.train == TrainTag(2, 0, 3) and torch.equal(got.tensor, x)
    value = torch.zeros(1, 64)
    value[0, 0] = 0.25
    got = decode(encode(Frame(FrameKind.CLIP, 7, [0], [0], [1], value, train=TrainTag(2, 4, 1))), run=7, hidden=64)
    assert got.train.layer == 1 and got.tensor[0, 0].item() == 0.25
    bad = [Frame(FrameKind.CLIP, 7, [0], [0], [2], torch.zeros(2, 64), train=TrainTag(2, 4, 0)),  # two rows
           Frame(FrameKind.CLIP, 7, [0], [0], [1], value, train=TrainTag(2, 4, 2)),  # no phase 2
           Frame(FrameKind.EVAL, 7, [0], [0], [5], x[:5])]  # no train header
    for f in bad:
        with pytest.raises(FrameError):
            decode(encode(f), run=7, hidden=64, max_len=16)


def test_optimizer_state_travels_in_the_train_body():
    from mdi.model.adapters.stage_train import OptimizerState
    from mdi.ring.init_request import RequestError
    from mdi.ring.train_request import pairs_reply, read_pairs_reply, read_train_body, train_body
    setup = _setup("llama", ("q",))
    pairs = {"1.self_attn.q_proj": (torch.randn(4, 64), torch.randn(64, 4))}
    state = OptimizerState(7, {"1.self_attn.q_proj.lora_A": (torch.randn(4, 64), torch.rand(4, 64)),
                               "1.self_attn.q_proj.lora_B": (torch.randn(64, 4), torch.rand(64, 4))})
    _, _, got = read_train_body(train_body(setup, pairs, state))
    assert got.steps == 7 and all(torch.equal(got.moments[k][i], state.moments[k][i]) for k in state.moments
                                  for i in (0, 1))
    _, got = read_pairs_reply(pairs_reply(pairs, state))
    assert got.steps == 7
    half = OptimizerState(7, {"1.self_attn.q_proj.lora_A": state.moments["1.self_attn.q_proj.lora_A"]})
    with pytest.raises(RequestError, match="AdamW moments"):
        read_train_body(train_body(setup, pairs, half))


def test_a_ring_on_ggml_is_refused_saying_where_its_backend_came_from(tiny_models, monkeypatch):
    monkeypatch.setenv("MDI_BACKEND", "ggml")  # the config names no backend: the environment's default
    with pytest.raises(ConfigError, match="runtime.backend to auto or torch \\(MDI_BACKEND=ggml in the environment is"):
        training.training_config(parse_run_config(tiny_models["llama"]))
    monkeypatch.delenv("MDI_BACKEND")
    with pytest.raises(ConfigError, match="to auto or torch$"):
        training.training_config(parse_run_config(tiny_models["llama"], runtime={"backend": "ggml"}))


def test_a_spare_is_held_to_training_s_backend_as_the_nodes_are(tiny_models, monkeypatch):
    """A spare that takes a lost node's layers trains too: its own backend: ggml is refused before
    the run (it had been, mid-run, as the recovery's POST /train), and one without trains on torch."""
    from ringconfigs import run_config_dict
    from mdi.runconfig import parse_config
    monkeypatch.delenv("MDI_BACKEND", raising=False)
    data = run_config_dict(tiny_models["llama"], [9001, 9002], spares=[9003])
    data["spares"][0]["backend"] = "ggml"
    with pytest.raises(ConfigError, match="^spare1: backend ggml cannot train .*remove its own backend: ggml"):
        training.training_config(parse_config(data, "test"))
    del data["spares"][0]["backend"]
    cfg = training.training_config(parse_config(dict(data, runtime={"backend": "auto"}), "test"))
    assert [cfg.backend_of(n) for n in cfg.nodes + cfg.spares] == ["torch"] * 4
