"""The prefix cache (mdi.starter.prefix_cache, mdi.model.prefix_store): a prompt that starts like
an earlier one starts after what every node holds of it, and gives the same tokens and logits
as on an empty cache: full and partial hits, entries saved and loaded when slots are reused,
eviction under a small budget, adapters kept apart, a rebuilt ring; on one node and on a ring
of real processes behind --serve; bad settings and frames refused in one line."""
import os
import threading

import pytest
import requests
import torch

from conftest import CHARS, ON_TORCH, ServeProcess, WorkerProcess, free_ports, tiny_model, worker_pool
from ringconfigs import parse_run_config, write_run_config
from mdi.model.prefix_store import CacheOp, PrefixCacheError, PrefixStore, budget_bytes
from mdi.model.sliding_cache import SlidingRing
from mdi.model.sampling import SamplingParams, sample_generator
from mdi.model.source import ModelSource
from mdi.ring import wire
from mdi.ring.transport import LocalLoop
from mdi.runconfig import ConfigError, parse_prefix_cache
from mdi.starter import batch
from mdi.starter.control import NodeError
from mdi.starter.pipeline import Pipeline
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.prefix_cache import PrefixIndex
from mdi.starter.prompt_passes import reusable_positions
from mdi.starter.sample import Sample
from test_adapter_ring import write_peft_lora


def ids(text):
    return [CHARS.index(c) for c in text]


# --- the index: decisions without I/O -------------------------------------------------------

def test_partial_matches_count_to_the_token_and_the_last_token_is_always_computed():
    index = PrefixIndex(1000)
    assert index.admit(0, [1, 2, 3, 4, 5], key=0) == 0
    index.release(0, [1, 2, 3, 4], key=0)  # its last token (5) was never fed
    assert index.admit(0, [1, 2, 3, 9, 9, 9], key=0) == 3  # partial: 3 positions
    index.release(0, [1, 2, 3, 9, 9], key=0)
    assert index.admit(0, [1, 2, 3, 9, 9], key=0) == 4  # all held: the last token goes round for its logits
    index.release(0, [1, 2, 3, 9], key=0)
    assert index.admit(0, [1, 2, 3, 9, 9], key=1) == 0  # another adapter's KV is not ours
    assert index.counters.hits == 2 and index.counters.tokens_reused == 7


def test_a_sample_goes_to_the_slot_holding_most_of_it_else_an_empty_one_else_the_oldest():
    index = PrefixIndex(1000)
    for slot, tokens in ((0, [1, 2, 3]), (1, [1, 2, 3, 4, 5, 6]), (2, [7, 8])):
        index.admit(slot, tokens + [0], key=0)
        index.release(slot, tokens, key=0)
    assert index.choose_slot([0, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7], key=0) == 1
    assert index.choose_slot([0, 1, 2, 3], [9, 9], key=0) == 3  # nothing shared: the empty slot
    assert index.choose_slot([0, 1, 2], [9, 9], key=0) == 0  # none empty: the least recently used
    assert index.choose_slot([0, 1, 2], [1, 2, 3, 4, 5, 6, 7], key=5) == 0  # another key shares nothing


def test_a_slot_overwritten_is_saved_first_then_loaded_back_and_extended_entries_are_superseded():
    index = PrefixIndex(1000)
    index.admit(0, [1, 2, 3, 4, 5], key=0)
    index.release(0, [1, 2, 3, 4], key=0)
    assert index.take_ops() == []  # a slot holds it: no copy yet
    assert index.admit(0, [7, 7, 7], key=0) == 0
    assert index.take_ops() == [CacheOp("save", 1, 0, 4)]
    index.release(0, [7, 7], key=0)
    assert index.admit(0, [1, 2, 3, 4, 5, 6, 7], key=0) == 4  # from entry 1, after saving [7, 7]
    assert index.take_ops() == [CacheOp("save", 2, 0, 2), CacheOp("load", 1, 0, 4)]
    index.release(0, [1, 2, 3, 4, 5, 6], key=0)
    index.admit(0, [8, 8], key=0)
    # [1..6] extends entry 1: that one is dropped as the longer is saved (a conversation keeps one entry)
    assert index.take_ops() == [CacheOp("drop", 1), CacheOp("save", 3, 0, 6)]
    assert sorted(index.entries) == [2, 3]


