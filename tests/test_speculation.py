"""Speculative decoding (mdi.starter.speculation): drafts verified in the ring give exactly the
plain run's tokens, greedy or sampled with the same seed, whatever the drafter guesses, however
many passes are in flight, on one node or a ring of real processes, through recovery."""
import collections
import json
import math
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from conftest import CHARS, ROOT, tiny_model, worker_pool
from ringconfigs import parse_run_config
from mdi.lab.oracle_drafter import OracleDrafter
from mdi.model.sampling import SamplingParams, sample_generator, sample_next
from mdi.ring import wire
from mdi.ring.transport import LocalLoop
from mdi.runconfig import ConfigError, SpeculationSpec, parse_speculation
from mdi.starter import batch, speculation
from mdi.starter.pipeline import Pipeline
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.sample import Sample
from mdi.starter.speculation import NgramDrafter

PROMPTS = ["The quick brown fox jumps", "abcabcabcabc", "To be, or not to be, that is", "x"]


# --- the n-gram drafter --------------------------------------------------------------------

def test_ngram_drafter_proposes_what_followed_the_latest_earlier_match():
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2], ngram_min=2, ngram_max=3)
    # "1 2" last occurred at positions 9..10 followed by 3, 7, 8 (not the older 3, 4, 5)
    assert d.propose([], 3) == [3, 7, 8]
    assert d.propose([3], 2) == [7, 8]  # the frontier extends the query: "2 3" -> 7, 8
    assert d.propose([], 0) == []
    assert NgramDrafter([5, 6, 7, 8]).propose([], 4) == []  # nothing recurs
    d.commit([3, 7])
    assert d.propose([], 2) == [8, 1]  # what was accepted is searched too


def accepting(state, a, drafts=1000):
    """`state` as a sample whose drafts were accepted at rate `a`, lately and over its life."""
    state.rate, state.judged, state.agreed = a, drafts, round(a * drafts)


def test_a_sample_keeps_the_way_it_measures_faster():
    """Filling the ring or verifying alone: each tried for MODE_TRIAL verifications, then the
    faster kept, the other tried again after MODE_RETRY."""
    policy = speculation.SpecPolicy(SpeculationSpec("ngram"), n_stages=3, costs=speculation.PassCosts.linear(0.1, 9))
    state = speculation.SpecState(NgramDrafter([]))
    accepting(state, 0.9)  # where the model gives filling a chance
    clock = [0.0]

    def verifications(n, seconds_per_token):
        for _ in range(n):
            clock[0] += seconds_per_token
            state.timed(1, clock[0])
            policy.choose_way(state, decoding=1)
    verifications(speculation.policy.MODE_TRIAL, 0.1)  # alone: 10 tokens/s
    assert state.filling
    verifications(speculation.policy.MODE_TRIAL, 0.2)  # filling measured slower: back, and it stays
    assert not state.filling
    verifications(speculation.policy.MODE_RETRY - 1, 0.1)
    assert not state.filling
    verifications(1, 0.1)
    assert state.filling  # tried again
    policy.choose_way(state, decoding=3)  # a ring that plain decoding fills: nothing changes
    assert policy.depth(state, decoding=3) == 1


