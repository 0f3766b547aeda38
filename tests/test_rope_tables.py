"""RoPE tables cover the positions a run reaches, not the context a model file claims
(issue 40 item 10: a 2^22-token context_length cost every node 1.2 GB of tables at load for
a 4-token run), and growing them on demand changes no result."""
import dataclasses

import pytest
import torch

from conftest import tiny_config
from mdi.model.rope import RotaryEmbedding
from mdi.model.row_batch import RowBatch
from mdi.model.source import build_chunk
from mdi.model.transformer import ModelChunk, full_model


def chunk_with_context(block_size: int, seed: int = 3) -> ModelChunk:
    config = dataclasses.replace(tiny_config("llama"), block_size=block_size)
    torch.manual_seed(seed)
    model = full_model(dataclasses.replace(config, block_size=128))  # the same weights whatever the context
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return build_chunk(config, model.state_dict(), 0, config.n_layer, True, True, torch.float32, "cpu")


def table_bytes(rope: RotaryEmbedding) -> int:
    return rope.cos.numel() * rope.cos.element_size() + rope.sin_signed.numel() * rope.sin_signed.element_size()


def test_a_huge_claimed_context_costs_nothing_until_a_run_reaches_it():
    chunk = chunk_with_context(1 << 22)  # 2^22 positions x 16 x 4 bytes x 2 tables would be 512 MB
    assert table_bytes(chunk.rope) == 0
    chunk.allocate_cache(2, 8)
    assert 8 <= chunk.rope.cos.shape[0] <= RotaryEmbedding.MIN_POSITIONS
    assert table_bytes(chunk.rope) < 1 << 20


def generate(chunk: ModelChunk, max_len: int, prompt_len: int, steps: int):
    chunk.allocate_cache(1, max_len)
    ids = torch.arange(prompt_len) % chunk.config.vocab_size
    with torch.inference_mode():
        x = chunk.forward_rows(chunk.embed_rows(ids, torch.arange(prompt_len)), RowBatch.of([0], [0], [prompt_len]))
        out = [chunk.head(x[-1:])]
        for pos in range(prompt_len, prompt_len + steps):
            token = out[-1].argmax(-1)
            batch = RowBatch.of([0], [pos], [1])
            out.append(chunk.head(chunk.forward_rows(chunk.embed_rows(token, batch.positions), batch)))
    return torch.cat(out)


def test_tables_grown_on_demand_give_the_same_logits_bit_for_bit():
    # A cache past the first table (256 positions) makes the tables grow; the whole-context
    # tables of a chunk whose context is exactly that long are the reference.
    reference = chunk_with_context(600)
    reference.rope.reserve(600)
    grown = chunk_with_context(1 << 20)
    want = generate(reference, 600, 270, 12)
    got = generate(grown, 600, 270, 12)
    assert torch.equal(want, got)
    assert torch.equal(grown.rope.cos[:600], reference.rope.cos[:600])


def test_a_pass_without_a_cache_grows_the_tables_and_a_position_past_the_context_is_refused():
    rope = RotaryEmbedding(dataclasses.replace(tiny_config("llama"), block_size=1000))
    x = torch.randn(1, 2, 300, rope.inv_freq.shape[0] * 2)
    y = rope(x, 0)
    assert y.shape == x.shape and rope.cos.shape[0] >= 300
    with pytest.raises(ValueError, match="beyond the model's context of 1000"):
        rope(x, 800)


def test_tables_grown_under_inference_mode_serve_a_pass_that_records_gradients():
    rope = RotaryEmbedding(dataclasses.replace(tiny_config("llama"), block_size=1000))
    x = torch.randn(1, 2, 300, rope.inv_freq.shape[0] * 2)
    with torch.inference_mode():
        rope(x, 0)  # the tables first grown here
    w = torch.randn_like(x, requires_grad=True)
    rope(w, 0).sum().backward()  # would raise for inference tensors saved for backward
    assert w.grad is not None
