"""The engine's adapters at run time: loading, mixing and unloading them on every node while
samples keep flowing (--serve's POST /v1/mdi/adapters, llama.cpp's `lora` field), and what
serving asks of them (mdi.starter.engine_face). A part of `Engine` (its mixin), split off by idea.
"""
import threading
import time
from typing import Any, Callable, List, Optional, Tuple, cast

from mdi.runconfig import ConfigError
from mdi.starter.adapter_set import (MAX_MIXES, AdapterSet, MixTableFull, StarterTooLarge, read_adapter,
                                     virtual_tokens)
from mdi.starter.control import NodeError
from mdi.starter.planning.capacity import starter_free_bytes
from mdi.starter.planning.node_budget import check_starter_adapter
from mdi.starter.sample import Sample
from mdi.system.memory import release_freed_memory


class RuntimeAdapters:
    """Needs the engine's `adapters`, `source`, `chunk`, `device`, `ring`, `pipeline`, `_mix_lock`,
    and for the starter's memory limit `plan`, `starter_spare` and `prefix_bytes`."""
    adapters: Optional[AdapterSet]
    plan: Any
    starter_spare: Optional[int]
    prefix_bytes: int
    source: Any
    chunk: Any
    device: str
    ring: Any
    pipeline: Any
    _mix_lock: threading.Lock

    # --- what serving asks (mdi.starter.engine_face) -----------------------------------------
    def loaded_adapters(self) -> List[Tuple[int, str]]:
        """(id, name) of the adapters requests may name (none pending)."""
        return self.adapters.loaded() if self.adapters else []

    def has_adapter(self, adapter: int) -> bool:
        return self.adapters is not None and self.adapters.has(adapter)

    def virtual_tokens(self, adapter: int) -> int:
        """The positions a soft prompt adapter puts before the prompt (0 for any other)."""
        return virtual_tokens(self.adapters, adapter)

    def prepare_sample(self, sample: Sample, adapter: int) -> None:
        """Give `sample` its adapter (a soft prompt's rows too), before it is admitted."""
        if self.adapters:
            self.adapters.prepare(sample, adapter)

    def adapter_and_mixes(self, name: str) -> List[int]:
        """The loaded adapter `name`'s id, then those of the mixes it is part of ([]: none is loaded)."""
        if self.adapters is None or name not in [n for _, n in self.adapters.loaded()]:
            return []
        adapter = self.adapters.id_of(name)
        return [adapter] + [m for m, _ in self.adapters.mixes_with(adapter)]

    def kept_adapters(self) -> Optional[AdapterSet]:
        """The adapters a rebuilt ring loads again, under the same ids (serving passes it on as is)."""
        return self.adapters

    # --- loading and unloading --------------------------------------------------------------
    def add_adapter(self, name: str, path: str) -> int:
        """Load an adapter and give every node its layers' part, while samples keep flowing. It
        stays pending (no request can name it) until every node holds it."""
        return self._install_adapter(name, read_adapter(name, path, self.source.config))

    def _install_adapter(self, name: str, adapter: Any) -> int:
        if self.adapters is None:
            self.adapters = AdapterSet({}, self.source.config)
        if adapter.kind == "prompt" and adapter.n_virtual >= self.plan.max_len:  # every request naming it would fail
            raise ConfigError("adapter %s: its soft prompt's %d virtual tokens leave no room in this run's context "
                              "of %d tokens" % (name, adapter.n_virtual, self.plan.max_len))
        # The starter holds every layer's matrices (AdapterSet: sent again after a re-plan or a
        # recovery) and its own layers' copy in its chunk: both count (one had been counted).
        first, last = self.chunk.first, self.chunk.last
        held = self.adapters.held_bytes(0, self.source.config.n_layer) + self.adapters.held_bytes(first, last)
        check_starter_adapter(name, adapter.nbytes() + adapter.nbytes(adapter.for_layers(first, last)),
                              self.plan.budgets[0], self.starter_spare, self.prefix_bytes, held,
                              starter_free_bytes(self.device))
        adapter_id = self.adapters.add(name, adapter, pending=True)
        try:
            if adapter.kind != "prompt":  # a soft prompt lives in the samples, on the starter alone
                self.chunk.set_adapter(adapter_id, adapter.for_layers(self.chunk.first, self.chunk.last))
                if self.ring is not None:
                    self.ring.send_adapter(adapter_id, self.adapters)
        except BaseException:
            self.adapters.remove(name)
            self.chunk.drop_adapter(adapter_id)
            if self.ring is not None:
                try:
                    self.ring.drop_adapter(adapter_id)  # from the workers that took it
                except NodeError:
                    pass
            raise
        self.adapters.ready(adapter_id)
        return adapter_id

    def mix_adapters(self, entries: List[Tuple[int, float]],
                     evict: Optional[Callable[[List[int]], Optional[int]]] = None) -> int:
        """The adapter id for llama.cpp's `lora: [{id, scale}, ...]` (here as (adapter id,
        scale)): the base, one adapter, or a mix of scaled adapters loaded once on every node
        like any adapter (mdi.model.adapters.lora.mix_adapters) and reused by later requests.
        With MAX_MIXES held, or a node without room for it, `evict` (given the held mixes, least
        recently given out first) drops the first that no request uses and says which (None:
        every one is in use), so one client asking for mix after mix cannot lock every other
        client out of the table or of the nodes' memory."""
        if self.adapters is None:
            raise ConfigError("no adapter is loaded")
        with self._mix_lock:  # two requests asking for one new mix load it once
            key, held, mix = self.adapters.mix(entries)
            if held is not None:
                return held
            if len(self.adapters.mixes) >= MAX_MIXES and \
                    (evict is None or evict(self.adapters.mixes_by_age()) is None):
                raise MixTableFull("%d adapter mixes are held already (the most at once), each in use by a request"
                                   % MAX_MIXES)
            while True:
                try:
                    adapter_id = self._install_adapter(mix.name, mix)
                    break
                except (NodeError, StarterTooLarge) as e:
                    # a node short of memory: an idle mix gives its room back, as a full table
                    # does (idle mixes had locked every new one out for good: h66)
                    if (isinstance(e, NodeError) and e.status != 413) or evict is None or \
                            evict(self.adapters.mixes_by_age()) is None:
                        raise
            self.adapters.mixes[key] = adapter_id
            self.adapters.mix_used[adapter_id] = time.monotonic()
            return adapter_id

    def drop_mix(self, mix: int) -> None:
        """Unload a mix from every node (its adapters stay)."""
        assert self.adapters is not None  # a mix was made from them
        self._drop_adapter(cast(str, self.adapters.names[mix - 1]))

    def remove_adapter(self, name: str) -> int:
        """Unload an adapter, and every mix it is part of, from every node."""
        if self.adapters is None:
            raise ConfigError("unknown adapter %r: none is loaded" % name)
        adapter = self.adapters.id_of(name, pending_too=True)
        for _, mix in self.adapters.mixes_with(adapter):
            self._drop_adapter(mix)
        return self._drop_adapter(name)

    def _drop_adapter(self, name: str) -> int:
        assert self.adapters is not None  # it is loaded
        adapter = self.adapters.remove(name)
        if self.pipeline is not None and self.pipeline.prefix is not None:
            self.pipeline.prefix.forget_key(adapter)  # the id may name another adapter later
        self.chunk.drop_adapter(adapter)
        release_freed_memory()  # unloaded adapters gave nothing back before (919 -> 4053 MB stayed)
        if self.ring is not None:
            self.ring.drop_adapter(adapter)
        return adapter
