"""Shared fixtures: tiny random models saved as mdi directories, and real worker processes."""
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mdi.model.checkpoints import save_model_dir  # noqa: E402
from mdi.model.config import ModelConfig  # noqa: E402
from mdi.model.transformer import full_model  # noqa: E402
from mdi.model.tokenizers import char_tokenizer  # noqa: E402
from mdi.lab.nodes import free_ports  # noqa: E402,F401  (tests import it from here)

# One thread per process: several node processes share this machine's cores.
torch.set_num_threads(1)
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
BIN = os.path.dirname(sys.executable)


def tiny_config(family: str) -> ModelConfig:
    if family == "gpt2":
        return ModelConfig(name="tiny-gpt2", family="gpt2", vocab_size=len(CHARS), n_layer=4, n_embd=64,
                           n_head=4, block_size=128, bias=True, tied_head=True, gelu_approximate="tanh")
    return ModelConfig(name="tiny-llama", family="llama", vocab_size=len(CHARS), n_layer=4, n_embd=64,
                       n_head=8, n_kv_head=2, intermediate_size=128, block_size=128, tied_head=False)


def make_tiny_model(path: str, family: str, seed: int = 0, half_exact: bool = False) -> str:
    """A random model with a character tokenizer, saved as a prepared mdi directory.
    `half_exact`: every weight is a float16 value, so float16 storage loses nothing."""
    torch.manual_seed(seed)
    model = full_model(tiny_config(family))
    # Wider than default init so that greedy decoding does not collapse to one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            if half_exact:
                p.copy_(p.half().float())
    save_model_dir(path, model.config, model.state_dict(), "tests/conftest.py")
    char_tokenizer(CHARS).save(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(str(base / f), f) for f in ("gpt2", "llama")}


class WorkerProcess:
    def __init__(self, port: int, extra=(), env=None, token=None) -> None:
        self.port = port
        self.headers = {"Authorization": "Bearer " + token} if token else {}
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "mdi-worker-%d.log" % port), "w+")
        self.proc = subprocess.Popen([os.path.join(BIN, "mdi-worker"), "--port", str(port), "--threads", "1"]
                                     + list(extra), stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = "http://127.0.0.1:%d" % port

    def wait_ready(self, timeout: float = 90.0) -> "WorkerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("worker on port %d exited: %s" % (self.port, self.output()))
            try:
                if requests.get(self.url + "/health", headers=self.headers, timeout=1).ok:
                    return self
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("worker on port %d not ready in %.0f s" % (self.port, timeout))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                requests.post(self.url + "/shutdown", headers=self.headers, timeout=2)
                self.proc.wait(timeout=5)
            except (requests.RequestException, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.log.close()


@pytest.fixture(scope="session")
def workers():
    """Three worker processes shared by the ring tests (a worker serves run after run)."""
    procs = [WorkerProcess(p) for p in free_ports(3)]
    try:
        yield [w.wait_ready() for w in procs]
    finally:
        for w in procs:
            w.stop()
