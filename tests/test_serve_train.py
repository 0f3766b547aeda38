"""Training beside --serve (issue 38, Symbiosis): a LoRA job on a real 3-node serving ring while
requests stream. The streamed texts equal an idle ring's (greedy), the job's adapter equals
mdi-train's from the same seed and data on the same workers and split, and it is then served by
name without a restart; bad bodies are 400 naming the field, a second job 409, DELETE stops one
and the ring serves (and can train) on."""
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import load_file

from conftest import CHARS, ServeProcess
from ringconfigs import parse_run_config, write_run_config
from mdi.lab.random_lora import write_random_lora
from mdi.model.adapters.lora_train import peft_tensor_name
from mdi.model.source import ModelSource
from mdi.ring.train_request import TrainSetup
from mdi.starter import batch
from mdi.starter.train import training

# Training computes on torch; a ring serving on ggml refuses a job in one line (tests/test_serve.py)
pytestmark = pytest.mark.usefixtures("module_on_torch")

TEXT = "".join(CHARS[(i * 7 + i // 5) % (len(CHARS) - 1)] for i in range(900)) + "\n"
PROMPTS = ["The quick brown fox", "Once upon a time", "abc def"]
N = 24
LAYERS = [1, 1, 2]
RUNTIME = {"threads": 1, "ring_timeout": 30}
JOB = {"method": "lora", "rank": 4, "alpha": 8, "targets": ["q", "v", "o", "down"], "steps": 12, "batch_size": 4,
       "micro_batches": 2, "seq_len": 16, "lr": 1e-2, "seed": 5}
TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tiny_models, workers, tmp_path_factory):
    model = tiny_models["llama"]
    base = os.path.dirname(model)  # data and out may lie here (beside the model)
    data = os.path.join(base, "train-serve.txt")
    with open(data, "w") as f:
        f.write(TEXT)
    # mdi-train alone on the same workers and split, before the server takes them
    setup = TrainSetup(targets=tuple(JOB["targets"]), rank=JOB["rank"], alpha=float(JOB["alpha"]), lr=JOB["lr"])
    options = training.TrainOptions(data, setup, steps=JOB["steps"], batch_size=JOB["batch_size"],
                                    micro_batches=JOB["micro_batches"], seq_len=JOB["seq_len"], seed=JOB["seed"])
    alone = training.run(parse_run_config(model, workers[:2], layers=LAYERS, runtime=RUNTIME), options)
    path = write_run_config(tmp_path_factory.mktemp("serve-train") / "ring3.yaml", model, workers[:2],
                            layers=LAYERS, worker_name="board%d", runtime=RUNTIME,
                            serve={"max_in_flight": 4, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        yield server, model, base, data, alone
    finally:
        server.stop()


def stream(server, prompt, model="tiny"):
    body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "stream": True}
    text = []
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=(5, 120)) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    return "".join(text)


def train(server, verb="POST", **body):
    return requests.request(verb, server.url + "/v1/mdi/train", json=body if verb == "POST" else None,
                            timeout=120)


def wait_state(server, states, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = train(server, "GET").json()
        if report["state"] in states:
            return report
        time.sleep(0.05)
    raise AssertionError("training job still %s after %.0f s" % (report["state"], timeout))


def test_job_beside_streams(setup):
    server, model, base, data, alone = setup
    idle = {p: stream(server, p) for p in PROMPTS}
    assert train(server, "GET").status_code == 404  # no job yet
    out = os.path.join(base, "trained-beside")
    r = train(server, data=data, out=out, name="mine", **JOB)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "running" and r.json()["steps"] == JOB["steps"]
    overlapped = 0
    while True:  # requests stream while the job runs: their texts are the idle ring's
        running = train(server, "GET").json()["state"] == "running"
        for p in PROMPTS:
            assert stream(server, p) == idle[p]
        overlapped += running
        if not running:
            break
    assert overlapped >= 1
    report = wait_state(server, ("done", "failed"))
    assert report["state"] == "done", report
    assert report["step"] == JOB["steps"] and len(report["loss"]) == JOB["steps"] and report["error"] is None
    assert (report["out"], report["data"]) == ("trained-beside", "train-serve.txt"), report  # not the server's paths
    assert report["loss"] == pytest.approx([s.loss for s in alone.steps], rel=TOL)
    assert all(t > 0 for t in report["tokens_per_s"])
    state = server.get("/v1/mdi/state").json()["training"]
    assert state["loss"] == report["loss"]  # the dashboard's curve
    assert (state["out"], state["data"]) == ("trained-beside", "train-serve.txt"), state  # no server paths there (h38)
    # the adapter on disk equals mdi-train's (PEFT format, as mdi-train --out writes it)
    config = ModelSource(model).config
    got = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert len(got) == 2 * len(alone.pairs)
    for key, (a, b) in alone.pairs.items():
        for t, ab in ((a, "A"), (b, "B")):
            torch.testing.assert_close(got[peft_tensor_name(config, key, ab)], t, rtol=0, atol=TOL)
    # ... and is served by name at once, as a one-process run with that adapter gives it
    assert "mine" in [m["id"] for m in server.get("/v1/models").json()["data"]]
    want = batch.run(parse_run_config(model, label="alone", adapters={"mine": out}, n_tokens=N),
                     [PROMPTS[0]], adapters=["mine"]).texts[0]
    assert stream(server, PROMPTS[0], model="mine") == want != idle[PROMPTS[0]]


@pytest.mark.parametrize("body, field", [
    ({}, "data"),
    ({"data": "/etc/passwd"}, "data"),
    ({"data": "DATA", "out": "/tmp/elsewhere"}, "out"),
    ({"data": "DATA", "out": "OUT", "steps": 0}, "steps"),
    ({"data": "DATA", "out": "OUT", "steps": True}, "steps"),
    ({"data": "DATA", "out": "OUT", "lr": -1}, "lr"),
    ({"data": "DATA", "out": "OUT", "rank": "8"}, "rank"),
    ({"data": "DATA", "out": "OUT", "targets": ["q", "nope"]}, "targets"),
    ({"data": "DATA", "out": "OUT", "method": "prompt"}, "method"),
    ({"data": "DATA", "out": "OUT", "batch_size": 2, "micro_batches": 3}, "micro_batches"),
    ({"data": "DATA", "out": "OUT", "seq_len": 100000}, "seq_len"),
    ({"data": "SHORT", "out": "OUT"}, "data"),  # shorter than one window
    ({"data": "DATA", "out": "OUT", "name": "tiny"}, "name"),
    ({"data": "DATA", "out": "OUT", "name": "a b"}, "name"),
    ({"data": "DATA", "out": "OUT", "shuffle": True}, "shuffle"),
])
def test_bad_bodies_are_400_naming_the_field(setup, body, field):
    server, model, base, data, alone = setup
    short = os.path.join(base, "short.txt")
    with open(short, "w") as f:
        f.write("too short")
    body = {k: {"DATA": data, "SHORT": short, "OUT": os.path.join(base, "never")}.get(v, v)
            if isinstance(v, str) else v for k, v in body.items()}
    r = train(server, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "\n" not in error["message"], error
    assert not os.path.exists(os.path.join(base, "never"))


def test_out_never_overwrites_served_files_nor_any_files(setup):
    """Issue 58 (3): `out` may not be, lie inside or hold the model's folder or a served adapter's
    (configured, loaded, or loaded and unloaded again), nor be a folder that already holds files;
    the 400 names the field and says which, with paths relative to the models folder."""
    server, model, base, data, alone = setup
    lora = write_random_lora(os.path.join(base, "served-lora"), ModelSource(model).config, seed=3, rank=2)
    r = requests.post(server.url + "/v1/mdi/adapters", json={"name": "served", "path": lora}, timeout=120)
    assert r.status_code == 200, r.text
    full = os.path.join(base, "full")
    os.makedirs(os.path.join(full, "sub"))
    with open(os.path.join(full, "notes.txt"), "w") as f:
        f.write("mine")
    cases = [(model, "is the model"), (os.path.join(model, "new"), "inside the model"), (base, "holds the model"),
             (lora, "adapter 'served'"), (os.path.join(lora, "new"), "inside adapter 'served'"),
             (full, "already holds files"), (os.path.join(base, ".", "full"), "already holds files")]
    try:
        for out, says in cases:
            r = train(server, data=data, out=out, **dict(JOB, steps=1))
            assert r.status_code == 400, (out, r.text)
            error = r.json()["error"]
            assert error["param"] == "out" and says in error["message"], (out, error)
            assert base not in error["message"] and "\n" not in error["message"], error
        r = requests.delete(server.url + "/v1/mdi/adapters/served", timeout=120)
        assert r.status_code == 200, r.text
        r = train(server, data=data, out=lora, **dict(JOB, steps=1))  # unloaded: its files are still someone's
        assert r.status_code == 400 and "adapter 'served'" in r.json()["error"]["message"], r.text
        assert train(server, "GET").status_code in (200, 404)  # no job was started by any of them
        assert train(server, "GET").json().get("state") != "running"
    finally:
        requests.delete(server.url + "/v1/mdi/adapters/served", timeout=120)
    assert not os.path.exists(os.path.join(model, "adapter_config.json"))
    assert sorted(os.listdir(full)) == ["notes.txt", "sub"]
    for path in (model, lora):
        assert not os.path.exists(os.path.join(path, "new"))


def test_second_job_is_409_and_delete_stops_it(setup, workers):
    """A second job is a 409 while one runs, and so is an adapter loaded under the name the
    running job is to be served as, or from where it writes; each worker counts the job's pairs and optimizer state in
    what it holds (/status, and what adapters loaded meanwhile are checked against); DELETE
    stops the job, which writes nothing."""
    server, model, base, data, alone = setup

    def training_bytes():
        return [requests.get(w.url + "/status", timeout=10).json()["memory"]["training_bytes"] for w in workers[:2]]
    body = dict(JOB, steps=100000, data=data, out=os.path.join(base, "stopped"), name="pending")
    assert train(server, **body).status_code == 200
    r = train(server, **body)
    assert r.status_code == 409 and "running" in r.json()["error"]["message"]
    lora = write_random_lora(os.path.join(base, "other-lora"), ModelSource(model).config, seed=4, rank=2)
    r = requests.post(server.url + "/v1/mdi/adapters", json={"name": "pending", "path": lora}, timeout=120)
    assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text
    for path in (body["out"], os.path.join(body["out"], "sub")):  # the job writes there when done: not served
        r = requests.post(server.url + "/v1/mdi/adapters", json={"name": "early", "path": path}, timeout=120)
        assert r.status_code == 409 and r.json()["error"]["param"] == "path", r.text
    wait_state(server, ("running",))
    wait_step(server, 2)
    assert all(b > 0 for b in training_bytes())
    r = train(server, "DELETE")
    assert r.status_code == 200 and r.json()["state"] == "stopped", r.text
    assert training_bytes() == [0, 0]
    assert train(server, "DELETE").status_code == 404
    assert not os.path.exists(os.path.join(base, "stopped"))  # a stopped job writes no adapter
    assert stream(server, PROMPTS[1]) == stream(server, PROMPTS[1])  # serving goes on
    # every worker dropped its training state: a new job starts on the same run
    r = train(server, **dict(body, steps=2, out=os.path.join(base, "again"), name=None))
    assert r.status_code == 200, r.text
    assert wait_state(server, ("done", "failed"))["state"] == "done"


def test_worker_runs_passes_first_and_one_training_frame_per_pass():
    """The worker's yield rule (mdi.worker.run.Run._take_next), on a Run's inbox: a decode pass
    queued behind training frames goes first; while passes come, one costly training frame runs
    right after each and the next waits, as does one that comes late in the gap (a relay or step
    frame does not); once passes stop coming
    (overdue by twice their usual gap) training runs freely; a stop frame is never passed."""
    from collections import deque
    from types import SimpleNamespace
    from mdi.ring.wire import Frame, FrameKind, TrainTag
    from mdi.worker.run import Run

    def frame(kind, layer=2):
        return Frame(kind, 1, [0], [0], [1], torch.zeros(1, 4), train=TrainTag(0, 0, layer)
                     if kind not in (FrameKind.DECODE, FrameKind.STOP) else None)
    run = Run.__new__(Run)
    run.chunk = SimpleNamespace(first=2, last=4)
    run.last_generation, run.generation_gap, run.trained_since_generation = 0.0, 0.0, True
    fwd, fwd2, dec = frame(FrameKind.TRAIN), frame(FrameKind.TRAIN), frame(FrameKind.DECODE)
    run.inbox = deque([fwd, fwd2, dec])
    assert run._take_next() is dec  # the pass first, out of order
    run._generation_done()
    assert run._take_next() is fwd  # the one training frame this pass allows
    run.generation_gap = 10.0  # passes come every 10 s: the next one is not overdue
    assert run._take_next() is None and len(run.inbox) == 1 and run.inbox[0] is fwd2
    relay = frame(FrameKind.GRAD, layer=7)  # another node's gradient: costs nothing here
    run.inbox.appendleft(relay)
    assert run._take_next() is relay
    run._generation_done()
    run.last_generation -= 5.0  # half a gap after the last pass: too late to start before the next
    assert run._take_next() is None
    run.generation_gap, run.last_generation = 0.2, time.monotonic() - 1.0  # passes overdue: none served now
    assert run._take_next() is fwd2
    stop = frame(FrameKind.STOP)
    run.inbox = deque([frame(FrameKind.TRAIN), stop, frame(FrameKind.DECODE)])
    run.generation_gap, run.last_generation = 10.0, time.monotonic()
    run.trained_since_generation = True
    assert run._take_next() is None  # the decode behind the stop frame may not pass it


def own_server(tiny_models, tmp_path, data_name, n_spares=0, **runtime):
    """A serving ring of its own (two workers, `n_spares` spares): yields (server, workers,
    models folder, training data path)."""
    from conftest import worker_pool
    base = os.path.dirname(tiny_models["llama"])
    data = os.path.join(base, data_name)
    with open(data, "w") as f:
        f.write(TEXT)
    pool = worker_pool(2 + n_spares)
    workers = next(pool)
    # ring_timeout 30: under two CPU-bound jobs a first training step's frames had not come back
    # within 10 s (a dead worker is named by the starter's /status polling, not by this timeout)
    path = write_run_config(tmp_path / "ring3.yaml", tiny_models["llama"], workers[:2], layers=LAYERS,
                            worker_name="board%d", spares=workers[2:], runtime=dict(RUNTIME, ring_timeout=30, **runtime),
                            serve={"max_in_flight": 2, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        yield server, workers, base, data
    finally:
        server.stop()
        next(pool, None)


@pytest.fixture
def own_ring(tiny_models, tmp_path):
    yield from own_server(tiny_models, tmp_path, "train-serve-fail.txt", recovery_attempts=0)


@pytest.mark.slow
def test_a_dead_worker_fails_the_job_naming_it(own_ring):
    import signal
    server, workers, base, data = own_ring
    assert train(server, **dict(JOB, steps=100000, data=data, out=os.path.join(base, "dead"))).status_code == 200
    wait_step(server, 1)
    os.kill(workers[1].proc.pid, signal.SIGKILL)
    report = wait_state(server, ("failed",), timeout=60)
    assert "board2" in report["error"] and "\n" not in report["error"], report


def wait_step(server, step, timeout=120):
    """Until the running job has done `step` steps (its report, if it ends before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = train(server, "GET").json()
        assert report["state"] == "running", report
        if report["step"] >= step:
            return report
        time.sleep(0.05)
    raise AssertionError("training job still at step %d after %.0f s" % (report["step"], timeout))


@pytest.fixture
def ring_with_spare(tiny_models, tmp_path):
    yield from own_server(tiny_models, tmp_path, "train-serve-spare.txt", n_spares=1)


@pytest.mark.slow
def test_jobs_train_after_a_spare_took_a_dead_workers_layers(ring_with_spare):
    """A worker killed, a spare takes its layers; then jobs start, stop and finish on the new
    ring while requests stream, their texts unchanged, and no recovery is spent on them."""
    import signal
    server, workers, base, data = ring_with_spare
    before = {p: stream(server, p) for p in PROMPTS[:2]}
    with ThreadPoolExecutor(2) as pool:
        during = pool.submit(stream, server, PROMPTS[0])  # in flight when its node dies
        time.sleep(0.5)
        os.kill(workers[1].proc.pid, signal.SIGKILL)
        assert during.result() == before[PROMPTS[0]]
    assert stream(server, PROMPTS[0]) == before[PROMPTS[0]]  # the ring recovered (if the first did not see it)
    metrics = server.metrics()  # the first read: the node lost before it is listed, down
    recoveries = metrics["mdi_recoveries_total"]
    assert recoveries >= 1 and metrics['mdi_node_up{node="board2"}'] == 0
    for i in range(2):  # started and stopped at once, then after a step, while requests stream
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(stream, server, PROMPTS[1])
            body = dict(JOB, steps=100000, data=data, out=os.path.join(base, "spare-stopped%d" % i))
            assert train(server, **body).status_code == 200
            if i:
                wait_step(server, 1)
            assert train(server, "DELETE").status_code == 200
            assert wait_state(server, ("stopped", "failed"))["error"] is None
            assert beside.result() == before[PROMPTS[1]]
    assert train(server, **dict(JOB, data=data, out=os.path.join(base, "spare-done"))).status_code == 200
    assert stream(server, PROMPTS[1]) == stream(server, PROMPTS[1])
    report = wait_state(server, ("done", "failed"))
    assert report["state"] == "done", report
    assert report["step"] == JOB["steps"]
    assert stream(server, PROMPTS[0]) == before[PROMPTS[0]]
    assert server.metrics()["mdi_recoveries_total"] == recoveries
