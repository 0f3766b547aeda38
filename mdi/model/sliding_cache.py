"""What a sliding-window layer's KV cache keeps of a sample's past on the ggml backend (Gemma 3:
five layers in six attend to their last `sliding_window` positions only).

Such a layer keeps a ring of positions per slot instead of the whole context, sized as
llama.cpp sizes its SWA cache (n_swa + n_ubatch): the window and one ubatch, the most rows of a
sample a pass carries on a ring of ggml nodes (mdi.starter.prompt_passes cuts prompts within
ubatches; a verification carries 33). Position p lives in row p % ring of its slot, and the node
notes which position each row holds (its masks read that, not the row's index). The ring's
size depends on the model alone, so a row sums its window in the same order whatever the
passes: greedy ids still do not depend on batching, prompt chunks or the prefix cache. Once a
ring goes round, the order is the ring's, not the positions': ids can part from a run that
keeps every position. At Gemma 3's 512 positions a window, a slot of 8,192 positions keeps
1,024 of them in those layers.

The torch backend keeps every position: it is the reference, and training reads the whole past.
"""
from dataclasses import dataclass
from typing import Any, Optional

from mdi.model.ggml.kernel_rows import KV_PAD, TILED_ROWS, UBATCH

# The most rows a speculating sample's passes in flight write past its accepted tokens (the
# speculation policy caps filling the ring at this). A sample's prompt passes go one at a time,
# each back before the next, so these are the only rows a slot can hold past what it keeps.
ROWS_AHEAD = 2 * TILED_ROWS - 1


def ring_length(config: Any, first: int, last: int, max_len: int, prefill_chunk: int) -> int:
    """Positions a slot keeps in each sliding-window layer of layers [first, last) (window + a
    ubatch, padded to 256 as llama.cpp pads it), or 0 where
    they keep all `max_len`: no such layer there, a ring would save nothing, or the run's
    prompt passes may be longer than a ubatch (`prefill_chunk` over UBATCH)."""
    window = config.sliding_window or 0
    if not window or prefill_chunk > UBATCH or not any(config.layer_window(i) for i in range(first, last)):
        return 0
    # llama.cpp's SWA cache: n_swa + n_ubatch cells padded to 256 (llama-kv-cache-iswa.cpp); an
    # unpadded ring of a 48-token window had parted its perplexity from llama-perplexity's
    ring = -(-(window + UBATCH) // KV_PAD) * KV_PAD
    return ring if ring < max_len else 0


@dataclass(frozen=True)
class SlidingRing:
    """The rings of a run's sliding-window layers, as the starter's prefix index reasons about
    them: a sequence a place holds may be reused from position n only while the ring still
    holds the window before n."""
    ring: int  # positions a slot keeps (ring_length)
    window: int  # the model's sliding window

    def intact_from(self, held: int, reused_from: int, drafted: bool = True) -> int:
        """The first position a slot's sequence of `held` positions still holds in every ring,
        after a sample that reused positions of a place intact from `reused_from` (0: none)
        wrote the rest, and at most one row past them, ROWS_AHEAD + 1 if it `drafted`
        (speculation's passes in flight), over older ones."""
        lost = held + (ROWS_AHEAD if drafted else 0) + 1 - self.ring  # positions below this were overwritten
        return max(0, lost, reused_from)

    def reusable(self, shared: int, intact_from: int) -> int:
        """Of `shared` positions a place holds intact from `intact_from`, those a new sample may
        start from: all, or none where its first row's window reaches past what the ring holds."""
        return shared if max(0, shared - self.window + 1) >= intact_from else 0

    @classmethod
    def of(cls, config: Any, max_len: int, prefill_chunk: int) -> Optional["SlidingRing"]:
        """The rings a ggml node holding sliding-window layers keeps in a run of `max_len`
        positions a slot and `prefill_chunk` tokens a prompt pass (None: it keeps no ring)."""
        ring = ring_length(config, 0, config.n_layer, max_len, prefill_chunk)
        return cls(ring, config.sliding_window) if ring else None
