"""mdi-train through a lost worker (issue 38): a worker SIGKILLed during step 3 of 6 is replaced
by a spare, or its neighbours take its layers, the interrupted step is done again from the
start, and the run ends with the losses and adapter of an uninterrupted run."""
import dataclasses
import json
import logging
import os
import signal

import pytest

from conftest import worker_pool
from ringconfigs import parse_run_config, write_run_config
from test_train import SEQ, TEXT, _close, _setup
from test_train_features import _worst
from mdi.starter.train import ring_trainer, training

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

STEPS, BATCH, KILL_STEP = 6, 4, 2  # the third step (0-based 2)
TOL = 1e-5


@pytest.fixture
def three_workers():
    yield from worker_pool(3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("train_recovery") / "text.txt"
    path.write_text(TEXT)
    return str(path)


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, data):
    """The 6 steps of llama's tiny model in one process, nothing lost (what every recovered run must equal)."""
    return _uninterrupted(tiny_models, data, "llama")


def _uninterrupted(tiny_models, data, family):
    return training.run(parse_run_config(tiny_models[family]), _options(data, _setup(family)))


def _options(data, setup, **kw):
    return training.TrainOptions(data, setup, steps=STEPS, batch_size=BATCH, micro_batches=2, seq_len=SEQ, **kw)


def _config(spares=(), attempts=None):
    """A 2-worker ring's settings: layers 1 + 2 + 1, a dead node noticed within a second."""
    runtime = {"threads": 1, "heartbeat_interval": 0.2, "ring_timeout": 10}
    if attempts is not None:
        runtime["recovery_attempts"] = attempts
    return dict(worker_name="board%d", spares=spares, layers=[1, 2, 1], runtime=runtime)


def _kill_during(monkeypatch, victim, kind, settled=False):
    """SIGKILL `victim` the first time the starter builds a `kind` frame of step KILL_STEP to send:
    "train" mid-forward, "grad" mid-backward; `settled`: once the snapshot of the steps
    before, read meanwhile, has come back (else the read may be lost with the node)."""
    build = ring_trainer.RingTrainer.frame  # every train and grad frame the starter sends is built here
    killed = []

    def build_and_kill(self, frame_kind, step, micro, layer, y, copies=False):
        frame = build(self, frame_kind, step, micro, layer, y, copies)
        if not killed and frame_kind == kind and step == KILL_STEP:
            killed.append(step)
            reading = self.before_step.__self__.reading  # TrainRecovery.settle's: the read in flight
            if settled and reading is not None:
                reading.thread.join(30)
            os.kill(victim.proc.pid, signal.SIGKILL)
        return frame
    monkeypatch.setattr(ring_trainer.RingTrainer, "frame", build_and_kill)
    return killed


def _assert_same_run(result, whole):
    assert [s.step for s in result.steps] == list(range(STEPS))
    assert all(_close(a.loss, b.loss, TOL) for a, b in zip(result.steps, whole.steps)), \
        ([s.loss for s in result.steps], [s.loss for s in whole.steps])
    assert set(result.pairs) == set(whole.pairs) and _worst(result.pairs, whole.pairs) <= TOL
    # and the AdamW state every node ends with is the uninterrupted run's
    assert result.optimizer.steps == whole.optimizer.steps == STEPS
    assert _worst(result.optimizer.moments, whole.optimizer.moments) <= TOL


