"""`layers: auto` and mdi-plan on loopback with real workers: the nodes are profiled over
POST /profile and /probe, the plan is cached, the planned ring generates what the model
generates alone, and a ring that cannot hold the model fails before any weight is sent."""
import json
import os
import subprocess

import pytest
import requests

from conftest import BIN, WorkerProcess, free_ports
from ringconfigs import parse_run_config, write_run_config
from mdi.model.layout import weight_bytes
from mdi.model.profile_size import profile_blocks, profile_bytes
from mdi.ring.profile_request import ProfileRequest
from mdi.timing.node import profile_positions
from mdi.model.source import ModelSource
from mdi.runconfig import ConfigError, load_config
from mdi.starter import batch

PROMPTS = ["The quick brown fox", "Hi", "To be, or not to be"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = str(tmp_path / "profiles")
    monkeypatch.setenv("MDI_PROFILE_CACHE", path)
    return path


def write_config(path, model, workers, layers="auto"):
    return write_run_config(path, model, workers, layers=layers, n_tokens=10, generation={"prompts": PROMPTS},
                            runtime={"threads": 1, "ring_timeout": 30})


def test_layers_auto_plans_measures_once_and_generates_the_same_tokens(tiny_models, workers, tmp_path, cache_dir,
                                                                     monkeypatch):
    model = tiny_models["llama"]
    n_layer = ModelSource(model).config.n_layer
    alone = batch.run(parse_run_config(model, label="alone", n_tokens=10), PROMPTS)
    cfg = load_config(write_config(tmp_path / "auto.yaml", model, workers[:2]))
    assert cfg.auto_layers
    result = batch.run(cfg, PROMPTS)
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in alone.samples]
    plan = result.metrics()["plan"]
    assert sum(plan["counts"]) == n_layer and plan["counts"][0] >= 1
    assert plan["nodes"] == ["starter", "w1", "w2"] and plan["predicted_tokens_per_s"] > 0
    used = [c for c in plan["counts"] if c]
    assert [n["layers"][1] - n["layers"][0] for n in result.metrics()["nodes"]] == used
    assert set(plan["dropped"]) == {name for name, c in zip(plan["nodes"], plan["counts"]) if c == 0}
    cached = json.load(open(os.path.join(cache_dir, "profiles.json")))
    # The starter, two workers, two links; and when the plan leaves a node out, the nodes kept,
    # timed again by themselves (these workers share the starter's machine), round after round
    # until the plan keeps every node it was timed with: the last round's nodes are the ring's.
    kept = {name for name, c in zip(plan["nodes"], plan["counts"]) if c}
    assert bool(plan["retimed"]) == bool(plan["dropped"])
    assert not plan["retimed"] or set(plan["retimed"][-1]) == kept
    assert all(set(later) < set(earlier) for earlier, later in zip(plan["retimed"], plan["retimed"][1:]))
    assert len(cached) == 5 + sum(len(r) for r in plan["retimed"])
    # The second plan comes from the cache: nothing is measured again.
    before = {k: v for k, v in cached.items()}
    again = batch.run(load_config(str(tmp_path / "auto.yaml")), PROMPTS)
    assert json.load(open(os.path.join(cache_dir, "profiles.json"))) == before
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in alone.samples]
    # Other code (a faster kernel, say) makes those profiles stale: measured again.
    from mdi.starter.planning import node_speeds
    monkeypatch.setattr(node_speeds, "_code_ids", ["other code"])
    stale = batch.run(load_config(str(tmp_path / "auto.yaml")), PROMPTS).metrics()["plan"]
    assert len(json.load(open(os.path.join(cache_dir, "profiles.json")))) == len(cached) + 5 + sum(len(r) for r in stale["retimed"])


