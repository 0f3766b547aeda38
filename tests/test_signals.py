"""Ctrl-C and SIGTERM stop a batch run cleanly: the ring is ended at once (workers do not wait
for their heartbeat timeout), the partial texts and summary are printed for every node of the
ring, and the exit code says which signal it was (130 / 143)."""
import json
import os
import signal
import subprocess
import time

import pytest
import requests
import torch

from conftest import BIN, CHARS, free_ports, save_test_model
from ringconfigs import write_run_config
from mdi.model.config import ModelConfig
from mdi.model.tokenizers import char_tokenizer
from mdi.model.transformer import full_model


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Big enough that 900 tokens take seconds, so a signal lands mid-run."""
    path = str(tmp_path_factory.mktemp("slow") / "m")
    torch.manual_seed(0)
    config = ModelConfig(name="slow", family="llama", vocab_size=len(CHARS), n_layer=4, n_embd=256, n_head=8,
                         n_kv_head=2, intermediate_size=768, block_size=1024, tied_head=True)
    model = full_model(config)
    save_test_model(path, config, model.state_dict(), "tests/test_signals.py")
    char_tokenizer(CHARS).save(path)
    return path


def _sigint_as_at_a_terminal():
    # A suite started in the background (`cmd &` in a script, nohup) hands its children SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: mdi-start rightly runs to
    # the end, as a nohup'ed run should (nohup ignores SIGHUP too, which mdi-start then leaves
    # ignored). The user this test stands for is at a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _status(worker):
    # A busy machine may keep the answer waiting for seconds: the timeout bounds a hang.
    return requests.get("http://127.0.0.1:%d/status" % worker.port, timeout=30).json()


def _state(worker):
    return _status(worker)["state"]


def _generating(worker):
    """This run's frames are flowing through the worker (a stopped run's counters stay shown)."""
    status = _status(worker)
    return status["state"] == "running" and (status.get("counters") or {}).get("frames_done", 0) >= 10


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])  # SIGHUP: the ssh session gone
def test_a_signal_ends_the_ring_at_once_and_keeps_the_partial_run(tmp_path, slow_model, workers, signum):
    worker = workers[0]
    cfg = write_run_config(tmp_path / "ring2.yaml", slow_model, [worker], layers=2, worker_name="board%d",
                           n_tokens=900, runtime={"threads": 1, "heartbeat_timeout": 120})
    metrics = tmp_path / "m.json"
    proc = subprocess.Popen([os.path.join(BIN, "mdi-start"), "--config", cfg, "--prompt", "a", "--prompt", "b",
                             "--metrics-out", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True, preexec_fn=_sigint_as_at_a_terminal)
    try:
        deadline = time.monotonic() + 120
        while not _generating(worker):  # long before the 1800th token
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, (proc.returncode, out, err)
    assert "Traceback" not in err
    assert "mdi: error: interrupted by %s" % signal.Signals(signum).name in err, err
    assert "2 nodes" in out, out  # the summary counts the whole ring, not only the starter
    record = json.loads(metrics.read_text())
    assert [n["name"] for n in record["nodes"]] == ["starter", "board1"]
    assert record["error"].startswith("interrupted") and record["n_tokens"] > 0
    # The worker was told to stop (its heartbeat timeout is 120 s).
    assert _state(worker) in ("stopped", "idle")


@pytest.mark.slow
def test_a_server_whose_workers_died_exits_at_once_on_sigterm(tmp_path, tiny_models):
    """The stop frame cannot come back round a ring with dead nodes: the server names the
    node and exits instead of waiting out ring_timeout (it waited 30 s, the default)."""
    from conftest import ServeProcess, worker_pool
    pool = worker_pool(2)
    workers = next(pool)
    try:
        path = write_run_config(tmp_path / "ring3.yaml", tiny_models["llama"], workers, layers=[1, 1, 2],
                                worker_name="board%d", runtime={"threads": 1, "ring_timeout": 600})
        server = ServeProcess(path).wait_ready()
        for worker in workers:
            worker.proc.kill()
            worker.proc.wait(timeout=30)
        assert server.stop() == 0, server.output()  # stop() kills it past 60 s
        assert "closing the ring: node board" in server.output()
    finally:
        next(pool, None)


def test_a_starter_paused_past_the_heartbeat_timeout_says_it_was_the_silent_one(tmp_path, slow_model, workers):
    """The workers rightly end a run whose starter went silent; the starter, resumed, knows how
    long it did not poll them and says so, instead of only suspecting the worker."""
    worker = workers[0]
    cfg = write_run_config(tmp_path / "ring2.yaml", slow_model, [worker], layers=2, worker_name="board%d",
                           n_tokens=900, runtime={"threads": 1, "heartbeat_timeout": 20})  # (a busy machine's polls)
    proc = subprocess.Popen([os.path.join(BIN, "mdi-start"), "--config", cfg, "--prompt", "a"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    try:
        deadline = time.monotonic() + 120
        while not _generating(worker):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while _state(worker) == "running":  # the worker's heartbeat timeout passes
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (out, err)
    assert "node board1" in err and "this starter did not poll it for" in err, err


@pytest.mark.slow
def test_a_server_interrupted_while_its_ring_opens_exits_at_once_as_interrupted(tmp_path, tiny_models, workers):
    """Ctrl-C or SIGTERM while `--serve` opened its ring waited for the ring to open (4-16 s)
    and exited 0 (SIGINT) or 1; a server stopped once serving exits 0."""
    env = dict(os.environ, MDI_BACKEND="auto", MDI_PROFILE_CACHE=str(tmp_path / "fresh"))  # it measures: seconds
    path = write_run_config(tmp_path / "ring.yaml", tiny_models["llama"], workers[:1], layers=[2, 2],
                            worker_name="board%d", runtime={"threads": 1})
    proc = subprocess.Popen([os.path.join(BIN, "mdi-start"), "--config", path, "--serve", "--port",
                             str(free_ports(1)[0])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, env=env, preexec_fn=_sigint_as_at_a_terminal)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "measuring the ggml and torch backends" in line:
                break
            if "serving" in line:
                pytest.skip("the ring opened before a signal could land (auto did not measure here)")
        proc.send_signal(signal.SIGTERM)
        out = "".join(seen) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "mdi: error: interrupted by SIGTERM" in out and "Traceback" not in out, out
    assert _state(workers[0]) in ("idle", "stopped")


def test_a_hangup_ignored_by_nohup_stays_ignored():
    """`nohup mdi-prepare ...` (or mdi-start, mdi-bench): a closed terminal must not end the run,
    so the SIGHUP handler is installed only where SIGHUP is not ignored already."""
    from mdi.cli.process import interrupt_on_sigterm
    hangup, term = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        interrupt_on_sigterm(KeyboardInterrupt, also_sighup=True)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        interrupt_on_sigterm(KeyboardInterrupt, also_sighup=True)
        assert callable(signal.getsignal(signal.SIGHUP))
    finally:
        signal.signal(signal.SIGHUP, hangup)
        signal.signal(signal.SIGTERM, term)


def test_a_server_stopped_by_sighup_is_a_clean_stop(tmp_path, tiny_models):
    """A closed terminal stops a server as SIGTERM does, exit 0; it had raised past serve() and
    exited 129 "interrupted by SIGHUP" (h80)."""
    from conftest import ServeProcess
    path = write_run_config(tmp_path / "serve.yaml", tiny_models["llama"], runtime={"threads": 1})
    server = ServeProcess(path, preexec_fn=_sigint_as_at_a_terminal).wait_ready()
    try:
        server.proc.send_signal(signal.SIGHUP)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    out = server.output()
    assert code == 0 and "Traceback" not in out and "interrupted" not in out, (code, out)
