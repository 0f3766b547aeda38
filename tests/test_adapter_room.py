"""Adapters a run has no room for (h66): a new mix a node has no memory for makes room from an
idle mix, as a full mix table does (eleven idle mixes on a small board had locked every new mix
out for good), and a soft prompt longer than the context is refused when loaded."""
import threading
from types import SimpleNamespace

import pytest

from mdi.starter.control import NodeError
from mdi.starter.engine_adapters import RuntimeAdapters


class _Held:
    def __init__(self, mixes):
        self.mixes = dict(mixes)  # key -> id
        self.mix_used = {}

    def mix(self, entries):
        return tuple(entries), None, SimpleNamespace(name="mix-new")

    def mixes_by_age(self):
        return sorted(self.mixes.values())


def _engine(held, refusals):
    engine = RuntimeAdapters.__new__(RuntimeAdapters)  # only what mix_adapters uses
    engine.adapters, engine._mix_lock = held, threading.Lock()
    left = list(refusals)

    def install(name, mix):
        if left:
            raise left.pop(0)
        return 42
    engine._install_adapter = install
    return engine


def _evicting(held, evicted):
    def evict(by_age):
        for key, adapter in list(held.mixes.items()):
            if adapter == by_age[0]:
                del held.mixes[key]
                evicted.append(adapter)
                return adapter
        return None
    return evict


def test_a_node_without_room_gets_it_from_idle_mixes():
    held, evicted = _Held({("a",): 7, ("b",): 8}), []
    full = NodeError("node board1: adapter 9 needs 9.3 MB, but this worker holds 73.4 MB", "board1", status=413)
    engine = _engine(held, [full, full])
    assert engine.mix_adapters([(1, 0.5), (2, 0.5)], _evicting(held, evicted)) == 42
    assert evicted == [7, 8] and held.mixes == {((1, 0.5), (2, 0.5)): 42}


def test_with_no_idle_mix_or_another_fault_the_refusal_stands():
    full = NodeError("node board1: no room", "board1", status=413)
    held, evicted = _Held({}), []
    with pytest.raises(NodeError, match="no room"):
        _engine(held, [full]).mix_adapters([(1, 0.5), (2, 0.5)], _evicting(held, evicted))
    held = _Held({("a",): 7})
    broken = NodeError("node board1: HTTP 500", "board1", status=500)
    with pytest.raises(NodeError, match="HTTP 500"):
        _engine(held, [broken]).mix_adapters([(1, 0.5), (2, 0.5)], _evicting(held, evicted))
    assert evicted == [] and held.mixes == {("a",): 7}


def test_a_soft_prompt_longer_than_the_context_is_refused_when_loaded():
    """Loaded, it made every request naming it fail ("the prompt has 4100 tokens": h66)."""
    import numpy as np
    from mdi.model.adapters.lora import SoftPrompt
    from mdi.runconfig import ConfigError
    engine = RuntimeAdapters.__new__(RuntimeAdapters)
    engine.adapters, engine.plan = _Held({}), SimpleNamespace(max_len=16)
    with pytest.raises(ConfigError, match="16 virtual tokens leave no room in this run's context of 16"):
        engine._install_adapter("long", SoftPrompt("long", "-", np.zeros((16, 8), np.float32)))
