"""The `draft: PATH` drafter (mdi.starter.speculation.draft_model): a model with the target's vocabulary
drafts on the starter with its own KV cache; the ring's output stays the plain run's, greedy or
sampled with the same seed. Another vocabulary is refused in one line before any weight moves,
and a served request can only name the server's own draft model, never a file."""
import os
import random

import pytest
import requests
import torch

from conftest import CHARS, ServeProcess, make_tiny_model, save_test_model, tiny_config, tiny_model, worker_pool
from ringconfigs import parse_run_config, write_run_config
from mdi.model.config import ModelConfig
from mdi.model.ggml import lib as ggml_lib
from mdi.model.sampling import SamplingParams, sample_generator
from mdi.model.source import ModelSource
from mdi.model.tokenizers import char_tokenizer, load_tokenizer
from mdi.model.transformer import full_model
from mdi.ring.transport import LocalLoop
from mdi.runconfig import ConfigError, SpeculationSpec, parse_speculation
from mdi.serving.validation import COMPLETIONS, ApiError, validate
from mdi.starter import batch, speculation
from mdi.starter.pipeline import Pipeline
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.planning import run_plan
from mdi.starter.planning.preflight import preflight
from mdi.starter.sample import Sample
from mdi.starter.speculation import draft_model
from mdi.starter.speculation.draft_model import DraftModel, ModelDrafter, vocabulary_difference

PROMPTS = ["The quick brown fox jumps", "abcabcabcabc", "To be, or not to be, that is", "x"]


# --- settings -----------------------------------------------------------------------------------

def test_draft_settings_name_a_path_in_a_run_and_never_in_a_request():
    assert parse_speculation("x", "draft:models/d", paths=True).draft == "models/d"
    spec = parse_speculation("x", {"draft": "models/d", "quant": "int4", "max_draft": 4}, paths=True)
    assert (spec.method, spec.draft, spec.quant, spec.max_draft) == ("draft", "models/d", "int4", 4)
    with pytest.raises(ConfigError, match=r"x.draft: method draft needs the draft model's path"):
        parse_speculation("x", "draft", paths=True)
    with pytest.raises(ConfigError, match="quant: expected one of"):
        parse_speculation("x", {"draft": "d", "quant": "int3"}, paths=True)
    # a request: "draft" is the server's own draft model; a path (or a quantization) is refused
    assert parse_speculation("speculation", "draft").method == "draft"
    for body in ({"draft": "/etc/passwd"}, "draft:/etc/passwd", {"method": "draft", "quant": "int8"}):
        with pytest.raises(ConfigError) as e:
            parse_speculation("speculation", body)
        assert "a request cannot name a draft model's file" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ApiError) as api:
            validate({"prompt": "a", "speculation": body}, COMPLETIONS)
        assert api.value.status == 400 and "cannot name a draft model" in str(api.value)
    assert validate({"prompt": "a", "speculation": "draft"}, COMPLETIONS)["speculation"].method == "draft"


def test_vocabularies_are_compared_token_by_token():
    chars = list(CHARS)
    assert vocabulary_difference(char_tokenizer(chars), char_tokenizer(list(chars))) is None
    other = list(chars)
    other[7] = "\u00e9"
    assert vocabulary_difference(char_tokenizer(chars), char_tokenizer(other)) == \
        "token 7 is %r for the target, %r for the draft" % (chars[7], "\u00e9")
    assert vocabulary_difference(char_tokenizer(chars), char_tokenizer(chars[:50])) == \
        "the target's tokenizer has %d tokens, the draft's 50" % len(chars)


# --- exactness on one node, passes in flight as in a ring ----------------------------------------

def run_local(chunk, prompts, n_tokens, draft=None, params=SamplingParams(0.0), n_stages=3, max_batch=1,
              context_shift=False, seed=3, max_draft=6):
    """Samples on a LocalLoop whose policy believes in `n_stages` boards; `draft` (a full model
    with a cache of the target's slots) drafts for every sample."""
    samples = [Sample(i, p, [CHARS.index(c) for c in p], n_tokens, sample_generator(seed, i))
               for i, p in enumerate(prompts)]
    spec = parse_speculation("t", {"method": "ngram", "max_draft": max_draft}) if draft is not None else None
    factory = None
    if draft is not None:
        model = DraftModel(draft, prefill_chunk=8)
        factory = lambda s: ModelDrafter(model, s)  # noqa: E731
    settings = PipelineSettings(max_batch=max_batch, prefill_chunk=8, context_shift=context_shift,
                                speculation=spec or SpeculationSpec(), n_stages=n_stages)
    # rows are free here: draft as much as the acceptance pays for
    pipe = Pipeline(chunk, LocalLoop(), 1, params, None, settings, drafter_factory=factory,
                    pass_costs=speculation.PassCosts.linear(0.0, 9))
    with torch.no_grad():
        pipe.run(samples)
    return [s.token_ids for s in samples], pipe


