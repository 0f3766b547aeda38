"""Drafters: what proposes the tokens a sample's next pass guesses, and the one a run's
speculation method names (new_drafter). Prompt lookup (NgramDrafter) lives here; the draft
model's drafter in draft_model.py."""
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from mdi.runconfig import SpeculationSpec
from mdi.starter.sample import Sample
from mdi.starter.speculation.draft_model import DraftModel, ModelDrafter


class Drafter(Protocol):
    """Proposes the tokens that follow a sample's history (the starter, per sample)."""

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens the target accepted, in order, after those seen so far."""

    def propose(self, frontier: Sequence[int], k: int) -> List[int]:
        """Up to k tokens to follow the history and then `frontier` (tokens guessed earlier,
        still being verified)."""


class NgramDrafter:
    """Prompt lookup (llama.cpp's ngram speculation, transformers' prompt_lookup): find the most
    recent earlier place where the history's last n tokens occurred (n from ngram_max down to
    ngram_min) and propose what followed it there. No model: free on the starter, and right
    whenever the answer copies the prompt or itself (rewrites, quotes, code edits, lists)."""

    KEEP = 4  # end positions remembered per n-gram (the latest one may be the query itself)

    def __init__(self, history: Sequence[int], ngram_min: int = 2, ngram_max: int = 4) -> None:
        self.n_min, self.n_max = ngram_min, ngram_max
        self.tokens: List[int] = []
        self.index: Dict[Tuple[int, ...], List[int]] = {}  # n-gram -> positions of its last token
        self.commit(history)

    def commit(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            for n in range(self.n_min, self.n_max + 1):
                if end + 1 >= n:
                    ends = self.index.setdefault(tuple(self.tokens[end + 1 - n:end + 1]), [])
                    ends.append(end)
                    if len(ends) > self.KEEP:
                        del ends[0]

    def propose(self, frontier: Sequence[int], k: int) -> List[int]:
        if k < 1:
            return []
        tokens, n_hist = self.tokens, len(self.tokens)
        length = n_hist + len(frontier)

        def at(i: int) -> int:
            return tokens[i] if i < n_hist else int(frontier[i - n_hist])

        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            key = tuple(at(i) for i in range(length - n, length))
            for end in reversed(self.index.get(key, ())):
                if end >= length - 1:
                    continue  # the query itself
                out: List[int] = []
                for j in range(k):
                    pos = end + 1 + j
                    # past the history's end the match continues into what is being proposed:
                    # a repeating pattern proposes its own next period
                    out.append(at(pos) if pos < length else out[pos - length])
                return out
        return []

def new_drafter(spec: SpeculationSpec, sample: Sample, draft_model: Optional[DraftModel] = None) -> Drafter:
    """`sample`'s drafter for `spec`. Method draft needs the run's draft model: the engine loads
    it whenever generation.speculation names one, and --serve refuses a request's `draft` (400)
    on a server without one, so its absence here is a caller's bug."""
    if spec.method == "ngram":
        return NgramDrafter(sample.prompt_ids + sample.token_ids, spec.ngram_min, spec.ngram_max)
    if spec.method == "draft" and draft_model is not None:
        return ModelDrafter(draft_model, sample)
    raise ValueError("speculation method %r has no drafter here" % spec.method)
