"""Half-precision storage with float32 compute (old Jetson GPUs), checked on CPU."""
import os

import pytest
import torch

from mdi.starter import batch
from mdi.runconfig import parse_config
from mdi.system.devices import resolve_compute_dtype
from conftest import ROOT, free_ports, make_tiny_model


def greedy(model, dtype, compute=None, nodes=None):
    data = {"model": {"path": model, "dtype": dtype}, "generation": {"n_tokens": 24, "temperature": 0}}
    if compute:
        data["model"]["compute_dtype"] = compute
    if nodes:
        data["nodes"] = nodes
    result = batch.run(parse_config(data, "t"), ["Once upon", "The"])
    return [s.token_ids for s in result.samples], result


SHIPPED = os.path.join(ROOT, "models", "nanogpt-shakespeare")


def test_fp16_storage_fp32_compute_keeps_the_trained_model_greedy_tokens():
    reference, _ = greedy(SHIPPED, "float32")
    assert greedy(SHIPPED, "float16", "float32")[0] == reference


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fp16_storage_fp32_compute_equals_fp32_on_a_ring(tmp_path, workers, family):
    # Weights that float16 holds exactly: any difference would come from computing in half.
    model = make_tiny_model(str(tmp_path / family), family, seed=3, half_exact=True)
    reference, _ = greedy(model, "float32")
    assert greedy(model, "float16", "float32")[0] == reference
    ports = free_ports(2)
    ring = [{"name": "s", "data_port": ports[0]}, {"name": "w", "port": workers[0].port, "data_port": ports[1]}]
    ids, result = greedy(model, "float16", "float32", ring)
    assert ids == reference
    # Activations travel in the compute dtype: 4 bytes per value on every decode hop.
    starter_node = result.nodes[0]
    decode_bytes = starter_node["bytes_sent_by_kind"]["decode"] / starter_node["messages_sent_by_kind"]["decode"]
    assert decode_bytes >= 64 * 4


def test_compute_dtype_choice_per_gpu_generation():
    tx2, xavier, orin = (6, 2), (7, 2), (8, 7)
    assert resolve_compute_dtype("cpu", torch.float16, None, None) == (torch.float16, None)
    assert resolve_compute_dtype("cuda", torch.float16, torch.float32, tx2) == (torch.float32, None)
    dtype, note = resolve_compute_dtype("cuda", torch.float16, None, tx2)
    assert dtype == torch.float16 and "compute_dtype: float32" in note and "sm_62" in note
    dtype, note = resolve_compute_dtype("cuda:0", torch.bfloat16, None, xavier)
    assert dtype == torch.float32 and "bfloat16" in note
    assert resolve_compute_dtype("cuda", torch.bfloat16, None, orin) == (torch.bfloat16, None)
    assert resolve_compute_dtype("cuda", torch.float16, None, xavier) == (torch.float16, None)


def test_a_device_this_node_lacks_is_one_line_naming_it():
    from mdi.runconfig import ConfigError
    from mdi.system.devices import unusable_reason
    assert unusable_reason("cpu") is None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = unusable_reason("cuda:%d" % (n + 98))
    assert why.startswith("cuda:%d: this node" % (n + 98)) and "\n" not in why
    if not torch.cuda.is_available():  # the starter says so before it loads anything
        with pytest.raises(ConfigError, match="starter: cuda: this node's torch sees no CUDA GPU"):
            batch.run(parse_config({"model": {"path": SHIPPED, "device": "cuda"}, "generation": {"n_tokens": 2}},
                                   "t"), ["To be"])
