"""runtime.fused_decode: the switch between the scripted decode blocks (mdi.model.fused_decode)
and the eager ones is a run's setting, not a module global. It travels to every worker in
/init and /profile (checked there like its neighbours), a profile taken one way is never
reused for a run the other way, and the model package has no import cycle (the attention
maths both paths share lives in mdi.model.attention)."""
import json
import os

import pytest
import requests
import torch

from conftest import free_ports, tiny_config, worker_in_this_process
from ringconfigs import parse_run_config
from mdi.model import fused_decode
from mdi.ring.init_request import RequestError, validate_init
from mdi.ring.profile_request import ProfileReply, ProfileRequest, validate_profile
from mdi.timing.node import profile_here
from mdi.runconfig import ConfigError, parse_config
from test_layering import cycles, import_graph

pytestmark = pytest.mark.usefixtures("module_on_torch")  # fused decode is torch's TorchScript path

PROMPTS = ["The quick brown fox", "Hi", "To be, or not to be"]
covered = pytest.mark.skipif(not hasattr(torch, "rms_norm"), reason="this torch has no torch.rms_norm: decode stays eager")


# --- the setting -----------------------------------------------------------------

def test_the_setting_is_validated_and_defaults_on(monkeypatch):
    monkeypatch.delenv(fused_decode.ENV_DEFAULT, raising=False)
    assert parse_config({"model": {"path": "m"}}, "t").runtime.fused_decode is True
    assert parse_config({"model": {"path": "m"}, "runtime": {"fused_decode": False}}, "t").runtime.fused_decode is False
    for bad in ("no", 0, 1):
        with pytest.raises(ConfigError) as e:
            parse_config({"model": {"path": "m"}, "runtime": {"fused_decode": bad}}, "t")
        assert "runtime.fused_decode" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv(fused_decode.ENV_DEFAULT, "0")  # a benchmark's override of the default
    assert parse_config({"model": {"path": "m"}}, "t").runtime.fused_decode is False
    assert parse_config({"model": {"path": "m"}, "runtime": {"fused_decode": True}}, "t").runtime.fused_decode is True


def test_profile_requests_carry_it_and_refuse_a_wrong_type():
    request = ProfileRequest(tiny_config("llama"), "float32", "cpu", [1], 8, 4, fused_decode=False)
    sent = json.loads(json.dumps(request.to_json()))
    assert sent["fused_decode"] is False and validate_profile(sent) == request
    old = {k: v for k, v in sent.items() if k != "fused_decode"}  # a starter from before the setting
    assert validate_profile(old).fused_decode is True
    for bad in ("false", 0, None):
        with pytest.raises(RequestError) as e:
            validate_profile(dict(sent, fused_decode=bad))
        assert str(e.value) == "fused_decode must be true or false"


# --- (a) the profile cache -------------------------------------------------------

class FakeClient:
    """A worker's control client whose /profile answers at once, counting the requests."""

    def __init__(self, asked):
        self.asked = asked

    def profile(self, request):
        self.asked.append(request.fused_decode)
        return ProfileReply({1: 0.001}, 0.0001, {1: 0.0001}, 1, "cpu", 0.5)


def test_a_profile_taken_with_fused_decode_off_is_not_reused_with_it_on(tiny_models, tmp_path, monkeypatch):
    """The worker's and the starter's profiles are keyed by the setting: the other setting
    measures again, the same setting (another Profiler, from the file on disk) does not."""
    from mdi.model.source import ModelSource
    from mdi.starter.control import NodeRegistry
    from mdi.starter.planning import node_speeds
    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path / "profiles"))
    model = tiny_models["llama"]
    asked, timed_here = [], []
    monkeypatch.setattr(NodeRegistry, "client", lambda self, node: FakeClient(asked))

    def starter_profile(request, device, **kw):
        timed_here.append(request.fused_decode)
        return ProfileReply({1: 0.001}, 0.0001, {1: 0.0001}, 1, "cpu", 0.5, ends_s={1: 0.0002})
    monkeypatch.setattr(node_speeds, "profile_here", starter_profile)

    def plan(fused):
        cfg = parse_run_config(model, [2], label="t", data_ports=(), runtime={"fused_decode": fused})
        profiler = node_speeds.Profiler(cfg, ModelSource(model), 2, 32, 2)
        profiler._worker_timing(cfg.nodes[1], "cpu", [])
        profiler._starter_timing([])
        if profiler.cache_dirty:  # as Profiler.costs ends
            node_speeds._write_cache(profiler.cache)

    plan(False)
    assert asked == [False] and timed_here == [False]
    plan(True)  # a profile of the eager blocks says nothing of the scripted ones
    assert asked == [False, True] and timed_here == [False, True]
    plan(False)
    plan(True)  # both from the cache now
    assert asked == [False, True] and timed_here == [False, True]
    assert len(json.load(open(str(tmp_path / "profiles" / "profiles.json")))) == 4


@covered
def test_a_profile_times_the_path_its_request_names(monkeypatch):
    """What a node answers /profile with was measured on the blocks the run will use."""
    runs = []
    real = fused_decode.forward

    def counting(*args, **kw):
        y = real(*args, **kw)
        runs.append(y is not None)
        return y
    monkeypatch.setattr(fused_decode, "forward", counting)
    for fused in (False, True):
        del runs[:]
        request = ProfileRequest(tiny_config("llama"), "float32", "cpu", [1], 8, 4, threads=1, fused_decode=fused)
        profile_here(request, "cpu", n_blocks=2)
        assert any(runs) == fused, fused


