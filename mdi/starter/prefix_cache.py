"""The starter's prefix cache index: which token sequences every node holds the KV of, and the
ops that keep every node's prefix store (mdi.model.prefix_store) in step with it.

A sample's KV at position p depends only on its tokens 0..p (and its adapter, which changes the
keys and values, and a soft prompt, whose placeholder ids an adapter id names), so a new prompt
may start from any held sequence it shares a prefix with, for as many positions as they share;
on a ring that computes with ggml, its bits also depend on the size of the passes that computed
it, so there only as many as were computed as the new prompt's cold passes would
(shared_positions).
Places that hold sequences:
- a free slot: what its last sample left there (a finished request's slot is cache, not
  garbage). A new sample put in that slot reuses the shared prefix with no copy at all: a chat's
  next turn goes to the slot of its last turn.
- an entry: a compact copy every node keeps within its byte budget. A slot's sequence is saved as
  one before a sample that does not continue it overwrites it; an entry is copied back into
  whichever slot a sample that shares more with it than with anything else gets.

Why whole sequences matched by their longest common prefix, not a token trie or block hashes:
what is held is bounded by the nodes' memory to a few hundred sequences, and comparing a prompt
with each is one vectorised comparison (microseconds), while hashes would match whole blocks
only; partial matches count to the token here. An entry that is a prefix of a newer one with the
same key is dropped as the newer is saved, so a conversation holds one entry, its latest.

Every decision is made here, without I/O (vLLM's scheduler style); the pipeline sends the ops
`take_ops` returns in its next frame, which every node carries out, in order, before computing.
"""
import itertools
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from mdi.model.prefix_store import CacheOp
from mdi.model.sliding_cache import SlidingRing
from mdi.starter import prompt_passes


@dataclass
class Held:
    """A token sequence whose KV a place holds (positions 0..len-1), for samples of `key`."""
    tokens: np.ndarray  # int64
    key: int  # the adapter id the KV was computed with (0: the base)
    used: int  # the index's clock when last written or reused: least recently used goes first
    # how each position was computed (prompt_passes.ONE_ROW / TILED / ANSWER), where a ring
    # cuts prompts as ggml computes them; None: not told (any position may be reused)
    kinds: Optional[np.ndarray] = None
    # the first position the nodes' sliding-window rings still hold (SlidingRing.intact_from)
    intact_from: int = 0
    answer_from: int = 0  # where its answer begins (its window's length; 0: not told)


@dataclass
class Admitted:
    """What admit decided for a busy slot, which its release makes a Held of."""
    kinds: Optional[np.ndarray]  # its window's kinds (Held.kinds); None: not told
    reused_from: int  # the intact_from of the positions it reused (0: none)
    window: int  # its window's length (Held.answer_from)


def shared_positions(held: Held, want: np.ndarray, kinds: Optional[np.ndarray],
                     ring: Optional[SlidingRing] = None) -> int:
    """Positions of `want` that `held` holds, computed as a cold prompt of `want` computes
    them (`kinds`, its cold passes' prompt_passes.cold_kinds; None: any): a prompt row keeps
    the bits of the pass that computed it, and a pass below TILED_ROWS rows takes another
    attention kernel than a longer one, so the start of a short prompt is no start of a long
    one (an answer's rows are, as a conversation's). `ring`: the nodes' sliding-window layers
    keep rings, which must still hold the window before the first position computed."""
    n = common_prefix(held.tokens, want)
    if kinds is not None and held.kinds is not None and n:
        have = held.kinds[:n]
        differ = np.flatnonzero((have != kinds[:n]) & (have != prompt_passes.ANSWER))
        n = int(differ[0]) if len(differ) else n
    return ring.reusable(n, held.intact_from) if ring is not None else n


