"""A stream whose text is held back (a tool call being written: nothing may reach the client
until the call is whole) still sends the client an SSE comment every KEEPALIVE seconds. A soak
under load saw 17-19 s of silence on streamed tool calls, where a client with a short read
timeout gives up; keep-alives went out only when no event at all came for a second."""
import itertools
from types import SimpleNamespace

from mdi.serving import api
from mdi.serving.request import FinishEvent, TextEvent


class HeldBack:
    """The Reply of a tools answer whose calls are not whole yet: no chunk until its end."""
    chat, include_usage = False, False

    def chunks(self, text, index, logprobs):
        return []

    def last_chunks(self, reason, index=0):
        return [{"finish_reason": reason}]


class Events:
    """One choice's events, one per wait (the ring producing tokens), none already there."""

    def __init__(self, n_text):
        self.queue = [(0, TextEvent("x")) for _ in range(n_text)] + [(0, FinishEvent("stop"))]
        self.requests = []

    def __len__(self):
        return 1

    def next_event(self, timeout):
        return self.queue.pop(0) if self.queue and timeout > 0 else None


def test_held_back_text_still_sends_keep_alives(monkeypatch):
    clock = itertools.count(0, 0.25)  # each look at the clock a quarter of a second later
    monkeypatch.setattr(api.time, "monotonic", lambda: next(clock))
    server = api.Routes.__new__(api.Routes)
    server.sched = SimpleNamespace(alive=True)
    server._cancel = lambda requests: None
    out = list(server._stream(Events(40), HeldBack()))
    assert out[-1] == "data: [DONE]\n\n" and '"finish_reason": "stop"' in out[-2]
    assert out.count(": keep-alive\n\n") >= 5  # 40 events over about 10 s of the clock, no byte of text
