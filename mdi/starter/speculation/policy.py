"""How much a sample drafts (k) and which way it speculates (verifying one pass at a time, or
filling the ring with passes built on guesses in flight): SpecPolicy, by the gain models
(gains.py) fed the sample's measured acceptance and the measured pass costs."""
from typing import List, Optional, Tuple

from mdi.model.sliding_cache import ROWS_AHEAD
from mdi.runconfig import SpeculationSpec
from mdi.starter.sample import Sample
from mdi.starter.speculation.costs import PassCosts
from mdi.starter.speculation.gains import best_fill, best_verify
from mdi.starter.speculation.state import Pass, SpecState

PAUSE_TOKENS = 16  # plain passes after a probe before a sample whose drafts do not pay drafts again
MIN_GAIN = 1.05  # expected tokens per pass time a draft must beat plain decoding by
# Whether filling pays is measured, not assumed: boards that share CPUs (this project's 2-core
# test machine runs 3 processes), or quota-limited ones, lose to the stale passes what idle
# boards would gain. A sample tries each way for MODE_TRIAL verifications, keeps the one with
# the higher token rate, and tries the other again every MODE_RETRY verifications. A way's rate
# is its latest trial's tokens over its time: filling returns verifications in bursts (one
# right behind another, then a whole trip after a failure), and a mean of per-interval rates
# counted each burst's sub-millisecond gap as thousands of tokens a second, so filling won the
# comparison where it was slower (loopback, a = 0.7: 1.35x the plain ring filling, 1.56x not).
MODE_TRIAL = 8
MODE_RETRY = 64
# A trial of filling costs what filling loses, for MODE_TRIAL verifications each time: on one
# H200 (SmolLM2 shape, S = 1) trying both ways made 1.26x / 1.99x the plain ring at a = 0.5 / 0.7
# where verifying alone made 1.78x / 2.44x. So filling is tried only where the model (fill_gain
# at its best against verify_gain at its best) puts it within this fraction of verifying alone:
# the models miss by more than 10% either way in measurement (at a = 0.9 on that H200 the model
# put filling at 0.99x verifying alone, and trying both measured 1.15x).
FILL_TRIAL_MIN = 0.9