@pytest.mark.parametrize("kind,every", [("grad", 1), ("train", 4)], ids=["mid-backward", "mid-forward-every-4"])
def test_a_spare_takes_over_and_the_step_is_redone(tiny_models, data, uninterrupted, three_workers, monkeypatch,
                                                   caplog, kind, every):
    board1, board2, spare = three_workers
    cfg = parse_run_config(tiny_models["llama"], [board1, board2], **_config([spare]))
    killed = _kill_during(monkeypatch, board1, kind, settled=True)
    with caplog.at_level(logging.WARNING, logger="mdi"):
        result = training.run(cfg, _options(data, _setup("llama"), recovery_every=every))
    assert killed == [KILL_STEP]
    _assert_same_run(result, uninterrupted)
    (rec,) = result.metrics()["recoveries"]
    assert "board1" in rec["cause"] and "spare1" in rec["action"] and rec["step"] == KILL_STEP
    # every 4 steps: the snapshot is the start's, so steps 1 and 2 ran again too
    assert rec["resumed_at_step"] == (KILL_STEP if every == 1 else 0)
    snaps = result.metrics()["snapshots"]
    assert snaps["every"] == every and snaps["count"] >= STEPS // every and snaps["bytes"] > 0
    assert result.n_nodes == 3
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("mdi-train: lost a node"))
    assert "step 3" in line and "board1" in line and "spare1" in line


@pytest.mark.parametrize("family,victim", [("llama", 0), ("llama", 1), ("gpt2", 0)],
                         ids=["board1-starter-grows", "board2", "gpt2-board1"])
def test_neighbours_absorb_the_layers_without_a_spare(tiny_models, data, uninterrupted, three_workers, monkeypatch,
                                                      family, victim):
    boards = three_workers[:2]
    cfg = parse_run_config(tiny_models[family], boards, **_config(attempts=1))
    _kill_during(monkeypatch, boards[victim], "grad")
    result = training.run(cfg, _options(data, _setup(family)))
    _assert_same_run(result, uninterrupted if family == "llama" else _uninterrupted(tiny_models, data, family))
    (rec,) = result.metrics()["recoveries"]
    assert "board%d" % (victim + 1) in rec["cause"] and "go to" in rec["action"]
    assert result.n_nodes == 2


def test_two_workers_lost_the_spare_then_the_neighbours(tiny_models, data, uninterrupted, three_workers,
                                                         monkeypatch):
    """board1 dies in step 3 (the spare takes its layers), board2 in step 5 (no spare left: the
    starter and the spare share its layers); the run still ends as the uninterrupted one."""
    board1, board2, spare = three_workers
    cfg = parse_run_config(tiny_models["llama"], [board1, board2], **_config([spare]))  # 2 attempts
    build, kills = ring_trainer.RingTrainer.frame, {(KILL_STEP, "grad"): board1, (KILL_STEP + 2, "train"): board2}

    def build_and_kill(self, kind, step, micro, layer, y, copies=False):
        frame = build(self, kind, step, micro, layer, y, copies)
        victim = kills.pop((step, kind), None)
        if victim is not None:
            os.kill(victim.proc.pid, signal.SIGKILL)
        return frame
    monkeypatch.setattr(ring_trainer.RingTrainer, "frame", build_and_kill)
    result = training.run(cfg, _options(data, _setup("llama")))
    assert not kills
    _assert_same_run(result, uninterrupted)
    first, second = result.metrics()["recoveries"]
    assert "board1" in first["cause"] and "spare1" in first["action"] and first["step"] == KILL_STEP
    assert "board2" in second["cause"] and "go to" in second["action"] and second["step"] == KILL_STEP + 2
    assert result.n_nodes == 2


def test_a_snapshot_lost_with_its_node_leaves_the_one_before(tiny_models, data, uninterrupted, three_workers,
                                                            monkeypatch):
    """board2 dies while the starter reads the state after step 2 (GET /train, overlapping step
    3): that read fails, so the ring goes back to the state after step 1 and redoes 2 and 3."""
    board1, board2, spare = three_workers
    cfg = parse_run_config(tiny_models["llama"], [board1, board2], **_config([spare]))
    states, reads = ring_trainer.RingTrainer.worker_states, []

    def read(self):
        reads.append(1)
        if len(reads) == 2:  # the read after step 2 (after step 1 first)
            os.kill(board2.proc.pid, signal.SIGKILL)
            board2.proc.wait(10)
        return states(self)
    monkeypatch.setattr(ring_trainer.RingTrainer, "worker_states", read)
    result = training.run(cfg, _options(data, _setup("llama")))
    _assert_same_run(result, uninterrupted)
    (rec,) = result.metrics()["recoveries"]
    assert "board2" in rec["cause"] and "spare1" in rec["action"]
    assert rec["step"] == KILL_STEP and rec["resumed_at_step"] == KILL_STEP - 1