def test_a_way_s_rate_is_its_tokens_over_its_time_however_bursty():
    """Filling returns verifications in bursts (right behind one another, then a whole trip
    after a failure): its rate is the trial's tokens over the trial's time, so bursts of
    near-zero gaps do not make a slower way look faster."""
    policy = speculation.SpecPolicy(SpeculationSpec("ngram"), n_stages=3, costs=speculation.PassCosts.linear(0.1, 9))
    state = speculation.SpecState(NgramDrafter([]))
    accepting(state, 0.9)
    clock = [0.0]

    def verification(tokens, seconds):
        clock[0] += seconds
        state.timed(tokens, clock[0])
        policy.choose_way(state, decoding=1)
    state.last_commit = 0.0  # the sample's first token
    for _ in range(speculation.policy.MODE_TRIAL):  # alone: 2 tokens every 20 ms, 100 tokens/s
        verification(2, 0.02)
    assert state.filling and state.token_rates[False] == pytest.approx(100)
    for _ in range(speculation.policy.MODE_TRIAL // 4):  # filling: 3 returns 0.1 ms apart, then a failure's trip
        for tokens, seconds in ((2, 0.0001), (2, 0.0001), (2, 0.0001), (1, 0.1)):
            verification(tokens, seconds)
    assert state.token_rates[True] == pytest.approx(7 / 0.1003)  # per-interval rates averaged: 1990
    assert not state.filling  # verifying alone measured faster: back to it


def test_filling_is_tried_only_where_the_model_gives_it_a_chance():
    """A trial of filling costs what filling loses. Where passes of many rows cost little more
    than one (a GPU: 1.21 one-row passes for 2-9 rows on an H200), verifying alone with long
    drafts beats filling by the model at a = 0.5 and 0.7: no trial, whatever the clock says.
    At a = 0.9 the two are close, so both are tried. A sample whose acceptance falls while it
    fills goes back to verifying alone without a trial."""
    gpu = speculation.PassCosts((1.0,) + (1.21,) * 8)
    policy = speculation.SpecPolicy(SpeculationSpec("ngram"), n_stages=3, costs=gpu)
    state = speculation.SpecState(NgramDrafter([]))
    clock = [0.0]

    def verifications(n):
        for _ in range(n):
            clock[0] += 0.01
            state.timed(2, clock[0])
            policy.choose_way(state, decoding=1)
    for rate in (0.5, 0.7):
        accepting(state, rate)
        verifications(speculation.policy.MODE_RETRY + speculation.policy.MODE_TRIAL)
        assert not state.filling and not policy.fill_may_pay(state), rate
    accepting(state, 0.9)
    assert policy.fill_may_pay(state)
    verifications(speculation.policy.MODE_TRIAL)  # the retry is due: filling is tried
    assert state.filling
    accepting(state, 0.5)
    verifications(speculation.policy.MODE_TRIAL)
    assert not state.filling
    # What decides is the acceptance over the sample's life, not its last few drafts: a lucky
    # streak at a true 0.5 starts no trial.
    state.rate, state.judged, state.agreed = 0.95, 200, 100
    verifications(speculation.policy.MODE_RETRY + speculation.policy.MODE_TRIAL)
    assert not state.filling
    fresh = speculation.SpecState(NgramDrafter([]))
    assert fresh.long_rate == speculation.state.RATE_PRIOR
    fresh.learn(3, 4)
    assert speculation.state.RATE_PRIOR < fresh.long_rate < 0.75
    # the CPU's costs (AVX-512, int4: 2-4 rows 1.06-1.33, 5 rows 1.93): filling stays a candidate at 0.7
    cpu = speculation.PassCosts((1.0, 1.063, 1.176, 1.326, 1.925, 2.19, 2.456, 2.721, 2.986))
    accepting(state, 0.7)
    assert speculation.SpecPolicy(SpeculationSpec("ngram"), n_stages=3, costs=cpu).fill_may_pay(state)


def test_a_filling_sample_drafts_by_the_pipeline_model_and_fills_only_where_it_pays():
    """Verifying alone, k maximises accepted tokens per pass time; filling the ring, passes
    stand only while every guess before them does, so the model picks fewer drafts per pass,
    fills where the acceptance pays for the stale passes (not at 0.3), and keeps more passes in
    flight where chains of standing passes are longer (each stale pass delays the next chain)."""
    policy = speculation.SpecPolicy(SpeculationSpec("ngram"), n_stages=3, costs=speculation.PassCosts.linear(0.26, 9))
    state = speculation.SpecState(NgramDrafter([]))
    for rate, depth in ((0.3, 1), (0.7, 2), (0.9, 3)):
        fills = depth > 1
        state.rate, state.filling = rate, False
        alone, alone_gain = policy.best_draft(state, False)
        assert policy.depth(state, decoding=1) == 1  # verifying alone: one pass in flight
        state.filling = True
        k, gain = policy.best_draft(state, True)
        assert policy.depth(state, decoding=1) == depth, rate
        assert policy.depth(state, decoding=3) == 1  # plain decoding fills the ring
        if fills:
            assert k < alone and gain > alone_gain  # shorter passes, more tokens per unit of time
            assert policy.draft_len(state, decoding=1) == (k, False)
            assert policy.draft_len(state, decoding=3) == (alone, False)
    # the model's extremes: a drafter never right gains nothing either way; always right, the
    # filled ring approaches one pass per stage time
    assert speculation.fill_gain(0.0, 0, 1.0, 3) < 1 and speculation.verify_gain(0.0, 1, 1.26) < 1
    assert 2.5 < speculation.fill_gain(0.999, 0, 1.0, 3) <= 3


def test_pass_costs_are_timed_as_verifications_and_interpolated(monkeypatch):
    """A cost per pass size, one row first: the small sizes and the largest timed (as
    verifications run), the sizes between them interpolated, never falling with more rows;
    beyond the table, its mean extra row more per row."""
    chunk = tiny_model("llama")
    chunk.allocate_cache(1, 32)
    seen = []
    real = chunk.forward_rows

    def forward_rows(x, batch):
        seen.append((batch.rows, batch.row_wise))
        return real(x, batch)
    monkeypatch.setattr(chunk, "forward_rows", forward_rows)
    costs = speculation.measure_pass_costs(chunk, 9, repeats=2)
    assert {rows for rows, _ in seen} == {1, 2, 3, 4, 5, 9} and all(wise for _, wise in seen)
    c = costs.relative
    assert len(c) == 9 and c[0] == 1.0 and all(b >= a for a, b in zip(c, c[1:]))
    assert c[6] == pytest.approx(c[4] + (c[8] - c[4]) / 2)  # 7 rows: halfway between 5 and 9
    assert costs.of(11) == pytest.approx(c[8] + 2 * (c[8] - 1) / 8)
    assert speculation.measure_pass_costs(chunk, 1).relative == (1.0,)
    # a slot shorter than the widest pass (a short prompt, few tokens): timed up to the slot's length
    seen.clear()
    chunk.allocate_cache(1, 5)
    costs = speculation.measure_pass_costs(chunk, 9, repeats=2)
    assert max(rows for rows, _ in seen) == 5 and len(costs.relative) == 5 and costs.of(9) > costs.of(5)


def test_ngram_drafter_continues_a_repeating_pattern_past_its_end():
    d = NgramDrafter([1, 2, 3, 1, 2, 3, 1, 2], ngram_min=2, ngram_max=4)
    assert d.propose([], 7) == [3, 1, 2, 3, 1, 2, 3]


# --- exactness on one node, passes in flight as in a ring ------------------------------------

# Rows are free: draft as much as the acceptance pays for (verifying alone then beats filling).
FREE_ROWS = speculation.PassCosts.linear(0.0, 9)
# Rows as on a CPU: filling the ring stays a candidate from a = 0.6 (fill_may_pay).
CPU_ROWS = speculation.PassCosts.linear(0.26, 9)


def run_local(chunk, prompts, n_tokens, spec=None, factory=None, params=SamplingParams(0.0), n_stages=3,
              max_batch=1, context_shift=False, seed=3, costs=FREE_ROWS):
    """Samples run on a LocalLoop whose policy believes in `n_stages` boards: up to that many
    passes of one sample in flight, returned in order as a ring returns them."""
    samples = [Sample(i, p, [CHARS.index(c) for c in p], n_tokens, sample_generator(seed, i))
               for i, p in enumerate(prompts)]
    settings = PipelineSettings(max_batch=max_batch, prefill_chunk=8, context_shift=context_shift,
                                speculation=spec or SpeculationSpec(), n_stages=n_stages)
    pipe = Pipeline(chunk, LocalLoop(), 1, params, None, settings, drafter_factory=factory, pass_costs=costs)
    with torch.no_grad():
        pipe.run(samples)
    return [s.token_ids for s in samples], pipe


def oracle(reference, agree, seed=0):
    return lambda s: OracleDrafter(s.prompt_ids + s.token_ids, len(s.prompt_ids), reference[s.index], agree,
                                   seed=seed + s.index, vocab=len(CHARS))


class TickClock:
    """time for speculation's decoder: one second a reading, so that the way a sample takes
    (filling the ring or verifying alone, chosen by measured token rates) is the same on every
    machine, however busy."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_drafter_gives_the_plain_greedy_tokens(family, quick_ways, monkeypatch):
    monkeypatch.setattr(speculation.decoder, "time", TickClock())
    chunk = tiny_model(family)
    chunk.allocate_cache(4, 128)
    plain, _ = run_local(chunk, PROMPTS[:2], 40)
    ngram = SpeculationSpec("ngram", max_draft=6)
    for factory, n_stages, what in ((None, 1, "ngram, verify only"), (None, 3, "ngram, filling"),
                                    (oracle(plain, 1.0), 3, "always right"), (oracle(plain, 0.0), 3, "always wrong"),
                                    (oracle(plain, 0.6), 2, "right 60%"), (oracle(plain, 0.7), 3, "right 70%")):
        costs = CPU_ROWS if what == "right 70%" else FREE_ROWS  # where filling is tried, guesses fail in flight
        got, pipe = run_local(chunk, PROMPTS[:2], 40, ngram, factory, n_stages=n_stages, max_batch=2, costs=costs)
        assert got == plain, what
        c = pipe.spec_counters
        if what == "always right":
            assert c.accepted == c.drafted > 0 and c.passes_stale == 0
        if what == "always wrong":
            assert c.accepted == 0
        if what.startswith("right"):
            assert 0 < c.accepted < c.drafted
        if what == "right 70%":  # passes were built on guesses that then failed
            assert c.passes_stale > 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_random_accept_patterns_over_a_thousand_tokens_never_drift(family, quick_ways):
    """Acceptance that changes at random, windows that shift past the cache's end and passes
    built on guesses that fail: more than 1000 tokens, each the plain run's."""
    chunk = tiny_model(family)
    chunk.allocate_cache(2, 96)
    plain, _ = run_local(chunk, ["The cat"], 1100, context_shift=True)
    rng = random.Random(5)
    for n_stages in (1, 3):
        agree = [rng.choice((0.0, 0.5, 0.9, 1.0)) for _ in range(1100)]

        class Moody(OracleDrafter):  # right with a probability that changes along the answer
            def _guess(self, position):
                self.agree = agree[position]
                return OracleDrafter._guess(self, position)

        factory = lambda s: Moody(s.prompt_ids, len(s.prompt_ids), plain[0], 0.5, seed=n_stages, vocab=len(CHARS))
        got, pipe = run_local(chunk, ["The cat"], 1100, SpeculationSpec("ngram", max_draft=8), factory,
                              n_stages=n_stages, context_shift=True)
        assert got == plain, n_stages
        assert pipe.context_shifts > 5 and pipe.spec_counters.accepted > 100


def test_sampled_tokens_with_speculation_are_the_plain_run_s_with_the_same_seed(quick_ways):
    chunk = tiny_model("llama")
    chunk.allocate_cache(4, 128)
    params = SamplingParams(0.8, None, 0.95)
    plain, _ = run_local(chunk, PROMPTS[:3], 40, params=params)
    other_seed, _ = run_local(chunk, PROMPTS[:3], 40, params=params, seed=4)
    assert other_seed != plain  # the seed matters: the equality below is not a coincidence
    for agree in (0.0, 0.7, 1.0):
        got, pipe = run_local(chunk, PROMPTS[:3], 40, SpeculationSpec("ngram"), oracle(plain, agree),
                              params=params, n_stages=3, max_batch=3)
        assert got == plain, agree


def test_a_draft_is_accepted_as_often_as_the_target_draws_it():
    """Chi-square: at a fixed context, drafting the target's most likely token is accepted with
    its probability under temperature 0.8 and top-p 0.9, and the tokens drawn follow that
    distribution (a test at the 0.1% level, seeded: it cannot flake)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.7])
    params = SamplingParams(0.8, None, 0.9)
    probs = torch.softmax(logits / 0.8, -1)
    order = torch.argsort(probs, descending=True)
    keep = (torch.cumsum(probs[order], 0) - probs[order]) < 0.9
    p = torch.zeros_like(probs)
    p[order[keep]] = probs[order[keep]]
    p /= p.sum()
    gen = sample_generator(11, 0)
    n = 20000
    counts = collections.Counter(sample_next(logits, params, gen) for _ in range(n))
    guess = int(torch.argmax(logits))
    chi2 = sum((counts[i] - n * float(p[i])) ** 2 / (n * float(p[i])) for i in range(8) if p[i] > 0)
    dof = int((p > 0).sum()) - 1
    assert chi2 < {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}[dof]
    assert all(counts[i] == 0 for i in range(8) if p[i] == 0)
    accepted = counts[guess] / n
    assert math.isclose(accepted, float(p[guess]), abs_tol=4 * math.sqrt(p[guess] * (1 - p[guess]) / n))


# --- a ring of real processes -----------------------------------------------------------------

@pytest.fixture(scope="module")
def three_workers():
    yield from worker_pool(3)


def ring_run(model, workers, spec, prompts, n_tokens=40, spares=(), on_token=None, factory=None,
             generation=None, quant=None):
    g = dict(generation or {})
    g["speculation"] = spec
    cfg = parse_run_config(model, workers, "spec", spares=spares, n_tokens=n_tokens, generation=g, quant=quant,
                           runtime={"threads": 1, "heartbeat_interval": 0.2, "ring_timeout": 10})
    def hook(engine):
        engine.drafter_factory = factory  # None: the method's own drafter
    return batch.run(cfg, prompts, on_token=on_token, on_engine=hook)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_ring_verifies_drafts_and_gives_the_plain_tokens(tiny_models, three_workers, family):
    model = tiny_models[family]
    prompts = PROMPTS[:2]  # no more samples than boards: they draft
    for workers in (three_workers[:1], three_workers[:2]):
        plain = [s.token_ids for s in ring_run(model, workers, "off", prompts).samples]
        for spec, factory in (({"method": "ngram", "max_draft": 6}, None),
                              ("ngram", lambda s: OracleDrafter(s.prompt_ids, len(s.prompt_ids), plain[s.index], 1.0,
                                                                vocab=len(CHARS))),
                              ("ngram", lambda s: OracleDrafter(s.prompt_ids, len(s.prompt_ids), plain[s.index], 0.5,
                                                                seed=s.index, vocab=len(CHARS)))):
            result = ring_run(model, workers, spec, prompts, factory=factory)
            assert [s.token_ids for s in result.samples] == plain, (len(workers), spec)
            record = result.metrics()["nodes"][0]["speculation"]
            assert record["drafted"] >= record["accepted"] >= 0
        assert record["drafted"] > 0 and record["verifications"] > 0


def test_a_run_shorter_than_one_full_draft_gives_the_plain_tokens(tiny_models, three_workers):
    """A prompt and token budget shorter than 1 + max_draft: the slot is shorter than the widest
    pass the starter would time (it had stopped the run: positions exceed the cache length)."""
    model = tiny_models["llama"]
    plain = [s.token_ids for s in ring_run(model, three_workers[:1], "off", ["ab"], n_tokens=3).samples]
    result = ring_run(model, three_workers[:1], {"method": "ngram", "max_draft": 32}, ["ab"], n_tokens=3)
    assert [s.token_ids for s in result.samples] == plain and len(plain[0]) == 3


def test_smollm2_int4_ring_with_ngram_speculation_gives_the_plain_tokens(smollm2_dir, three_workers):
    prompt = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
              "Here is the same code again:\n")
    plain = ring_run(smollm2_dir, three_workers[:2], "off", [prompt], n_tokens=48)
    spec = ring_run(smollm2_dir, three_workers[:2], "ngram", [prompt], n_tokens=48)
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]
    record = spec.metrics()["nodes"][0]["speculation"]
    assert record["accepted"] > 0, record
    costs = record["pass_costs"]  # what k was chosen by, measured on the starter's chunk at start
    assert len(costs) == 9 and costs[0] == 1.0 and costs == sorted(costs)


def test_a_killed_worker_s_replay_keeps_the_tokens(tiny_models):
    model = tiny_models["llama"]
    prompts = PROMPTS[:2]
    for workers in worker_pool(3):
        board1, board2, spare = workers
        plain = [s.token_ids for s in ring_run(model, [board1, board2], "off", prompts, n_tokens=60,
                                               spares=[spare]).samples]
        kill_at, count = random.Random().randint(10, 90), [0]

        def on_token(sample, token):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(board1.proc.pid, signal.SIGKILL)
        factory = lambda s: OracleDrafter(s.prompt_ids, len(s.prompt_ids), plain[s.index], 0.7, seed=s.index,
                                          vocab=len(CHARS))
        result = ring_run(model, [board1, board2], "ngram", prompts, n_tokens=60, spares=[spare],
                          on_token=on_token, factory=factory)
        assert [s.token_ids for s in result.samples] == plain, "killed at token %d" % kill_at
        assert len(result.extra["recoveries"]) == 1


# --- bad input: one line, before any weight moves --------------------------------------------

@pytest.mark.parametrize("raw, message", [
    ("lookahead", "method: expected one of off, ngram, draft, got 'lookahead'"),
    ({"method": "ngram", "max_draft": 0}, "max_draft: expected an integer in [1, 32], got 0"),
    ({"method": "ngram", "max_draft": 99}, "max_draft: expected an integer in [1, 32], got 99"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "expected 1 <= ngram_min <= ngram_max <= 16"),
    ({"method": "ngram", "draft": "x"}, "unknown key 'draft'"),
    ({"method": "ngram", "fill": "yes"}, "fill"),
    ({"max_draft": 4}, "method: needed beside max_draft (off, ngram or draft)"),  # had turned speculation off
])
def test_bad_speculation_settings_are_refused_in_one_line(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_speculation("ring.yaml: generation.speculation", raw)
    assert message in str(e.value) and "\n" not in str(e.value) and "generation.speculation" in str(e.value)


def test_yaml_off_and_on_mean_off_and_ngram():
    assert not parse_speculation("x", False).on and parse_speculation("x", True).method == "ngram"
    assert parse_speculation("x", None).method == "off"


def test_verify_frames_return_every_row_and_epochs_are_checked():
    x = torch.randn(5, 16)
    frame = wire.Frame("verify", 7, [0, 1], [3, 9], [2, 3], x, epochs=[4, 0])
    back = wire.decode(wire.encode(frame), run=7, hidden=16)
    assert back.kind == "verify" and back.epochs == [4, 0] and torch.equal(back.tensor, x)
    header, payload = wire.encode(wire.Frame("verify", 7, [0, 1], [3, 9], [2, 3], x[:2]))
    with pytest.raises(wire.FrameError, match="shape rows 2 do not match"):
        wire.decode([header, bytes(payload)])
    import msgpack
    header, payload = wire.encode(frame)
    bad = msgpack.packb(dict(msgpack.unpackb(header), epoch=[-1, 2]))
    with pytest.raises(wire.FrameError, match="epoch has a value outside"):
        wire.decode([bad, bytes(payload)])


def test_verification_rows_attend_row_by_row_on_a_cpu_and_in_one_call_on_a_gpu(monkeypatch):
    """Row by row buys a CPU exact bits; on a GPU each row's attention is kernel launches of its
    own (a 9-row pass cost 2.2 one-row passes on an H200), so verifications attend in one call
    there. Both ways give a verification the same tokens (the ring tests on a GPU check that)."""
    from mdi.model.row_batch import ROW_WISE_ENV, RowBatch, verifies_row_by_row
    monkeypatch.delenv(ROW_WISE_ENV, raising=False)
    assert verifies_row_by_row(torch.device("cpu")) and verifies_row_by_row(None)
    assert not verifies_row_by_row(torch.device("cuda")) and not verifies_row_by_row(torch.device("cuda:1"))
    assert RowBatch.of([0], [3], [4], torch.device("cpu"), row_wise=True).row_wise
    assert not RowBatch.of([0], [3], [4], torch.device("cpu")).row_wise
    monkeypatch.setenv(ROW_WISE_ENV, "0")
    assert not RowBatch.of([0], [3], [4], torch.device("cpu"), row_wise=True).row_wise
    monkeypatch.setenv(ROW_WISE_ENV, "1")
    assert verifies_row_by_row(torch.device("cuda"))
    # Either way a verification's logits are its rows' decode steps' (bit for bit on the CPU
    # only row by row): greedy tokens with drafts equal the plain run's.
    chunk = tiny_model("llama")
    chunk.allocate_cache(2, 64)
    plain, _ = run_local(chunk, PROMPTS[:1], 24)
    for forced in ("1", "0"):
        monkeypatch.setenv(ROW_WISE_ENV, forced)
        got, pipe = run_local(chunk, PROMPTS[:1], 24, SpeculationSpec("ngram", max_draft=6), oracle(plain, 0.7))
        assert got == plain and pipe.spec_counters.accepted > 0, forced


def test_the_gpu_bench_s_speculation_part_runs_on_a_cpu_with_the_plain_ids(tmp_path):
    """scripts/bench_gpu.py --parts spec (the GPU figures in results/gpu) keeps running: its
    logic check on the CPU, a tiny shape, a ring of 3 real processes, every mode's ids the plain
    ring's (greedy, float32)."""
    out = tmp_path / "bench_gpu.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_gpu.py"), "--device", "cpu", "--quick",
                        "--parts", "spec", "--shapes", "tiny-tied", "--dtype", "float32", "--out", str(out),
                        "--cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (part,) = json.load(open(out))["parts"]["spec"]
    assert part["status"] == "ok" and part["verify_rows"] == "row-wise", part
    modes = part["modes"]
    assert {"plain ring", "one node", "a=0.7 filling", "a=0.7 verify only"} <= set(modes)
    assert all(all(m["ids_equal_plain"]) for m in modes.values() if "ids_equal_plain" in m)
    assert part["pass_costs"][0] == 1.0 and len(part["pass_costs"]) == part["max_draft"] + 1


