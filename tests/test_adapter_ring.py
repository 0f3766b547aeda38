"""LoRA adapters over the ring with real workers: samples with different adapters (and the
base) share frames and forwards, and each gets exactly the tokens it gets alone with its
adapter; each worker holds only its own layers' matrices."""
import os

import pytest
import requests

from conftest import ON_TORCH
from ringconfigs import parse_run_config
from mdi.lab.random_lora import write_random_lora
from mdi.model.source import ModelSource
from mdi.runconfig import ConfigError
from mdi.starter import batch

PROMPTS = ["The quick brown fox", "Hi", "To be, or not to be", "0123", "abc def", "xyz"]
ADAPTERS = ["chat", "tools", "poet"]
# Sample i's adapter: three adapters and the base, mixed (the same adapter on several samples).
CHOICE = ["chat", "base", "tools", "poet", "chat", "base"]


def write_peft_lora(path, config, seed, rank=4):
    """A PEFT LoRA directory for an mdi tiny model, every linear layer of the blocks targeted."""
    return write_random_lora(str(path), config, seed, rank)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("adapters")
    out = {}
    for family, model in tiny_models.items():
        config = ModelSource(model).config
        out[family] = {name: write_peft_lora(str(base / family / name), config, seed=i + 1)
                       for i, name in enumerate(ADAPTERS)}
    return out


def config_for(model, adapters, workers=(), counts=None, max_batch="auto", n_tokens=10):
    return parse_run_config(model, workers, layers=counts, adapters=adapters, n_tokens=n_tokens,
                            runtime={"ring_timeout": 30, "max_batch": max_batch})


def alone(model, adapters, prompt, name):
    """One sample alone on one node with its adapter: the reference."""
    result = batch.run(config_for(model, adapters), [prompt], adapters=[name])
    return result.samples[0].token_ids


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mixed_adapters_in_one_run_match_each_sample_alone(family, tiny_models, adapter_dirs, workers):
    model, adapters = tiny_models[family], adapter_dirs[family]
    reference = [alone(model, adapters, p, a) for p, a in zip(PROMPTS, CHOICE)]
    base = alone(model, adapters, PROMPTS[0], "base")
    assert reference[0] != base, "the adapter must change the text for this test to mean anything"
    n_layer = ModelSource(model).config.n_layer
    rings = [((), None), (workers[:2], [1, 1, n_layer - 2])]
    for ring_workers, counts in rings:
        for max_batch in (1, "auto"):
            result = batch.run(config_for(model, adapters, ring_workers, counts, max_batch), PROMPTS, adapters=CHOICE)
            got = [s.token_ids for s in result.samples]
            assert got == reference, "%d nodes, max_batch %s" % (len(ring_workers) + 1, max_batch)
            if max_batch == "auto" and ring_workers:
                # Samples of different adapters shared forwards.
                assert max(n.get("samples_per_forward_max", 0) for n in result.metrics()["nodes"]) > 1
            assert [s.get("adapter", 0) for s in result.metrics()["samples"]] == \
                [0 if a == "base" else ADAPTERS.index(a) + 1 for a in CHOICE]


def test_each_worker_holds_only_its_layers_adapters(tiny_models, adapter_dirs, workers):
    model, adapters = tiny_models["llama"], adapter_dirs["llama"]
    n_layer = ModelSource(model).config.n_layer
    counts = [1, 1, n_layer - 2]
    batch.run(config_for(model, adapters, workers[:2], counts), PROMPTS[:2], adapters=["chat"])
    held = [requests.get("http://127.0.0.1:%d/status" % w.port, timeout=10).json()["memory"]["adapter_bytes"]
            for w in workers[:2]]
    # Three adapters, rank 4, float32: each worker holds exactly its layers' share.
    from mdi.model.adapters.adapter_files import load_adapter
    config = ModelSource(model).config
    loaded = [load_adapter(adapters[n], config, n) for n in ADAPTERS]
    ranges = ((1, 2), (2, n_layer))
    want = [sum(a.nbytes(a.for_layers(first, last)) for a in loaded) for first, last in ranges]
    if not ON_TORCH:  # ggml holds each GGUF matrix's own pair: a fused layer's zero blocks of B are left out
        fused = want
        want = []
        for first, last in ranges:
            chunk = ModelSource(model).ggml_chunk(first, last, False, False, threads=1)
            for i, a in enumerate(loaded):
                chunk.set_adapter(i + 1, a.for_layers(first, last))
            want.append(chunk.adapter_bytes)
            chunk.close()
        assert want[0] < fused[0]
    assert held == want and held[1] == (n_layer - 2) * held[0]


