"""mdi-train in float16 / bfloat16 compute (model.dtype): the frozen base computes in the narrow
dtype while the LoRA parameters, their AdamW state and the loss stay float32, so a bfloat16
run's losses track the float32 run's (loosely: bfloat16 keeps 8 bits of mantissa); where the
device cannot train in the dtype, one line says so before any work starts."""
import pytest
import torch

from ringconfigs import parse_run_config, write_run_config
from test_train import BATCH, SEQ, TEXT, _options, _setup
from mdi.runconfig import ConfigError
from mdi.starter.train import training

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

STEPS = 5
LOSS_TOL = 3e-2  # relative, per step: bfloat16 rounds every activation to ~3 significant digits


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("train_dtype") / "text.txt"
    path.write_text(TEXT)
    return str(path)


def _run(cfg, data_file, micro):
    return training.run(cfg, _options(data_file, _setup("llama"), micro, steps=STEPS))


def _assert_tracks(got, want):
    losses, reference = [s.loss for s in got.steps], [s.loss for s in want.steps]
    assert all(abs(g - w) <= LOSS_TOL * abs(w) for g, w in zip(losses, reference)), (losses, reference)
    assert losses != reference  # computed in bfloat16 indeed, not silently in float32
    assert all(t.dtype == torch.float32 for ab in got.pairs.values() for t in ab)  # what trains stays float32
    # B starts at 0: what training moved it by points the float32 run's way (AdamW's first
    # steps move each weight by ~lr x sign(gradient), so single weights with tiny gradients differ)
    moved = torch.cat([got.pairs[k][1].flatten() for k in sorted(got.pairs)])
    reference_moved = torch.cat([want.pairs[k][1].flatten() for k in sorted(want.pairs)])
    cosine = torch.nn.functional.cosine_similarity(moved, reference_moved, dim=0).item()
    assert cosine > 0.9, cosine
    assert all(m.dtype == torch.float32 for ab in got.optimizer.moments.values() for m in ab)


def test_bfloat16_losses_track_float32_on_one_node(tiny_models, data_file):
    path = tiny_models["llama"]
    want = _run(parse_run_config(path), data_file, 2)
    got = _run(parse_run_config(path, dtype="bfloat16"), data_file, 2)
    _assert_tracks(got, want)


def test_bfloat16_losses_track_float32_through_the_ring(tiny_models, data_file, workers):
    path = tiny_models["llama"]

    def cfg(**kw):
        return parse_run_config(path, workers[:2], layers=[1, 2, 1], runtime={"ring_timeout": 30}, **kw)
    want = _run(cfg(), data_file, 2)
    got = _run(cfg(dtype="bfloat16"), data_file, 2)
    assert got.n_nodes == 3
    _assert_tracks(got, want)


def test_a_dtype_the_device_cannot_train_in_is_one_line(tiny_models, data_file, tmp_path, monkeypatch, capsys):
    from mdi.cli import train_main
    matmul = torch.Tensor.__matmul__

    def old_torch(x, w):  # torch builds without CPU float16 matmul fail this way
        if x.dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return matmul(x, w)
    monkeypatch.setattr(torch.Tensor, "__matmul__", old_torch)
    monkeypatch.setattr(training, "open_engine", lambda *a: pytest.fail("work started"))
    config = write_run_config(tmp_path / "half.yaml", tiny_models["llama"], dtype="float16")
    argv = ["--config", config, "--data", data_file, "--steps", "1", "--batch-size", str(BATCH), "--seq-len", str(SEQ)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "float16" in err and "on cpu" in err and "use float32" in err, err
    with pytest.raises(ConfigError, match="model dtype float16"):
        training.check_train_dtype(parse_run_config(tiny_models["llama"], dtype="float16"))
    # float32 and bfloat16 train here
    training.check_train_dtype(parse_run_config(tiny_models["llama"], dtype="bfloat16"))
