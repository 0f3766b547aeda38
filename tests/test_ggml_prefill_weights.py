"""runtime.prefill_weights on the ggml backend: a prompt's passes multiply dequantized weights
(mdi.model.ggml.dequant_rows) only for a sample that brings enough rows, each such sample's rows
in a product of their own, so no other sample's bits change; shorter passes keep the quantized
product's bits; a matrix dequantized in slices gives the bits of the whole; a ring of 3 takes the
setting and gives one process's ids with it."""
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import BIN, ROOT, WorkerProcess, free_ports
from ringconfigs import write_run_config
from mdi.model.ggml import lib
from mdi.model.pass_rows import PassRows
from mdi.model.source import ModelSource
from mdi.runconfig import ConfigError, parse_config

pytestmark = pytest.mark.skipif(lib.unavailable_reason() is not None, reason=str(lib.unavailable_reason()))

MIN_ROWS = 16  # the rule the chunk tests force, whatever this CPU measures
LONG, SHORT = 40, 5


@pytest.fixture(scope="module")
def source(smollm2_dir):
    return ModelSource(smollm2_dir)


@pytest.fixture(scope="module")
def chunk(source):
    c = source.ggml_chunk(0, 4, True, False, threads=1)
    c.allocate_cache(4, 128)
    yield c
    c.close()


@pytest.fixture()
def forced(chunk, monkeypatch):
    """The chunk dequantizing to bfloat16 from MIN_ROWS rows (the measurement bypassed), back to
    quantized afterwards."""
    from mdi.model.ggml import dequant_rows

    monkeypatch.setattr(dequant_rows, "measure_rule", lambda *a: dequant_rows.DequantRule(lib.TYPE_IDS["BF16"], MIN_ROWS))
    chunk.set_prefill_weights("dequantized")
    assert chunk.prefill_rule == "dequantized to BF16 from %d rows" % MIN_ROWS
    yield chunk
    chunk.set_prefill_weights("quantized")


def rows(source, n, seed):
    return np.random.default_rng(seed).integers(0, source.config.vocab_size, n).astype(np.int32)


def passes(chunk, source):
    """A long prompt alone, a short one alone, both in one pass, and two long ones in one pass."""
    a, b, c = rows(source, LONG, 1), rows(source, SHORT, 2), rows(source, LONG + 3, 3)
    return {"long": chunk.embed_forward_rows(a, PassRows([0], [0], [LONG])),
            "short": chunk.embed_forward_rows(b, PassRows([1], [0], [SHORT])),
            "long_other": chunk.embed_forward_rows(c, PassRows([2], [0], [LONG + 3])),
            "mixed": chunk.embed_forward_rows(np.concatenate([b, a]), PassRows([1, 0], [0, 0], [SHORT, LONG])),
            "two_long": chunk.embed_forward_rows(np.concatenate([a, c]), PassRows([0, 2], [0, 0], [LONG, LONG + 3]))}


def test_a_samples_rows_keep_their_bits_whatever_shares_its_pass(source, chunk, forced):
    got = passes(forced, source)
    assert np.array_equal(got["mixed"][:SHORT], got["short"])
    assert np.array_equal(got["mixed"][SHORT:], got["long"])
    assert np.array_equal(got["two_long"][:LONG], got["long"])
    assert np.array_equal(got["two_long"][LONG:], got["long_other"])


def test_only_a_sample_bringing_enough_rows_multiplies_dequantized(source, chunk, forced):
    dequantized = passes(forced, source)
    forced.set_prefill_weights("quantized")
    assert forced.prefill_rule == "quantized"
    quantized = passes(forced, source)
    assert np.array_equal(dequantized["short"], quantized["short"])  # fewer rows than the rule: as stored
    long_d, long_q = dequantized["long"], quantized["long"]
    assert not np.array_equal(long_d, long_q)  # the other way was taken...
    # ... and computes the same model: bfloat16 against 8-bit activations, within their rounding
    assert np.abs(long_d - long_q).max() <= 0.05 * np.abs(long_q).max()


def test_a_matrix_dequantized_in_slices_gives_the_bits_of_the_whole(source, chunk, forced, monkeypatch):
    from mdi.model.ggml import products

    whole = forced.embed_forward_rows(rows(source, LONG, 4), PassRows([3], [0], [LONG]))
    shared = passes(forced, source)  # with a short sample, and two dequantized ones, in one pass
    # slices of a third of ffn_up's output rows (576 x 1536 float32 is 3.4 MB); graphs rebuilt
    monkeypatch.setattr(products, "DEQUANT_SLICE_BYTES", 576 * 4 * 512)
    forced._drop_graphs(lambda key: True)
    assert products.dequant_slice_count(forced.tensors["blk.0.ffn_up.weight"]) == 3
    sliced = forced.embed_forward_rows(rows(source, LONG, 4), PassRows([3], [0], [LONG]))
    # each dequantized sample of a pass takes every slice in turn from the one scratch
    sliced_shared = passes(forced, source)
    forced._drop_graphs(lambda key: True)
    assert np.array_equal(sliced, whole)
    for name, got in sliced_shared.items():
        assert np.array_equal(got, shared[name]), name