def test_without_recovery_the_run_fails_naming_the_node_and_keeps_no_snapshots(tiny_models, data, three_workers,
                                                                                  monkeypatch):
    from mdi.starter.control import NodeError
    boards = three_workers[:2]
    cfg = parse_run_config(tiny_models["llama"], boards, **_config())
    assert cfg.recovery_attempts == 0  # no spares, no runtime.recovery_attempts: recovery is off
    states, reads = ring_trainer.RingTrainer.worker_states, []
    monkeypatch.setattr(ring_trainer.RingTrainer, "worker_states", lambda self: reads.append(1) or states(self))
    killed = _kill_during(monkeypatch, boards[1], "grad")
    with pytest.raises(NodeError, match="board2"):
        training.run(cfg, _options(data, _setup("llama")))
    assert killed == [KILL_STEP] and reads == []  # two steps done, and not one GET /train spent on snapshots


def test_mdi_train_cli_records_the_recovery(tiny_models, data, three_workers, monkeypatch, tmp_path, capsys):
    from mdi.cli.train import train_main
    board1, board2, spare = three_workers
    config = write_run_config(tmp_path / "ring.yaml", tiny_models["llama"], [board1, board2], **_config([spare]))
    _kill_during(monkeypatch, board2, "grad", settled=True)
    metrics = tmp_path / "m.json"
    assert train_main(["--config", config, "--data", data, "--steps", "4", "--batch-size", "4", "--seq-len", str(SEQ),
                       "--rank", "4", "--alpha", "8", "--lr", "0.01", "--recovery-every", "2",
                       "--metrics-out", str(metrics)]) == 0
    record = json.loads(metrics.read_text())
    assert [s["step"] for s in record["steps"]] == [0, 1, 2, 3]
    (rec,) = record["recoveries"]
    assert "board2" in rec["cause"] and "spare1" in rec["action"] and rec["resumed_at_step"] == 2
    assert record["snapshots"]["every"] == 2


def test_a_prompt_run_recovers_its_prompt_to_the_snapshot(tiny_models, data, three_workers, monkeypatch):
    """--method prompt: the workers train nothing, the prompt and its AdamW state are the
    starter's; after a spare takes over, the prompt goes back to the snapshot with the ring and
    the run equals an uninterrupted one."""
    from mdi.model.adapters.prompt_train import PromptSpec
    setup = dataclasses.replace(_setup("llama"), targets=())
    options = dict(recovery_every=4, prompt=PromptSpec(3))  # the snapshot is the start: steps 1-3 redone
    whole = training.run(parse_run_config(tiny_models["llama"]), _options(data, setup, **options))
    board1, board2, spare = three_workers
    cfg = parse_run_config(tiny_models["llama"], [board1, board2], **_config([spare]))
    killed = _kill_during(monkeypatch, board2, "grad", settled=True)
    result = training.run(cfg, _options(data, setup, **options))
    assert killed == [KILL_STEP]
    assert result.metrics()["recoveries"][0]["resumed_at_step"] == 0
    assert all(_close(a.loss, b.loss, TOL) for a, b in zip(result.steps, whole.steps))
    assert result.prompt is not None and float((result.prompt - whole.prompt).norm() / whole.prompt.norm()) <= TOL
    assert result.optimizer.steps == whole.optimizer.steps == STEPS
    assert _worst(result.optimizer.moments, whole.optimizer.moments) <= TOL
