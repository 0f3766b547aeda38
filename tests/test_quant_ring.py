"""Quantized models end to end: SmolLM2's Q4_1 GGUF kept quantized computes what its
dequantized float32 twin computes, standalone and over a 3-node ring of real workers; pushed
weights, /status and per-node overrides at quantized sizes."""
import pytest
import requests
import torch

from conftest import SMOLLM2_DIR, WorkerProcess, free_ports
from ringconfigs import parse_run_config
from mdi.model.layout import QuantSpec, torch_kv_cache_bytes, weight_bytes
from mdi.model.quantization import kernel_report, qkernels
from mdi.model.source import ModelSource, build_chunk
from mdi.starter import batch

pytestmark = pytest.mark.usefixtures("module_on_torch")  # mdi's own int8 / int4 layouts compute on torch

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smollm2_q(smollm2_dir):  # smollm2_dir: tests/conftest.py
    source = ModelSource(smollm2_dir)
    if not source.stored_quant:
        pytest.skip("models/smollm2-135m was prepared without quantization")
    return source


def _full_chunk(source, mode):
    c = source.config
    quant = source.layout(0, c.n_layer, True, mode)
    weights = source.weights(0, c.n_layer, True, True, torch.float32, quant)
    chunk = build_chunk(c, weights, 0, c.n_layer, True, True, torch.float32, "cpu", quant=quant)
    chunk.allocate_cache(1, 64)
    return chunk


def test_gguf_q4_1_taken_over_gives_the_float_models_logits(smollm2_q):
    qkernels.set_preference("exact")  # what `exact` promises: the dequantized model's numbers
    stored = smollm2_q.stored_quant
    assert stored["blocks.0.attn.qkv"] == QuantSpec("int4", 32) and stored["tok_emb"] == QuantSpec("int8", 32)
    quantized, dequantized = _full_chunk(smollm2_q, "auto"), _full_chunk(smollm2_q, "none")
    for prompt in PROMPTS:
        ids = torch.tensor(smollm2_q.tokenizer.encode(prompt))
        with torch.no_grad():
            a = quantized.head(quantized.forward_blocks(quantized.embed(ids, 0), 0, 0))
            b = dequantized.head(dequantized.forward_blocks(dequantized.embed(ids, 0), 0, 0))
        assert float((a - b).abs().max()) <= 1e-3 * float(b.max() - b.min()), prompt


def _config(quant, workers=(), data_ports=(), node_options=None, n_tokens=64, kernel="exact", kernel_memory=None):
    """SmolLM2's 30 layers on the starter alone, or 10 each on it and two boards."""
    runtime = {"ring_timeout": 60, "threads": 1, "quant_kernel": kernel}
    if kernel_memory is not None:
        runtime["kernel_memory"] = kernel_memory
    return parse_run_config(SMOLLM2_DIR, workers, layers=[10, 10, 10] if workers else [30], data_ports=data_ports,
                            worker_name="board%d", node_options=node_options, quant=quant, n_tokens=n_tokens,
                            runtime=runtime)


def _ids(cfg):
    result = batch.run(cfg, PROMPTS)
    assert all(s.finish_reason in ("length", "eos") for s in result.samples)
    return [s.token_ids for s in result.samples]


def _chunk_bytes(worker):
    return requests.get("http://127.0.0.1:%d/status" % worker.port, timeout=10).json()["memory"]["chunk_bytes"]


@pytest.mark.slow  # SmolLM2 on a ring of real workers
def test_ring_of_quantized_nodes_matches_the_float_model(smollm2_q, workers):
    reference = _ids(_config("none", n_tokens=64))  # standalone, float32 dequantized
    ports = free_ports(3)
    assert _ids(_config("auto", workers[:2], ports)) == reference  # 3 nodes, Q4_1 kept as int4
    config = smollm2_q.config
    quantized = weight_bytes(config, (10, 20), "float32", quant=smollm2_q.layout(10, 20, False, "auto"))
    held = _chunk_bytes(workers[0])
    assert quantized <= held < weight_bytes(config, (10, 20), "float32") / 4
    # one board told to hold floats (quant: none) still gives the same tokens, at float size
    got = _ids(_config("auto", workers[:2], ports, {2: {"quant": "none"}}, n_tokens=16))
    assert got == [ids[:16] for ids in reference]
    assert _chunk_bytes(workers[1]) >= weight_bytes(config, (20, 30), "float32")
    assert _chunk_bytes(workers[0]) < weight_bytes(config, (10, 20), "float32") / 4


