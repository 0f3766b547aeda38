"""Speculative decoding through the ring: the starter drafts, the ring verifies.

A sample's pass carries its last accepted token and up to k drafted tokens, as rows at
consecutive positions; every node writes them into the sample's KV slot as it writes prefill
rows, and the last node returns every row (a "verify" frame). The starter's head scores each
row and keeps the longest run of drafts the target agrees with, plus the target's own token
after it. Each token is drawn exactly as the plain run draws it (the same logits, bit for bit:
verification rows attend row by row, as decode steps do; the same generator, one draw per
token), and a draft counts as accepted when the draw equals it: the output is the plain run's,
greedy or sampled with the same seed, and a one-hot draft is accepted with probability
p(draft), as speculative sampling would.

Filling the ring: a sample alone in a ring of N boards leaves N - 1 of them idle. While a
verification travels, the starter sends the next pass built on the drafts in flight (the
"frontier": tokens guessed for the positions after the accepted ones), up to one pass per
board. When a verification disagrees, every pass built on the rejected guesses is stale: the
sample moves to a new epoch (every frame carries each sample's epoch), the starter ignores what
comes back from older epochs, and a node that finds a later epoch of a slot queued behind an
older pass drops that pass unrun (mdi.worker.run). Nothing is ever attended beyond a pass's own
positions (attention reads a slot only up to each row's position), so the rows a stale pass
wrote are simply overwritten by the next pass at those positions.

How much to draft is measured per sample: the rolling acceptance `rate` (the fraction of drafted
tokens the target agreed with) and what a pass of 1 + k rows costs in passes of one row
(`PassCosts`, measured on the starter's chunk) choose k to maximise expected tokens per unit of
pass time; when no k pays, the sample drafts nothing for a while and probes again later.
Passes are built on guesses only while the ring has fewer decoding samples than boards, and no
sample drafts once it holds more than one per board: plain decoding and batching fill the ring
then (speculation yields to them).

The package, one idea a module: drafters.py (what proposes guesses: prompt lookup, and the
method's drafter) and draft_model.py (a smaller model's), state.py (a sample's state and the
run's counters), costs.py (what a pass of several rows costs), gains.py (the expected speed-up
models), policy.py (how much to draft, which way) and decoder.py (the pipeline's two calls:
which passes to send, what a verification accepts).
"""
from mdi.starter.speculation.costs import PassCosts, measure_pass_costs
from mdi.starter.speculation.decoder import SpecDecoder
from mdi.starter.speculation.drafters import Drafter, NgramDrafter, new_drafter
from mdi.starter.speculation.gains import best_fill, best_verify, fill_gain, verify_gain
from mdi.starter.speculation.policy import SpecPolicy
from mdi.starter.speculation.state import Pass, SpecCounters, SpecState

__all__ = ["Drafter", "NgramDrafter", "Pass", "PassCosts", "SpecCounters", "SpecDecoder", "SpecPolicy",
           "SpecState", "best_fill", "best_verify", "fill_gain", "measure_pass_costs", "new_drafter",
           "verify_gain"]