class _Always:
    """A drafter that always has `n` more guesses (token 7)."""
    def commit(self, tokens):
        pass

    def propose(self, frontier, n):
        return [7] * n


def test_passes_in_flight_write_at_most_rows_ahead_past_the_accepted_tokens():
    """Filling a ring of 8 boards with passes of 33 rows would write 264 rows past a sample's
    accepted tokens: more than a sliding-window layer's ring allows for past what it keeps
    (mdi.model.sliding_cache), whose older positions they overwrite. The passes stop at ROWS_AHEAD."""
    from mdi.model.sliding_cache import ROWS_AHEAD
    from mdi.starter.sample import Sample
    policy = speculation.SpecPolicy(SpeculationSpec("ngram", max_draft=32), n_stages=8,
                                    costs=speculation.PassCosts.linear(0.001, 33))
    state = speculation.SpecState(_Always())
    accepting(state, 0.99)
    state.filling = True
    sample = Sample(0, "", list(range(10)), 1000, None)
    sample.spec = state
    start, tokens = policy.next_pass(sample, 1, True, 4096)
    assert len(tokens) == 33
    while True:
        more = policy.next_pass(sample, 1, False, 4096)
        if more is None:
            break
        start, tokens = more
    assert start + len(tokens) - (sample.window_len - 1) == ROWS_AHEAD  # up to it, not past
