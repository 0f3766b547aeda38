"""Sampling stays well defined for every accepted setting, and one sample whose logits go bad
fails alone (the hardening issue's HIGH item: a tiny temperature used to turn a shared step
into NaN and fail every request in it)."""
import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import BIN, tiny_config
from mdi.model.sampling import SamplingError, SamplingParams, sample_generator, sample_next
from mdi.model.transformer import full_model
from mdi.ring.transport import LocalLoop
from mdi.starter.pipeline import Pipeline
from mdi.starter.sample import make_samples

TINY = [1e-45, 1e-40, 1e-38, 1e-30, 1e-8]


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_behave_as_greedy(temperature):
    gen = sample_generator(3, 0)
    for seed in range(20):
        logits = torch.randn(500, generator=torch.Generator().manual_seed(seed)) * 8
        assert sample_next(logits, SamplingParams(temperature), gen) == int(logits.argmax())
        # with the other filters at their extremes too
        params = SamplingParams(temperature, top_k=1, top_p=1e-45)
        assert sample_next(logits, params, gen) == int(logits.argmax())


def test_extreme_filters_keep_the_best_token():
    gen = sample_generator(1, 0)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5))
    best = int(logits.argmax())
    # (a top_p under float32's least value, 1.4e-45, rounded to 0 and kept no token: the draw
    # raised and a server failed every request on its ring)
    tiny_p = [SamplingParams(t, top_p=p) for t in (1.0, 1e-40) for p in (1e-45, 1e-46, 1e-300, 5e-324)]
    for params in tiny_p + [SamplingParams(1.0, top_k=1), SamplingParams(1e30, top_k=1)]:
        assert all(sample_next(logits, params, gen) == best for _ in range(20))
    # a huge temperature is a valid (near uniform) distribution, not NaN
    assert 0 <= sample_next(logits, SamplingParams(1e300), gen) < 300


def _nucleus_by_sorting(probs, top_p):
    """The top-p rule written the plain way (a full sort), as the reference."""
    values, order = torch.sort(probs, descending=True)
    drop = (values.cumsum(0) - values) >= top_p
    return torch.zeros_like(drop).scatter(0, order, drop).numpy()


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.999, 0.99999])
@pytest.mark.parametrize("sharpness", [0.5, 3.0, 12.0])
def test_nucleus_keeps_what_a_full_sort_keeps(top_p, sharpness):
    # flat and peaked distributions over a vocabulary bigger than the first candidates looked
    # at, so the search has to widen (sharpness 0.5 and top_p near 1: most of the vocabulary)
    from mdi.model.sampling import _nucleus
    for seed in range(5):
        probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * sharpness, 0)
        kept = _nucleus(probs.numpy(), top_p) > 0
        assert (kept == ~_nucleus_by_sorting(probs, top_p)).all()
        assert kept.any()


def test_draws_follow_the_distribution_and_skip_impossible_tokens():
    logits = torch.tensor([2.0, -1e4, 1.0, 0.0, -1.0, -1e4])  # -1e4: probability exactly 0 in float32
    probs = torch.softmax(logits, 0)
    assert probs[1] == 0 and probs[5] == 0
    gen = sample_generator(7, 0)
    draws = [sample_next(logits, SamplingParams(1.0), gen) for _ in range(20000)]
    counts = torch.bincount(torch.tensor(draws), minlength=6).double() / len(draws)
    assert counts[1] == 0 and counts[5] == 0
    assert torch.allclose(counts, probs.double(), atol=0.015)
    # top-p 0.8 keeps the two best (0.665 + 0.245 of the mass): nothing else is ever drawn
    draws = [sample_next(torch.tensor([2.0, 1.0, 0.0, -1.0]), SamplingParams(1.0, top_p=0.8), gen)
             for _ in range(5000)]
    assert set(draws) == {0, 1}