def test_the_rule_is_measured_once_and_remembered(source, tmp_path, monkeypatch):
    from mdi.model.ggml import dequant_rows

    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path))
    monkeypatch.setattr(dequant_rows, "_measured", {})
    c = source.ggml_chunk(0, 2, False, False, threads=1)
    try:
        c.set_prefill_weights("dequantized")
        rule = c.builder.dequant
        # whatever this CPU measured: a float type from a probed size, or nothing faster
        assert rule is None or (lib.TYPE_NAMES[rule.type_id] in dequant_rows.FLOAT_TYPES and
                                rule.min_rows in dequant_rows.PROBE_ROWS + (dequant_rows.TYPE_ROWS,))
        assert os.path.exists(tmp_path / "ggml_dequant.json")
        monkeypatch.setattr(dequant_rows, "_measured", {})
        monkeypatch.setattr(dequant_rows, "_measure", lambda *a: pytest.fail("measured twice"))
        c.set_prefill_weights("quantized")
        c.set_prefill_weights("dequantized")
        assert c.builder.dequant == rule
    finally:
        c.close()


def test_a_draft_model_on_ggml_prefills_as_the_target_does(smollm2_dir, source):
    """A draft model beside a ggml starter takes the run's setting (its prompts are the target's);
    its drafts are only proposals, which the target verifies in passes of a few rows."""
    from mdi.starter.speculation.draft_model import DraftModel, DraftSource, GgmlDraft

    draft = DraftModel.load(DraftSource(smollm2_dir, source, None), 1, 128, lambda: pytest.fail("torch asked"), "cpu",
                            64, ggml=GgmlDraft(1, "f16", True, prefill_weights="dequantized"))
    try:
        assert draft.chunk.backend == "ggml" and draft.chunk.prefill_weights == "dequantized"
    finally:
        draft.chunk.close()


def test_a_bad_setting_is_refused_in_one_line(smollm2_dir, source):
    from mdi.ring.backend_request import BackendRequest, validate_backend
    from mdi.ring.init_request import DataPlane, InitRequest, RequestError, Weights, validate_init

    with pytest.raises(ConfigError, match="runtime.prefill_weights: expected one of auto, quantized, dequantized"):
        parse_config({"model": {"path": smollm2_dir}, "nodes": [{"name": "s"}],
                      "runtime": {"prefill_weights": "fast"}}, "x.yaml")
    request = InitRequest(run_id=1, model=source.config, layers=[0, 2], dtype="float32", device="cpu", n_slots=1,
                          max_len=16, data=DataPlane(9000, "127.0.0.1", 9001, True), weights=Weights(path="m"),
                          prefill_weights="dequantized")
    assert validate_init(request.to_json()).prefill_weights == "dequantized"  # it travels
    with pytest.raises(RequestError, match="prefill_weights must be one of"):
        validate_init(dict(request.to_json(), prefill_weights="fast"))
    # auto's question to a worker carries it too: ggml's prefill is timed as the run computes it
    asked = BackendRequest(source.config, [0, 2], "auto", "cpu", "float32", prefill_weights="dequantized")
    assert validate_backend(asked.to_json()).prefill_weights == "dequantized"
    with pytest.raises(RequestError, match="prefill_weights must be one of"):
        validate_backend(dict(asked.to_json(), prefill_weights="fast"))


