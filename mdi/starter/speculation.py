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
"""
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from mdi.model.row_batch import RowBatch
from mdi.runconfig import SpeculationSpec
from mdi.starter.draft_model import DraftModel, ModelDrafter
from mdi.starter.sample import Sample

RATE_PRIOR = 0.5  # the acceptance assumed before a sample's first verification
RATE_MEMORY = 0.85  # weight of the past in the rolling acceptance (per verified draft)
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
LONG_PRIOR = 4  # drafts' weight of RATE_PRIOR in SpecState.long_rate, which fill_may_pay reads


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

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
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


@dataclass(frozen=True)
class PassCosts:
    """What a pass of r rows costs, in passes of one row: `relative[r - 1]` (1.0 for one row).
    Measured (measure_pass_costs), as it is not a line: torch's packed int4 CPU kernel
    multiplies rows in blocks of 4, so on SmolLM2 at 1 thread (AVX-512) 4 rows cost about 1.5
    one-row passes and 5 about 2.1. Three drafts per pass then pay where four do not."""
    relative: Tuple[float, ...]

    @classmethod
    def linear(cls, row_cost: float, max_rows: int) -> "PassCosts":
        """Each row beyond the first adds `row_cost` (a model's, or a test's free rows at 0)."""
        return cls(tuple(1.0 + row_cost * r for r in range(max(1, max_rows))))

    def of(self, rows: int) -> float:
        """A pass of `rows` rows; beyond the measured ones, their mean extra row's cost more each."""
        n = len(self.relative)
        if rows <= n:
            return self.relative[max(rows, 1) - 1]
        return self.relative[-1] + self.row_cost * (rows - n)

    @property
    def row_cost(self) -> float:
        """The mean cost of an extra row over the widest measured pass (a one-number summary)."""
        n = len(self.relative)
        return (self.relative[-1] - 1.0) / (n - 1) if n > 1 else 0.0

    def to_json(self) -> List[float]:
        return [round(c, 3) for c in self.relative]


def verify_gain(a: float, k: int, trip: float) -> float:
    """Expected tokens per unit of time, over plain decoding, of one pass at a time carrying k
    drafts (each right with probability a): 1 + a + .. + a^k tokens per pass of k + 1 rows, which
    costs `trip` passes of one row (PassCosts.of(k + 1))."""
    return (1 - a ** (k + 1)) / (1 - a) / trip


def fill_gain(a: float, k: int, trip: float, stages: int, depth: Optional[int] = None) -> float:
    """The same with the ring filled by `depth` passes in flight (default: one per stage), each
    of k + 1 rows built on the guesses before it, until a guess fails. A pass stands when all
    its k + 1 guesses do (a^(k+1)); the chain that ends at a failing pass gave (k + 1) tokens
    per standing pass and j + 1 from the failing one (j of its guesses right). A pass enters
    every trip / depth; the failing one comes back a whole trip after it entered; and each of
    the depth - 1 passes sent on after it holds a stage for a stage time (trip / stages) before
    the next chain's first pass gets past it: the starter computed its layers, a worker may be
    running it. So deeper filling pays only where chains are long: on 3 emulated 0.5-core
    boards at a = 0.7, 2 passes in flight made 1.73-1.94x the plain ring and 3 made 1.52-1.67x
    (alternating, same run); at a = 0.9 both made 1.8-2.1x. `trip`: what a pass of k + 1 rows
    costs in passes of one row."""
    depth = stages if depth is None else depth
    stands = a ** (k + 1)
    standing = stands / (1 - stands)  # expected standing passes before the failing one
    # sum over j <= k of (j + 1) a^j (1 - a), in closed form, over the chance of failing at all
    failing = (1 - (k + 2) * stands + (k + 1) * stands * a) / ((1 - a) * (1 - stands))
    return (standing * (k + 1) + failing) / (standing * trip / depth + trip + (depth - 1) * trip / stages)


def best_verify(a: float, costs: "PassCosts", max_draft: int) -> Tuple[int, float]:
    """(k, gain) with the most expected tokens per unit of time over plain decoding when
    verifying one pass at a time (verify_gain); (0, 1.0) where no k beats plain decoding."""
    best, best_gain = 0, 1.0
    for k in range(1, max_draft + 1):
        gain = verify_gain(a, k, costs.of(k + 1))
        if gain > best_gain:
            best, best_gain = k, gain
    return best, best_gain


def best_fill(a: float, costs: "PassCosts", max_draft: int, stages: int) -> Tuple[int, int, float]:
    """(k, depth, gain) with the most expected tokens per unit of time over plain decoding when
    filling the ring (fill_gain): k drafts per pass, 2 .. `stages` passes in flight; (0, 1, 1.0)
    where nothing beats plain decoding."""
    best = (0, 1, 1.0)
    for k in range(max_draft + 1):
        trip = costs.of(k + 1)
        for depth in range(2, stages + 1):
            gain = fill_gain(a, k, trip, stages, depth)
            if gain > best[2]:
                best = (k, depth, gain)
    return best


