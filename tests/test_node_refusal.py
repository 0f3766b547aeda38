"""A node's refusal of an adapter or mix, as --serve's client sees it (mdi.serving.node_refusal):
too large is 413 and busy is 429, each naming the node; anything else a node did is a 502.
The worker's real 413 through ControlClient is in test_worker_memory_rule."""
from mdi.serving.node_refusal import node_api_error
from mdi.starter.adapter_set import StarterTooLarge
from mdi.starter.control import NodeError, NodeTimeout

MESSAGE = "node board1 (127.0.0.1:7001): POST /adapters/3 failed with HTTP %d: why"


def test_too_large_is_413_busy_is_429_naming_the_node():
    too_large = node_api_error(NodeError(MESSAGE % 413, "board1", 413), "lora")
    assert (too_large.status, too_large.param, too_large.kind) == (413, "lora", "invalid_request_error")
    busy = node_api_error(NodeError(MESSAGE % 409, "board1", 409), "path")
    assert (busy.status, busy.param, busy.kind) == (429, "path", "rate_limit_error")
    assert "board1" in too_large.message and "board1" in busy.message


def test_the_starter_s_own_refusal_is_413():
    error = node_api_error(StarterTooLarge("adapter mix:1*2 needs 9.0 MB on the starter, which has 1.0 MB free"),
                           "lora")
    assert error.status == 413 and "starter" in error.message


def test_any_other_node_failure_is_a_502():
    for e in (NodeError(MESSAGE % 400, "board1", 400), NodeError("node board1: bad reply", "board1"),
              NodeTimeout("node board1: no answer in 30 s", "board1"), RuntimeError("the ring is down")):
        error = node_api_error(e, "lora")
        assert (error.status, error.param, error.kind) == (502, None, "server_error"), e
