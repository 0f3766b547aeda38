"""What a worker can give a run is one rule (mdi.worker.memory_budget.memory_limit): the capacity its /status
reports to planners, the limit its loads are checked against and the limit a kept chunk's
new KV cache is checked against are the same number. Checked on a worker in this process
whose free memory is fixed, so each boundary is exact."""
import json
import os

import pytest
import requests
import torch

from conftest import free_ports, worker_in_this_process
from mdi.model.config import ModelConfig
from mdi.model.layout import torch_kv_cache_bytes, weight_bytes
from mdi.ring.init_request import DataPlane, InitRequest, Weights
from mdi.system.memory import LOAD_HEADROOM_BYTES

LAYERS, MAX_LEN = [1, 3], 32


@pytest.fixture
def worker(tiny_models, monkeypatch):
    """A worker in this process behind its real HTTP app; `worker.free` is what its device has free."""
    from mdi.worker import memory_budget, status_report
    with worker_in_this_process(models_dir=os.path.dirname(tiny_models["llama"])) as w:
        w.free = 0
        for module in (memory_budget, status_report):  # the rule, and the free memory /status shows
            monkeypatch.setattr(module, "free_bytes_on", lambda device: w.free)
        yield w


def init(worker, model_dir, n_slots):
    with open(os.path.join(model_dir, "mdi_config.json")) as f:
        model = ModelConfig.from_dict(json.load(f)["model"])
    bind, nxt = free_ports(2)
    request = InitRequest(run_id=7 + n_slots, model=model, layers=LAYERS, dtype="float32", device="cpu",
                          n_slots=n_slots, max_len=MAX_LEN, data=DataPlane(bind, "127.0.0.1", nxt, True),
                          weights=Weights(path=model_dir), heartbeat_timeout=60)
    r = requests.post("http://127.0.0.1:%d/init" % worker.port, json=request.to_json(), timeout=60)
    worker.end_run()  # the weights stay, the cache goes
    return r, model


def capacity(worker):
    r = requests.get("http://127.0.0.1:%d/status" % worker.port, timeout=10)
    return r.json()["memory"]["capacity_bytes"]


def test_status_capacity_is_the_limit_of_loads_and_of_a_kept_chunks_cache(worker, tiny_models):
    model_dir = tiny_models["llama"]
    with open(os.path.join(model_dir, "mdi_config.json")) as f:
        config = ModelConfig.from_dict(json.load(f)["model"])
    weights = weight_bytes(config, LAYERS, "float32")
    per_slot = torch_kv_cache_bytes(config, LAYERS[1] - LAYERS[0], 1, MAX_LEN, torch.float32)
    need = weights + 2 * per_slot  # two slots

    worker.free = need + LOAD_HEADROOM_BYTES - 1  # one byte short
    assert capacity(worker) == need - 1
    r, _ = init(worker, model_dir, 2)
    assert r.status_code in (400, 413) and "limit" in r.json()["error"], r.text
    worker.free += 1  # exactly enough: what /status says is what a load gets
    assert capacity(worker) == need
    r, _ = init(worker, model_dir, 2)
    assert r.status_code == 200, r.text

    # The chunk is kept (the cache went with the run): the worker can give the free memory
    # and the weights it holds (as its tensors count them). A kept chunk's next cache is
    # checked against that same figure.
    assert capacity(worker) >= worker.free + weights - LOAD_HEADROOM_BYTES
    slots = (capacity(worker) // per_slot) + 1  # one slot more than the capacity holds
    r, _ = init(worker, model_dir, slots)
    assert r.status_code in (400, 413) and "limit" in r.json()["error"], r.text


def test_an_adapter_counts_against_the_same_limit(worker, tiny_models):
    """Adapters (and every mix a client may ask for) are held beside the weights: a board
    limited to 0.7 GB held 1.28 GB of them. One that does not fit is refused (413), naming
    the worker's limit; one that fits is taken, and counted in what the worker holds."""
    from mdi.ring.adapter_request import adapter_body
    model_dir = tiny_models["llama"]
    worker.free = 1 << 30
    r, config = init(worker, model_dir, 1)
    assert r.status_code == 200, r.text
    layer = "blocks.%d.mlp.gate_up" % LAYERS[0]
    rank = 4

    def body(r_):
        return adapter_body({layer: (torch.zeros(r_, config.n_embd), torch.zeros(2 * config.intermediate_size, r_))})
    url = "http://127.0.0.1:%d/adapters/1" % worker.port
    held = worker._held_bytes()
    # free memory leaves room for the weights held and a small adapter, not a big one
    worker.free = len(body(rank)) + LOAD_HEADROOM_BYTES + 1024
    big = body(256)
    r = requests.post(url, data=big, headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert r.status_code == 413 and "adapter 1 needs" in r.json()["error"], r.text
    assert worker._held_bytes() == held  # nothing taken
    r = requests.post(url, data=body(rank), headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert r.status_code == 200, r.text
    assert worker._held_bytes() > held


def test_a_worker_s_memory_refusal_reaches_an_api_client_as_413_naming_it(worker, tiny_models):
    """The seam --serve reads (issue 58, 6): the starter's client keeps the worker's 413 on the
    NodeError, and `node_refusal` makes it the client's 413 (not a 502), naming the node."""
    from mdi.ring.adapter_request import adapter_body
    from mdi.runconfig import NodeSpec
    from mdi.serving.node_refusal import node_api_error
    from mdi.starter.control import ControlClient, NodeError
    worker.free = 1 << 30
    r, config = init(worker, tiny_models["llama"], 1)
    assert r.status_code == 200, r.text
    worker.free = LOAD_HEADROOM_BYTES + 1024
    big = adapter_body({"blocks.%d.mlp.gate_up" % LAYERS[0]: (torch.zeros(256, config.n_embd),
                                                              torch.zeros(2 * config.intermediate_size, 256))})
    client = ControlClient(NodeSpec("board7", port=worker.port), connect_timeout=10, init_timeout=60)
    with pytest.raises(NodeError) as e:
        client.post_adapter(1, big)
    assert e.value.status == 413 and e.value.node == "board7"
    error = node_api_error(e.value, "lora")
    assert error.status == 413 and error.param == "lora" and error.kind == "invalid_request_error"
    assert "board7" in error.message and "adapter 1 needs" in error.message, error.message


def test_a_kv_cache_over_the_limit_is_refused_as_too_large():
    """A KV cache over the worker's limit (or the run's cache budget) is a 413 naming both sizes,
    as weights over the limit are: one status for "too large" (h96: it was a 400 here)."""
    from mdi.ring.init_request import TooLarge
    from mdi.worker.memory_budget import check_cache_fits
    model = ModelConfig(vocab_size=1000, n_layer=4, n_head=4, n_embd=256, block_size=512)
    request = InitRequest(run_id=1, model=model, layers=[1, 3], dtype="float32", device="cpu", n_slots=2,
                          max_len=32, data=DataPlane(9, "127.0.0.1", 10, True), weights=Weights(path="m"))
    check_cache_fits(request, 1000, 1000, "--max-memory")
    with pytest.raises(TooLarge, match="KV cache of 1001 bytes does not fit") as e:
        check_cache_fits(request, 1001, 1000, "--max-memory")
    assert e.value.status == 413