# --- (b) the setting reaches a worker ----------------------------------------------

@pytest.fixture
def worker_here(tiny_models):
    """A worker in this process behind its real HTTP app, so a test can look at its chunk."""
    with worker_in_this_process() as worker:
        yield worker


@covered
def test_a_ring_with_fused_decode_off_decodes_eagerly_on_the_worker(tiny_models, worker_here, monkeypatch):
    """The worker's own chunk is switched by the run's setting (the starter's is the
    starter's business): its decode frames run its eager blocks, or none of them do."""
    from mdi.model.transformer import Block
    from mdi.starter import batch
    worker = worker_here
    eager_decode = []  # the block of every eager block call on a decode frame
    real = Block.forward

    def counting(self, x, k_cache, v_cache, batch, rope):
        if batch.rows == len(batch.slots):
            eager_decode.append(self)
        return real(self, x, k_cache, v_cache, batch, rope)
    monkeypatch.setattr(Block, "forward", counting)
    ports = free_ports(2)
    tokens = {}
    for fused in (False, True, False):  # the kept chunk is switched per run, both ways
        cfg = parse_run_config(tiny_models["llama"], [worker], label="t", layers=2, data_ports=ports, n_tokens=8,
                               runtime={"ring_timeout": 20, "fused_decode": fused})
        del eager_decode[:]
        result = batch.run(cfg, PROMPTS)
        ids = [s.token_ids for s in result.samples]
        assert worker.chunk.fused_decode is fused
        assert (worker.chunk._decode_script.get("module") is not None) is fused
        mine = [b for b in eager_decode if any(b is own for own in worker.chunk.blocks.values())]
        assert bool(mine) is not fused, (fused, len(mine))  # decode frames through its eager blocks, or none
        assert tokens.setdefault("ids", ids) == ids  # the same tokens either way (bit for bit)


def test_init_carries_it_and_a_worker_refuses_a_wrong_type(tiny_models, worker_here):
    from mdi.model.config import ModelConfig
    from mdi.ring.init_request import DataPlane, InitRequest, Weights
    with open(os.path.join(tiny_models["llama"], "mdi_config.json")) as f:
        model = ModelConfig.from_dict(json.load(f)["model"])
    bind, nxt = free_ports(2)
    request = InitRequest(run_id=3, model=model, layers=[1, 3], dtype="float32", device="cpu", n_slots=2,
                          max_len=32, data=DataPlane(bind, "127.0.0.1", nxt, True),
                          weights=Weights(path=tiny_models["llama"]), fused_decode=False)
    body = json.loads(json.dumps(request.to_json()))
    assert body["fused_decode"] is False and validate_init(body) == request
    old = {k: v for k, v in body.items() if k != "fused_decode"}  # a starter from before the setting
    assert validate_init(old).fused_decode is True
    r = requests.post("http://127.0.0.1:%d/init" % worker_here.port, json=dict(body, fused_decode="off"), timeout=30)
    assert r.status_code == 400 and r.json()["error"] == "fused_decode must be true or false", r.text


# --- (c) no import cycle -----------------------------------------------------------

def test_the_model_package_has_no_import_cycle():
    graph = {m: {n for n in imported if n.startswith("mdi.model.")}
             for m, imported in import_graph().items() if m.startswith("mdi.model.")}
    assert "mdi.model.transformer" not in graph["mdi.model.fused_decode"]
    assert "mdi.model.attention" in graph["mdi.model.transformer"] & graph["mdi.model.fused_decode"]
    assert cycles(graph) == []


def test_a_ggml_profile_says_runtime_repack_only_where_it_is_off():
    """runtime.repack: false was timed repacked (Q4_0's decode 1.6x faster than the run's) and
    kept under the key of true; true keeps the body, and the cache key, from before the setting."""
    from conftest import tiny_config
    common = dict(backend="ggml", layer_types={"attn_q.weight": "Q4_0"})
    on = ProfileRequest(tiny_config("llama"), "float32", "cpu", [1], 8, 4, **common)
    off = ProfileRequest(tiny_config("llama"), "float32", "cpu", [1], 8, 4, repack=False, **common)
    assert "repack" not in on.to_json() and off.to_json()["repack"] is False
    assert validate_profile(off.to_json()).repack is False and validate_profile(on.to_json()).repack is True


def test_a_damaged_profile_cache_is_said_and_timed_again(tmp_path, monkeypatch, caplog):
    """A truncated profiles.json had every node timed again without a word (h72)."""
    import logging
    from mdi.starter.planning import node_speeds
    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path))
    (tmp_path / "profiles.json").write_text('{"abc": {"layer_s"')
    with caplog.at_level(logging.WARNING, logger="mdi"):
        assert node_speeds._read_cache() == {}
    assert any("profiles.json cannot be read" in r.getMessage() and "timed again" in r.getMessage()
               for r in caplog.records), caplog.records
    (tmp_path / "profiles.json").unlink()
    assert node_speeds._read_cache() == {}  # none yet: nothing said


def test_two_planners_writing_the_profile_cache_keep_both_entries(tmp_path, monkeypatch):
    """Each starter writes the profiles it timed: a plain rewrite from its own copy had dropped
    what another starter on the machine wrote since (both read the file before timing)."""
    from mdi.starter.planning import node_speeds
    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path))
    node_speeds._write_cache({"first": {"layer_s": 1.0}})
    node_speeds._write_cache({"second": {"layer_s": 2.0}})  # read before "first" was written
    assert node_speeds._read_cache() == {"first": {"layer_s": 1.0}, "second": {"layer_s": 2.0}}