def test_a_conversation_whose_template_rewrites_answers_keeps_no_entry_a_turn():
    """Gemma 3's template trims each answer (" I" comes back as "I"), so a turn's prompt parts
    from the slot inside the last answer: each turn's whole sequence was saved as an entry, and
    a chat of 8 turns held 7 (answers never reused, memory growing with the square of turns)."""
    index = PrefixIndex(1000)
    turns = [[1, 2, 3, 4, 5]]
    turns.append(turns[0] + [160, 61, 62, 9, 9])  # the answer [60, 61, 62] as the template rewrote it
    turns.append(turns[1] + [163, 64, 9, 9])
    for i, (turn, answer) in enumerate(zip(turns, ([60, 61, 62], [63, 64], [65]))):
        assert index.admit(0, turn, key=0) == (len(turns[i - 1]) if i else 0)  # the last prompt's positions
        index.release(0, turn + answer, key=0)
    assert index.take_ops() == [] and index.entries == {}
    index.admit(0, [7, 7, 7], key=0)  # another conversation: the last turn is saved, once
    assert index.take_ops() == [CacheOp("save", 1, 0, 15)]
    index.release(0, [7, 7, 7, 8], key=0)
    index.admit(0, [7, 7, 5, 5], key=0)  # parting in its prompt: the sequence is saved as before
    assert index.take_ops() == [CacheOp("save", 2, 0, 4)]
    # Gemma 3's sliding-window layers: past a long answer the ring no longer holds the window
    # before the parting (nothing reused), and each turn's sequence was still saved (h73)
    ringed = PrefixIndex(1000, SlidingRing(16, 4))
    turn = list(range(1, 6))
    for i in range(4):
        ringed.admit(0, turn, key=0)
        answer = [100 + 40 * i + j for j in range(30)]
        ringed.release(0, turn + answer, key=0)
        turn = turn + [answer[0] + 1000] + answer[1:] + [9, 9]  # its first token as the template rewrote it
    assert ringed.take_ops() == [] and ringed.entries == {}


def test_eviction_drops_the_least_recently_used_never_the_entry_being_loaded():
    index = PrefixIndex(10)
    index.admit(0, [1, 1, 1, 1, 0], key=0)
    index.release(0, [1, 1, 1, 1], key=0)
    index.admit(0, [2, 2, 2, 2, 0], key=0)  # saves [1]*4 as entry 1
    index.release(0, [2, 2, 2, 2], key=0)
    index.admit(0, [3, 3, 3, 0], key=0)  # saves [2]*4 as entry 2 (8 of 10 positions)
    index.release(0, [3, 3, 3], key=0)
    index.take_ops()
    # Loading entry 1 (the oldest) needs [3]*3 saved first: entry 2 goes, not entry 1.
    assert index.admit(0, [1, 1, 1, 1, 5], key=0) == 4
    assert index.take_ops() == [CacheOp("drop", 2), CacheOp("save", 3, 0, 3), CacheOp("load", 1, 0, 4)]
    assert index.tokens_held <= 10 and index.counters.evictions == 1
    index.release(0, list(range(20)), key=0)
    index.admit(0, [9, 0], key=0)  # 20 positions never fit in 10: not saved, nothing dropped for it
    assert [op.kind for op in index.take_ops()] == []


def test_forgetting_an_adapter_drops_what_was_computed_with_it():
    index = PrefixIndex(100)
    index.admit(0, [1, 2, 3, 0], key=4)
    index.release(0, [1, 2, 3], key=4)
    index.admit(0, [5, 0], key=0)
    index.release(0, [5], key=0)
    index.admit(1, [1, 2, 3, 0], key=4)
    index.release(1, [1, 2, 3], key=4)
    index.take_ops()
    index.forget_key(4)
    assert index.take_ops() == [CacheOp("drop", 1)] and 1 not in index.slots
    assert index.admit(2, [1, 2, 3, 7], key=4) == 0


# --- a node's store ------------------------------------------------------------------------

