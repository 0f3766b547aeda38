"""How a prompt is cut into passes on a ring that computes with ggml, so that each prompt row
computes the same bits however the prompt is chunked, batched or partly taken from the prefix
cache, and the bits llama.cpp's own run of the same prompt gives.

ggml's CPU flash attention computes a sample's query rows with one kernel below TILED_ROWS rows
(each query rounded to float16 against the float16 keys) and with a tiled kernel (float32
queries) from TILED_ROWS rows up: a prompt row's hidden state, and from there a greedy id at a
near tie, depended on the size of the pass that carried it (a 137-token prompt in passes of
64 + 64 + 9 parted from the same prompt in one pass). llama.cpp cuts a prompt into ubatches of
UBATCH tokens, so its rows take the tiled kernel wherever their ubatch holds TILED_ROWS rows or
more. So the passes follow that: within a ubatch of TILED_ROWS rows or more every pass carries
at least TILED_ROWS of its rows (about `chunk` a pass, the last pass of the ubatch taking what
is left), and a shorter ubatch goes in passes of at most `chunk` (all below TILED_ROWS). Pass
lengths stay multiples of REPACK_ROWS from the ubatch's start, as weights ggml re-lays
(`runtime.repack`) multiply rows in groups of that many from a pass's start. A sample's cuts
depend on its window's length and its position alone, never on what else a frame carries.
"""
import numpy as np

from mdi.model.ggml.kernel_rows import REPACK_ROWS, TILED_ROWS, UBATCH
# How a held position's row was computed (mdi.starter.prefix_cache.Held.kinds): in a prompt's
# pass below TILED_ROWS rows, in one of TILED_ROWS or more, or as an answer's (a decode step's,
# a verification's: below TILED_ROWS rows too, but reused where a cold prompt would tile it, as
# llama.cpp's server reuses a conversation: the one exception "Determinism" states).
ONE_ROW, TILED, ANSWER = 0, 1, 2


def _ubatch(position: int, window: int):
    """(start, end) of the ubatch holding `position` in a window of `window` tokens."""
    start = position // UBATCH * UBATCH
    return start, min(window, start + UBATCH)


def next_pass_rows(window: int, fed: int, chunk: int) -> int:
    """Rows of the next pass of a sample whose window holds `window` tokens, `fed` of them sent
    already, in passes of about `chunk` tokens (runtime.prefill_chunk)."""
    start, end = _ubatch(fed, window)
    left = end - fed
    if end - start < TILED_ROWS:  # a short ubatch: its rows take the one-row kernel in any pass below TILED_ROWS
        return min(left, chunk)
    step = max(TILED_ROWS, chunk - chunk % REPACK_ROWS)
    return left if left - step < TILED_ROWS else step


def replay_pass_rows(prompt: int, window: int, fed: int, chunk: int) -> int:
    """`next_pass_rows` of a window that may hold generated tokens after its `prompt` ones (a
    replay after a node failure, a context shift): the prompt cut as when it came, the
    generated tokens, computed a row a pass at first, in passes below TILED_ROWS rows, whose
    rows compute as one-row passes' do. A replay past 64 tokens had parted from the run
    that never failed."""
    if fed < prompt:
        return next_pass_rows(prompt, fed, chunk)
    return min(window - fed, chunk, TILED_ROWS - 1)


def reusable_positions(window: int, cached: int) -> int:
    """The most of `cached` positions (a prefix-cache hit) a sample may start from so that its
    passes compute its rows as a cold prompt's passes do: its first pass starts a multiple of
    REPACK_ROWS from the ubatch's start, short ubatch or not (re-laid weights multiply rows in
    groups of that many from a pass's start: a Gemma 3 Q4_K_M prompt of 16 tokens, 15 of them
    cached, computed its last row alone and parted from its cold text), and in a tiled ubatch
    it needs TILED_ROWS rows of it (the hit moves back, a few rows computed again)."""
    if cached <= 0:
        return 0
    start, end = _ubatch(cached, window)
    at = cached if end - start < TILED_ROWS else min(cached, end - TILED_ROWS)
    return start + (at - start) // REPACK_ROWS * REPACK_ROWS


def cold_kinds(window: int) -> np.ndarray:
    """Per position of a window of `window` tokens, how its cold passes compute it: TILED
    where its ubatch holds TILED_ROWS rows or more (every ubatch but a short last one), else
    ONE_ROW. A prefix-cache hit reuses only positions computed that way (or answers)."""
    kinds = np.full(window, TILED, dtype=np.uint8)
    tail = window % UBATCH
    if 0 < tail < TILED_ROWS:
        kinds[window - tail:] = ONE_ROW
    return kinds
