"""A chunk's graphs kept between passes, one per pass shape: built once and computed again with
new inputs, dropped when idle or over a count and a byte budget; and the one whose output was
last lent (read in place by the caller, not copied) kept until the chunk's next lookup."""
import time
from typing import Any, Callable, List, Optional, OrderedDict

import numpy as np

from mdi.model.ggml.built import Built
from mdi.system.memory import release_freed_memory

MAX_GRAPHS = 24  # pass shapes whose graphs are kept (least recently used dropped first)
MAX_GRAPH_BYTES = 32 << 20  # and their buffers together (a long prompt's prefill graphs had kept 42 MB)
# A graph no pass asked for in this many lookups goes before another is built: a finished
# prompt's prefill shapes, a mix of slots no frame carries now. A served Gemma 3 grew by ~5 MB a
# request with them. A steady decode asks for each of its shapes every round.
IDLE_LOOKUPS = 32


class GraphCache(OrderedDict[Any, Built]):
    """Graphs by key, least recently used first (the caller's lock around every call)."""

    def __init__(self) -> None:
        super().__init__()
        self._lookups = 0  # graph lookups so far (IDLE_LOOKUPS)
        # The graph whose output was last lent (`output`), and graphs dropped meanwhile: its
        # rows may still be read, so they are freed at the next lookup, when the lend ends.
        self._lent: Optional[Built] = None
        self._retired: List[Built] = []
        self.built = 0
        self.build_seconds = 0.0

    def lookup(self, key: Any, build: Callable[[], Built], check: Callable[[Any], None]) -> Built:
        """The graph of `key`, built (and `check`ed: raises if the backend cannot compute it) if
        not kept. Ends the last lend: the caller is about to compute."""
        self._lookups += 1
        self._end_lend()
        g = self.get(key)
        if g is not None:
            self.move_to_end(key)
            g.last_lookup = self._lookups
            return g
        freed = False
        while self and next(iter(self.values())).last_lookup < self._lookups - IDLE_LOOKUPS:
            self._free(self.popitem(last=False)[1])
            freed = True
        t0 = time.perf_counter()
        g = build()
        try:
            check(g.graph)
        except RuntimeError:
            g.free()
            raise
        self.build_seconds += time.perf_counter() - t0
        self.built += 1
        g.last_lookup = self._lookups
        self[key] = g
        while len(self) > MAX_GRAPHS or (
                len(self) > 1 and sum(b.buffer_bytes for b in self.values()) > MAX_GRAPH_BYTES):
            self._free(self.popitem(last=False)[1])
            freed = True
        if freed:  # their buffers' pages, which glibc keeps resident in the heap's holes
            release_freed_memory()
        return g

    def drop(self, which: Callable[[Any], bool]) -> None:
        """Drop the graphs whose key `which` accepts."""
        for key in [k for k in self if which(k)]:
            self._free(self.pop(key))

    def clear(self) -> None:
        self.drop(lambda key: True)
        self._end_lend()

    def output(self, g: Built, rows: int, lend: bool) -> np.ndarray:
        """The first `rows` rows of `g`'s output: copied, or `lend`: read in place, valid until
        the next lookup (a device's output comes back copied either way)."""
        if lend:
            self._lent = g
        return g.rows_out(rows, copy=not lend)

    def _free(self, g: Built) -> None:
        if g is self._lent:
            self._retired.append(g)
        else:
            g.free()

    def _end_lend(self) -> None:
        self._lent = None
        while self._retired:
            self._retired.pop().free()