def test_a_node_s_store_copies_exactly_and_refuses_what_it_was_not_told():
    chunk = tiny_model("llama")
    cache = chunk.allocate_cache(2, 32)
    cache.k.normal_()
    cache.v.normal_()
    per_position = 2 * cache.k[:, 0, :, :1].numel() * 4
    store = PrefixStore(cache, 10 * per_position)
    store.apply([CacheOp("save", 1, 0, 6)])
    store.apply([CacheOp("load", 1, 1, 5)])
    assert torch.equal(cache.k[:, 1, :, :5], cache.k[:, 0, :, :5]) and torch.equal(cache.v[:, 1, :, :5],
                                                                                   cache.v[:, 0, :, :5])
    assert store.stats.bytes == 6 * per_position and store.stats.tokens_loaded == 5
    with pytest.raises(PrefixCacheError, match="entry 2 is not held here"):
        store.apply([CacheOp("load", 2, 1, 3)])
    with pytest.raises(PrefixCacheError, match="over the budget"):
        store.apply([CacheOp("save", 3, 0, 5)])
    with pytest.raises(PrefixCacheError, match="holds 6 positions, not 7"):
        store.apply([CacheOp("load", 1, 1, 7)])
    store.apply([CacheOp("drop", 1)])
    assert store.stats.bytes == 0 and store.stats.bytes_dropped == 6 * per_position


def test_budgets_resolve_in_one_rule():
    assert budget_bytes(0, 10 ** 9) == 0 and budget_bytes(None, None) == 0
    assert budget_bytes("auto", 10 ** 9) == 5 * 10 ** 8 and budget_bytes("auto", None) == 0
    assert budget_bytes(1000, 5000) == 1000
    with pytest.raises(ValueError, match="does not fit"):
        budget_bytes(10 ** 9, 10 ** 6)


@pytest.mark.parametrize("raw, want", [("auto", "auto"), ("off", 0), (False, 0), (0, 0), ("512MB", 512 << 20),
                                       ("1.5G", int(1.5 * (1 << 30))), (4096, 4096), ("2 GiB", 2 << 30)])
def test_prefix_cache_settings_parse(raw, want):
    assert parse_prefix_cache("x", raw) == want


@pytest.mark.parametrize("raw", ["lots", "-5MB", -1, True, "5 parsecs"])
def test_bad_prefix_cache_settings_are_one_line(raw):
    with pytest.raises(ConfigError) as e:
        parse_prefix_cache("ring.yaml: runtime.prefix_cache", raw)
    assert "runtime.prefix_cache" in str(e.value) and "\n" not in str(e.value)


# --- the wire ------------------------------------------------------------------------------

def test_cache_ops_travel_in_frames_and_bad_ones_are_refused():
    frame = wire.Frame(wire.FrameKind.PREFILL, 7, [1], [4], [2], torch.zeros(2, 8),
                       cache_ops=[CacheOp("save", 3, 1, 4), CacheOp("load", 2, 1, 4), CacheOp("drop", 1)])
    back = wire.decode(wire.encode(frame), run=7, hidden=8, n_slots=2, max_len=16)
    assert back.cache_ops == frame.cache_ops
    header, payload = wire.encode(frame)
    import msgpack
    for bad in ([["keep", 1, 0, 1]], [["save", 0, 0, 1]], [["save", 1, 5, 1]], [["load", 1, 0, 0]],
                [["load", 1, 0, 17]], [["drop", 1, 1, 0]], [], "save", [["save", 1, 0]], [["save", 1.5, 0, 1]]):
        raw = msgpack.packb(dict(msgpack.unpackb(header), cache=bad))
        with pytest.raises(wire.FrameError, match="cache"):
            wire.decode([raw, bytes(payload)], run=7, hidden=8, n_slots=2, max_len=16)
    stop = msgpack.packb(dict(msgpack.unpackb(wire.encode(wire.Frame(wire.FrameKind.STOP, 7))[0]),
                              cache=[["drop", 1, 0, 0]]))
    with pytest.raises(wire.FrameError, match="stop frames carry no cache ops"):
        wire.decode([stop, b""], run=7)


# --- one node: the same tokens and logits as on an empty cache ------------------------------

