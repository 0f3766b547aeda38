"""The sampling fields requests send (penalties, logit_bias, min_p) and the log-probabilities
of drawn tokens, against references written out by hand on small vocabularies; and their
exactness with speculative decoding (each verified token is the plain run's draw)."""
import math

import pytest
import torch

from conftest import tiny_model
from mdi.model.sampling import SamplingError, SamplingParams, draw, sample_generator, sample_next
from mdi.runconfig import SpeculationSpec
from mdi.starter import speculation

LOGITS = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0, -0.5])


def adjusted(params, generated=(), prompt=()):
    """The logits after bias and penalties, read back through greedy logprobs: log-softmax of
    what was drawn from, up to a constant (temperature 1)."""
    d = draw(LOGITS, params, sample_generator(0, 0), generated, prompt, top_logprobs=LOGITS.numel())
    values = dict(d.logprobs.top)
    return torch.tensor([values[i] for i in range(LOGITS.numel())])


def log_softmax(x):
    return torch.log_softmax(torch.tensor(x, dtype=torch.float32), 0)


def test_frequency_and_presence_penalties_follow_openai_s_formula():
    # token 1 generated twice, token 2 once: logit - count * frequency - (count > 0) * presence
    params = SamplingParams(0.0, presence_penalty=0.5, frequency_penalty=0.3)
    want = [1.0, 2.0 - 2 * 0.3 - 0.5, -1.0 - 0.3 - 0.5, 0.5, 3.0, -0.5]
    got = adjusted(params, generated=[1, 2, 1], prompt=[3, 4, 4])  # the prompt does not count
    assert torch.allclose(got, log_softmax(want), atol=1e-6)
    # negative values encourage repetition
    want = [1.0, 2.0 + 2 * 1.0 + 2.0, -1.0 + 1.0 + 2.0, 0.5, 3.0, -0.5]
    got = adjusted(SamplingParams(0.0, presence_penalty=-2, frequency_penalty=-1), generated=[1, 2, 1])
    assert torch.allclose(got, log_softmax(want), atol=1e-6)


def test_repeat_penalty_follows_llama_cpp_over_the_last_tokens_of_prompt_and_answer():
    # last 3 of prompt [5, 0] + generated [2, 3, 2] are 2, 3, 2: positive logits divided, negative multiplied
    params = SamplingParams(0.0, repeat_penalty=2.0, repeat_last_n=3)
    want = [1.0, 2.0, -1.0 * 2, 0.5 / 2, 3.0, -0.5]
    assert torch.allclose(adjusted(params, [2, 3, 2], [5, 0]), log_softmax(want), atol=1e-6)
    # a window longer than the answer reaches into the prompt; -1: everything
    params = SamplingParams(0.0, repeat_penalty=2.0, repeat_last_n=4)
    want = [1.0 / 2, 2.0, -1.0 * 2, 0.5 / 2, 3.0, -0.5]
    assert torch.allclose(adjusted(params, [2, 3, 2], [5, 0]), log_softmax(want), atol=1e-6)
    params = SamplingParams(0.0, repeat_penalty=2.0, repeat_last_n=-1)
    want = [1.0 / 2, 2.0, -1.0 * 2, 0.5 / 2, 3.0, -0.5 * 2]
    assert torch.allclose(adjusted(params, [2, 3, 2], [5, 0]), log_softmax(want), atol=1e-6)
    # repeat_last_n 0 turns it off
    assert torch.allclose(adjusted(SamplingParams(0.0, repeat_penalty=2.0, repeat_last_n=0), [2], [5]),
                          log_softmax(LOGITS.tolist()), atol=1e-6)


def test_penalties_change_greedy_choice_as_defined():
    # token 4 (best, 3.0) generated once: presence 1.5 brings it to 1.5 < 2.0, so token 1 wins
    params = SamplingParams(0.0, presence_penalty=1.5)
    assert sample_next(LOGITS, params, sample_generator(0, 0), [4]) == 1
    assert sample_next(LOGITS, params, sample_generator(0, 0), [3]) == 4
    assert sample_next(LOGITS, SamplingParams(0.0, repeat_penalty=1.6), sample_generator(0, 0), [], [4]) == 1


