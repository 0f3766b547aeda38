"""The speculative decoder: everything the pipeline asks of speculation, in two calls. `send`:
which speculative passes leave now (each sample's next verification, and the passes that fill
the ring for it), in frames of their own. `verify`: what a verification that came back
accepts, drawn row by row through the pipeline's own draw and take, and what the sample's
policy learns from it. The pipeline draws and takes every token; this module decides which
tokens are guesses and what happens when one fails."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence, Tuple

from mdi.model.sampling import SamplingError
from mdi.runconfig import SpeculationSpec
from mdi.starter.sample import FinishReason, Sample
from mdi.starter.speculation.costs import PassCosts
from mdi.starter.speculation.draft_model import DraftModel
from mdi.starter.speculation.drafters import Drafter, new_drafter
from mdi.starter.speculation.policy import SpecPolicy
from mdi.starter.speculation.state import SpecCounters, SpecState

if TYPE_CHECKING:  # torch is imported where a torch path needs it: a ggml starter never loads it
    import torch

SpecPass = Tuple[Sample, int, List[int]]  # a sample, its pass's first position and its tokens
SendPass = Callable[[List[Sample], List[int], List[Tuple[int, List[int]]]], None]


class SpecDecoder:
    """The run's speculation: its setting (a sample may carry its own), the boards of the ring,
    what passes of several rows cost (measure_pass_costs; the engine measures them) and the
    drafting counters; the samples' states live on the samples (Sample.spec)."""

    def __init__(self, speculation: SpeculationSpec, n_stages: int, epochs: Iterator[int],
                 drafter_factory: Optional[Callable[[Sample], Drafter]] = None) -> None:
        self.speculation, self.n_stages = speculation, n_stages
        self.epochs = epochs  # the pipeline's: a sample whose guesses failed moves to a new epoch
        self.pass_costs = PassCosts.linear(0.1, 1 + speculation.max_draft)
        self.counters = SpecCounters()
        # a sample's drafter when not the speculation method's own (measurement: mdi.lab.oracle_drafter)
        self.drafter_factory = drafter_factory
        self.draft_model: Optional[DraftModel] = None  # method draft's model (the engine loads it)
        self.drafting: List[Sample] = []  # the samples holding a SpecState, until they leave the pipeline

    def policy(self, sample: Sample) -> SpecPolicy:
        return SpecPolicy(sample.speculation or self.speculation, self.n_stages, self.pass_costs)

    # --- (a) sending ---------------------------------------------------------------
    def send(self, ready: List[Sample], active: Sequence[Sample], max_len: int, max_batch: int,
             prefill_chunk: int, send_pass: SendPass) -> List[Sample]:
        """Send the passes of the decoding samples that speculate, and the passes that fill
        the ring for them, in frames of their own (`send_pass`); return the other ready
        samples. `active`: every admitted, unfinished sample; `max_len`: a cache slot's
        positions; frames of at most `max_batch` samples and about `prefill_chunk` rows."""
        self._settle(ready, active)
        decoding = len(active)  # samples admitted: those still prefilling decode soon
        passes: List[SpecPass] = []
        plain = []
        for sample in ready:
            one = self._spec_pass(sample, self.policy(sample), decoding, True, max_len) \
                if sample.spec is not None and sample.fed >= sample.window_prompt_len and sample.unsent == 1 else None
            if one is None:
                plain.append(sample)
            else:
                passes.append(one)
        for sample in list(active):  # fill the ring with passes built on guesses
            spec = sample.spec
            if spec is None or not spec.passes:
                continue
            policy = self.policy(sample)
            while not sample.done and len(spec.passes) < policy.depth(spec, decoding) and policy.active(decoding):
                one = self._spec_pass(sample, policy, decoding, False, max_len)
                if one is None:
                    break
                passes.append(one)
        while passes:  # in order, a sample's later passes in later frames (a frame holds a slot once)
            frame: List[SpecPass] = []
            rows, slots = 0, set()
            for one in passes[:max_batch]:
                rows += len(one[2])
                if frame and (rows > prefill_chunk + max_batch or one[0].slot in slots):
                    break
                frame.append(one)
                slots.add(one[0].slot)
            passes = passes[len(frame):]
            send_pass([f[0] for f in frame], [len(f[2]) for f in frame], [(f[1], f[2]) for f in frame])
        return plain

    def _settle(self, ready: List[Sample], active: Sequence[Sample]) -> None:
        """States follow the samples: a sample that left the pipeline (finished) lets its
        drafter go (a draft model's slot is free again); a ready sample that may speculate gets
        its state (built here, not at admission: nothing of it is read before its first pass
        leaves); and a ready one starts from its accepted tokens (a replay's passes in flight
        are gone; any other ready sample has none)."""
        if self.drafting:
            here = set(map(id, active))
            for sample in [s for s in self.drafting if id(s) not in here]:
                self.drafting.remove(sample)
                if sample.spec is not None:
                    sample.spec.close()
        for sample in ready:
            spec = sample.speculation or self.speculation
            if spec.on and sample.spec is None:
                drafter = self.drafter_factory(sample) if self.drafter_factory is not None \
                    else new_drafter(spec, sample, self.draft_model)
                sample.spec = SpecState(drafter, seen=len(sample.token_ids))
            if sample.spec is not None:
                sample.spec.forget_flight()
                if all(s is not sample for s in self.drafting):
                    self.drafting.append(sample)

    def _spec_pass(self, sample: Sample, policy: SpecPolicy, decoding: int, first: bool,
                   max_len: int) -> Optional[SpecPass]:
        one = policy.next_pass(sample, decoding, first, max_len)
        if one is None:
            return None
        self.counters.drafted += len(one[1]) - 1 if first else len(one[1])  # the guesses it carries
        return sample, one[0], one[1]

    # --- (b) verifying -------------------------------------------------------------
    def verify(self, sample: Sample, epoch: int, logits: torch.Tensor, draw: Callable[[torch.Tensor], int],
               take: Callable[[Sample, int], None], fail: Callable[[Sample, SamplingError], None],
               decoding: int) -> None:
        """A speculative pass came back: row i scores the token after input i. Tokens are taken
        while they match the guesses; the first that differs (or the row past the guesses)
        ends the run of them, and every pass built on the rest becomes stale. `draw`: a row's
        token, as the plain run draws it; `take` / `fail`: the pipeline's; `decoding`: the
        samples admitted."""
        spec, counters = sample.spec, self.counters
        assert spec is not None, "only a speculating sample's passes come back to be verified"
        if sample.done or epoch != sample.epoch:  # an earlier verification in these frames rejected
            counters.stale(logits.shape[0])
            return
        done_pass = spec.passes.popleft()
        assert done_pass.start == sample.window_len - 1, "a verification must start at the last accepted token"
        shifts = len(sample.shifts)
        judged = agreed = taken = 0
        matched = False
        for i in range(done_pass.count):
            guess = spec.frontier[i] if i < len(spec.frontier) else None
            try:
                # Drawn exactly as without a guess, one uniform per token: a guess is accepted when
                # the draw agrees with it, which happens with probability p(guess), the most any
                # scheme can accept a one-hot draft with. So each token is the plain run's own,
                # greedy or sampled with the same seed, whatever was guessed or still in flight.
                token = draw(logits[i])
            except SamplingError as e:
                fail(sample, e)
                break
            matched = token == guess
            judged += guess is not None
            agreed += matched
            taken += 1
            take(sample, token)
            if not matched or sample.done or sample.cancelled or len(sample.shifts) != shifts:
                break
        if sample.cancelled and not sample.done:  # e.g. a stop string among these tokens: no more of them
            sample.finish_reason = FinishReason.CANCELLED
        spec.learn(agreed, judged)
        spec.timed(taken, time.perf_counter())
        self.policy(sample).choose_way(spec, decoding)
        counters.accepted += agreed
        counters.verifications += judged > 0
        counters.rows_wasted += done_pass.count - taken
        if matched and taken == done_pass.count and not sample.done and len(sample.shifts) == shifts:
            spec.frontier = spec.frontier[taken:]  # the next pass in flight goes on from here
            return
        if spec.passes:  # built on a guess that failed: stale wherever they are
            sample.epoch = next(self.epochs)
        spec.forget_flight()
        if len(sample.shifts) == shifts:
            sample.fed = sample.window_len - 1  # the rows after the last taken token are overwritten
