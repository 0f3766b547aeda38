"""The ring with real worker processes on loopback: every partition and number of samples in
flight gives exactly the standalone tokens, greedy and sampled."""
import json
import os
import subprocess

import pytest

from conftest import BIN, free_ports
from ringconfigs import parse_run_config, write_run_config
from mdi.ring.status import StatusReply
from mdi.starter import batch

PROMPTS = ["The quick brown fox", "Hi", "To be, or not to be", "0123", "abc def ghi jkl mno"]
PARTITIONS = {1: [4], 2: [2, 2], 3: [1, 2, 1], 4: [1, 1, 1, 1]}


@pytest.fixture(scope="module")
def data_ports():
    return free_ports(4)


def ring_config(model: str, workers, data_ports, counts, temperature=0.0, n_tokens=12):
    """A ring of len(counts) nodes (the first len(counts) - 1 workers), seeded top-k sampling."""
    return parse_run_config(model, workers[:len(counts) - 1], layers=counts, data_ports=data_ports, n_tokens=n_tokens,
                            generation={"temperature": temperature, "seed": 7, "top_k": 20},
                            runtime={"ring_timeout": 20})


def run_ids(cfg, prompts):
    result = batch.run(cfg, prompts)
    return [s.token_ids for s in result.samples], result


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_partitions_and_samples_match_standalone(family, tiny_models, workers, data_ports):
    model = tiny_models[family]
    for n_samples in (1, 2, 3, 5):
        prompts = PROMPTS[:n_samples]
        reference, _ = run_ids(ring_config(model, workers, data_ports, PARTITIONS[1]), prompts)
        assert all(len(ids) == 12 for ids in reference)
        for n_nodes in (2, 3, 4):
            got, result = run_ids(ring_config(model, workers, data_ports, PARTITIONS[n_nodes]), prompts)
            assert got == reference, "greedy ids differ: %d nodes, %d samples" % (n_nodes, n_samples)
            assert len(result.metrics()["nodes"]) == n_nodes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_seeded_sampling_is_identical_across_partitions(family, tiny_models, workers, data_ports):
    model = tiny_models[family]
    prompts = PROMPTS[:3]
    texts = []
    for n_nodes in (1, 2, 4):
        cfg = ring_config(model, workers, data_ports, PARTITIONS[n_nodes], temperature=0.9, n_tokens=20)
        result = batch.run(cfg, prompts)
        texts.append(result.texts)
    assert texts[0] == texts[1] == texts[2]
    # Different samples of the same run draw from different generators.
    cfg = ring_config(model, workers, data_ports, PARTITIONS[2], temperature=0.9, n_tokens=20)
    same_prompt = batch.run(cfg, [prompts[0]] * 2).texts
    assert same_prompt[0] != same_prompt[1]


def test_decode_hop_bytes_do_not_grow_with_context(tiny_models, workers, data_ports):
    model = tiny_models["llama"]
    hidden = 64
    per_message = []
    for prompt in ("a", "a much longer prompt " * 4):
        _, result = run_ids(ring_config(model, workers, data_ports, PARTITIONS[3], n_tokens=16), [prompt])
        for node in result.metrics()["nodes"]:
            n = node["messages_sent_by_kind"]["decode"]
            b = node["bytes_sent_by_kind"]["decode"]
            assert n == 15  # one decode pass per token after the first, per hop
            per_message.append(b / n)
    payload = hidden * 4
    assert all(payload <= b <= payload + 160 for b in per_message), per_message
    assert len(set(per_message)) == 1, "decode hop size changed with the context length"


def test_cli_ring_metrics_and_reuse(tiny_models, workers, data_ports, tmp_path):
    """mdi-start as users run it, twice against the same workers, with a metrics file."""
    cfg_path = write_run_config(tmp_path / "ring3.yaml", tiny_models["gpt2"], workers[:2], data_ports=data_ports,
                                worker_name="board%d", n_tokens=10)
    outputs = []
    for i in range(2):
        metrics = tmp_path / ("m%d.json" % i)
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", cfg_path, "--prompt", "Hello",
                               "--prompt", "World", "--metrics-out", str(metrics), "--threads", "1"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "20 tokens" in proc.stdout and "3 nodes" in proc.stdout
        record = json.loads(metrics.read_text())
        assert [n["layers"] for n in record["nodes"]] == [[0, 2], [2, 3], [3, 4]]
        assert [len(s["token_ids"]) for s in record["samples"]] == [10, 10]
        assert all(len(s["token_times"]) == 10 for s in record["samples"])
        assert record["n_nodes"] == 3 and record["tokens_per_s"] > 0
        assert all(n["peak_memory_bytes"] > 0 and n["messages_sent"] > 0 for n in record["nodes"])
        assert all(0 < n["compute_seconds"] < record["seconds"] for n in record["nodes"])
        outputs.append([s["token_ids"] for s in record["samples"]])
    assert outputs[0] == outputs[1]


