"""A worker under hostile or careless starters: pushed weights are streamed to disk (an aborted
push leaves it idle, an oversized one is refused unread, a push does not double its memory),
a second starter is refused while a run holds it, `weights.path` stays inside --models-dir,
runtime.threads reaches every worker, and bad mdi-worker flags are one-line usage errors."""
import copy
import glob
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch

from conftest import BIN, CHARS, WorkerProcess, free_ports
from ringconfigs import parse_run_config, run_config_dict
from mdi.cli.worker import worker_parser
from mdi.model.config import ModelConfig
from mdi.model.layout import torch_dtype
from mdi.model.source import ModelSource
from mdi.model.files.store import save_model_dir
from mdi.model.tokenizers import char_tokenizer
from mdi.model.threads import candidates, usable_cpus
from mdi.model.transformer import full_model
from mdi.ring.init_request import (MAX_WEIGHTS_BYTES, SAFETENSORS_SLACK, DataPlane, InitRequest, NodeBusy,
                                   PushedWeights, RequestError, Weights)
from mdi.runconfig import NodeSpec, parse_config
from mdi.starter import batch
from mdi.starter.control import ControlClient, NodeError
from mdi.starter.planning import run_shape


def model_config(path):
    with open(os.path.join(path, "mdi_config.json")) as f:
        return ModelConfig.from_dict(json.load(f)["model"])


def init_request(model_dir, run_id, weights, layers=(2, 4), threads=None, heartbeat_timeout=60.0):
    bind, nxt = free_ports(2)
    return InitRequest(run_id=run_id, model=model_config(model_dir), layers=list(layers), dtype="float32",
                       device="cpu", n_slots=1, max_len=16, data=DataPlane(bind, "127.0.0.1", nxt, True),
                       weights=weights, heartbeat_timeout=heartbeat_timeout, threads=threads)


