"""What a sliding-window layer's KV cache keeps of a sample's past on the ggml backend (Gemma 3:
five layers in six attend to their last `sliding_window` positions only).

Such a layer keeps a ring of positions per slot instead of the whole context, as llama.cpp's
SWA cache does: position p lives in row p % ring of its slot, and the node notes which position
each row holds (its masks read that, not the row's index). A pass writes its rows before they
attend, so the ring holds the window plus the rows one pass may write, and as many again: a
sequence a slot held stays reusable by a prompt that shares all but its last few tokens (the
rows a speculation wrote past what was kept overwrote older ones). At Gemma 3's 512 positions a
window, a slot of 8192 positions keeps 768 of them in those layers: a sixth of the cache.

The torch backend keeps every position: it is the reference, and training reads the whole past.
"""
from dataclasses import dataclass
from typing import Any, Optional

from mdi.model.ggml.kernel_rows import TILED_ROWS


# The most rows a speculating sample's passes in flight write past its accepted tokens (the
# speculation policy caps filling the ring at this): what pass_rows_bound leaves for them.
ROWS_AHEAD = 2 * TILED_ROWS - 1


def pass_rows_bound(prefill_chunk: int) -> int:
    """The most rows one sample writes past what it keeps, in a run of `prefill_chunk` tokens
    a prompt pass: a prompt's pass (on ggml, up to TILED_ROWS - 1 more: prompt_passes.next_pass_rows),
    a replay after a context shift or a failure, or its speculative passes in flight (ROWS_AHEAD)."""
    return max(int(prefill_chunk), TILED_ROWS) + TILED_ROWS


def ring_length(config: Any, first: int, last: int, max_len: int, pass_rows: int) -> int:
    """Positions a slot keeps in each sliding-window layer of layers [first, last), or 0 where
    they keep all `max_len` (no such layer there, or a ring would save nothing)."""
    window = config.sliding_window or 0
    if not window or not any(config.layer_window(i) for i in range(first, last)):
        return 0
    ring = window + 2 * pass_rows
    return ring if ring < max_len else 0


@dataclass(frozen=True)
class SlidingRing:
    """The rings of a run's sliding-window layers, as the starter's prefix index reasons about
    them: a sequence a place holds may be reused from position n only while the ring still
    holds the window before n."""
    ring: int  # positions a slot keeps (ring_length)
    window: int  # the model's sliding window
    pass_rows: int  # pass_rows_bound: the most rows a pass writes, some past what is then kept

    def intact_from(self, held: int, reused_from: int) -> int:
        """The first position a slot's sequence of `held` positions still holds in every ring,
        after a sample that reused positions of a place intact from `reused_from` (0: none)
        wrote the rest, and at most pass_rows - 1 rows past them, over older ones."""
        lost = held + self.pass_rows - 1 - self.ring  # positions below this were overwritten
        return max(0, lost, reused_from)

    @classmethod
    def of(cls, config: Any, max_len: int, prefill_chunk: int) -> Optional["SlidingRing"]:
        """The rings a ggml node holding sliding-window layers keeps in a run of `max_len`
        positions a slot and `prefill_chunk` tokens a prompt pass (None: it keeps no ring)."""
        rows = pass_rows_bound(prefill_chunk)
        ring = ring_length(config, 0, config.n_layer, max_len, rows)
        return cls(ring, config.sliding_window, rows) if ring else None

    def reusable(self, shared: int, intact_from: int) -> int:
        """Of `shared` positions a place holds intact from `intact_from`, those a new sample may
        start from: all, or none where its first row's window reaches past what the ring holds."""
        return shared if max(0, shared - self.window + 1) >= intact_from else 0