class Recorder:
    """The starter's head, recording every row's logits it returns."""

    def __init__(self, chunk):
        self.head, self.rows = chunk.head, []
        chunk.head = self

    def __call__(self, x):
        out = self.head(x)
        self.rows.append(out.detach().clone())
        return out


def conversation(pipe, turns, n_tokens=8):
    """Turns of (conversation, text): each prompt is its conversation so far plus its own text;
    returns (samples, logits per turn)."""
    rec = Recorder(pipe.chunk)
    history, samples, logits = {}, [], []
    for i, (who, text) in enumerate(turns):
        prompt = history.get(who, []) + ids(text)
        s = Sample(i, text, prompt, n_tokens, sample_generator(1, i))
        s.slot = pipe.choose_slot(s, pipe.free_slots)
        rec.rows = []
        pipe.admit(s)
        while pipe.active:
            pipe.step()
        samples.append(s)
        logits.append(torch.cat(rec.rows))
        history[who] = prompt + s.token_ids
    return samples, logits


TURNS = ["Once upon a time", " there was", " a small", " house. And then", " they all", " went home."]


def one_node(family, n_slots, budget):
    chunk = tiny_model(family)
    chunk.allocate_cache(n_slots, 128)
    pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None, PipelineSettings(max_batch=n_slots, prefill_chunk=8))
    if budget:
        pipe.enable_prefix_cache(budget, 10 ** 9)
    return pipe


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("n_slots, budget", [(2, 1000), (1, 1000), (1, 40)])
def test_a_conversation_gives_the_tokens_and_logits_of_an_empty_cache(family, n_slots, budget):
    # Interleave another conversation so slots are reused (1 slot: every turn saves and loads).
    turns = [t for pair in zip(TURNS, ["Zebras", " run", " fast", " far", " away", " now"])
             for t in ((0, pair[0]), (1, pair[1]))]
    cold, cold_logits = conversation(one_node(family, n_slots, 0), turns)
    pipe = one_node(family, n_slots, budget)
    warm, warm_logits = conversation(pipe, turns)
    assert [s.token_ids for s in warm] == [s.token_ids for s in cold]
    for a, b in zip(warm_logits, cold_logits):
        assert (a - b).abs().max() <= 1e-4
    # Each turn after the first reuses what the nodes hold (a small budget: at least the slot's)
    assert sum(s.cached_tokens > 0 for s in warm) >= (len(turns) - 2 if budget > 100 else 1)
    counters = pipe.prefix.metrics()
    assert counters["tokens_reused"] == sum(s.cached_tokens for s in warm)
    assert pipe.prefix.tokens_held <= budget
    if n_slots == 1 and budget > 100:
        assert pipe.prefix_store.stats.loads > 0 and pipe.prefix_store.stats.saves > 0
    if budget == 40:
        assert counters["evictions"] + counters["superseded"] > 0 or pipe.prefix.tokens_held <= 40


def test_a_budget_of_zero_sends_no_cache_op_and_reuses_nothing():
    pipe = one_node("llama", 1, 0)
    sent = []
    send = pipe.transport.send
    pipe.transport.send = lambda frame: (sent.append(frame), send(frame))
    samples, _ = conversation(pipe, [(0, t) for t in TURNS[:3]])
    assert pipe.prefix is None and all(s.cached_tokens == 0 for s in samples)
    assert sent and not any(f.cache_ops for f in sent)


