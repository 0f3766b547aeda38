"""A request's generation options are one frozen value (mdi.starter.generation_options): the
serving Request holds it, its choices share it but for the seed, and the scheduler hands the
very object to the request's Sample, whose fields `Sample.for_options` alone maps from it."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.sampling import SamplingParams, sample_generator
from mdi.runconfig import SpeculationSpec
from mdi.serving.choices import Choices
from mdi.serving.request import Request
from mdi.serving.scheduler import Scheduler
from mdi.starter.generation_options import GenerationOptions
from mdi.starter.sample import Sample
from ringconfigs import parse_run_config

NAMES = ("max_tokens", "params", "seed", "stop", "adapter", "speculation", "top_logprobs", "cache_prompt", "grammar",
         "stop_token_ids", "min_tokens", "ignore_eos", "include_stop_str")


def _options(**changes):
    """Options with every field away from its default, so a mapping that drops one shows."""
    given = dict(max_tokens=7, params=SamplingParams(0.5, 3, 0.9), seed=11, stop=("END", "", "\n\n"), adapter=2,
                 speculation=SpeculationSpec(method="ngram"), top_logprobs=3, cache_prompt=False,
                 grammar=GrammarSpec("regex", "[ab]+", "response_format"), stop_token_ids=(5,), min_tokens=2,
                 ignore_eos=True, include_stop_str=True)
    given.update(changes)
    return GenerationOptions(**given)


def test_the_options_are_one_frozen_value_with_one_name_per_option():
    opts = _options()
    assert tuple(f.name for f in dataclasses.fields(GenerationOptions)) == NAMES
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 3
    assert opts.stop == ("END", "\n\n")  # empty stop strings dropped, once, here
    other = opts.with_seed(12)
    assert other.seed == 12 and other is not opts
    assert dataclasses.replace(other, seed=11) == opts


def test_for_options_maps_every_option():
    opts = _options()
    rng = sample_generator(opts.seed, 0)
    sample = Sample.for_options(4, [1, 2, 3], opts, rng, slot=1, constraint="c")
    assert sample.options is opts
    assert (sample.index, sample.slot, sample.prompt_ids, sample.rng, sample.constraint) == (4, 1, [1, 2, 3], rng, "c")
    assert sample.max_new_tokens == opts.max_tokens
    assert sample.params is opts.params
    assert sample.speculation is opts.speculation
    assert sample.top_logprobs == opts.top_logprobs
    assert sample.reuse_prefix is opts.cache_prompt
    # seed: the rng the caller drew from it; stop: the request's text stream; adapter: set by
    # the engine's prepare_sample (a prompt-tuning adapter's sample runs as the base);
    # grammar: its compiled constraint, this sample's own state
    assert sample.adapter == 0


def test_the_older_constructors_still_work():
    params = SamplingParams(0.7)
    spec = SpeculationSpec(method="ngram")
    sample = Sample(0, "p", [5], 9, torch.Generator(), params=params, adapter=1, speculation=spec,
                    reuse_prefix=False, top_logprobs=2)
    assert (sample.max_new_tokens, sample.params, sample.adapter, sample.speculation, sample.reuse_prefix,
            sample.top_logprobs, sample.options, sample.slot) == (9, params, 1, spec, False, 2, None, 0)
    grammar = GrammarSpec("json_schema", "{}", "response_format")
    req = Request([1, 2], 10, params, 5, ["x", ""], 1, spec, 2, False, grammar)
    assert (req.max_tokens, req.params, req.seed, req.stop, req.adapter, req.speculation, req.top_logprobs,
            req.cache_prompt, req.grammar) == (10, params, 5, ["x"], 1, spec, 2, False, grammar)
    assert req.options == GenerationOptions(10, params, 5, ("x",), 1, spec, 2, False, grammar)
    plain = Request([1], 3, params)
    assert (plain.seed, plain.stop, plain.adapter, plain.cache_prompt, plain.grammar) == (None, [], 0, True, None)
    with pytest.raises(AttributeError):
        req.max_tokens = 3  # read-only: the value is shared with the sample
    with pytest.raises(TypeError):
        Request([1], 3, params, options=_options())


class _Engine:
    """The face's few calls that admitting a request makes."""
    in_flight = 0
    busy_seconds = 0.0

    def __init__(self):
        self.admitted = []

    def free_slots(self):
        return [0, 1, 2]

    def has_adapter(self, adapter):
        return True

    def virtual_tokens(self, adapter):
        return 0

    def prepare_sample(self, sample, adapter):
        sample.adapter = adapter

    def choose_slot(self, sample, free):
        return free[0]

    def admit(self, sample):
        self.admitted.append(sample)


def test_a_served_request_and_its_choices_hand_their_options_to_their_samples():
    cfg = parse_run_config("unused-model-path")
    source = SimpleNamespace(tokenizer=SimpleNamespace(), config=SimpleNamespace(block_size=64), path="x")
    sched = Scheduler(cfg, source)
    sched.engine, sched.slots = _Engine(), 3
    opts = _options(grammar=None, speculation=None)
    choices = Choices(Request([1, 2, 3], options=opts), 3)
    assert choices.requests[0].options is opts
    for i, req in enumerate(choices.requests):
        assert req.options == dataclasses.replace(opts, seed=opts.seed + i)  # differing in the seed alone
        sched._waiting.append(req)
        sched._queued += 1
    sched._admit()
    samples = sched.engine.admitted
    assert [s.options for s in samples] == [r.options for r in choices.requests]
    assert all(s.options is r.options and r.sample is s for s, r in zip(samples, choices.requests))
    assert samples[0].max_new_tokens == 7 and samples[0].reuse_prefix is False and samples[0].adapter == 2
    assert choices.requests[0].text.stops == ["END", "\n\n"]


@pytest.mark.parametrize("backend", ["torch", "ggml"])
def test_a_head_wider_than_the_tokenizer_never_draws_an_id_past_it(tiny_models, tmp_path, backend):
    """A head padded past its tokenizer (Qwen2.5's 151936 rows for 151665 ids) is allowed; an id
    drawn past the tokenizer had failed the decode of every sample of the run (h77)."""
    import shutil
    from conftest import CHARS
    from mdi.model.source import ModelSource
    from mdi.model.tokenizers import char_tokenizer
    from mdi.starter import batch
    model = str(tmp_path / "narrow")
    shutil.copytree(tiny_models["llama"], model)
    char_tokenizer(CHARS[:40]).save(model)  # 40 of the head's ids
    assert ModelSource(model).config.vocab_size > 40
    for temperature in (0.0, 1.5):
        cfg = parse_run_config(model, n_tokens=24, generation={"temperature": temperature, "seed": 3},
                               runtime={"backend": backend})
        result = batch.run(cfg, ["#+", "()"])
        for s in result.samples:
            assert len(s.token_ids) == 24 and max(s.token_ids) < 40, s.token_ids
