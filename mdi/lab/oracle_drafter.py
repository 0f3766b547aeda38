"""A drafter for measuring speculation, not for use: it knows the answer (the plain run's token
ids) and agrees with it with a chosen probability, so acceptance is controlled exactly
(scripts/bench_speculation.py's sweep, the exactness tests' always-right and always-wrong
drafters and random accept patterns)."""
import random
from typing import List, Sequence


class OracleDrafter:
    """Proposes `reference` (the tokens the target generates after the prompt), each token kept
    right with probability `agree` and otherwise replaced by a wrong one. Whether a position is
    right is fixed per (seed, position), so proposing again for a position gives the same
    guess, as a real drafter's would for the same context."""

    def __init__(self, history: Sequence[int], prompt_len: int, reference: Sequence[int], agree: float,
                 seed: int = 0, vocab: int = 1 << 15) -> None:
        self.generated = len(history) - prompt_len  # tokens of the answer already accepted
        self.reference, self.agree, self.seed, self.vocab = list(reference), agree, seed, vocab

    def commit(self, tokens: Sequence[int]) -> None:
        self.generated += len(tokens)

    def _guess(self, position: int) -> int:
        right = self.reference[position]
        if random.Random(self.seed * 1000003 + position).random() < self.agree:
            return right
        return (right + 1) % self.vocab

    def propose(self, frontier: Sequence[int], k: int) -> List[int]:
        first = self.generated + len(frontier)
        return [self._guess(p) for p in range(first, min(first + k, len(self.reference)))]
