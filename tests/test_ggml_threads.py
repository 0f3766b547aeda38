"""A row's bits on a ggml CPU node do not depend on the node's threads, its cache slots' length or
the size of the pass that carries the row. ggml's CPU flash attention splits a lone query row's
positions (from 512 attended) across the threads and merges their partial sums, which gave a
decode step other logits at 2 threads than at 1 (0.6 on SmolLM2, 2.3 on Gemma 3), other logits
in a longer cache, and other logits than the same row verified in a pass of several rows:
greedy text then hung on `--threads`, on `--n-tokens` and on speculation.
(mdi.model.ggml.graph.GraphBuilder._attention_views)"""
import numpy as np
import pytest

from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.source import ModelSource

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

PROMPT_ROWS = 296  # the rows after it attend to 512 positions, where ggml's split starts
ROWS = 3  # decode steps compared (a verification pass of 3 rows: Q4_K re-laid multiplies 4+ otherwise)


def _text_ids(tokenizer, n):
    words = ("the ring of boards keeps one cache slot per sample and every board works on another "
             "sample at each step, so adding boards adds throughput as well as memory; ").split()
    text, k = [], 0
    while len(tokenizer.encode(" ".join(text))) < n + ROWS:
        text.append(words[k % len(words)] + str(k % 7))
        k += 1
    return tokenizer.encode(" ".join(text))[:n + ROWS]


def _logits(source, ids, threads, cache_len, rows_per_pass):
    """Logits of the ROWS rows after the prompt, in passes of `rows_per_pass` rows, on a whole
    model's chunk with `threads` threads and one slot of `cache_len` positions."""
    chunk = source.ggml_chunk(0, source.config.n_layer, True, True, threads=threads)
    chunk.allocate_cache(1, cache_len)
    chunk.forward_rows(chunk.embed_rows(np.array(ids[:PROMPT_ROWS], np.int32), None),
                       PassRows([0], [0], [PROMPT_ROWS]))
    out = []
    for at in range(PROMPT_ROWS, PROMPT_ROWS + ROWS, rows_per_pass):
        y = chunk.forward_rows(chunk.embed_rows(np.array(ids[at:at + rows_per_pass], np.int32), None),
                               PassRows([0], [at], [rows_per_pass]))
        out += [chunk.head(y[k:k + 1])[0] for k in range(rows_per_pass)]
    chunk.close()
    return np.stack(out)


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request, smollm2_dir):
    """SmolLM2 (9 query heads over 3 KV heads) and Gemma 3 (4 over one)."""
    if request.param == "smollm2":
        return ModelSource(smollm2_dir)
    return ModelSource(request.getfixturevalue("gemma3_gguf"))


def test_a_decode_row_has_the_same_bits_at_any_thread_count_cache_length_and_pass_size(model):
    ids = _text_ids(model.tokenizer, PROMPT_ROWS)
    one_thread = _logits(model, ids, 1, 1024, 1)
    assert np.isfinite(one_thread).all()
    assert np.array_equal(_logits(model, ids, 2, 1024, 1), one_thread)  # split across 2 threads before
    assert np.array_equal(_logits(model, ids, 2, PROMPT_ROWS + ROWS + 5, 1), one_thread)  # a shorter slot
    assert np.array_equal(_logits(model, ids, 2, 1024, ROWS), one_thread)  # verified in one pass