@pytest.mark.slow
def test_a_ring_of_three_dequantizes_as_one_process_does(smollm2_dir, source, tmp_path):
    """Every node of a ggml ring takes runtime.prefill_weights; with a rule remembered for this
    machine (BF16 from 16 rows: the cache every node reads), the ring's greedy ids are one
    process's with the same setting, and differ from neither run's own chunking."""
    from mdi.model.ggml.dequant_rows import DequantRule, probe_key, remember

    cache = tmp_path / "cache"
    cache.mkdir()
    env = dict(os.environ, MDI_PROFILE_CACHE=str(cache))
    keys = set()
    for first, last in ((0, 30), (0, 10), (10, 20), (20, 30)):  # alone, and each node of the ring's split
        c = source.ggml_chunk(first, last, False, False, threads=1)
        try:
            keys.add(probe_key(c.compute_backend, c.tensors, c._dequantizable))
        finally:
            c.close()
    os.environ["MDI_PROFILE_CACHE"], saved = str(cache), os.environ.get("MDI_PROFILE_CACHE")
    try:
        for key in keys:
            remember(key, DequantRule(lib.TYPE_IDS["BF16"], MIN_ROWS))
    finally:
        if saved is None:
            del os.environ["MDI_PROFILE_CACHE"]
        else:
            os.environ["MDI_PROFILE_CACHE"] = saved
    prompt = " ".join(open(os.path.join(ROOT, "README.md")).read().split()[:60])
    workers = [WorkerProcess(p, env=env) for p in free_ports(2)]
    try:
        ready = [w.wait_ready() for w in workers]
        runtime = {"threads": 1, "backend": "ggml", "prefill_chunk": 32}
        alone = write_run_config(tmp_path / "alone.yaml", smollm2_dir, n_tokens=12, runtime=runtime)
        ring = write_run_config(tmp_path / "ring.yaml", smollm2_dir, ready, n_tokens=12, runtime=runtime)
        records = {}
        for name, config in (("alone", alone), ("ring", ring)):
            out = str(tmp_path / (name + ".json"))
            proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--metrics-out", out,
                                   "--prompt", prompt, "--prefill-weights", "dequantized"],
                                  capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            with open(out) as f:
                records[name] = json.load(f)
        assert [n["backend"] for n in records["ring"]["nodes"]] == ["ggml"] * 3
        lines = [n["backend_line"] for n in records["ring"]["nodes"]]
        assert all(line.endswith("; prefill weights dequantized to BF16 from %d rows" % MIN_ROWS) for line in lines), lines
        assert records["ring"]["samples"][0]["token_ids"] == records["alone"]["samples"][0]["token_ids"]
        assert len(records["ring"]["samples"][0]["token_ids"]) == 12
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("measured, want", [(16, 64), (64, 64), (128, None), (None, None)])
def test_auto_dequantizes_from_where_the_cuts_start_or_not_at_all(source, chunk, monkeypatch, measured, want):
    """auto takes the measured float type from TILED_ROWS rows exactly (where the starter's cuts
    and ggml's attention start), and nothing where only longer passes were measured faster."""
    from mdi.model.ggml import dequant_rows
    rule = dequant_rows.DequantRule(lib.TYPE_IDS["BF16"], measured) if measured else None
    monkeypatch.setattr(dequant_rows, "measure_rule", lambda *a: rule)
    try:
        chunk.set_prefill_weights("auto")
        assert chunk.dequantized_from == want
        assert chunk.prefill_rule == ("dequantized to BF16 from 64 rows" if want else
                                      "quantized (auto: dequantized measured no faster here from 64 rows)")
        chunk.set_prefill_weights("dequantized")  # asked for: from the fewest rows measured faster
        assert chunk.dequantized_from == measured
    finally:
        chunk.set_prefill_weights("quantized")


def test_auto_is_quantized_on_a_node_whose_backend_is_asked_for_by_name(smollm2_dir, source, tmp_path):
    """runtime.prefill_weights auto (the default) reaches a node whose backend auto chooses as
    auto, and a node asked to compute with ggml (or torch) by name as quantized: its prompt's
    bits are llama.cpp's. An explicit setting reaches every node as it is."""
    nodes = [{"name": "starter", "data_port": 1}, {"name": "w1", "host": "127.0.0.1", "port": 2, "data_port": 3,
                                                    "backend": "ggml"}, {"name": "w2", "host": "127.0.0.1", "port": 4,
                                                                         "data_port": 5}]
    cfg = parse_config({"model": {"path": str(smollm2_dir)}, "nodes": nodes, "runtime": {"backend": "auto"}}, "x.yaml")
    assert cfg.runtime.prefill_weights == "auto"
    assert [cfg.prefill_weights_of(n) for n in cfg.nodes] == ["auto", "quantized", "auto"]
    cfg.runtime.backend = "ggml"
    assert [cfg.prefill_weights_of(n) for n in cfg.nodes] == ["quantized", "quantized", "quantized"]
    cfg.runtime.prefill_weights = "dequantized"
    assert [cfg.prefill_weights_of(n) for n in cfg.nodes] == ["dequantized"] * 3


def test_the_served_state_names_the_starter_s_prefill_weights(forced):
    """/v1/mdi/state and the dashboard read the starter's line from Engine.starter_reading: it
    says what runtime.prefill_weights does there, as the metrics record's does."""
    from types import SimpleNamespace
    from mdi.model.backend import BackendChoice
    from mdi.starter.engine import Engine
    engine = SimpleNamespace(chunk=forced, backend_choice=BackendChoice("ggml", "ggml", ""), pipeline=None)
    line = Engine.starter_reading(engine).backend_line  # type: ignore[arg-type]
    assert line == "ggml (asked); prefill weights dequantized to BF16 from %d rows" % MIN_ROWS
