"""Which node a silent ring is blamed on, and how surely (h63: a worker frozen through the ring's
timeout that woke for recovery's health check was kept, then refused the new run with a 409,
while a spare stood free)."""
import threading
import time
from types import SimpleNamespace

from mdi.ring.transport import RingTimeout
from mdi.starter.control import NodeError, NodeTimeout
from mdi.starter.session import RingSession


class _Client:
    def close(self):
        pass


def _session(probe):
    s = RingSession.__new__(RingSession)  # only what named_failure reads
    s.workers = [SimpleNamespace(name="board1"), SimpleNamespace(name="board2")]
    s.failure = None
    s.registry = SimpleNamespace(fresh=lambda node: _Client())
    s._counters = {}
    s._probe = lambda client: probe(s)
    return s


def test_a_node_that_does_not_answer_the_probe_is_named_as_lost():
    got = _session(lambda s: NodeTimeout("node board1: no answer in 5 s", "board1")).named_failure(RingTimeout("x"))
    assert got.node == "board1" and got.silent  # recovery replaces it without asking again


def test_the_watchdogs_verdict_reached_during_the_probe_wins():
    verdict = NodeTimeout("node board1: unanswered twice", "board1")
    verdict.silent = True

    def probe(s):  # the watchdog decides while the probe waits
        s.failure = verdict
        return NodeError("node board2: is no longer serving this run", "board2")
    assert _session(probe).named_failure(RingTimeout("x")) is verdict


def test_a_node_that_answers_with_a_fault_is_not_marked_lost():
    got = _session(lambda s: NodeError("node board2: compute failed: boom", "board2")).named_failure(RingTimeout("x"))
    assert got.node == "board2" and not got.silent


def test_every_node_answering_leaves_the_ring_timeout():
    silent = RingTimeout("no activations came back")
    session = _session(lambda s: None)
    session.cfg = SimpleNamespace(runtime=SimpleNamespace(ring_timeout=10.0))
    assert session.named_failure(silent) is silent


class _Polled:
    """A worker's control client: the first poll goes unanswered, the next finds the run ended."""

    def __init__(self):
        self.node = SimpleNamespace(name="board1", address="127.0.0.1:1")
        self.polls = 0

    def status(self, timeout, run_id):
        self.polls += 1
        if self.polls == 1:
            raise NodeTimeout("node board1: no answer", "board1")
        return SimpleNamespace(error=None, counters=None, run_id=None, state="idle")


def test_a_worker_that_answered_no_poll_is_blamed_not_the_starter():
    s = RingSession.__new__(RingSession)
    s.cfg = SimpleNamespace(runtime=SimpleNamespace(heartbeat_interval=0.5, heartbeat_timeout=8.0))
    s.run_id, s._stopping, s._counters, s._unanswered = 7, False, {}, {}
    s._watching = threading.Event()
    s._watching.set()
    s._answered = {"board1": time.monotonic() - 20}  # its last answer, 20 s ago
    client = _Polled()
    assert isinstance(s._probe(client), NodeTimeout)
    said = str(s._probe(client))
    assert "answered no poll for 20 s" in said and "starter paused" not in said, said