def test_a_lost_pass_times_out_however_finely_the_wait_is_sliced():
    """The serving loop steps with short timeouts to admit requests in between; a pass lost
    on the way must still end in RingTimeout after recv_timeout (which starts recovery)."""
    import time
    from conftest import tiny_config
    from mdi.model.transformer import full_model
    from mdi.ring.transport import RingTimeout
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.pipeline_settings import PipelineSettings
    from mdi.starter.sample import make_samples
    from mdi.model.sampling import SamplingParams

    class LosingTransport:  # every frame vanishes
        def send(self, frame):
            pass

        def recv(self, timeout):
            time.sleep(timeout)
            raise RingTimeout("nothing")

    chunk = full_model(tiny_config("gpt2"))
    chunk.allocate_cache(1, 64)
    pipe = Pipeline(chunk, LosingTransport(), 1, SamplingParams(temperature=0.0), None,
                    PipelineSettings(recv_timeout=0.5))
    t0 = time.monotonic()  # before the admission, which starts the silence's clock
    pipe.admit(make_samples(["ab"], [[3, 4]], 4, seed=0)[0])
    with pytest.raises(RingTimeout):
        while time.monotonic() - t0 < 60:
            assert pipe.step(timeout=0.05) == []
    assert time.monotonic() - t0 >= 0.45


def test_worker_keeps_its_state_out_of_the_typed_init_request(tiny_models):
    """In process: an /init request built on the starter's side goes through JSON and the
    worker's validator unchanged, starts a run, is reused for the same layers, and the worker
    never writes its own state into it (its lock is taken once per call: a plain Lock)."""
    import copy
    from mdi.model.config import ModelConfig
    from mdi.ring.init_request import DataPlane, InitRequest, RequestError, Weights, validate_init
    from mdi.system.memory import memory_pool
    from mdi.worker.node import Worker
    with open(os.path.join(tiny_models["gpt2"], "mdi_config.json")) as f:
        model = ModelConfig.from_dict(json.load(f)["model"])
    bind, nxt = free_ports(2)
    request = InitRequest(run_id=4, model=model, layers=[1, 3], dtype="float32", device="cpu", n_slots=2,
                          max_len=32, data=DataPlane(bind, "127.0.0.1", nxt, True),
                          weights=Weights(path=tiny_models["gpt2"]), heartbeat_timeout=30.0)
    assert validate_init(json.loads(json.dumps(request.to_json()))) == request
    worker = Worker("127.0.0.1", free_ports(1)[0], models_dir=os.path.dirname(tiny_models["gpt2"]))
    try:
        sent = copy.deepcopy(request)
        reply = worker.init(request)
        per_position = 2 * 2 * model.n_kv_head * model.head_dim * 4  # 2 layers, K and V, float32
        assert reply == {"ok": True, "need_weights": False, "cache_bytes": worker.chunk.cache.nbytes,
                         "prefix_cache_bytes": 0, "prefix_token_bytes": per_position,  # no prefix_cache asked
                         "memory_pool": memory_pool(), "backend": "torch", "backend_line": "torch (asked)"}
        assert request == sent and worker.run.request is request and worker.run.heartbeat_timeout == 30.0
        status = worker.status()
        assert status.state == "running" and status.layers == [1, 3] and status.run_id == 4
        assert StatusReply.from_json(json.loads(json.dumps(status.to_json()))) == status  # the wire round trip
        chunk = worker.chunk
        again = copy.deepcopy(request)
        again.run_id = 5
        worker.end_run()  # run 4 ends first: while it holds the worker, another run's /init is refused
        assert worker.init(again)["need_weights"] is False and worker.chunk is chunk  # weights reused
        assert worker.runs_served == 2 and worker.status().run_id == 5
        # Another split: the old weights are gone before the new ones load (no run, thread or
        # local still holds them: a board near its memory limit cannot hold both).
        import gc
        import time
        import weakref
        old = weakref.ref(worker.chunk)
        del chunk
        time.sleep(0.6)  # the heartbeat watcher has looked at run 5 at least once
        other = copy.deepcopy(request)
        other.run_id, other.layers = 6, [0, 2]
        worker.end_run()
        worker.init(other)
        gc.collect()
        assert old() is None and worker.status().layers == [0, 2]
        bad = copy.deepcopy(request)
        bad.weights = Weights(path=os.path.join(tiny_models["gpt2"], "missing"))
        worker.end_run()
        with pytest.raises(RequestError, match="cannot load weights"):
            worker.init(bad)
        assert not worker.loading and worker.run is None and worker.status().state == "idle"
        worker.end_run()  # the lock was released on the failure
    finally:
        worker.end_run()
        worker.shutdown_requested.set()