def test_a_worker_down_when_the_planner_times_it_is_replaced_by_a_spare(tiny_models, workers, tmp_path, cache_dir,
                                                                        caplog):
    """layers: auto with a worker that does not answer: the planner had failed the run naming it
    (as a fixed split's recovery does not), a spare standing by; now the spare takes its place,
    and without a spare the others share its layers."""
    import logging
    model = tiny_models["llama"]
    alone = batch.run(parse_run_config(model, label="alone", n_tokens=10), PROMPTS)
    dead = free_ports(1)[0]
    path = write_run_config(tmp_path / "auto.yaml", model, [workers[0].port, dead], layers="auto", n_tokens=10,
                            spares=[workers[1]], runtime={"threads": 1, "ring_timeout": 30, "recovery_attempts": 1})
    with caplog.at_level(logging.WARNING):
        result = batch.run(load_config(path), PROMPTS)
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in alone.samples]
    assert "w2" not in result.metrics()["plan"]["nodes"] and "spare1" in result.metrics()["plan"]["nodes"]
    assert "w2" in result.metrics()["plan"]["dropped"]  # the record says where it went
    assert "node w2 is lost" in caplog.text and "spare spare1 takes its place" in caplog.text
    # --check says the lost worker instead (and fails)
    from mdi.cli.start import start_main
    assert start_main(["--config", path, "--check"]) == 1
    without = write_run_config(tmp_path / "alone.yaml", model, [workers[0].port, dead], layers="auto", n_tokens=10,
                               runtime={"threads": 1, "ring_timeout": 30, "recovery_attempts": 1})
    result = batch.run(load_config(without), PROMPTS)
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in alone.samples]
    assert result.metrics()["plan"]["nodes"] == ["starter", "w1"] and "w2" in result.metrics()["plan"]["dropped"]