def push_request(model_dir, run_id, layers=(2, 4), heartbeat_timeout=60.0):
    """An /init announcing a push, and the blob to push (as the starter makes them)."""
    blob = ModelSource(model_dir).chunk_bytes(layers[0], layers[1], torch_dtype("float32"))
    push = PushedWeights(nbytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    return init_request(model_dir, run_id, Weights(push=push), layers, heartbeat_timeout=heartbeat_timeout), blob


def status(worker):
    return requests.get(worker.url + "/status", timeout=10).json()


def wait_state(worker, state, timeout=60):
    deadline = time.monotonic() + timeout
    while status(worker)["state"] != state:
        assert time.monotonic() < deadline, "worker on port %d never became %s" % (worker.port, state)
        time.sleep(0.05)


def client(worker, name="w"):
    return ControlClient(NodeSpec(name, port=worker.port), connect_timeout=10, init_timeout=120)


def post_raw(port, head, body=b"", read_reply=True):
    """An HTTP request written by hand on a socket: the body may stop short of Content-Length.
    Returns (status line, reply body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(head.encode("ascii") + body)
        if not read_reply:
            return b"", b""
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = s.recv(65536)
            assert data, "connection closed before a reply: %r" % reply
            reply += data
        headers, _, rest = reply.partition(b"\r\n\r\n")
        length = re.search(br"(?im)^content-length:\s*(\d+)", headers)
        while length and len(rest) < int(length.group(1)):
            data = s.recv(65536)
            if not data:
                break
            rest += data
        return headers.split(b"\r\n")[0], rest
    finally:
        s.close()


def ring_cfg(model, workers, threads=None):
    """The starter and w1... on free data ports, 8 greedy tokens, as a config dict."""
    runtime = {"heartbeat_timeout": 30, "ring_timeout": 60}
    if threads is not None:
        runtime["threads"] = threads
    return run_config_dict(model, workers, n_tokens=8, runtime=runtime)


def reference_ids(model, prompt, n_tokens):
    cfg = parse_run_config(model, label="ref", n_tokens=n_tokens)
    return batch.run(cfg, [prompt]).samples[0].token_ids


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    """Two workers that may read the tiny models (--models-dir), each with its own TMPDIR."""
    models = os.path.dirname(tiny_models["gpt2"])
    procs = []
    for port in free_ports(2):
        tmp = str(tmp_path_factory.mktemp("worker-tmp"))
        procs.append(WorkerProcess(port, extra=("--models-dir", models), env=dict(os.environ, TMPDIR=tmp)))
        procs[-1].tmp = tmp
    try:
        yield [w.wait_ready() for w in procs]
    finally:
        for w in procs:
            w.stop()


# --- 4: pushed weights ------------------------------------------------------------------------

def test_aborted_push_leaves_the_worker_idle_and_able_to_run(tiny_models, pair):
    model = tiny_models["gpt2"]
    worker = pair[0]
    # A server that hands a request over only once all of it is in never shows the worker an
    # aborted push: its starter's silence (heartbeat_timeout) frees the worker then.
    request, blob = push_request(model, 101, heartbeat_timeout=5.0)  # long enough to see it loading on a busy box
    assert client(worker).init(request)["need_weights"] is True
    assert status(worker)["state"] == "loading"
    # Half the body, then the starter is gone (its connection closes).
    head = ("POST /weights HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
            "Content-Length: %d\r\n\r\n" % len(blob))
    post_raw(worker.port, head, blob[:len(blob) // 2], read_reply=False)
    wait_state(worker, "idle")
    assert glob.glob(os.path.join(worker.tmp, "mdi-weights-*")) == []  # its temporary file is gone
    # The worker serves the next run, weights pushed afresh.
    cfg = parse_config(ring_cfg(model, [worker]), "after-abort")
    got = batch.run(cfg, ["Once upon"]).samples[0].token_ids
    assert got == reference_ids(model, "Once upon", 8)
    assert glob.glob(os.path.join(worker.tmp, "mdi-weights-*")) == []


def test_a_bad_push_frees_the_worker(tiny_models, pair):
    worker = pair[0]
    request, blob = push_request(tiny_models["gpt2"], 102, layers=(1, 4))  # not the weights it holds
    c = client(worker)
    assert c.init(request)["need_weights"] is True
    with pytest.raises(NodeError, match="sha256"):
        c.push_weights(bytes([blob[0] ^ 1]) + blob[1:])
    assert status(worker)["state"] == "idle"
    assert glob.glob(os.path.join(worker.tmp, "mdi-weights-*")) == []


def test_oversized_push_is_refused_before_any_byte_is_read(tiny_models):
    model = tiny_models["gpt2"]
    request, blob = push_request(model, 103)
    limit = int(0.0001 * 1024 ** 3)  # --max-memory 0.0001 GB: less than these weights
    assert len(blob) > limit
    worker = WorkerProcess(free_ports(1)[0], extra=("--max-memory", "0.0001")).wait_ready()
    try:
        r = requests.post(worker.url + "/init", json=request.to_json(), timeout=30)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert str(len(blob)) in error and str(limit) in error and "--max-memory" in error, error
        assert status(worker)["state"] == "idle"
        # Nothing waits for weights: a push beyond any announcement is answered unread.
        head = ("POST /weights HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                "Content-Length: %d\r\n\r\n" % (MAX_WEIGHTS_BYTES + SAFETENSORS_SLACK + 1))
        line, body = post_raw(worker.port, head)
        assert re.match(br"HTTP/1\.[01] 4\d\d", line), (line, body)
        assert status(worker)["state"] == "idle"
    finally:
        worker.stop()


def _vm(pid, key):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """About 50 MB of float32 weights in 16 small blocks: a push big enough to measure."""
    path = str(tmp_path_factory.mktemp("wide") / "m")
    torch.manual_seed(0)
    config = ModelConfig(name="wide", family="gpt2", vocab_size=len(CHARS), n_layer=17, n_embd=256, n_head=4,
                         block_size=64, bias=True, tied_head=True, gelu_approximate="tanh")
    save_model_dir(path, config, full_model(config).state_dict(), "tests/test_worker_hardening.py")
    char_tokenizer(CHARS).save(path)
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_a_pushed_chunk_does_not_double_the_workers_memory(wide_model, tiny_models):
    request, blob = push_request(wide_model, 104, layers=(1, 17))
    worker = WorkerProcess(free_ports(1)[0]).wait_ready()
    try:
        # A small push first: torch's and werkzeug's code paths, paged in once, are not the push's.
        warm, small = push_request(tiny_models["gpt2"], 105)
        c = client(worker)
        assert c.init(warm)["need_weights"] is True
        c.push_weights(small)
        c.stop(warm.run_id)
        pid = worker.pid
        try:
            with open("/proc/%d/clear_refs" % pid, "w") as f:
                f.write("5")  # resets the peak (VmHWM) to the current RSS
        except OSError:
            pytest.skip("cannot reset the worker's peak RSS")
        before = _vm(pid, "VmRSS")
        assert c.init(request)["need_weights"] is True
        c.push_weights(blob)
        assert status(worker)["state"] == "running"
        peak = _vm(pid, "VmHWM") - before
        # Buffered whole, the push held the body, a parsed copy and the chunk: about 3x.
        assert peak < 1.6 * len(blob), "peak RSS grew by %.1f MB for %.1f MB of weights" % (peak / 1e6, len(blob) / 1e6)
        c.stop(request.run_id)
    finally:
        worker.stop()


# --- 5: two starters on the same workers ------------------------------------------------------

def test_a_second_starter_is_refused_while_a_run_holds_the_workers(tiny_models, pair, tmp_path):
    from mdi.model.sampling import SamplingParams
    from mdi.starter.engine import Engine
    from mdi.starter.sample import make_samples
    from mdi.starter.planning.run_plan import plan_run
    model = tiny_models["llama"]
    cfg_a = parse_config(ring_cfg(model, pair), "run A")
    source = ModelSource(model)
    prompt_ids = run_shape.encode_prompts(source, ["Once upon"])
    shape = run_shape.RunShape(1, len(prompt_ids[0]) + 8)
    engine = Engine(plan_run(cfg_a, source, shape), source, SamplingParams(0.0))
    engine.open()  # run A holds both workers; its watchdog is their heartbeat
    try:
        run_a = engine.ring.run_id
        path_b = tmp_path / "b.yaml"
        path_b.write_text(json.dumps(ring_cfg(model, pair)))
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", str(path_b), "--prompt", "x"],
                              capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        # both refuse at once: the first refusal to arrive is the one named
        assert ("w1" in lines[0] or "w2" in lines[0]) and "HTTP 409" in lines[0] and "run %d" % run_a in lines[0], \
            lines[0]
        assert "127.0.0.1" in lines[0], lines[0]  # the holder's address as the worker saw it
        # Run B's failure ended only run B: run A goes on and its stop frame comes back round.
        assert all(status(w)["run_id"] == run_a and status(w)["state"] == "running" for w in pair)
        samples = make_samples(["Once upon"], prompt_ids, 8, 1)
        engine.run(samples)
        stats = engine.close()
        assert samples[0].token_ids == reference_ids(model, "Once upon", 8) and len(stats) == 2
    finally:
        engine.abort()
    # The stop frame freed both workers at once: run B now runs.
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", str(path_b), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_lapsed_heartbeat_lets_another_run_take_over(tiny_models):
    from mdi.worker.node import Worker
    model = tiny_models["gpt2"]
    worker = Worker("127.0.0.1", free_ports(1)[0], models_dir=os.path.dirname(model))
    worker.shutdown_requested.set()  # no watchdog: the lapse is simulated below
    try:
        first = init_request(model, 1, Weights(path=model))
        worker.init(first, "10.0.0.7")
        second = copy.deepcopy(first)
        second.run_id = 2
        with pytest.raises(NodeBusy, match=r"run 1 of the starter at 10\.0\.0\.7") as err:
            worker.init(second, "10.0.0.8")
        assert err.value.status == 409 and worker.run.id == 1
        assert worker.init(first, "10.0.0.7")["ok"]  # its own starter may configure it again
        assert worker.stop_run(3) is False and worker.run.id == 1  # another run's stop ends nothing
        worker.last_contact -= 61  # run 1's starter silent past its heartbeat_timeout of 60 s
        worker.init(second, "10.0.0.8")
        assert worker.run.id == 2 and worker.run.peer == "10.0.0.8"
        assert worker.stop_run(2) is True and worker.run is None
        # run 3's starter stopped it (an aborted start-up) before its /init came: refused
        third = copy.deepcopy(first)
        third.run_id = 3
        with pytest.raises(RequestError, match="run 3 was stopped by its starter before this /init came"):
            worker.init(third, "10.0.0.9")
        assert worker.run is None and worker.init(first, "10.0.0.7")["ok"]
    finally:
        worker.end_run()


def test_a_next_host_that_cannot_be_reached_frees_the_data_port_and_the_cache(tiny_models):
    """A next host the worker's sockets cannot connect to (a name no syntax allows) is a 400
    naming it, and the run it would have started leaves nothing bound: the next /init on the
    same data port starts its run. Over HTTP the field is checked before any of that."""
    from mdi.ring.init_request import validate_init
    from mdi.worker.node import Worker
    model = tiny_models["gpt2"]
    worker = Worker("127.0.0.1", free_ports(1)[0], models_dir=os.path.dirname(model))
    worker.shutdown_requested.set()
    try:
        bad = init_request(model, 1, Weights(path=model))
        good = copy.deepcopy(bad)
        bad.data.next_host = "a b"
        with pytest.raises(RequestError, match="cannot connect to the next node at a b:"):
            worker.init(bad, "127.0.0.1")
        assert worker.run is None and worker.chunk is not None and worker.chunk.cache is None
        assert worker.init(good, "127.0.0.1")["ok"] and worker.run.id == 1  # the same data port
        for host in ("a b", "tcp://x", "x:80", "::1", "-x", "a/b"):
            with pytest.raises(RequestError, match="data.next_host must be a host name or IPv4 address"):
                validate_init(dict(bad.to_json(), data=dict(bad.data.to_json(), next_host=host)))
    finally:
        worker.end_run()


def test_a_start_up_that_fails_on_one_node_leaves_the_others_free_at_once(tiny_models, pair, tmp_path):
    """w2 is another HTTP server (its /health answers, nothing else): the start-up fails naming
    it while w1 is still being configured. w1 is free the moment mdi-start has exited, and the
    next run takes it: the failed run's /init, arriving after the abort's /stop, had held it
    (a 409 for the next run) until its heartbeat lapsed. An /init that reaches w1 after the
    stop (a loaded machine) is refused: the worker remembers the runs stopped before they began."""
    import http.server
    import threading

    class HealthOnly(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"ok": true}' if self.path == "/health" else b"<html>\n<body>no</body>\n</html>"
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = do_GET

        def log_message(self, *args):
            pass

    fake = http.server.ThreadingHTTPServer(("127.0.0.1", free_ports(1)[0]), HealthOnly)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    model = tiny_models["llama"]
    try:
        for attempt in range(3):  # the race it closes was met 3 times in 3
            bad = tmp_path / ("bad%d.yaml" % attempt)
            bad.write_text(json.dumps(ring_cfg(model, [pair[0], fake.server_address[1]])))
            proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", str(bad), "--prompt", "x"],
                                  capture_output=True, text=True, timeout=120)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 1 and len(lines) == 1 and "w2" in lines[0], proc.stderr
            # Free well before the run's 30 s heartbeat would lapse: at once on an idle machine; on
            # a loaded one the worker's stop may wait for the /init loading under its lock.
            deadline = time.monotonic() + 25
            while status(pair[0])["state"] == "running" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert status(pair[0])["state"] != "running", status(pair[0])
            cfg = parse_config(ring_cfg(model, [pair[0]]), "after-failed-start")
            assert batch.run(cfg, ["Once upon"]).samples[0].token_ids == reference_ids(model, "Once upon", 8)
    finally:
        fake.shutdown()


def test_chunk_files_of_a_prepared_model_run_under_backend_auto(tiny_models, pair, tmp_path):
    """mdi-prepare --chunks writes safetensors chunks for the nodes' `weights:`; with backend
    auto (the default) each worker computes its chunk with torch (ggml computes GGUF tensors),
    where ggml had been chosen from the model's GGUF and the chunk then refused as "not a GGUF"."""
    from ringconfigs import run_config_dict
    model = tiny_models["llama"]
    out = os.path.join(os.path.dirname(model), "llama-chunked")  # inside the workers' --models-dir
    proc = subprocess.run([os.path.join(BIN, "mdi-prepare"), model, "--out", out, "--chunks", "2-1-1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    chunks = os.path.join(out, "chunks", "2-1-1")
    cfg = run_config_dict(out, pair, layers=[2, 1, 1], n_tokens=8, runtime={"backend": "auto"},
                          node_options={1: {"weights": os.path.join(chunks, "node1.safetensors")},
                                        2: {"weights": os.path.join(chunks, "node2.safetensors")}})
    result = batch.run(parse_config(cfg, "chunks"), ["Once upon"])
    assert result.samples[0].token_ids == reference_ids(model, "Once upon", 8)
    assert [n.backend for n in result.nodes[1:]] == ["torch", "torch"]


# --- 6: weights.path stays inside --models-dir -----------------------------------------------

def test_weights_path_outside_the_models_dir_is_refused_alike(tiny_models, pair, tmp_path):
    model = tiny_models["gpt2"]
    worker = pair[1]
    outside = tmp_path / "outside"
    outside.mkdir()
    link = os.path.join(os.path.dirname(model), "link-out-%d" % os.getpid())

    def init(path):
        body = init_request(model, 201, Weights(path=path)).to_json()
        return requests.post(worker.url + "/init", json=body, timeout=60)

    replies = {}
    for path in ("../../../../etc/passwd", "/etc/passwd", "/etc/no-such-file-here", str(outside),
                 os.path.join(model, "..", "..", "x"), "/proc/self/environ"):
        r = init(path)
        assert r.status_code == 400, (path, r.status_code, r.text)
        replies[path] = r.json()["error"].replace(repr(path), "PATH")
    assert len(set(replies.values())) == 1 and "models directory" in replies["/etc/passwd"], replies
    # A symlink out of the models directory is refused too...
    (outside / "model.safetensors").write_bytes(open(os.path.join(model, "model.safetensors"), "rb").read())
    os.symlink(str(outside), link)
    try:
        r = init(link)
        assert r.status_code == 400 and "models directory" in r.json()["error"], r.text
    finally:
        os.remove(link)
    # ...while a path inside it loads, relative ones from the worker's working directory.
    r = init(os.path.relpath(model, os.getcwd()))
    assert r.status_code == 200 and r.json()["need_weights"] is False, r.text
    requests.put(worker.url + "/stop?run=201", timeout=10)
    # Inside, a file that is not safetensors is a 400 naming the problem, not a 500.
    junk = os.path.join(os.path.dirname(model), "junk-%d.safetensors" % os.getpid())
    with open(junk, "wb") as f:
        f.write(b"\xff" * 64)
    try:
        r = init(junk)
        assert r.status_code == 400 and "cannot load weights" in r.json()["error"], r.text
    finally:
        os.remove(junk)
    # A NUL in the path (os functions raise on it) is a one-line 400 too.
    r = init(model + "\0x")
    assert r.status_code == 400 and "NUL" in r.json()["error"], r.text
    assert status(worker)["state"] == "idle"


# --- 9: runtime.threads reaches the workers ---------------------------------------------------

def test_runtime_threads_reach_workers_unless_they_have_their_own(tiny_models):
    model = tiny_models["gpt2"]
    # OMP_NUM_THREADS=2: torch's default here is 2 whatever the machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="2")
    plain, own = free_ports(2)
    procs = [WorkerProcess(plain, ["--log-level", "info"], env=env, threads=None),
             WorkerProcess(own, ["--log-level", "info"], env=env, threads=2)]
    try:
        workers = [w.wait_ready() for w in procs]
        assert status(workers[0])["threads"] == 2
        cfg = parse_config(ring_cfg(model, workers, threads=1), "threads")
        result = batch.run(cfg, ["Once upon"])
        assert [n["threads"] for n in result.metrics()["nodes"]] == [1, 1, 2]  # the metrics record's, starter's too
        assert [status(w)["threads"] for w in workers] == [1, 2]
        # auto: the plain worker times its chunk at 1, 2, ... threads and keeps one of them,
        # saying so; the one started with --threads keeps its own; the text does not change.
        auto = batch.run(parse_config(ring_cfg(model, workers, threads="auto"), "threads"),
                         ["Once upon"])
        assert auto.samples[0].token_ids == result.samples[0].token_ids
        assert status(workers[1])["threads"] == 2 and "threads: auto" not in procs[1].output()
        chose = [line for line in procs[0].output().splitlines() if "threads: auto chose" in line]
        assert len(chose) == 1 and status(workers[0])["threads"] in candidates(usable_cpus()), chose
        assert "1: " in chose[0] and "ms per pass" in chose[0]
    finally:
        for w in procs:
            w.stop()


# --- mdi-worker flags -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["--port", "80000"], "--port"), (["--port", "0"], "--port"), (["--threads", "-2"], "--threads"),
    (["--threads", "0"], "--threads"), (["--log-level", "bogus"], "--log-level"),
    (["--max-memory", "-1"], "--max-memory"),
])
def test_bad_worker_flags_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        worker_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()  # one line, not argparse's usage block first
    assert len(lines) == 1 and lines[0].startswith("mdi: error: argument %s" % needle), err
    assert lines[0].endswith("(mdi-worker --help lists the options)"), err


def test_good_worker_flags():
    args = worker_parser().parse_args(["--port", "65535", "--threads", "2", "--log-level", "debug",
                                       "--models-dir", "/srv/models"])
    assert (args.port, args.threads, args.log_level, args.models_dir) == (65535, 2, "DEBUG", "/srv/models")


def test_missing_models_dir_is_one_line(tmp_path):
    proc = subprocess.run([os.path.join(BIN, "mdi-worker"), "--port", str(free_ports(1)[0]),
                           "--models-dir", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "mdi: error: --models-dir %s is not a directory" % (
        tmp_path / "nope"), proc.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_worker_process_limits_its_malloc_arenas_unless_the_user_set_them():
    # A worker serves every run on a new thread; with an arena per thread its memory grew run
    # after run (mdi.system.memory.limit_malloc_arenas says how much).
    code = "from mdi.system.memory import limit_malloc_arenas; print(limit_malloc_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    theirs = subprocess.run([sys.executable, "-c", code], env=dict(env, MALLOC_ARENA_MAX="4"), capture_output=True,
                            text=True, timeout=60)
    assert (ours.stdout.strip(), theirs.stdout.strip()) == ("True", "False"), ours.stderr + theirs.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_node_process_fixes_mallocs_thresholds_unless_the_user_set_them():
    # Left to itself glibc serves large blocks from the heap once one was freed, and the heap's
    # holes stay resident (mdi.system.memory.fix_malloc_thresholds says how much that cost).
    code = ("import ctypes, sys, numpy as np\n"
            "from mdi.cli.process import setup_process\n"
            "if sys.argv[1] == 'set-up':\n"
            "    setup_process()\n"
            "class M(ctypes.Structure):  # mallinfo's (mallinfo2 is glibc 2.33's: not JetPack 5's 2.31)\n"
            "    _fields_ = [(n, ctypes.c_int) for n in 'arena ord smb hblks hblkhd usm fsm uord ford keep'.split()]\n"
            "f = ctypes.CDLL(None).mallinfo\n"
            "f.restype = M\n"
            "b = np.ones(8 << 20, np.uint8)\n"
            "del b  # freed: glibc raises its threshold past 6 MB\n"
            "a = np.ones(6 << 20, np.uint8)\n"
            "print(f().hblkhd >= 6 << 20)")  # a mapping of its own, unmapped when freed
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    runs = [subprocess.run([sys.executable, "-c", code, how], env=env, capture_output=True, text=True, timeout=60)
            for how in ("set-up", "plain")]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], runs[0].stderr + runs[1].stderr
    code = "from mdi.system.memory import fix_malloc_thresholds; print(fix_malloc_thresholds())"
    theirs = subprocess.run([sys.executable, "-c", code], env=dict(env, MALLOC_MMAP_THRESHOLD_="131072"),
                            capture_output=True, text=True, timeout=60)
    assert theirs.stdout.strip() == "False", theirs.stderr