def draft_of(family, seed, n_slots, max_len):
    model = tiny_model(family, seed)
    model.allocate_cache(n_slots, max_len)
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_draft_model_gives_the_plain_greedy_tokens_batched_or_not(family, quick_ways):
    chunk = tiny_model(family)
    chunk.allocate_cache(4, 128)
    for n in (1, 2, 4):
        prompts = PROMPTS[:n]
        plain, _ = run_local(chunk, prompts, 40, n_stages=max(3, n), max_batch=n)
        for seed, n_stages, what in ((0, max(3, n), "itself, filling"), (0, n, "itself, verify only"),
                                     (5, max(3, n), "another model")):
            got, pipe = run_local(chunk, prompts, 40, draft_of(family, seed, 4, 128), n_stages=n_stages, max_batch=n)
            assert got == plain, (n, what)
            c = pipe.spec_counters
            assert c.drafted > 0, (n, what)
            if seed == 0:  # the same weights, the same greedy tokens: every draft is right
                assert c.accepted == c.drafted, (n, what, c)
            else:
                assert c.accepted < c.drafted, (n, what, c)


def test_a_draft_model_follows_rejections_and_context_shifts(quick_ways):
    """A draft model of other weights is right now and then; the window shifts past the slot's
    end several times; hundreds of tokens, each the plain run's, and the draft's slot is freed."""
    chunk = tiny_model("llama")
    chunk.allocate_cache(2, 64)
    plain, _ = run_local(chunk, ["The cat"], 300, n_stages=3, context_shift=True)
    draft = draft_of("llama", 0, 2, 64)
    with torch.no_grad():  # nudge its weights: mostly right, sometimes wrong
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    got, pipe = run_local(chunk, ["The cat"], 300, draft, n_stages=3, context_shift=True)
    assert got == plain
    c = pipe.spec_counters
    assert pipe.context_shifts > 3 and 0 < c.accepted < c.drafted, c


def test_sampled_tokens_with_a_draft_model_are_the_plain_run_s_with_the_same_seed(quick_ways):
    chunk = tiny_model("llama")
    chunk.allocate_cache(4, 128)
    params = SamplingParams(0.8, None, 0.95)
    plain, _ = run_local(chunk, PROMPTS[:3], 40, params=params, max_batch=3)
    first, _ = run_local(chunk, PROMPTS[:3], 40, draft_of("llama", 0, 4, 128), params=params, max_batch=3)
    again, pipe = run_local(chunk, PROMPTS[:3], 40, draft_of("llama", 0, 4, 128), params=params, max_batch=3)
    assert first == again == plain
    assert pipe.spec_counters.accepted > 0


def test_a_draft_slot_is_rolled_back_to_the_accepted_tokens():
    """After a rejection the slot feeds from the first differing position only, and what it
    then drafts is what a fresh slot drafts for the same tokens."""
    draft = draft_of("llama", 1, 2, 64)
    model = DraftModel(draft, prefill_chunk=4)
    rng = random.Random(0)
    tokens = [rng.randrange(len(CHARS)) for _ in range(20)]
    fed = []
    feed = model._feed
    model._feed = lambda slot, start, toks: fed.append((start, len(toks))) or feed(slot, start, toks)
    first = model.propose(0, 1, tokens, 5)
    wrong = tokens[:12] + [(tokens[12] + 1) % len(CHARS)]
    fed.clear()
    after = model.propose(0, 1, wrong, 3)
    assert fed[0] == (12, 1)  # only the differing token: positions 12.. are overwritten
    assert after == model.propose(1, 2, wrong, 3)  # a fresh slot agrees
    assert first == model.propose(1, 3, tokens, 5)
    model.release(0, 1)
    assert 0 not in model.held


# --- real models: refusals, SmolLM2 drafting for itself, a ring ------------------------------------

