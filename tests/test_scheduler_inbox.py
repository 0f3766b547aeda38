"""The scheduler's inbox carries typed messages only (mdi.serving.inbox), and its ring state is a
StrEnum whose members serialize as the strings /health, /metrics and the dashboard always showed."""
import json
import threading
import time
from types import SimpleNamespace

from mdi.model.sampling import SamplingParams
from mdi.serving.inbox import Call, Cancel, RingState, Submit, Wake
from mdi.serving.request import FinishEvent, Request
from mdi.serving.scheduler import Scheduler
from mdi.starter.generation_options import GenerationOptions
from mdi.starter.sample import FinishReason
from ringconfigs import parse_run_config


class _Engine:
    """The face's few calls that an idle ring, an admission and a shutdown make."""
    in_flight = 0  # nothing in flight: the test cancels what it admits
    busy_seconds = 0.0

    def __init__(self):
        self.admitted, self.closed = [], False

    def free_slots(self):
        return [0, 1]

    def has_adapter(self, adapter):
        return True

    def virtual_tokens(self, adapter):
        return 0

    def prepare_sample(self, sample, adapter):
        pass

    def choose_slot(self, sample, free):
        return free[0]

    def admit(self, sample):
        self.admitted.append(sample)

    def step(self, timeout=None):  # an idle scheduler steps too (a node found failed is recovered then)
        return []

    def close(self):
        self.closed = True


def _scheduler():
    cfg = parse_run_config("unused-model-path")
    source = SimpleNamespace(tokenizer=SimpleNamespace(), config=SimpleNamespace(block_size=64), path="x")
    sched = Scheduler(cfg, source)
    engine = _Engine()

    def open_stub():  # instead of opening a ring: the stub engine, up
        sched.engine, sched.slots, sched.state = engine, 2, RingState.UP
    sched._open = open_stub
    sent = []
    put = sched._inbox.put
    sched._inbox.put = lambda message: (put(message), sent.append(message))[0]  # in the inbox once in `sent`
    return sched, engine, sent


def test_submit_cancel_call_and_stop_go_through_the_inbox_as_typed_messages():
    sched, engine, sent = _scheduler()
    assert sched.state == RingState.STARTING and not sched.serving
    sched.start()
    assert sched.ready.wait(10) and sched.open_error is None
    assert sched.state is RingState.UP and sched.serving
    req = Request([1, 2, 3], options=GenerationOptions(4, SamplingParams(0.0, None, 1.0)))
    def queues():
        return [r.id for r in sched._waiting], [r.id for r in sched._running.values()]
    # The scheduler thread held in a call while the Submit and a second call queue up behind it,
    # so that one drain takes both, in order, before the next admission (however the threads run).
    holding, gate, first = threading.Event(), threading.Event(), []
    held = threading.Thread(target=sched.between_steps, args=(lambda: (holding.set(), gate.wait(10)), 10))
    held.start()
    assert holding.wait(10)
    sched.submit([req])
    asker = threading.Thread(target=lambda: first.append(sched.between_steps(queues, 10)))
    asker.start()
    deadline = time.monotonic() + 10
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    held.join(10)
    asker.join(10)
    assert first == [([req.id], [])]  # taken in order, before the next admission
    assert sched.between_steps(queues, 10) == ([], [req.id]) and engine.admitted[0] is req.sample
    sched.cancel(req)
    event = req.next_event(10)
    assert isinstance(event, FinishEvent) and event.reason == FinishReason.CANCELLED
    sched.stop(10)
    assert not sched.alive and sched.state is RingState.STOPPED and engine.closed
    kinds = [type(m) for m in sent]
    assert kinds == [Call, Submit, Call, Call, Cancel, Wake]
    assert sent[1] == Submit(req) and sent[4] == Cancel(req)
    assert sched.queue_length == 0


def test_ring_states_serialize_as_the_strings_they_were():
    assert [s.value for s in RingState] == ["starting", "up", "down", "stopped"]
    for s in RingState:
        assert s == s.value and str(s) == s.value and "%s" % s == s.value and f"{s}" == s.value
        assert json.dumps({"state": s}) == json.dumps({"state": s.value})
    assert "the ring is %s" % RingState.DOWN == "the ring is down"


def test_an_unloading_adapter_also_waits_for_a_mix_made_with_it_while_it_drained():
    # DELETE of adapter 1 while a client asks for a new mix of it (id 7): the mix's request was
    # admitted after the unload had listed its ids, ran on, and the removal (which drops every
    # mix with it) then failed the whole ring. Every look now asks for the ids again.
    sched = Scheduler.__new__(Scheduler)
    sched._waiting, sched.closing = [], set()
    sched._running = {"x": SimpleNamespace(adapter=1)}  # a long request on the adapter, ending at look 2
    sched._inbox = SimpleNamespace(put=lambda message: message.call.fn() if isinstance(message, Call) else None)
    sched._dequeued = lambda: None
    sched._finish = lambda req, reason, error=None: None
    mix_made, looks, removed_at = [False], [], []

    def between_steps(fn, timeout):
        looks.append(len(looks) + 1)
        value = fn()
        if len(looks) == 1:  # the mix is made and its request admitted between two looks
            mix_made[0] = True
            sched._running["mix"] = SimpleNamespace(adapter=7)
        elif len(looks) == 2:
            del sched._running["x"]
        elif len(looks) == 3:
            del sched._running["mix"]  # it ends
        return value
    sched.between_steps = between_steps
    sched.unload_adapter(lambda: [1] + ([7] if mix_made[0] else []), lambda: removed_at.append(len(looks)), 5.0)
    assert removed_at == [4]  # not while the mix's request ran
    assert sched.closing == set()  # served again (here: unknown) once gone