# --- a ring of real processes behind --serve ---------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny_models, workers, tmp_path_factory):
    model = tiny_models["llama"]
    config = ModelSource(model).config
    lora = write_peft_lora(os.path.join(os.path.dirname(model), "lora-prefix"), config, 21)
    path = write_run_config(tmp_path_factory.mktemp("prefix") / "ring3.yaml", model, workers[:2],
                            layers=[1, 1, 2], adapters={"chat": lora},
                            runtime={"threads": 1, "ring_timeout": 30, "prefix_cache": "8MB"},
                            serve={"max_in_flight": 2, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        yield server
    finally:
        server.stop()


def complete(server, prompt, **body):
    r = requests.post(server.url + "/v1/completions", timeout=120,
                      json=dict({"prompt": prompt, "max_tokens": 6, "temperature": 0}, **body))
    assert r.status_code == 200, r.text
    return r.json()


def chat_turns(server, turns, model="tiny", reference=None):
    """A conversation over /v1/completions; with `reference`, each turn's text must equal it."""
    prompt, out = "", []
    for i, turn in enumerate(turns):
        prompt += turn
        body = complete(server, prompt, model=model)
        text = body["choices"][0]["text"]
        out.append((text, body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        if reference is not None:
            assert text == reference[i], (i, prompt)
        prompt += text
    return out


def test_a_served_conversation_reuses_its_history_and_says_so(served):
    reference = [t for t, cached in chat_turns_off(served, TURNS)]
    got = chat_turns(served, TURNS, reference=reference)
    assert all(cached > 0 for _, cached in got[1:]), got
    # cache_prompt: false computes the whole prompt again (llama.cpp's field)
    body = complete(served, "".join(TURNS), cache_prompt=False)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = served.metrics()
    assert metrics["mdi_prefix_cache_hits_total"] >= len(TURNS) - 1
    assert metrics["mdi_prefix_cache_tokens_reused_total"] > 0
    held = [v for k, v in metrics.items() if k.startswith("mdi_node_prefix_cache_budget_bytes")]
    assert len(held) == 3 and all(v == 8 << 20 for v in held)
    # the limit the index applies, the same on every node (each node's bytes above did not say it)
    assert 0 < metrics["mdi_prefix_cache_tokens_held"] <= metrics["mdi_prefix_cache_token_budget"], metrics


def chat_turns_off(server, turns, model="tiny"):
    prompt, out = "", []
    for turn in turns:
        prompt += turn
        body = complete(server, prompt, model=model, cache_prompt=False)
        out.append((body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        prompt += out[-1][0]
    assert all(cached == 0 for _, cached in out)
    return out


def test_concurrent_conversations_each_get_their_own_text(served):
    starts = ["Alpha", "Bravo", "Charlie", "Delta"]
    turns = {s: [s + ":"] + TURNS[1:4] for s in starts}
    reference = {s: [t for t, _ in chat_turns_off(served, turns[s])] for s in starts}
    errors = []

    def talk(s):
        try:
            chat_turns(served, turns[s], reference=reference[s])
        except BaseException as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=talk, args=(s,)) for s in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors


def test_an_adapter_never_reuses_the_base_s_positions(served):
    prompt = "The same words for both"
    complete(served, prompt)  # the base holds them now
    first = complete(served, prompt, model="chat")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(served, prompt, model="chat")
    # a ggml ring resumes a multiple of 4 rows into a prompt's pass
    reused = len(prompt) - 1 if ON_TORCH else reusable_positions(len(prompt), len(prompt) - 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == reused > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == \
        complete(served, prompt, model="chat", cache_prompt=False)["choices"][0]["text"]


@pytest.mark.parametrize("value", ["yes", 1, "true", [True]])
def test_a_bad_cache_prompt_is_a_400_naming_it(served, value):
    r = requests.post(served.url + "/v1/completions", json={"prompt": "x", "cache_prompt": value}, timeout=30)
    assert r.status_code == 400 and "cache_prompt" in r.json()["error"]["message"]


# --- recovery and memory ---------------------------------------------------------------------

def test_a_budget_a_worker_cannot_hold_is_refused_naming_it(tiny_models, tmp_path):
    procs = [WorkerProcess(p, extra=["--max-memory", "0.05"]) for p in free_ports(1)]
    try:
        worker = procs[0].wait_ready()
        cfg = parse_run_config(tiny_models["llama"], [worker], "big", n_tokens=4,
                               runtime={"prefix_cache": "1GB", "threads": 1})
        with pytest.raises((NodeError, ConfigError)) as e:
            batch.run(cfg, ["hello"])
        message = str(e.value)
        assert "prefix cache" in message and "\n" not in message, message
    finally:
        for p in procs:
            p.stop()


def test_a_replaced_worker_starts_with_an_empty_cache_and_the_text_is_unchanged(tiny_models, tmp_path):
    model = tiny_models["llama"]
    for board1, board2, spare in worker_pool(3):
        path = write_run_config(tmp_path / "ring.yaml", model, [board1, board2], layers=[1, 1, 2],
                                spares=[spare], runtime={"threads": 1, "ring_timeout": 10, "heartbeat_interval": 0.2,
                                                         "prefix_cache": "4MB"},
                                serve={"max_in_flight": 2, "model_name": "tiny"})
        server = ServeProcess(path).wait_ready()
        try:
            reference = [t for t, _ in chat_turns_off(server, TURNS[:3])]
            chat_turns(server, TURNS[:3], reference=reference)  # the cache holds this conversation now
            board1.proc.kill()
            board1.proc.wait(10)
            prompt = "".join(t + r for t, r in zip(TURNS[:3], reference))
            body = complete(server, prompt + TURNS[3])
            body_off = complete(server, prompt + TURNS[3], cache_prompt=False)
            assert body["choices"][0]["text"] == body_off["choices"][0]["text"]
            assert server.metrics()["mdi_prefix_cache_lookups_total"] >= 1
            again = complete(server, prompt + TURNS[3])
            assert again["choices"][0]["text"] == body_off["choices"][0]["text"]
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        finally:
            server.stop()


def test_a_shifted_window_is_kept_as_the_sequence_it_became():
    """A sample whose window shifted leaves its slot holding the shorter window: a prompt that
    continues that window reuses it, and gets the tokens of an empty cache."""
    def run(budget):
        chunk = tiny_model("llama")
        chunk.allocate_cache(1, 48)
        pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None,
                        PipelineSettings(prefill_chunk=8, context_shift=True))
        if budget:
            pipe.enable_prefix_cache(budget, 10 ** 9)
        first = Sample(0, "", ids("A story: "), 60, sample_generator(1, 0))
        pipe.run([first])
        assert first.shifts, "the window must have shifted"
        window = first.window_tokens(0, first.window_len)
        follow = Sample(1, "", window[:-12] + ids(" ok"), 6, sample_generator(1, 1), slot=0)
        pipe.run([follow])
        return first, follow
    cold_first, cold = run(0)
    warm_first, warm = run(1000)
    assert warm_first.token_ids == cold_first.token_ids and warm.token_ids == cold.token_ids
    assert warm.cached_tokens > 0 and cold.cached_tokens == 0


def test_a_ring_under_eviction_pressure_gives_the_whole_prompt_s_text(tiny_models, tmp_path):
    """One slot and a budget of a conversation or so: turns of three conversations in turn
    save, load and evict entries on every node, and each turn's text is the one computed whole."""
    for workers in worker_pool(2):  # its own: the module's server holds the shared ones
        eviction_ring(tiny_models, workers, tmp_path)


def eviction_ring(tiny_models, workers, tmp_path):
    path = write_run_config(tmp_path / "ring.yaml", tiny_models["llama"], workers, layers=[1, 1, 2],
                            runtime={"threads": 1, "ring_timeout": 30, "prefix_cache": "24KB"},
                            serve={"max_in_flight": 1, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        history = {who: "" for who in ("Ann:", "Bob:", "Cid:")}
        for turn in TURNS[:4]:
            for who in history:
                prompt = history[who] + (who if not history[who] else "") + turn
                whole = complete(server, prompt, cache_prompt=False)["choices"][0]["text"]
                body = complete(server, prompt)
                assert body["choices"][0]["text"] == whole, (who, prompt)
                history[who] = prompt + whole
        metrics = server.metrics()
        assert metrics["mdi_prefix_cache_hits_total"] > 0 and metrics["mdi_prefix_cache_evictions_total"] > 0
    finally:
        server.stop()


def test_a_save_that_cannot_fit_beside_the_entry_being_loaded_evicts_nothing():
    index = PrefixIndex(10)
    index.admit(0, [1] * 8 + [0], key=0)
    index.release(0, [1] * 8, key=0)
    index.admit(0, [2, 2, 2, 0], key=0)  # [1]*8 saved as entry 1
    index.release(0, [2, 2, 2, 2, 2], key=0)
    index.take_ops()
    # Loading entry 1 (8 positions) leaves no room for [2]*5: it is not saved, and nothing is dropped.
    assert index.admit(0, [1] * 8 + [3], key=0) == 8
    assert index.take_ops() == [CacheOp("load", 1, 0, 8)] and index.counters.evictions == 0
    assert index.tokens_held == 8