def test_unknown_adapter_names_the_known_ones(tiny_models, adapter_dirs):
    model, adapters = tiny_models["gpt2"], adapter_dirs["gpt2"]
    with pytest.raises(ConfigError) as e:
        batch.run(config_for(model, adapters), ["Hi"], adapters=["nope"])
    assert "nope" in str(e.value) and "chat" in str(e.value) and "base" in str(e.value)
    with pytest.raises(ConfigError, match="lists no adapters"):
        batch.run(config_for(model, {}), ["Hi"], adapters=["chat"])


def test_mdi_prepare_merges_an_adapter(tiny_models, adapter_dirs, tmp_path):
    import subprocess
    from conftest import BIN
    model, adapters = tiny_models["llama"], adapter_dirs["llama"]
    out = str(tmp_path / "merged")
    r = subprocess.run([os.path.join(BIN, "mdi-prepare"), model, "--out", out, "--merge-adapter", adapters["tools"]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    merged = batch.run(config_for(out, {}), PROMPTS[:2])
    assert [s.token_ids for s in merged.samples] == [alone(model, adapters, p, "tools") for p in PROMPTS[:2]]
    wrong = subprocess.run([os.path.join(BIN, "mdi-prepare"), tiny_models["gpt2"], "--out", str(tmp_path / "x"),
                            "--merge-adapter", adapters["tools"]], capture_output=True, text=True, timeout=300)
    assert wrong.returncode != 0 and "mdi-prepare: error:" in wrong.stderr


def test_an_adapter_that_leaves_a_node_s_layers_alone(tiny_models, workers, tmp_path):
    """Only layer 0 adapted: the workers hold no matrix of it but must still know its id."""
    model = tiny_models["llama"]
    config = ModelSource(model).config
    adapters = {"first": write_random_lora(str(tmp_path / "first"), config, seed=3, rank=4, layers=[0])}
    reference = [alone(model, adapters, p, "first") for p in PROMPTS[:3]]
    ring = config_for(model, adapters, workers[:2], [1, 1, config.n_layer - 2])
    got = batch.run(ring, PROMPTS[:3], adapters=["first", "base", "first"])
    assert [s.token_ids for s in got.samples] == [reference[0], alone(model, adapters, PROMPTS[1], "base"),
                                                  reference[2]]


def test_adapter_mixes_are_held_once_and_go_with_their_parts(tiny_models, adapter_dirs):
    from mdi.starter.adapter_set import AdapterSet
    config = ModelSource(tiny_models["llama"]).config
    adapters = AdapterSet(adapter_dirs["llama"], config)
    chat, tools, poet = (adapters.id_of(n) for n in ADAPTERS)
    assert adapters.mix([(chat, 0.0)])[1] == 0  # every scale 0: the base
    assert adapters.mix([(tools, 1.0), (chat, 0.0)])[1] == tools  # one adapter at scale 1: itself
    key, held, mix = adapters.mix([(tools, -0.5), (chat, 2.0)])
    assert held is None and key == ((chat, 2.0), (tools, -0.5)) and mix.rank == 2 * adapters.adapters[0].rank
    mix_id = adapters.add(mix.name, mix)  # what Engine.mix_adapters does once every node holds it
    adapters.mixes[key] = mix_id
    assert adapters.mix([(chat, 2.0), (tools, -0.5)])[1] == mix_id
    assert [n for _, n in adapters.loaded()] == ADAPTERS  # a mix is never listed
    assert adapters.mixes_with(tools) == [(mix_id, mix.name)] and adapters.mixes_with(poet) == []
    adapters.remove(mix.name)
    assert not adapters.mixes and adapters.mix([(chat, 2.0), (tools, -0.5)])[1] is None
    with pytest.raises(ConfigError, match="adapter 99 is not loaded"):
        adapters.mix([(99, 1.0)])