def test_logit_bias_adds_and_minus_100_bans():
    assert torch.allclose(adjusted(SamplingParams(0.0, logit_bias={0: 5.0, 5: -1.5})),
                          log_softmax([6.0, 2.0, -1.0, 0.5, 3.0, -2.0]), atol=1e-6)
    gen = sample_generator(3, 0)
    params = SamplingParams(1.0, logit_bias={4: -100})
    draws = {sample_next(LOGITS, params, gen) for _ in range(3000)}
    assert 4 not in draws and draws == {0, 1, 2, 3, 5}
    assert sample_next(LOGITS, SamplingParams(0.0, logit_bias={4: -100}), gen) == 1
    # +100 makes a token all but certain
    assert {sample_next(LOGITS, SamplingParams(1.0, logit_bias={2: 100}), gen) for _ in range(200)} == {2}
    with pytest.raises(SamplingError, match="bans every token"):
        sample_next(LOGITS, SamplingParams(1.0, logit_bias=dict((i, -100) for i in range(6))), gen)
    with pytest.raises(SamplingError, match="vocabulary"):
        sample_next(LOGITS, SamplingParams(1.0, logit_bias={6: 1.0}), gen)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_keeps_only_tokens_at_least_min_p_times_the_best(temperature, min_p):
    probs = torch.softmax(LOGITS / temperature, 0)
    allowed = {i for i in range(6) if probs[i] >= min_p * probs.max()}
    gen = sample_generator(1, 0)
    draws = [sample_next(LOGITS, SamplingParams(temperature, min_p=min_p), gen) for _ in range(4000)]
    assert set(draws) == allowed
    # among the kept tokens, the draws follow the renormalised probabilities
    kept = torch.tensor([probs[i] if i in allowed else 0.0 for i in range(6)])
    freq = torch.bincount(torch.tensor(draws), minlength=6).double() / len(draws)
    assert torch.allclose(freq, (kept / kept.sum()).double(), atol=0.03)


def test_logprobs_are_the_log_softmax_after_temperature_and_the_draw_is_unchanged():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 3
    for params in (SamplingParams(0.7), SamplingParams(1.2, top_k=20, top_p=0.9), SamplingParams(0.0)):
        a, b = sample_generator(9, 0), sample_generator(9, 0)
        for _ in range(20):
            d = draw(logits, params, a, top_logprobs=5)
            assert d.token == sample_next(logits, params, b)  # asking for logprobs draws nothing more
            want = torch.log_softmax(logits / (params.temperature or 1.0), 0)
            assert abs(d.logprobs.logprob - float(want[d.token])) < 1e-4
            top = torch.topk(want, 5)
            assert [i for i, _ in d.logprobs.top] == top.indices.tolist()
            assert all(abs(v - float(w)) < 1e-4 for (_, v), w in zip(d.logprobs.top, top.values))
            assert sum(math.exp(v) for _, v in d.logprobs.top) <= 1 + 1e-6
            if params.temperature == 0:  # greedy: the chosen token is the best one
                assert d.logprobs.top[0] == (d.token, d.logprobs.logprob)


def test_neutral_values_are_the_defaults_and_draw_the_same_tokens():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(2)) * 4
    plain = SamplingParams(0.8, 40, 0.9)
    neutral = SamplingParams(0.8, 40, 0.9, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                             repeat_penalty=1.0, repeat_last_n=64, logit_bias={})
    assert plain == neutral and not neutral.adjusts
    a, b = sample_generator(5, 0), sample_generator(5, 0)
    assert [sample_next(logits, plain, a) for _ in range(50)] == \
        [sample_next(logits, neutral, b, list(range(30)), [1, 2]) for _ in range(50)]


@pytest.mark.parametrize("kwargs,needle", [
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"), ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias")])
def test_bad_values_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(1.0, **kwargs)


def test_penalised_sampling_with_speculation_gives_the_plain_run_s_tokens(monkeypatch):
    """Penalties depend on the tokens taken so far: a verification draws its rows token by
    token with them, so whatever was guessed, each token is the plain run's draw."""
    from test_speculation import PROMPTS, oracle, run_local
    monkeypatch.setattr(speculation.policy, "MODE_TRIAL", 1)
    chunk = tiny_model("llama")
    chunk.allocate_cache(4, 128)
    for params in (SamplingParams(0.0, frequency_penalty=0.8, presence_penalty=0.4, logit_bias={5: -100}),
                   SamplingParams(0.9, top_p=0.95, min_p=0.05, repeat_penalty=1.3, repeat_last_n=16,
                                  frequency_penalty=0.5)):
        plain, _ = run_local(chunk, PROMPTS[:3], 40, params=params)
        unpenalised, _ = run_local(chunk, PROMPTS[:3], 40, params=SamplingParams(params.temperature, top_p=params.top_p))
        assert plain != unpenalised  # the penalties matter here: the equality below is not a coincidence
        for agree in (0.0, 0.7, 1.0):
            got, pipe = run_local(chunk, PROMPTS[:3], 40, SpeculationSpec("ngram"), oracle(plain, agree),
                                  params=params, n_stages=3, max_batch=3)
            assert got == plain, (params, agree)
            if agree == 1.0:
                assert pipe.spec_counters.accepted > 0