def test_same_seed_same_draws():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 4
    for params in (SamplingParams(0.8), SamplingParams(1.0, top_k=40), SamplingParams(0.7, top_p=0.9)):
        a, b = sample_generator(5, 2), sample_generator(5, 2)
        draws = [[sample_next(logits, params, g) for _ in range(30)] for g in (a, b)]
        assert draws[0] == draws[1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_settings_are_refused(bad):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(bad)
    if bad != -1.0:
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(1.0, top_p=bad)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_non_finite_logits_raise_a_sampling_error(temperature):
    logits = torch.tensor([0.1, float("nan"), 0.3])
    with pytest.raises(SamplingError, match="non-finite logits"):
        sample_next(logits, SamplingParams(temperature), sample_generator(0, 0))


def _generate(poison_call=None):
    """Three samples through one pipeline on a local loop; the head's output for its
    `poison_call`-th call (counting from 0) is replaced by NaN."""
    torch.manual_seed(0)
    chunk = full_model(tiny_config("llama"))
    with torch.no_grad():
        for p in chunk.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    head, calls = chunk.head, [0]

    def head_with_fault(x):
        out = head(x)
        calls[0] += 1
        return out.fill_(float("nan")) if calls[0] - 1 == poison_call else out

    chunk.head = head_with_fault
    chunk.allocate_cache(3, 64)
    samples = make_samples(["a", "b", "c"], [[3, 4, 5], [6, 7], [8]], 12, seed=1)
    Pipeline(chunk, LocalLoop(), 0, SamplingParams(temperature=0.8, top_k=20), eos_id=None).run(samples)
    return samples


def test_a_sample_with_bad_logits_fails_alone():
    clean = _generate()
    assert all(s.finish_reason == "length" and len(s.token_ids) == 12 for s in clean)
    hurt = _generate(poison_call=7)  # mid-run, while all three are in flight
    failed = [s for s in hurt if s.finish_reason == "error"]
    assert len(failed) == 1 and "non-finite logits" in failed[0].error
    for before, after in zip(clean, hurt):
        if after is failed[0]:
            # it keeps the tokens it had; nothing after the fault
            assert after.token_ids == before.token_ids[:len(after.token_ids)] and len(after.token_ids) < 12
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"


def test_a_fault_in_one_samples_draw_fails_that_sample_alone(monkeypatch):
    """Only SamplingError was caught around a draw: any other fault for one request's settings
    (a top_p that kept no token raised numpy's ValueError) failed the ring and every request on it."""
    import mdi.starter.sample as sample_module
    clean = _generate()
    real_draw = sample_module.draw

    def draw_with_fault(logits, params, rng, token_ids, prompt_ids, *rest):
        if list(prompt_ids) == [6, 7] and len(token_ids) == 4:
            raise ValueError("zero-size array to reduction operation maximum which has no identity")
        return real_draw(logits, params, rng, token_ids, prompt_ids, *rest)

    monkeypatch.setattr(sample_module, "draw", draw_with_fault)
    hurt = _generate()
    assert [s.finish_reason for s in hurt] == ["length", "error", "length"]
    assert "could not be drawn (ValueError: zero-size array" in hurt[1].error
    assert hurt[1].token_ids == clean[1].token_ids[:4]
    assert [s.token_ids for s in hurt[::2]] == [s.token_ids for s in clean[::2]]


def test_batch_run_with_a_tiny_temperature_matches_greedy(tmp_path, tiny_models):
    def run(temperature):
        out = tmp_path / ("m-%s.json" % temperature)
        cfg = tmp_path / "c.yaml"
        cfg.write_text("model: {path: %s}\ngeneration: {n_tokens: 8, seed: 3}\n" % tiny_models["gpt2"])
        proc = subprocess.run([BIN + "/mdi-start", "--config", str(cfg), "--prompt", "Once", "--temperature",
                               temperature, "--metrics-out", str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(out.read_text())["samples"][0]["token_ids"]

    assert run("1e-40") == run("0")


def test_a_batch_run_whose_samples_failed_says_so_and_exits_1(tmp_path):
    """Every sample ended in error (non-finite logits) and mdi-start still exited 0: the texts so
    far and the record are kept, and the run's exit says it failed, in one line."""
    from conftest import CHARS, save_test_model, tiny_model
    from mdi.model.tokenizers import char_tokenizer
    model = tiny_model("llama")
    state = model.state_dict()
    state["norm_f.weight"] = torch.full_like(state["norm_f.weight"], float("nan"))  # the final norm: every logit
    path = str(tmp_path / "nan-model")
    save_test_model(path, model.config, state, "tests/test_sampling.py")
    char_tokenizer(CHARS).save(path)
    out = tmp_path / "m.json"
    proc = subprocess.run([BIN + "/mdi-start", "--model", path, "--prompt", "Once", "--prompt", "Up", "--n-tokens",
                           "4", "--metrics-out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mdi: error: 2 of 2 samples failed (sample 0: the model produced non-finite logits"), last
    assert "--- sample 1 (0 tokens, error) ---" in proc.stdout and "mdi: 0 tokens" in proc.stdout, proc.stdout
    assert [s["finish_reason"] for s in json.loads(out.read_text())["samples"]] == ["error", "error"]


def test_yaml_nan_temperature_is_a_config_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: x}\ngeneration: {temperature: .nan}\n")
    proc = subprocess.run([BIN + "/mdi-start", "--config", str(cfg), "--prompt", "x"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert proc.returncode == 2 and "generation.temperature" in proc.stderr, proc.stderr
    assert math.isnan(float("nan")) and sys.executable
