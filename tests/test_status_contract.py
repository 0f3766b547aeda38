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
