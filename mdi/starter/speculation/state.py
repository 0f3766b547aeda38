"""One sample's speculation state (SpecState: its drafter, its guesses and passes in flight, its
measured acceptance) and the run's counters over all samples (SpecCounters)."""
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from mdi.starter.speculation.drafters import Drafter

RATE_PRIOR = 0.5  # the acceptance assumed before a sample's first verification
RATE_MEMORY = 0.85  # weight of the past in the rolling acceptance (per verified draft)
LONG_PRIOR = 4  # drafts' weight of RATE_PRIOR in SpecState.long_rate, which fill_may_pay reads


@dataclass
class Pass:
    """A pass of one sample in flight: its first position and rows."""
    start: int
    count: int


@dataclass
class SpecCounters:
    """A run's drafting counters, summed over its samples (the metrics record's, /metrics').
    The acceptance rate is accepted over drafted: a guess sent after one that failed counts as
    drafted and not accepted (the policy's own rate, SpecState.rate, counts guesses up to the
    first that failed: the chance of the next guess given the ones before it stood)."""
    drafted: int = 0  # guessed tokens sent for verification
    accepted: int = 0
    verifications: int = 0  # passes that came back carrying guesses
    passes_stale: int = 0  # passes that came back after their guesses had failed
    rows_wasted: int = 0  # rows the ring computed for nothing: rejected guesses and stale passes

    def stale(self, rows: int) -> None:
        """A pass came back after a guess it was built on had failed: its rows were for nothing."""
        self.passes_stale += 1
        self.rows_wasted += rows

    def metrics(self) -> Dict[str, Any]:
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "accepted_per_pass": round(self.accepted / self.verifications, 4) if self.verifications else None,
                "verifications": self.verifications, "passes_stale": self.passes_stale,
                "rows_wasted": self.rows_wasted}


class SpecState:
    """One sample's speculation: its drafter, the guesses in flight and its measured acceptance."""

    def __init__(self, drafter: Drafter, seen: int = 0) -> None:
        self.drafter = drafter
        self.seen = seen  # the sample's generated tokens the drafter has been given (catch_up)
        self.frontier: List[int] = []  # guessed tokens for the positions after the accepted ones
        self.passes: Deque[Pass] = deque()  # its passes in flight in the current epoch, oldest first
        self.rate = RATE_PRIOR
        self.judged, self.agreed = 0, 0  # drafted tokens judged, and accepted, over the sample's life
        self.pause = 0  # plain passes left before drafting again
        self.filling = False  # building passes on guesses in flight (the way being measured)
        self.token_rates: Dict[bool, Optional[float]] = {False: None, True: None}  # tokens/s, by `filling`
        self.trial = 0  # verifications since `filling` last changed
        self.trial_tokens, self.trial_seconds = 0, 0.0  # taken, and the time it took, in this trial
        self.last_commit: Optional[float] = None
        self.fill_plan: Optional[Tuple[Any, Tuple[int, int, float]]] = None  # SpecPolicy.best_fill's last answer

    def catch_up(self, token_ids: Sequence[int]) -> None:
        """Give the drafter the tokens the sample took since it last had them. The pipeline takes
        tokens without a word to speculation; a drafter reads them only to propose, so it is
        told just before (the same tokens, in the same order, as when told at each take)."""
        if len(token_ids) > self.seen:
            self.drafter.commit(token_ids[self.seen:])
            self.seen = len(token_ids)

    def timed(self, taken: int, now: float) -> None:
        """A verification took `taken` tokens at `now`: the current way's token rate, over its
        trial so far."""
        if self.last_commit is not None and now > self.last_commit:
            self.trial_tokens += taken
            self.trial_seconds += now - self.last_commit
            self.token_rates[self.filling] = self.trial_tokens / self.trial_seconds
        self.last_commit = now
        self.trial += 1

    def switch_way(self) -> None:
        """Fill the ring or verify alone, whichever it did not: a new trial."""
        self.filling, self.trial = not self.filling, 0
        self.trial_tokens, self.trial_seconds = 0, 0.0

    def close(self) -> None:
        """Its sample ended: a drafter that holds memory for it (a draft model's slot) lets go."""
        close = getattr(self.drafter, "close", None)
        if close is not None:
            close()

    def forget_flight(self) -> None:
        """Every pass in flight is lost or stale: the next pass starts from the accepted tokens."""
        self.frontier = []
        self.passes.clear()

    def learn(self, agreed: int, verdicts: int) -> None:
        """`verdicts` drafted tokens were judged, the first `agreed` of them accepted."""
        for i in range(verdicts):
            self.rate = RATE_MEMORY * self.rate + (1 - RATE_MEMORY) * (1.0 if i < agreed else 0.0)
        self.judged += verdicts
        self.agreed += agreed

    @property
    def long_rate(self) -> float:
        """The acceptance over the sample's life so far (RATE_PRIOR weighing as LONG_PRIOR
        drafts): steadier than `rate`, which follows the last few drafts and at a true 0.5
        reached 0.7 often enough to start trials of filling that lost (loopback, a = 0.5:
        filling 1.14x the plain ring against verifying alone's 1.38x)."""
        return (self.agreed + RATE_PRIOR * LONG_PRIOR) / (self.judged + LONG_PRIOR)