class SpecPolicy:
    """How much one sample drafts and how many of its passes may be in flight: by the gain models
    (gains.py), fed the sample's rolling acceptance and the measured pass costs. Whether filling
    the ring pays on these boards at all is measured (choose_way), not modelled."""

    def __init__(self, spec: SpeculationSpec, n_stages: int, costs: PassCosts) -> None:
        self.spec, self.n_stages, self.costs = spec, n_stages, costs

    def fills(self, state: SpecState, decoding: int) -> bool:
        """Whether this sample's passes are built on guesses in flight now: the way it measures
        faster, on a ring with boards no other sample keeps busy."""
        return self.spec.fill and state.filling and decoding < self.n_stages

    def best_draft(self, state: SpecState, filling: bool) -> Tuple[int, float]:
        """(k, expected gain over plain decoding) maximising tokens per unit of time: k drafts
        per pass, with the ring filled (at its best depth) or one pass at a time."""
        if filling:
            k, _, gain = self.best_fill(state)
            return k, gain
        return best_verify(min(state.rate, 0.999), self.costs, self.spec.max_draft)

    def best_fill(self, state: SpecState) -> Tuple[int, int, float]:
        """best_fill at the sample's acceptance, kept until it changes (asked several times a pass)."""
        a = min(state.rate, 0.999)
        key = (a, self.costs, self.spec.max_draft, self.n_stages)
        if state.fill_plan is None or state.fill_plan[0] != key:
            state.fill_plan = (key, best_fill(a, self.costs, self.spec.max_draft, self.n_stages))
        return state.fill_plan[1]

    def draft_len(self, state: SpecState, decoding: int) -> Tuple[int, bool]:
        """(k, probe): the k that maximises expected accepted tokens per unit of time; when
        none pays, one draft as a probe (the caller then pauses the sample, if it drafted), so
        the acceptance keeps being measured at a small cost."""
        if state.pause > 0:
            state.pause -= 1
            return 0, False
        best, best_gain = self.best_draft(state, self.fills(state, decoding))
        if best_gain < MIN_GAIN:
            return 1, True
        return best, False

    def fill_may_pay(self, state: SpecState) -> bool:
        """Whether the model gives filling a chance at this sample's acceptance over its life
        (SpecState.long_rate): its best filling within FILL_TRIAL_MIN of its best verification."""
        a = min(state.long_rate, 0.999)
        verify = best_verify(a, self.costs, self.spec.max_draft)[1]
        return best_fill(a, self.costs, self.spec.max_draft, self.n_stages)[2] >= FILL_TRIAL_MIN * verify

    def choose_way(self, state: SpecState, decoding: int) -> None:
        """After a verification: keep filling the ring or not, by the measured token rates;
        filling only where the model gives it a chance."""
        if not self.spec.fill or decoding >= self.n_stages or state.trial < MODE_TRIAL:
            return
        if not self.fill_may_pay(state):
            if state.filling:  # the acceptance fell: back to verifying alone, no trial needed
                state.switch_way()
            return  # verifying alone where filling cannot pay: no trial, it would cost tokens
        mine, other = state.token_rates[state.filling], state.token_rates[not state.filling]
        if other is None or mine is None or other > mine or state.trial >= MODE_RETRY:
            state.switch_way()

    def depth(self, state: SpecState, decoding: int) -> int:
        """Passes of this sample allowed in flight: while it fills the ring, as many as the
        model says its acceptance pays for the stale passes (at most one per board), else one."""
        if not self.fills(state, decoding) or state.pause > 0:
            return 1
        _, depth, gain = self.best_fill(state)
        return depth if gain >= MIN_GAIN else 1

    def next_pass(self, sample: Sample, decoding: int, first: bool, max_len: int) -> Optional[Tuple[int, List[int]]]:
        """(start, tokens) of a speculating sample's next pass, noted in its state as sent:
        `first`, from its accepted tokens (its last one and up to k drafts after it); else one
        more pass built on the guesses in flight (None when the drafter has none to add).
        Nothing is drafted past the sample's token budget or its cache slot (`max_len`)."""
        spec = sample.spec
        assert spec is not None, "only a speculating sample has a next speculative pass"
        spec.catch_up(sample.token_ids)
        room = min(sample.max_new_tokens - len(sample.token_ids), max_len - sample.window_len)
        if first:
            start = sample.window_len - 1
            k, probe = self.draft_len(spec, decoding) if self.active(decoding) else (0, False)
            k = min(k, room - 1)
            spec.frontier = spec.drafter.propose([], k) if k > 0 else []
            if probe and spec.frontier:
                spec.pause = PAUSE_TOKENS
            tokens = sample.window_tokens(start, 1) + spec.frontier
        else:
            last = spec.passes[-1]
            start = last.start + last.count
            n = min(self.best_draft(spec, True)[0] + 1, room - 1 - len(spec.frontier),
                    ROWS_AHEAD - 1 - len(spec.frontier))  # (what sliding-window rings allow for)
            tokens = spec.drafter.propose(spec.frontier, n) if n > 0 else []
            if not tokens:
                return None
            spec.frontier = spec.frontier + tokens
        spec.passes.append(Pass(start, len(tokens)))
        sample.fed = start + len(tokens)
        return start, tokens

    def active(self, decoding: int) -> bool:
        """Whether samples draft at all: while the ring holds at most one decoding sample per
        board (each pass then has boards or rows to spare); beyond, plain decoding and
        batching fill it, and extra rows would take capacity from them."""
        return self.spec.on and decoding <= self.n_stages