@pytest.fixture(scope="module")
def smollm2_vocab_llama(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer: a draft that is rarely right."""
    path = str(tmp_path_factory.mktemp("draft") / "tiny-smol")
    torch.manual_seed(0)
    config = ModelConfig(name="tiny-smol-vocab", family="llama", vocab_size=ModelSource(smollm2_dir).config.vocab_size,
                         n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=128, block_size=2048,
                         tied_head=True)
    net = full_model(config)
    save_test_model(path, config, net.state_dict(), "tests/test_speculation_draft.py")
    load_tokenizer(smollm2_dir).save(path)
    return path


@pytest.fixture(scope="module")
def three_workers():
    yield from worker_pool(3)


def ring_run(model, workers, spec, prompts, n_tokens=24, generation=None, quant=None, backend=None):
    g = dict(generation or {})
    g["speculation"] = spec
    runtime = {"threads": 1, "heartbeat_interval": 0.2, "ring_timeout": 30}
    if backend is not None:
        runtime["backend"] = backend
    cfg = parse_run_config(model, workers, "spec", n_tokens=n_tokens, generation=g, quant=quant, runtime=runtime)
    return batch.run(cfg, prompts)


def test_a_draft_model_of_another_vocabulary_is_refused_before_any_weight_moves(smollm2_dir, tiny_models,
                                                                              monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("a weight was loaded before the vocabulary was checked")
    monkeypatch.setattr(ModelSource, "load_chunk", no_weights)
    shakespeare = os.path.join(os.path.dirname(smollm2_dir), "nanogpt-shakespeare")
    for draft, difference in ((shakespeare, "the target's tokenizer has 49152 tokens, the draft's %d"
                               % load_tokenizer(shakespeare).vocab_size),
                              (tiny_models["gpt2"], "the target's tokenizer has 49152 tokens, the draft's %d"
                               % len(CHARS))):
        with pytest.raises(ConfigError) as e:
            ring_run(smollm2_dir, [], {"draft": draft}, ["Hello"])
        message = str(e.value)
        assert "\n" not in message and difference in message and "has another vocabulary" in message, message


def test_a_draft_vocabulary_that_differs_in_one_token_is_refused(tiny_models, tmp_path):
    other = str(tmp_path / "other")
    make_tiny_model(other, "llama")
    chars = list(CHARS)
    chars[10] = "\u00e9"
    char_tokenizer(chars).save(other)
    with pytest.raises(ConfigError) as e:
        ring_run(tiny_models["llama"], [], {"draft": other}, ["Hello"])
    assert "token 10 is %r for the target, %r for the draft" % (CHARS[10], "\u00e9") in str(e.value)


def test_a_target_whose_head_is_padded_past_the_tokenizer_takes_a_draft_of_the_tokenizer_s_size(tiny_models, tmp_path):
    """Sizes of one family pad their heads differently (Qwen2.5-0.5B 151936 ids, 7B 152064): a
    draft whose head is smaller names only ids the target has, so it drafts; a larger one is refused."""
    import dataclasses
    padded = str(tmp_path / "padded")
    torch.manual_seed(0)
    model = full_model(dataclasses.replace(tiny_config("llama"), vocab_size=len(CHARS) + 4))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
        model.lm_head.weight[len(CHARS):] = 0  # padding: logit 0, below the best of 96 random ones
    save_test_model(padded, model.config, model.state_dict(), "test")
    char_tokenizer(CHARS).save(padded)
    plain = [s.token_ids for s in ring_run(padded, [], "off", ["Hello"]).samples]
    result = ring_run(padded, [], {"draft": tiny_models["llama"]}, ["Hello"])
    assert [s.token_ids for s in result.samples] == plain
    assert result.metrics()["nodes"][0]["speculation"]["drafted"] > 0
    with pytest.raises(ConfigError) as e:
        ring_run(tiny_models["llama"], [], {"draft": padded}, ["Hello"])
    assert "scores %d ids, the target %d" % (len(CHARS) + 4, len(CHARS)) in str(e.value)


def test_smollm2_drafts_for_itself_int4_for_float32_exactly(smollm2_dir, three_workers, smollm2_vocab_llama):
    """SmolLM2 int4 drafting for SmolLM2 float32 (on 1 node and a ring of 3): the plain tokens,
    most drafts accepted; a random-weights draft of SmolLM2's vocabulary: the plain tokens too."""
    prompt = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
              "Here is the same code again:\n")
    for workers in ([], three_workers[:2]):
        plain = ring_run(smollm2_dir, workers, "off", [prompt])
        spec = ring_run(smollm2_dir, workers, {"draft": smollm2_dir, "quant": "int4"}, [prompt])
        assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples], len(workers)
        record = spec.metrics()["nodes"][0]["speculation"]
        assert record["drafted"] > 0 and record["acceptance_rate"] >= 0.8, record
    poor = ring_run(smollm2_dir, three_workers[:2], {"draft": smollm2_vocab_llama}, [prompt])
    assert [s.token_ids for s in poor.samples] == [s.token_ids for s in plain.samples]


