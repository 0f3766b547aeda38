"""mdi-train (issue 38): LoRA trained through the ring equals a plain single-process reference.

The reference here is written apart from mdi's training code: the full tiny model's cacheless
forward (ModelChunk.forward_batch) with each targeted PEFT module's LoRA added by a forward
hook, part by part (y[rows of q] += scale * x A_q^T B_q^T, as PEFT's q_proj does), one
cross-entropy mean over the whole batch and torch's AdamW. Only the initial pairs
(mdi.model.adapters.lora_train.init_pairs: seeded, PEFT's init) and the tokenizer are shared."""
import json
import math

import msgpack
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import CHARS, tiny_model
from ringconfigs import parse_run_config
from mdi.model.adapters.lora import layer_shapes, part_rows
from mdi.model.adapters.lora_train import LoraSpec, MODULES, init_pairs, key_layer
from mdi.model.tokenizers import char_tokenizer
from mdi.ring.train_request import TrainSetup, read_train_body, train_body
from mdi.ring.wire import Frame, FrameError, FrameKind, TrainTag, decode, encode
from mdi.starter.train import training
from mdi.starter.train.train_data import step_windows, text_windows

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

TEXT = "".join(CHARS[(i * 7 + i // 5) % (len(CHARS) - 1)] for i in range(700)) + "\n"
STEPS, BATCH, SEQ = 3, 4, 16
TOL = 1e-5  # losses, relative
# Final weights, relative in norm: the bound. AdamW's first steps move each weight by
# about lr * sign(gradient), so an element whose gradient is float32-rounding-sized moves either
# way: float32 alone leaves up to ~5e-5 between two correct orders of the same sums (seen on
# an A whose gradients were exactly 0 at step 0, B starting at 0).
WEIGHT_TOL = 1e-4


def _setup(family, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8.0, recompute=False):
    return TrainSetup(targets=tuple(targets), rank=rank, alpha=alpha, lr=1e-2, recompute=recompute)


def reference(family, setup, pairs, ids, steps=STEPS, batches=None, clip=None):
    """(losses, final pairs) of plain PyTorch: hooks add each PEFT module's LoRA. `batches`
    (step -> (ids [B, L], scored [B, L])) replaces the text's windows; `clip` is
    torch.nn.utils.clip_grad_norm_'s bound."""
    model = tiny_model(family)
    config = model.config
    for p in model.parameters():
        p.requires_grad_(False)
    params = {k: (a.clone().requires_grad_(True), b.clone().requires_grad_(True)) for k, (a, b) in pairs.items()}
    by_layer = {}
    for key, ab in params.items():
        layer, module = key.split(".", 1)
        hf = {v[0]: (v[1], v[2]) for v in MODULES[family].values()}
        mdi, part = hf[module]
        by_layer.setdefault("blocks.%s.%s" % (layer, mdi), []).append((mdi, part, ab))
    scale = setup.alpha / setup.rank

    def hook(parts):
        def add(module, inputs, y):
            x = inputs[0]
            n_out = y.shape[-1]
            for mdi, part, (a, b) in parts:
                start, end = part_rows(config, mdi, part)
                delta = (x @ a.t() @ b.t()) * scale
                y = y + F.pad(delta, (start, n_out - end))
            return y
        return add

    modules = dict(model.named_modules())
    for name, parts in by_layer.items():
        modules[name].register_forward_hook(hook(parts))
    flat = [t for ab in params.values() for t in ab]
    opt = torch.optim.AdamW(flat, lr=setup.lr, betas=setup.betas, eps=setup.eps, weight_decay=setup.weight_decay)
    windows = text_windows(ids, SEQ, "text") if ids is not None else None
    losses = []
    for step in range(steps):
        if batches is None:
            batch = step_windows(windows, step, BATCH)
            scored = torch.ones_like(batch, dtype=torch.bool)
        else:
            batch, scored = batches(step)
        logits = model.forward_batch(batch)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none")
        mask = scored[:, 1:].reshape(-1).float()
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(flat, clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: (a.detach(), b.detach()) for k, (a, b) in params.items()}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "text.txt"
    path.write_text(TEXT)
    return str(path)


def _ids():
    return torch.tensor(char_tokenizer(CHARS).encode_plain(TEXT), dtype=torch.long)


def _close(got, want, tol=TOL):
    return abs(got - want) <= tol * max(abs(want), 1e-6)


def _assert_same(result, family, setup, steps=STEPS):
    config = tiny_model(family).config
    spec = setup.spec
    pairs = init_pairs(config, spec, 0)
    losses, final = reference(family, setup, pairs, _ids(), steps)
    got = [s.loss for s in result.steps]
    assert all(_close(g, w) for g, w in zip(got, losses)), (got, losses)
    assert set(result.pairs) == set(final)
    worst = 0.0
    for key, (a, b) in final.items():
        ga, gb = result.pairs[key]
        for g, w in ((ga, a), (gb, b)):
            # relative in norm: AdamW divides each gradient by its own running size, so a weight
            # whose gradients are float32 noise-sized moves by noise-sized amounts either way
            worst = max(worst, ((g - w).norm() / w.norm()).item())
    assert worst <= WEIGHT_TOL, worst
    # training moved B off zero, so the comparison above compared something
    assert max(b.abs().max().item() for _, b in final.values()) > 0


# --- units -------------------------------------------------------------------------------------

def test_windows_follow_the_file_in_order_and_wrap():
    ids = torch.arange(50)
    w = text_windows(ids, 8, "f")
    assert w.shape == (6, 8) and w[1, 0] == 8  # the last 2 ids make no window
    assert step_windows(w, 1, 4)[:, 0].tolist() == [32, 40, 0, 8]
    with pytest.raises(Exception, match="shorter than one window"):
        text_windows(torch.arange(5), 8, "f")


def test_init_is_peft_s_default_and_seeded():
    config = tiny_model("llama").config
    spec = LoraSpec(("q", "v", "down"), 4, 8.0)
    pairs = init_pairs(config, spec, 3)
    assert len(pairs) == 3 * config.n_layer
    a, b = pairs["0.self_attn.q_proj"]
    assert a.shape == (4, config.n_embd) and b.shape == (config.n_head * config.head_dim, 4)
    assert b.abs().max() == 0 and 0 < a.abs().max() <= 1 / math.sqrt(config.n_embd)
    assert torch.equal(init_pairs(config, spec, 3)["2.mlp.down_proj"][0], pairs["2.mlp.down_proj"][0])


def test_training_frames_round_trip_and_are_validated():
    x = torch.randn(2 * 5, 64)
    frame = Frame(FrameKind.GRAD, 7, [0, 1], [0, 0], [5, 5], x, train=TrainTag(3, 1, 2))
    got = decode(encode(frame), run=7, hidden=64, n_slots=1, max_len=16)
    assert got.kind == FrameKind.GRAD and got.train == TrainTag(3, 1, 2) and torch.equal(got.tensor, x)
    step = decode(encode(Frame(FrameKind.STEP, 7, train=TrainTag(3, 4, 0))), run=7)
    assert step.train == TrainTag(3, 4, 0) and step.tensor is None
    asks = decode(encode(Frame(FrameKind.EVAL, 7, [0], [0], [5], x[:5], train=TrainTag(3, 0, 1, True))), run=7)
    assert asks.train == TrainTag(3, 0, 1, True)  # a forward asking every worker for a state copy
    bad = [Frame(FrameKind.TRAIN, 7, [0], [0], [5], x[:5]),  # no train header
           Frame(FrameKind.TRAIN, 7, [0, 1], [0, 2], [5, 5], x, train=TrainTag(0, 0, 0)),  # not from position 0
           Frame(FrameKind.TRAIN, 7, [0, 1], [0, 0], [4, 6], x, train=TrainTag(0, 0, 0)),  # windows of two lengths
           Frame(FrameKind.STEP, 7, train=TrainTag(0, 0, 0)),  # a step of no micro-batch
           Frame(FrameKind.SCORE, 7, [0], [0], [5], x[:5], train=TrainTag(0, 0, 0)),  # train header off a training kind
           Frame(FrameKind.GRAD, 7, [0], [0], [5], x[:5], train=TrainTag(0, 0, 1, True))]  # a copy asked of a gradient
    for f in bad:
        with pytest.raises(FrameError):
            decode(encode(f), run=7, hidden=64, max_len=16)
    parts = encode(Frame(FrameKind.TRAIN, 7, [0], [0], [5], x[:5], train=TrainTag(0, 0, 1)))
    header = msgpack.unpackb(parts[0])
    for train in ([0, 0, 1, 2], [0, 0, 1, 1, 1], [0, 0]):  # a copy flag other than 1; too many values; too few
        header["train"] = train
        with pytest.raises(FrameError):
            decode([msgpack.packb(header), parts[1]], run=7, hidden=64, max_len=16)


def test_train_body_round_trips():
    setup = _setup("llama", ("q", "o"))
    pairs = {"1.self_attn.q_proj": (torch.randn(4, 64), torch.zeros(64, 4))}
    got_setup, got, state = read_train_body(train_body(setup, pairs))
    assert state is None and got_setup == setup and torch.equal(got["1.self_attn.q_proj"][0], pairs["1.self_attn.q_proj"][0])


# --- exactness --------------------------------------------------------------------------------

def _options(data_file, setup, micro=1, steps=STEPS):
    return training.TrainOptions(data_file, setup, steps=steps, batch_size=BATCH, micro_batches=micro, seq_len=SEQ)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("micro", [1, 4])
def test_one_node_equals_the_reference(tiny_models, data_file, family, micro):
    setup = _setup(family)
    cfg = parse_run_config(tiny_models[family])
    _assert_same(training.run(cfg, _options(data_file, setup, micro)), family, setup)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_ring_equals_the_reference(tiny_models, data_file, workers, family):
    setup = _setup(family, recompute=family == "gpt2")
    for n_workers, layers, micro in ((1, [2, 2], 4), (2, [1, 2, 1], 2)):
        cfg = parse_run_config(tiny_models[family], workers[:n_workers], layers=layers,
                               runtime={"ring_timeout": 30})
        _assert_same(training.run(cfg, _options(data_file, setup, micro)), family, setup)


def test_worker_refuses_training_frames_of_a_run_not_training(tiny_models, workers):
    from mdi.model.sampling import SamplingParams
    from mdi.model.source import ModelSource
    from mdi.starter.engine import Engine
    from mdi.starter.planning.run_plan import plan_run
    from mdi.starter.planning.run_shape import RunShape
    from mdi.starter.control import NodeError
    cfg = parse_run_config(tiny_models["llama"], workers[:1], layers=[2, 2], runtime={"ring_timeout": 10})
    source = ModelSource(cfg.model.path)
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(plan_run(cfg, source, RunShape(1, SEQ), greedy), source, greedy)
    engine.open()
    try:
        x = torch.zeros(SEQ, 64)
        engine.pipeline.transport.send(Frame(FrameKind.TRAIN, engine.pipeline.run_id, [0], [0], [SEQ], x,
                                             train=TrainTag(0, 0, 2)))
        with pytest.raises(NodeError, match="w1.*not configured for training"):
            deadline = __import__("time").monotonic() + 20
            while __import__("time").monotonic() < deadline:
                engine._check()
                __import__("time").sleep(0.1)
    finally:
        engine.abort()


# --- the command line -------------------------------------------------------------------------

def test_mdi_train_writes_metrics_and_an_adapter_mdi_serves(tiny_models, data_file, tmp_path, capsys):
    from ringconfigs import write_run_config
    from mdi.cli import train_main
    from mdi.model.adapters.adapter_files import load_adapter
    from mdi.model.adapters.lora_train import TrainableLora
    config_path = write_run_config(tmp_path / "one.yaml", tiny_models["llama"])
    out, metrics = tmp_path / "lora", tmp_path / "m.json"
    argv = ["--config", str(config_path), "--data", data_file, "--steps", "2", "--batch-size", "2", "--seq-len",
            str(SEQ), "--rank", "2", "--targets", "q,v", "--lr", "0.01", "--out", str(out), "--metrics-out", str(metrics)]
    assert train_main(argv) == 0
    record = json.loads(metrics.read_text())
    assert [s["step"] for s in record["steps"]] == [0, 1] and all(s["loss"] > 0 and s["tokens_per_s"] > 0
                                                                  for s in record["steps"])
    assert "step 2/2" in capsys.readouterr().err
    # mdi's adapter reader (what --adapter / adapters: use) takes it, fused as training computed it
    config = tiny_model("llama").config
    adapter = load_adapter(str(out), config)
    assert adapter.rank == 2 and sorted(adapter.weights) == ["blocks.%d.attn.qkv" % i for i in range(4)]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["r"] == 2
    from safetensors.torch import load_file
    tensors = load_file(str(out / "adapter_model.safetensors"))
    pairs = {}
    for name, t in tensors.items():
        layer = name.split("layers.")[1].split(".")[0]
        module = name.split("layers.%s." % layer)[1].rsplit(".lora_", 1)[0]
        pairs.setdefault("%s.%s" % (layer, module), [None, None])["lora_B" in name] = t
    fused = TrainableLora(config, LoraSpec(("q", "v"), 2, 16.0), 0, 4, pairs).fused(torch.float32)
    for name, (a, b) in adapter.weights.items():
        assert np.allclose(a, fused[name][0].t().detach().numpy(), atol=1e-7) and \
            np.allclose(b, fused[name][1].t().detach().numpy(), atol=1e-7)


def test_mdi_train_refuses_bad_input_in_one_line(tiny_models, data_file, tmp_path, capsys):
    from ringconfigs import write_run_config
    from mdi.cli import train_main
    config_path = str(write_run_config(tmp_path / "one.yaml", tiny_models["llama"]))
    assert train_main(["--config", config_path, "--data", data_file, "--resume", "x"]) == 2
    short = tmp_path / "short.txt"
    short.write_text("abc")
    assert train_main(["--config", config_path, "--data", str(short), "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "--resume x: not a complete mdi-train checkpoint" in err and "shorter than one window" in err


def test_a_ring_that_cannot_hold_the_optimizer_state_is_refused_before_any_step(tiny_models, data_file, tmp_path,
                                                                                capsys):
    """A worker whose --max-memory holds its layers and KV cache but not the LoRA with its
    gradients and AdamW moments: mdi-train ends in one line naming it, before any step."""
    from conftest import WorkerProcess
    from ringconfigs import write_run_config
    from mdi.cli import train_main
    from mdi.lab.processes import free_ports
    # rank 256 on every module of 2 tiny layers: ~3.7 MB of LoRA, x4 with grads and moments
    small = WorkerProcess(free_ports(1)[0], extra=["--max-memory", "0.006"]).wait_ready()  # ~6 MB
    try:
        config_path = str(write_run_config(tmp_path / "two.yaml", tiny_models["llama"], [small], layers=[2, 2],
                                           runtime={"ring_timeout": 30}))
        metrics = tmp_path / "m.json"
        code = train_main(["--config", config_path, "--data", data_file, "--steps", "2", "--batch-size", "2",
                           "--seq-len", str(SEQ), "--rank", "256", "--metrics-out", str(metrics)])
    finally:
        small.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert "LoRA and its optimizer state" in err[0] and "MB" in err[0], err
    assert "step 1/" not in err[0] and not metrics.exists()