@dataclass
class PrefixCounters:
    lookups: int = 0  # samples admitted that could reuse
    hits: int = 0  # ... and did (at least one position)
    prompt_tokens: int = 0  # tokens of the windows looked up
    tokens_reused: int = 0  # positions not computed again
    saves: int = 0
    evictions: int = 0  # entries dropped for room (the least recently used first)
    superseded: int = 0  # entries dropped because a longer one with the same start was saved

    def metrics(self) -> Dict[str, int]:
        return {"lookups": self.lookups, "hits": self.hits, "misses": self.lookups - self.hits,
                "prompt_tokens": self.prompt_tokens, "tokens_reused": self.tokens_reused, "saves": self.saves,
                "evictions": self.evictions, "superseded": self.superseded}


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixIndex:
    """What every node's slots and prefix stores hold, for a run whose nodes each give entries
    `token_budget` positions (the smallest node budget over its bytes per position), and keep
    their sliding-window layers in `ring`s (None: every position)."""

    def __init__(self, token_budget: int, ring: Optional[SlidingRing] = None) -> None:
        self.budget = token_budget
        self.ring = ring
        self.entries: Dict[int, Held] = {}
        self.slots: Dict[int, Held] = {}  # free slots only: a busy slot's sequence changes as it runs
        self.counters = PrefixCounters()
        # kept, not summed on demand: /metrics reads it from an HTTP thread while entries change
        self.tokens_held = 0
        self._ops: List[CacheOp] = []
        self._running: Dict[int, Admitted] = {}  # busy slot -> what admit decided for it
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)

    def take_ops(self) -> List[CacheOp]:
        """The ops decided since the last call, for the next frame (every node, in order)."""
        ops, self._ops = self._ops, []
        return ops

    # --- placing a sample ------------------------------------------------------------
    def choose_slot(self, free: Sequence[int], tokens: Sequence[int], key: int, ggml_cuts: bool = False) -> int:
        """The free slot for a sample of `tokens`: the one holding the longest prefix it may
        reuse (no copy; `ggml_cuts` as admit's), else an empty one, else the one used least
        recently (its sequence is saved)."""
        want = _ids(tokens)
        kinds = prompt_passes.cold_kinds(len(want)) if ggml_cuts else None
        best, best_len = None, 0
        for slot in free:
            held = self.slots.get(slot)
            if held is not None and held.key == key:
                n = shared_positions(held, want, kinds, self.ring)
                if n > best_len:
                    best, best_len = slot, n
        if best is not None:
            return best
        empty = [s for s in free if s not in self.slots]
        if empty:
            return empty[0]
        return min(free, key=lambda s: self.slots[s].used)

    def admit(self, slot: int, tokens: Sequence[int], key: int, reuse: bool = True, ggml_cuts: bool = False) -> int:
        """A sample of `tokens` (its window) takes `slot`: returns the positions it starts
        with (0..n-2: its last token always goes through the ring, for the logits that choose
        the next). With `ggml_cuts` (a ring that cuts prompts as ggml computes them,
        mdi.starter.prompt_passes) only positions computed as its cold passes would compute them
        (shared_positions), and fewer where its first pass must start. The slot's old sequence
        is saved as an entry first when the sample would overwrite part of it; `reuse` False (a
        request's cache_prompt: false) reuses nothing."""
        want = _ids(tokens)
        kinds = prompt_passes.cold_kinds(len(want)) if ggml_cuts else None
        old = self.slots.pop(slot, None)
        limit = len(want) - 1
        own = shared_positions(old, want, kinds, self.ring) if reuse and old is not None and old.key == key else 0
        entry, from_entry = None, 0
        if reuse:
            for eid, held in self.entries.items():
                if held.key == key:
                    n = shared_positions(held, want, kinds, self.ring)
                    if n > from_entry:
                        entry, from_entry = eid, n
        use = max(0, min(limit, max(own, from_entry)))
        if ggml_cuts:
            use = prompt_passes.reusable_positions(len(want), use)
        load = entry if from_entry > own else None
        source = self.entries[load] if load is not None else old  # where the positions reused come from
        if use and self.ring is not None and source is not None:  # (fewer positions: is their window still held?)
            use = self.ring.reusable(use, source.intact_from)
        if not use:
            load = None
        stays = 0 if load is not None else use  # positions of the old sequence the sample keeps
        # One whose tokens hold every prompt position the old held goes on with its conversation:
        # the old answer's rows past where they part are not saved (a chat template that rewrites
        # answers, Gemma's trim, had left one entry a turn, each a whole conversation). By tokens,
        # not `own`: a sliding ring that lost the window before the parting leaves `own` 0.
        goes_on = old is not None and old.key == key and 0 < old.answer_from <= common_prefix(old.tokens, want)
        if old is not None and len(old.tokens) > stays and not goes_on:
            self._keep(slot, old, protect=load)
        if load is not None:
            self._ops.append(CacheOp("load", load, slot, use))
            self.entries[load].used = next(self._clock)
        reused = source.kinds[:use] if use and source is not None and source.kinds is not None else None
        self._running[slot] = Admitted(None if kinds is None or (use and reused is None) else (
            np.concatenate([reused, kinds[use:]]) if use else kinds),
            source.intact_from if use and source is not None else 0, len(want))
        if reuse:
            self.counters.lookups += 1
            self.counters.prompt_tokens += len(want)
            self.counters.hits += use > 0
            self.counters.tokens_reused += use
        return use

    def release(self, slot: int, tokens: Sequence[int], key: int, as_admitted: bool = True,
                drafted: bool = True) -> None:
        """A sample left `slot` holding the KV of `tokens` (what every node computed for it):
        its window as admitted, then its answer's rows (`as_admitted` False: a context shift
        computed its window again, how is not told); one that never `drafted` (speculation)
        wrote no rows past them but the next one's."""
        admitted = self._running.pop(slot, None)
        if admitted is None or not as_admitted:  # (a shift computed all again)
            admitted = Admitted(None, 0, 0)
        if not len(tokens):
            self.slots.pop(slot, None)
            return
        kinds = None
        if admitted.kinds is not None:
            kinds = np.full(len(tokens), prompt_passes.ANSWER, dtype=np.uint8)
            kinds[:len(admitted.kinds)] = admitted.kinds[:len(tokens)]
        intact = self.ring.intact_from(len(tokens), admitted.reused_from, drafted) if self.ring is not None else 0
        self.slots[slot] = Held(_ids(tokens), key, next(self._clock), kinds, intact, min(admitted.window, len(tokens)))

    # --- entries ---------------------------------------------------------------------
    def _keep(self, slot: int, held: Held, protect: Optional[int]) -> None:
        """Save the sequence `slot` holds as an entry, unless an entry holds it already or it
        cannot fit; entries it extends are dropped, then the least recently used for room."""
        n = len(held.tokens)
        if n > self.budget:
            return
        superseded = []
        for eid, e in self.entries.items():
            if e.key != held.key:
                continue
            shared = common_prefix(e.tokens, held.tokens)
            if shared == n:  # held already (maybe as the start of a longer entry)
                e.used = next(self._clock)
                return
            if shared == len(e.tokens) and eid != protect:
                superseded.append(eid)
        for eid in superseded:
            self._drop(eid)
            self.counters.superseded += 1
        kept = len(self.entries[protect].tokens) if protect in self.entries else 0  # loaded after this save
        if kept + n > self.budget:  # no eviction would make room: evict nothing
            return
        for eid, e in sorted(self.entries.items(), key=lambda item: item[1].used):
            if self.tokens_held + n <= self.budget:
                break
            if eid != protect:
                self._drop(eid)
                self.counters.evictions += 1
        eid = next(self._ids)
        self._ops.append(CacheOp("save", eid, slot, n))
        self.entries[eid] = replace(held, used=next(self._clock))
        self.tokens_held += n
        self.counters.saves += 1

    def _drop(self, eid: int) -> None:
        self.tokens_held -= len(self.entries.pop(eid).tokens)
        self._ops.append(CacheOp("drop", eid))

    def forget_key(self, key: int) -> None:
        """An adapter id was unloaded (it may name another adapter later): nothing computed
        with it is reused."""
        for eid in [eid for eid, e in self.entries.items() if e.key == key]:
            self._drop(eid)
        for slot in [s for s, held in self.slots.items() if held.key == key]:
            del self.slots[slot]

    def clear(self) -> None:
        """A new ring: its nodes hold nothing (ops not yet sent are void)."""
        self.entries.clear()
        self.slots.clear()
        self._running.clear()
        self.tokens_held = 0
        self._ops = []

    def metrics(self) -> Dict[str, int]:
        return dict(self.counters.metrics(), entries=len(self.entries), tokens_held=self.tokens_held,
                    token_budget=self.budget)


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return tokens if isinstance(tokens, np.ndarray) else np.asarray(list(tokens), dtype=np.int64)