@pytest.mark.slow  # SmolLM2 on a ring of real workers
def test_default_kernels_are_named_per_node_and_stay_within_what_the_plan_spares(smollm2_q):
    """`fast` (the default) measures each node's kernels and names them in the metrics; a
    kernel that holds more than the stored weight (the int8 integer ones) is taken only within
    runtime.kernel_memory (0 by default: every node holds its stored weights and no more), and
    with `auto` only within what the node's memory spares beside its plan: a worker whose
    --max-memory leaves 1 MB spare holds at most 1 MB beyond its planned weights, whatever it
    measured fastest."""
    config = smollm2_q.config
    planned = weight_bytes(config, (10, 20), "float32", quant=smollm2_q.layout(10, 20, False, "auto"))
    longest = max(len(smollm2_q.tokenizer.encode(p)) for p in PROMPTS)
    cache = torch_kv_cache_bytes(config, 10, len(PROMPTS), longest + 8, torch.float32)
    spare = 1 << 20
    tight = WorkerProcess(free_ports(1)[0], extra=["--max-memory", repr((planned + cache + spare) / 1024 ** 3)])  # GB
    roomy = WorkerProcess(free_ports(1)[0])
    try:
        tight.wait_ready()
        roomy.wait_ready()
        ports = free_ports(3)
        batch.run(_config("auto", [tight, roomy], ports, n_tokens=8, kernel="exact"), PROMPTS)
        stored = _chunk_bytes(tight)  # its layers as stored, and its RoPE tables
        stored_roomy = _chunk_bytes(roomy)
        assert planned <= stored
        # the defaults: no node holds a byte beyond its stored weights, however much it spares
        batch.run(_config("auto", [tight, roomy], ports, n_tokens=8, kernel=qkernels.DEFAULT_POLICY), PROMPTS)
        assert _chunk_bytes(tight) <= stored and _chunk_bytes(roomy) <= stored_roomy
        result = batch.run(_config("auto", [tight, roomy], ports, n_tokens=8, kernel=qkernels.DEFAULT_POLICY,
                                   kernel_memory="auto"), PROMPTS)
        assert all(len(s.token_ids) == 8 for s in result.samples)
        shapes = {"int4/g32 960x576", "int4/g32 576x576", "int4/g32 3072x576", "int4/g32 576x1536"}
        for node in result.metrics()["nodes"]:
            kernels = node["kernels"]  # weight shape -> "kernel: policy fast: every candidate's time"
            assert shapes <= set(kernels), node["name"]
            for text in kernels.values():
                assert text.split(":")[0] in qkernels.KERNEL_NAMES and "policy fast" in text
        assert "int8/g32 49152x576" in result.metrics()["nodes"][0]["kernels"]  # the starter's head
        assert _chunk_bytes(tight) <= stored + spare
        gate_up = result.metrics()["nodes"][1]["kernels"]["int4/g32 3072x576"]
        assert not gate_up.startswith("int8dyn"), gate_up  # it would hold 2.4 MB more
        status = requests.get("http://127.0.0.1:%d/status" % tight.port, timeout=10).json()
        assert status["kernels"] == result.metrics()["nodes"][1]["kernels"]
        assert status["cpu"] and "int4pack-cpu" in status["kernels_here"]  # what --check lists for it
        # one line per kernel outcome of a shape, its matrices counted: 4 in each of its 10 layers
        assert sum(kernel_report.kernel_counts(status["kernels"]).values()) == 4 * 10
    finally:
        tight.stop()
        roomy.stop()