def test_mdi_plan_prints_and_writes_a_config_that_runs(tiny_models, workers, tmp_path, cache_dir):
    model = tiny_models["gpt2"]
    config = write_config(tmp_path / "auto.yaml", model, workers[:2])
    out = tmp_path / "plans" / "planned.yaml"  # a folder that does not exist yet: made
    r = subprocess.run([os.path.join(BIN, "mdi-plan"), "--config", config, "--samples", "3", "--write", str(out)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "slowest stage" in r.stdout and "predicted tokens/s" in r.stdout and "memory use / limit" in r.stdout
    assert out.read_text().startswith("# planned by mdi-plan from %s (its comments are there)" % config)
    planned = load_config(str(out))
    assert not planned.auto_layers and planned.generation.n_samples == 3  # what it was planned for
    assert sum(n.layers for n in planned.nodes) == ModelSource(model).config.n_layer
    result = batch.run(planned, PROMPTS)
    assert all(len(s.token_ids) == 10 for s in result.samples)
    j = subprocess.run([os.path.join(BIN, "mdi-plan"), "--config", config, "--samples", "3", "--json"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert j.returncode == 0, j.stderr
    assert "timing" not in j.stderr  # cached by the first call
    assert [c for c in json.loads(j.stdout)["counts"] if c] == [n.layers for n in planned.nodes]


def test_a_worker_without_memory_for_a_layer_is_left_out(tiny_models, tmp_path, cache_dir):
    small = WorkerProcess(free_ports(1)[0], extra=["--max-memory", "0.00001"]).wait_ready()  # ~10 kB
    try:
        config = write_config(tmp_path / "auto.yaml", tiny_models["llama"], [small])
        r = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--quiet"],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert r.returncode == 0, r.stderr
        assert "w1" in r.stderr and "left out" in r.stderr
        status = requests.get("http://127.0.0.1:%d/status" % small.port, timeout=10).json()
        assert status["runs_served"] == 0 and status["memory"]["chunk_bytes"] == 0
    finally:
        small.stop()


def test_a_ggml_profile_past_a_worker_s_memory_is_refused_and_one_within_it_runs(tiny_models):
    """ggml's probe ignored --max-memory: a 7B-wide block in F32 took 2.3 GB on a worker given
    0.3 GB (torch's was refused); a board past its limit is killed, not told."""
    from mdi.model.ggml.lib import unavailable_reason
    from mdi.timing.ggml_profile import probe_bytes
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    config = ModelSource(tiny_models["llama"]).config
    request = ProfileRequest(config, "float32", "cpu", [1, 2], 8, 4, threads=1, backend="ggml",
                             layer_types={"attn_q.weight": "F32"})
    need = probe_bytes(request)
    small = WorkerProcess(free_ports(1)[0], extra=["--max-memory", repr((need - 1) / 1024 ** 3)]).wait_ready()
    roomy = WorkerProcess(free_ports(1)[0], extra=["--max-memory", repr(4 * need / 1024 ** 3)]).wait_ready()
    try:
        r = requests.post("http://127.0.0.1:%d/profile" % small.port, json=request.to_json(), timeout=120)
        assert r.status_code == 413 and "profiling needs %d bytes" % need in r.json()["error"], r.text
        r = requests.post("http://127.0.0.1:%d/profile" % roomy.port, json=request.to_json(), timeout=120)
        assert r.status_code == 200 and r.json()["blocks"] >= 1, r.text
    finally:
        small.stop()
        roomy.stop()


def test_an_idle_worker_lets_go_of_its_last_weights_when_a_profile_needs_their_room(tiny_models, tmp_path):
    # A board that holds its last run's layers and has room for the two blocks of a profile
    # only without them: it profiles (the next /init would drop them anyway), it is not left out.
    model = tiny_models["llama"]
    config = ModelSource(model).config
    request = ProfileRequest(config, "float32", "cpu", [1, 2], 8, 4, threads=1)
    two_blocks = profile_bytes(config, 2, "float32", None, 2, profile_positions(request))
    held = weight_bytes(config, (0, 2), "float32")  # the 2 layers the fixed ring below gives it
    limit = held + two_blocks - 1
    small = WorkerProcess(free_ports(1)[0], extra=["--max-memory", repr(limit / 1024 ** 3)]).wait_ready()
    try:
        cfg = load_config(write_config(tmp_path / "fixed.yaml", model, [small], layers=2))
        first = batch.run(cfg, PROMPTS)
        url = "http://127.0.0.1:%d" % small.port
        assert requests.get(url + "/status", timeout=10).json()["memory"]["chunk_bytes"] >= held
        r = requests.post(url + "/profile", json=request.to_json(), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["blocks"] >= 2
        assert requests.get(url + "/status", timeout=10).json()["memory"]["chunk_bytes"] == 0
        again = batch.run(cfg, PROMPTS)  # the next run loads its weights again
        assert [s.token_ids for s in again.samples] == [s.token_ids for s in first.samples]
    finally:
        small.stop()


def test_a_ring_too_small_for_the_model_fails_before_any_weight_is_sent(tiny_models, tmp_path, cache_dir,
                                                                        monkeypatch):
    import mdi.system.memory
    small = WorkerProcess(free_ports(1)[0], extra=["--max-memory", "0.00001"]).wait_ready()  # ~10 kB
    try:
        cfg = load_config(write_config(tmp_path / "auto.yaml", tiny_models["llama"], [small]))
        # This machine stands for a board with 20 kB free (the starter keeps none back for
        # itself): the ring has 30 kB in all.
        monkeypatch.setattr(mdi.system.memory, "available_memory_bytes", lambda: 20 * 1024)
        with pytest.raises(ConfigError) as e:
            batch.run(cfg, PROMPTS)
        msg = str(e.value)
        assert "cannot hold the model" in msg and "missing" in msg and "starter 20 kB" in msg and "w1 10 kB" in msg
        status = requests.get("http://127.0.0.1:%d/status" % small.port, timeout=10).json()
        assert status["runs_served"] == 0 and status["state"] == "idle"
    finally:
        small.stop()


def test_profile_requests_are_validated(workers, tiny_models):
    config = ModelSource(tiny_models["llama"]).config
    good = ProfileRequest(config, "float32", "cpu", [1, 2], 8, 4, threads=1).to_json()
    url = "http://127.0.0.1:%d/profile" % workers[2].port
    r = requests.post(url, json=good, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert set(reply["layer_s"]) == {"1", "2"} and reply["prefill_token_s"] > 0
    assert reply["blocks"] == profile_blocks(config, "float32", None, "cpu")  # no memory limit: all it wants
    for bad, word in ((dict(good, batch_sizes=[0]), "batch_sizes"), (dict(good, context=10 ** 6), "context"),
                      (dict(good, device="tpu"), "device"), (dict(good, dtype="int3"), "dtype"),
                      (dict(good, device="cuda:99"), "cuda:99: this node"),  # no such GPU here: one line, 400
                      (dict(good, quant={"blocks.9.attn.qkv": ["int4", 32]}), "quant"),
                      (dict(good, repack="no"), "repack must be true or false"),
                      (dict(good, extra=1), "unknown key")):
        r = requests.post(url, json=bad, timeout=30)
        assert r.status_code == 400 and word in r.json()["error"] and "\n" not in r.json()["error"], (bad, r.text)


def test_nodes_time_their_whole_loop_and_plan_with_it(tiny_models):
    """The starter's pass in its real pipeline loop and a worker's relay (frames out and back
    through the node's own data-plane endpoint) are timed per batch size, and the planner's
    stages hold what that loop costs beyond the timed blocks (a malformed reply is refused)."""
    import torch
    from mdi.model.block_timing import PROFILE_LAYERS
    from mdi.model.sampling import SamplingParams
    from mdi.model.source import random_chunk
    from mdi.starter.planning.loop_timing import time_starter_loop
    from mdi.ring.profile_request import ProfileReply
    from mdi.timing.relay import time_relay
    from mdi.starter.planning.node_speeds import Profiler
    source = ModelSource(tiny_models["llama"])
    chunk = random_chunk(source.config, 0, 2, True, True, torch.float32, "cpu")
    blocks_only = random_chunk(source.config, 0, 2, False, False, torch.float32, "cpu")
    for token in (None, "secret"):  # plain and CURVE-encrypted, as the run would send
        seconds = time_starter_loop(chunk, [1, 3], SamplingParams(0.0), token=token)
        assert sorted(seconds) == [1, 3] and all(0 < s < 5 for s in seconds.values())
        relay = time_relay(blocks_only, [2, 1], context=5, token=token)
        assert sorted(relay) == [1, 2] and all(0 < s < 5 for s in relay.values())
        assert chunk.cache is None and blocks_only.cache is None  # freed after timing
    cfg = parse_run_config(tiny_models["llama"], label="t")
    profiler = Profiler(cfg, source, 2, 32, 2)
    timing = {"layer_s": {"1": 0.001}, "prefill_token_s": 0.0, "frame_s": {"1": 0.0001}, "threads": 1,
              "device": "cpu", "seconds": 1.0, "ends_s": {"1": 0.0002}}
    plain = profiler._cost(0, cfg.nodes[0], timing, [], None)
    assert plain.fixed_s[1] == pytest.approx(0.0003)
    blocks = min(PROFILE_LAYERS, source.config.n_layer)
    looped = profiler._cost(0, cfg.nodes[0], dict(timing, loop_s={"1": 0.005}), [], None)
    assert looped.fixed_s[1] == pytest.approx(0.005 - blocks * 0.001)
    assert profiler._cost(0, cfg.nodes[0], dict(timing, loop_s={"1": 0.0001}), [], None).fixed_s[1] == \
        pytest.approx(0.0003)  # never less than the parts measured alone
    plain_worker = {k: v for k, v in timing.items() if k != "ends_s"}
    worker = profiler._cost(1, cfg.nodes[0], dict(plain_worker, loop_s={"1": 0.004}), [], None)
    assert worker.fixed_s[1] == pytest.approx(0.004 - blocks * 0.001)
    more = profiler._cost(1, cfg.nodes[0], dict(plain_worker, loop_s={"1": 0.008}, blocks=6), [], None)
    assert more.fixed_s[1] == pytest.approx(0.008 - 6 * 0.001)  # the loop ran the blocks the reply names
    for bad in ({"1": "fast"}, {"x": 1.0}, {"2": float("nan")}, {"3": -1.0}):
        with pytest.raises(ValueError) as e:
            ProfileReply.from_json(dict(timing, loop_s=bad))
        assert "loop_s" in str(e.value)


def test_a_ring_that_speculative_passes_fill_is_planned_as_filled(tiny_models, monkeypatch):
    """One sample that fills the ring with speculative passes keeps one pass per node in
    flight: the planner is asked for that many (a ring planned for one sample's latency leaves
    boards out); verifying alone, or plain decoding, is planned for the samples themselves."""
    from mdi.runconfig import parse_config
    from mdi.starter.planning import run_plan
    from mdi.starter.planning.run_shape import RunShape
    from ringconfigs import run_config_dict
    asked = []

    def planner(cfg, source, n_slots, max_len, samples, *args, **kw):
        asked.append((n_slots, samples))
        raise RuntimeError("planned")  # the request is what is checked here
    monkeypatch.setattr(run_plan, "plan_ring", planner)
    model = tiny_models["llama"]
    source = ModelSource(model)
    for speculation, slots, samples in (("ngram", 1, 3), ({"method": "ngram", "fill": False}, 1, 1), ("off", 1, 1),
                                        ("ngram", 5, 5)):
        d = run_config_dict(model, [8081, 8082], layers="auto", generation={"speculation": speculation})
        with pytest.raises(RuntimeError, match="planned"):
            run_plan.plan_run(parse_config(d, "t.yaml"), source, RunShape(slots, 64))
        assert asked[-1] == (slots, samples), speculation
