"""A node's prefix cache: the KV of earlier prompts kept beyond their requests, copied into a
sample's slot when the starter says a new prompt starts with the same tokens.

The starter owns the index (mdi.starter.prefix_cache) and decides everything; a node only
carries out the `CacheOp`s a frame brings, in order, before it computes the frame: `save` a
slot's first positions as a new entry, `load` an entry's first positions into a slot, `drop`
an entry. A node never guesses: an op naming an entry it does not hold, or one that would take
it past its byte budget, is a `PrefixCacheError`, and the run fails loudly (a rebuilt ring starts
with empty caches) rather than computing on positions it does not hold.

Entries are compact copies of a slot's positions, allocated when saved and freed when
dropped, so the budget bounds what is held, not what is reserved. The cache makes and restores
them (`read_range` / `write_range`: torch's mdi.model.kv_cache or ggml's), whatever its layout.
"""
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

OP_KINDS = ("save", "load", "drop")


class PrefixCacheError(RuntimeError):
    """An op this node cannot carry out: its message names the entry and what is wrong."""


@dataclass(frozen=True)
class CacheOp:
    """One instruction to every node's prefix cache (the wire's "cache" header list)."""
    kind: str  # one of OP_KINDS
    entry: int  # the starter's id of the entry
    slot: int = 0  # save: the slot read; load: the slot written (drop: unused)
    length: int = 0  # save/load: positions 0..length-1 (drop: 0)


@dataclass
class PrefixStats:
    """What a node's prefix cache holds and has done (its /status, /metrics and metrics record)."""
    budget_bytes: int = 0
    bytes: int = 0  # held now
    entries: int = 0
    saves: int = 0
    loads: int = 0  # entries copied into a slot: hits served from an entry
    tokens_loaded: int = 0
    drops: int = 0  # entries let go (evicted or superseded)
    bytes_dropped: int = 0


class PrefixStore:
    """The entries one node holds for one run, over that run's KV cache."""

    def __init__(self, cache: Any, budget_bytes: int) -> None:
        self.cache = cache  # a KV cache with range_bytes, read_range, write_range, kept_length, kept_bytes
        self.entries: Dict[int, Any] = {}  # id -> what the cache's read_range returned
        self.stats = PrefixStats(budget_bytes=budget_bytes)

    def apply(self, ops: Iterable[CacheOp]) -> None:
        for op in ops:
            if op.kind == "save":
                self._save(op.entry, op.slot, op.length)
            elif op.kind == "load":
                self._load(op.entry, op.slot, op.length)
            elif op.kind == "drop":
                self._drop(op.entry)
            else:
                raise PrefixCacheError("prefix cache: unknown op %r" % op.kind)

    def _save(self, entry: int, slot: int, length: int) -> None:
        if entry in self.entries:
            raise PrefixCacheError("prefix cache: entry %d is held already" % entry)
        self._check_span(slot, length)
        nbytes = self.cache.range_bytes(length)
        if self.stats.bytes + nbytes > self.stats.budget_bytes:
            raise PrefixCacheError("prefix cache: entry %d (%d bytes) would hold %d bytes, over the budget of %d"
                                   % (entry, nbytes, self.stats.bytes + nbytes, self.stats.budget_bytes))
        self.entries[entry] = self.cache.read_range(slot, length)
        self.stats.saves += 1
        self._count()

    def _load(self, entry: int, slot: int, length: int) -> None:
        held = self.entries.get(entry)
        if held is None:
            raise PrefixCacheError("prefix cache: entry %d is not held here" % entry)
        have = self.cache.kept_length(held)
        if length > have:
            raise PrefixCacheError("prefix cache: entry %d holds %d positions, not %d" % (entry, have, length))
        self._check_span(slot, length)
        self.cache.write_range(slot, held, length)
        self.stats.loads += 1
        self.stats.tokens_loaded += length

    def _drop(self, entry: int) -> None:
        held = self.entries.pop(entry, None)
        if held is None:
            raise PrefixCacheError("prefix cache: entry %d is not held here" % entry)
        self.stats.drops += 1
        self.stats.bytes_dropped += self.cache.kept_bytes(held)
        self._count()

    def _check_span(self, slot: int, length: int) -> None:
        if not (0 <= slot < self.cache.n_slots and 1 <= length <= self.cache.max_len):
            raise PrefixCacheError("prefix cache: slot %d positions [0, %d) are outside the cache's %d x %d"
                                   % (slot, length, self.cache.n_slots, self.cache.max_len))

    def clear(self) -> None:
        self.entries.clear()
        self._count()

    def _count(self) -> None:
        self.stats.bytes = sum(self.cache.kept_bytes(kept) for kept in self.entries.values())
        self.stats.entries = len(self.entries)


AUTO = "auto"


def budget_bytes(setting: Any, spare: Optional[int]) -> int:
    """The bytes a node gives its prefix cache for runtime.prefix_cache `setting` (None/0: none;
    "auto": half of `spare`, what its memory spares beside weights and KV cache, so kernels and
    adapters keep the other half; an integer: that, refused with ValueError when over `spare`).
    One rule for the starter and every worker."""
    if not setting:
        return 0
    if setting == AUTO:
        return max(0, spare // 2) if spare is not None else 0
    if spare is not None and setting > spare:
        raise ValueError("a prefix cache of %.1f MB does not fit: %.1f MB spare beside the weights and KV cache"
                         % (setting / 2 ** 20, max(0, spare) / 2 ** 20))
    return int(setting)


@dataclass(frozen=True)
class NodePrefixRoom:
    """What one node gives the prefix cache: its budget, its bytes per position (its layers'
    K and V), and the memory it draws on (mdi.system.memory.memory_pool; None: unknown)."""
    budget_bytes: int
    position_bytes: int
    pool: Optional[str] = None


def budget_positions(nodes: Sequence[NodePrefixRoom], auto: bool) -> int:
    """Positions the prefix cache may hold, each entry on every node: what the tightest node
    holds. An "auto" budget is half of what a node's memory spares, so nodes that draw on one
    memory (several on one machine: a ring tried on a laptop, a test) would each count that
    memory as their own; `auto` makes them share it, as one budget (the least any of them
    measured) over their bytes per position together."""
    groups: Dict[Any, List[NodePrefixRoom]] = {}
    for i, node in enumerate(nodes):
        groups.setdefault(node.pool if auto and node.pool is not None else i, []).append(node)
    fits = []
    for group in groups.values():
        per = sum(n.position_bytes for n in group)
        fits.append(min(n.budget_bytes for n in group) // per if per else 0)
    return min(fits) if fits else 0
