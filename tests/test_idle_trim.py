"""A process gives its heap's free pages back once idle after work (mdi.system.memory.IdleTrim):
a serving soak had left 50-66 MB a process resident in glibc's free lists. The scheduler's inbox
notes work and idleness as it waits, a worker's compute loop likewise."""
from mdi.serving.inbox import Inbox, Wake
from mdi.system import memory


def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: calls.append(1))
    return calls


def test_the_heap_is_trimmed_once_per_idle_spell_and_only_after_work(monkeypatch):
    calls = trims(monkeypatch)
    never = memory.IdleTrim(after_s=3600)
    never.worked()
    never.idle()
    assert calls == []  # not idle long enough
    at_once = memory.IdleTrim(after_s=0)
    at_once.idle()
    assert calls == []  # no work since the start: nothing freed to give back
    at_once.worked()
    at_once.idle()
    at_once.idle()
    assert calls == [1]  # once per idle spell
    at_once.worked()
    at_once.idle()
    assert calls == [1, 1]


def test_the_scheduler_s_inbox_trims_when_it_waits_idle_after_messages(monkeypatch):
    calls = trims(monkeypatch)
    inbox = Inbox()
    inbox._idle = memory.IdleTrim(after_s=0)
    assert list(inbox.drain(0.01)) == [] and calls == []  # idle since the start
    inbox.put(Wake())
    assert len(list(inbox.drain(None))) == 1
    assert list(inbox.drain(None)) == [] and calls == []  # a busy scheduler's look between steps
    assert list(inbox.drain(0.01)) == [] and calls == [1]  # then it waits, idle
    assert list(inbox.drain(0.01)) == [] and calls == [1]
