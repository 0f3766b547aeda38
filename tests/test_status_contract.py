"""/status's worker state is one vocabulary (mdi.ring.status.WorkerState): the same strings on
the wire, a member once parsed, and anything else refused naming the field."""
import json

import pytest

from mdi.ring.status import StatusError, StatusReply, WorkerState


def _reply(state):
    return {"state": state, "version": "0", "port": 8081, "device": "cpu"}


@pytest.mark.parametrize("state", ["idle", "loading", "running"])
def test_a_state_parses_to_its_member_and_goes_back_as_the_same_string(state):
    reply = StatusReply.from_json(_reply(state))
    assert reply.state is WorkerState(state) and reply.state == state
    assert json.loads(json.dumps(reply.to_json()))["state"] == state


@pytest.mark.parametrize("state", ["stopped", "", 3, None, "RUNNING"])
def test_any_other_state_is_refused_naming_the_field(state):
    with pytest.raises(StatusError, match=r"^status\.state: (expected one of idle, loading, running|missing|unexpected)"):
        StatusReply.from_json(_reply(state))


def test_a_down_ring_s_spare_that_took_a_place_is_listed_once():
    """With the ring down, its last node list holds the spare that took w1's place, and the
    config's spares list it again: /metrics had two mdi_node_up{node="spare1"} series (which
    Prometheus rejects) and the dashboard two rows."""
    from types import SimpleNamespace
    from conftest import free_ports
    from ringconfigs import parse_run_config
    from mdi.serving.metrics import Observer, Stats
    ports = free_ports(2)  # nothing listens there: every worker scrape fails at once
    cfg = parse_run_config("models/smollm2-135m", [ports[0]], spares=[ports[1]])
    (starter, w1), spare = cfg.nodes, cfg.spares[0]
    view = SimpleNamespace(cfg=cfg, stats=Stats(), state="down", serving=False, error="spare1 lost", slots=2,
                           max_len=64, in_flight=0, queue_length=0, engine=None, nodes=[starter, spare])
    names = [n["name"] for n in Observer(view, "m", None).snapshot()["nodes"]]
    assert sorted(names) == ["spare1", "starter", "w1"], names