@pytest.mark.skipif(ggml_lib.unavailable_reason() is not None, reason=str(ggml_lib.unavailable_reason()))
def test_on_ggml_the_draft_model_computes_on_ggml_too(smollm2_dir):
    """A starter computing with ggml runs its draft model on ggml, from the draft's GGUF as
    stored (the quant setting does not apply): the plain tokens, and SmolLM2 drafting for itself
    is right on (nearly) every guess, as both compute the same bits in passes of any size."""
    prompt = "def add(a, b):\n    return a + b\n\nHere is the same code again:\n"
    plain = ring_run(smollm2_dir, [], "off", [prompt], backend="ggml")
    spec = ring_run(smollm2_dir, [], {"draft": smollm2_dir, "quant": "int4"}, [prompt], backend="ggml")
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]
    record = spec.metrics()["nodes"][0]["speculation"]
    assert record["draft_backend"] == "ggml", record
    assert record["drafted"] > 0 and record["acceptance_rate"] >= 0.95, record
    on_torch = ring_run(smollm2_dir, [], {"draft": smollm2_dir}, [prompt], backend="torch")
    assert on_torch.metrics()["nodes"][0]["speculation"]["draft_backend"] == "torch"


def test_a_ring_of_three_with_a_draft_model_batched(tiny_models, three_workers):
    model = tiny_models["llama"]
    for n in (2, 3):
        plain = [s.token_ids for s in ring_run(model, three_workers[:2], "off", PROMPTS[:n], n_tokens=40).samples]
        result = ring_run(model, three_workers[:2], {"draft": model}, PROMPTS[:n], n_tokens=40)
        assert [s.token_ids for s in result.samples] == plain, n
        record = result.metrics()["nodes"][0]["speculation"]
        assert record["accepted"] > 0, record


def test_a_served_request_drafts_with_the_server_s_draft_model(tiny_models, tmp_path):
    model = tiny_models["llama"]
    # the server loads the draft model; requests that ask for "draft" use it
    path = write_run_config(tmp_path / "serve.yaml", model, runtime={"threads": 1},
                            generation={"speculation": {"draft": model}}, serve={"max_in_flight": 2, "model_name": "tiny"})
    cfg = parse_run_config(model, label="reference", n_tokens=40, runtime={"threads": 1})
    want = batch.run(cfg, ["abcabc"]).texts[0]
    srv = ServeProcess(path)
    try:
        srv.wait_ready()
        for speculation in ("draft", "off"):
            r = requests.post(srv.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "abcabc", "max_tokens": 40, "temperature": 0, "speculation": speculation})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        r = requests.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "abc", "speculation": {"draft": "/etc/passwd"}})
        assert r.status_code == 400 and "cannot name a draft model's file" in r.text
        metrics = requests.get(srv.url + "/metrics", timeout=10).text
        assert "mdi_speculation_accepted_total" in metrics
    finally:
        assert srv.stop() == 0, srv.output()


def test_check_reads_the_draft_once_from_the_run_plan(tiny_models, tmp_path, capsys, monkeypatch):
    """--check refuses a draft of another vocabulary in one line, and counts an accepted one's
    memory from the plan (its vocabulary read once, as the run reads it)."""
    other = str(tmp_path / "other")
    make_tiny_model(other, "llama")
    chars = list(CHARS)
    chars[3] = "\u00e9"
    char_tokenizer(chars).save(other)
    model = tiny_models["llama"]
    refused = parse_run_config(model, [], "spec", generation={"speculation": {"draft": other}})
    assert preflight(refused) == 1
    out = capsys.readouterr().out
    assert "plan: REFUSED: spec: generation.speculation.draft: %s has another vocabulary" % other in out, out
    opened = []
    real = draft_model.open_draft
    monkeypatch.setattr(run_plan, "open_draft", lambda *a, **k: opened.append(1) or real(*a, **k))
    accepted = parse_run_config(model, [], "spec", generation={"speculation": {"draft": model}})
    assert preflight(accepted) == 0
    out = capsys.readouterr().out
    assert "draft model %s" % model in out and "counted in the starter's need" in out, out
    assert len(opened) == 1


def test_a_config_s_draft_is_found_as_its_model_is_from_any_directory(tmp_path, tiny_models, monkeypatch):
    """`configs/x.yaml` naming `models/...` found its model from anywhere, but its draft only from
    the project's folder: "generation.speculation.draft: models/... does not exist"."""
    from mdi.runconfig import load_config
    (tmp_path / "proj" / "configs").mkdir(parents=True)
    (tmp_path / "proj" / "models").symlink_to(os.path.dirname(tiny_models["llama"]))
    config = tmp_path / "proj" / "configs" / "d.yaml"
    config.write_text("model: {path: models/llama}\ngeneration: {speculation: {draft: models/llama}}\n")
    monkeypatch.chdir(tmp_path)  # neither the project's folder nor its configs/
    cfg = load_config(str(config))
    assert cfg.generation.speculation.draft == cfg.model.path and os.path.isdir(cfg.model.path), cfg.model.path
