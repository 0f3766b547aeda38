"""Generation past the model's context: a sample stops there and says so (finish_reason
"context", one line on stderr), or with generation.context_shift keeps its prompt (up to half the
context), drops the older half of the rest and goes on, each later token being what the model
gives on the shorter window."""
import os
import subprocess

import torch

from conftest import BIN
from ringconfigs import parse_run_config
from mdi.model.source import ModelSource
from mdi.starter import batch

PROMPT = "To be, or not to be"  # 19 characters: 109 positions left of the tiny models' 128


def config(model, n_tokens, shift, workers=()):
    """One node, or with workers the starter, w1, w2 holding 2 + 1 + 1 layers."""
    return parse_run_config(model, workers[:2], layers=[2, 1, 1] if workers else None, n_tokens=n_tokens,
                            generation={"context_shift": shift}, runtime={"ring_timeout": 20})


def test_a_sample_stops_at_the_context_and_says_why(tiny_models):
    result = batch.run(config(tiny_models["gpt2"], 300, False), [PROMPT, "Hi"])
    for sample in result.samples:
        assert sample.finish_reason == "context"
        assert len(sample.prompt_ids) + len(sample.token_ids) == 128 + 1  # the last token is never fed
    assert result.metrics()["samples"][0]["finish_reason"] == "context"
    # within the budget nothing changes
    short = batch.run(config(tiny_models["gpt2"], 20, False), [PROMPT])
    assert short.samples[0].finish_reason == "length" and len(short.samples[0].token_ids) == 20


def test_the_cli_says_it_in_one_line(tiny_models, tmp_path):
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--model", tiny_models["llama"], "--prompt", PROMPT,
                           "--n-tokens", "300", "--temperature", "0", "--threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "context" in line]
    assert len(lines) == 1 and "asked for 300 new tokens, got 110" in lines[0] and "context_shift" in lines[0]
    assert "(110 tokens, context)" in proc.stdout


@torch.no_grad()
def test_context_shift_goes_on_with_the_later_half(tiny_models):
    model = tiny_models["llama"]
    result = batch.run(config(model, 300, True), [PROMPT])
    sample = result.samples[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 300
    assert len(sample.shifts) >= 2 and result.extra["context_shifts"] == len(sample.shifts)
    # After the last shift each token is the model's greedy choice on the window it had.
    source = ModelSource(model)
    full = source.load_chunk(0, source.config.n_layer, True, True, torch.float32, "cpu")
    _assert_greedy_on_its_window(full, sample, 300)
    assert sample.keep == len(sample.prompt_ids)  # a short prompt stays whole


def _assert_greedy_on_its_window(full, sample, n_tokens):
    """After the last shift each token is the model's greedy choice on the window it had: the
    first `keep` tokens of prompt + generated, then those after `dropped` more."""
    last = sample.shifts[-1]
    for k in range(last, min(last + 4, n_tokens)):
        history = sample.prompt_ids + sample.token_ids[:k]
        window = history[:sample.keep] + history[sample.keep + sample.dropped:]
        assert len(window) <= 128 and window == sample.window_tokens(0, len(window))
        logits = full.forward_batch(torch.tensor([window]))[0, -1]
        assert int(logits.argmax()) == sample.token_ids[k], k


@torch.no_grad()
def test_a_prompt_that_nearly_fills_the_context_is_shifted_too(tiny_models):
    """A prompt of 120 of the 128 positions: keeping all of it, each shift freed a token or two
    and prefilled the whole window again (h33: 10 shifts for 12 tokens). Its head (half the
    context) is kept and the older half of the rest dropped, so each shift frees a quarter."""
    model = tiny_models["llama"]
    prompt = (PROMPT + " ") * 6
    result = batch.run(config(model, 60, True), [prompt])
    sample = result.samples[0]
    assert len(sample.prompt_ids) >= 115 and sample.finish_reason == "length" and len(sample.token_ids) == 60
    assert sample.keep == 64 and 1 <= len(sample.shifts) <= 3, sample.shifts
    source = ModelSource(model)
    _assert_greedy_on_its_window(source.load_chunk(0, source.config.n_layer, True, True, torch.float32, "cpu"),
                                 sample, 60)
    # after a shift that dropped prompt tokens, the window's prompt part is shorter than the prompt:
    # passes are cut, decode frames told and drafts made by that (ggml had cut a pass past the window)
    assert sample.window_prompt_len < len(sample.prompt_ids)
    cfg = parse_run_config(model, [], n_tokens=60, generation={"context_shift": True, "temperature": 0,
                                                               "speculation": "ngram"})
    drafted = batch.run(cfg, [prompt])
    assert drafted.samples[0].token_ids == sample.token_ids


def test_context_shift_over_a_ring_gives_the_one_node_ids(tiny_models, workers):
    alone = batch.run(config(tiny_models["llama"], 260, True), [PROMPT, "abc"])
    ring = batch.run(config(tiny_models["llama"], 260, True, workers=workers), [PROMPT, "abc"])
    assert [s.token_ids for s in ring.samples] == [s.token_ids for s in alone.samples]
    assert all(s.shifts for s in ring.samples)


def test_every_end_of_generation_id_ends_a_sample(tiny_models, tmp_path):
    """A tokenizer's stop ids (generation_config.json's list, a GGUF's eot/eom) end a sample as
    EOS does: the first id a greedy run of the tiny model would produce is made a stop id."""
    import shutil
    from mdi.model.tokenizers import load_tokenizer
    model = str(tmp_path / "model")
    shutil.copytree(tiny_models["llama"], model)
    free = batch.run(config(model, 12, False), [PROMPT]).samples[0]
    tok = load_tokenizer(model)
    stop = free.token_ids[3]
    tok.stop_ids = [stop]
    tok.save(model)
    assert load_tokenizer(model).end_ids[-1] == stop
    sample = batch.run(config(model, 12, False), [PROMPT]).samples[0]
    assert sample.finish_reason == "eos" and sample.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