class SpecPolicy:
    """How much one sample drafts and how many of its passes may be in flight: by the models
    above, fed the sample's rolling acceptance and the measured pass costs. Whether filling
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
            n = min(self.best_draft(spec, True)[0] + 1, room - 1 - len(spec.frontier))
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


def new_drafter(spec: SpeculationSpec, sample: Sample, draft_model: Optional[DraftModel] = None) -> Drafter:
    """`sample`'s drafter for `spec`. Method draft needs the run's draft model: the engine loads
    it whenever generation.speculation names one, and --serve refuses a request's `draft` (400)
    on a server without one, so its absence here is a caller's bug."""
    if spec.method == "ngram":
        return NgramDrafter(sample.prompt_ids + sample.token_ids, spec.ngram_min, spec.ngram_max)
    if spec.method == "draft" and draft_model is not None:
        return ModelDrafter(draft_model, sample)
    raise ValueError("speculation method %r has no drafter here" % spec.method)


TIMED_ROWS = (1, 2, 3, 4, 5)  # pass sizes always timed: the CPU int4 kernel's first row block and the next
MEASURE_BUDGET_S = 1.0  # timing rounds after the second stop once this much time went (a big model's passes)


def measure_pass_costs(chunk: Any, max_rows: int, repeats: int = 5) -> PassCosts:
    """What a pass of 1 .. max_rows rows through `chunk` costs in passes of one row, run as
    verifications run (decode kernels; row by row attention on a CPU, one call per sample on a
    GPU, as RowBatch.of decides), in a scratch cache slot (slot 0, before any sample holds it).
    Memory-bound layers read their weights once for all rows, so extra rows cost little there;
    compute-bound kernels pay per row or per block of rows.

    With the head where the chunk has one (the starter's): a verification scores every row.
    SmolLM2's int8 head (fbgemm) took 0.88 / 1.01 / 1.09 / 1.56 ms for 1 / 2 / 3 / 4 rows at 1
    thread (AVX-512): fbgemm reads its weight twice from 8 rows, and Int8DynamicLinear makes
    2 x rows + 1 of them. Verifying alone at a = 0.7, 10 prompts, alternating in one run: on a
    loopback ring of 3, timed without the head k = 3 looked best and made 1.45x the plain ring,
    with it k = 2 and 1.60x (1.11x per prompt, better on all 10); on 3 emulated 0.5-core boards
    1.44x against 1.50x (1.04x per prompt, better on 8).

    TIMED_ROWS and max_rows are timed, the sizes between them interpolated; each is the least
    disturbed of up to `repeats` rounds (other processes only add time), at least 2, fewer
    than `repeats` once MEASURE_BUDGET_S has gone (at start: a 7B model's passes take tenths of
    a second each on a board).

    Timed in the process's CPU time, not the wall clock: a board held to a CPU quota (a cgroup,
    mdi-bench's emulated boards, a container) is throttled in whole periods, so a one-row pass
    that fits the period's quota and a longer one that does not differ by the throttling, not
    the work (0.5 core: 2.04 per row by the wall clock, which switched drafting off). A GPU's
    passes are timed by the wall clock, each waited for (its host thread idles meanwhile)."""
    device = chunk.device
    width = chunk.config.n_embd
    # a slot shorter than 1 + max_draft (a short prompt and few tokens) never holds a longer pass
    max_rows = max(1, min(max_rows, chunk.cache.max_len))
    sizes = sorted({n for n in TIMED_ROWS if n <= max_rows} | {max_rows})
    timings: Dict[int, List[float]] = {n: [] for n in sizes}
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    started = time.perf_counter()
    with torch.inference_mode():
        for round_ in range(max(2, repeats)):
            if round_ >= 2 and time.perf_counter() - started > MEASURE_BUDGET_S:
                break
            for n in sizes:
                batch = RowBatch.of([0], [0], [n], device, row_wise=True)
                x = torch.zeros(n, width, dtype=chunk.activation_dtype, device=device)
                t0 = clock()
                y = chunk.forward_rows(x, batch)
                if chunk.with_head:
                    chunk.head(y)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                timings[n].append(clock() - t0)
    one = max(min(timings[1]), 1e-9)
    timed, most = {}, 1.0
    for n in sizes:  # a pass is never cheaper than a shorter one: what says so is noise
        most = max(most, min(timings[n]) / one)
        timed[n] = most
    relative = []
    for rows in range(1, max_rows + 1):
        below = max(n for n in sizes if n <= rows)
        above = min(n for n in sizes if n >= rows)
        share = (rows - below) / (above - below) if above > below else 0.0
        relative.append(timed[below] + share * (timed[above] - timed[below]))
    return PassCosts(tuple(relative))
