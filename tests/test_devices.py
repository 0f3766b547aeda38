"""Half-precision storage with float32 compute (old Jetson GPUs), checked on CPU."""
import os

import pytest
import torch

from mdi.starter import batch
from mdi.system.devices import resolve_compute_dtype
from conftest import ROOT, make_tiny_model
from ringconfigs import parse_run_config


def greedy(model, dtype, compute=None, workers=()):
    cfg = parse_run_config(model, workers, label="t", dtype=dtype, compute_dtype=compute, n_tokens=24)
    result = batch.run(cfg, ["Once upon", "The"])
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
    ids, result = greedy(model, "float16", "float32", workers[:1])
    assert ids == reference
    # Activations travel in the compute dtype: 4 bytes per value on every decode hop.
    starter_node = result.metrics()["nodes"][0]
    decode_bytes = starter_node["bytes_sent_by_kind"]["decode"] / starter_node["messages_sent_by_kind"]["decode"]
    assert decode_bytes >= 64 * 4


def test_compute_dtype_choice_per_gpu_generation(monkeypatch):
    from mdi.system import devices
    tx2, xavier, orin = (6, 2), (7, 2), (8, 7)
    monkeypatch.setitem(devices._CPU_ARITHMETIC, torch.float16, True)  # (torch 2.0 has none: the test below)
    assert resolve_compute_dtype("cpu", torch.float16, None, None) == (torch.float16, None)
    assert resolve_compute_dtype("cuda", torch.float16, torch.float32, tx2) == (torch.float32, None)
    dtype, note = resolve_compute_dtype("cuda", torch.float16, None, tx2)
    assert dtype == torch.float16 and "compute_dtype: float32" in note and "sm_62" in note
    dtype, note = resolve_compute_dtype("cuda:0", torch.bfloat16, None, xavier)
    assert dtype == torch.float32 and "bfloat16" in note
    assert resolve_compute_dtype("cuda", torch.bfloat16, None, orin) == (torch.bfloat16, None)
    assert resolve_compute_dtype("cuda", torch.float16, None, xavier) == (torch.float16, None)


def test_a_half_type_this_torch_cannot_compute_on_the_cpu_is_computed_in_float32(monkeypatch):
    """torch 2.0 (JetPack 5's) has no float16 linear nor layer norm on the CPU: a float16 model
    had failed at its first token ("addmm_impl_cpu_" not implemented for 'Half')."""
    from mdi.system import devices
    assert devices.cpu_computes(torch.float32)
    monkeypatch.setitem(devices._CPU_ARITHMETIC, torch.float16, True)
    assert devices.resolve_compute_dtype("cpu", torch.float16, None) == (torch.float16, None)
    monkeypatch.setitem(devices._CPU_ARITHMETIC, torch.float16, False)
    for compute in (None, torch.float16):
        dtype, note = devices.resolve_compute_dtype("cpu", torch.float16, compute)
        assert dtype == torch.float32 and "no float16 arithmetic on the CPU: weights stay float16" in note
    assert devices.resolve_compute_dtype("cpu", torch.float16, torch.float32) == (torch.float32, None)
    assert devices.resolve_compute_dtype("cuda", torch.float16, None, (8, 7)) == (torch.float16, None)


def test_a_device_this_node_lacks_is_one_line_naming_it():
    from mdi.runconfig import ConfigError
    from mdi.system.devices import unusable_reason
    assert unusable_reason("cpu") is None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = unusable_reason("cuda:%d" % (n + 98))
    assert why.startswith("cuda:%d: this node" % (n + 98)) and "\n" not in why
    if not torch.cuda.is_available():  # the starter says so before it loads anything
        with pytest.raises(ConfigError, match="starter: cuda: this node's torch sees no CUDA GPU"):
            batch.run(parse_run_config(SHIPPED, label="t", device="cuda", n_tokens=2), ["To be"])


def test_runtime_device_names_the_runs_device_as_model_device_does():
    from mdi.runconfig import ConfigError, parse_config
    cfg = parse_config({"model": {"path": "m"}, "runtime": {"device": "cuda:1"}}, "run.yaml")
    assert cfg.model.device == "cuda:1" and cfg.device_of(cfg.nodes[0]) == "cuda:1"
    same = parse_config({"model": {"path": "m", "device": "cuda"}, "runtime": {"device": "cuda"}}, "run.yaml")
    assert same.model.device == "cuda"
    first = parse_config({"model": {"path": "m", "device": "cuda:0"}, "runtime": {"device": "cuda"}}, "run.yaml")
    assert first.model.device in ("cuda", "cuda:0")  # one GPU, two spellings
    with pytest.raises(ConfigError, match=r"runtime.device 'cuda' and model.device 'cuda:1' differ"):
        parse_config({"model": {"path": "m", "device": "cuda:1"}, "runtime": {"device": "cuda"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"^run.yaml: runtime.device 'cuda' and model.device 'cpu' differ"):
        parse_config({"model": {"path": "m", "device": "cpu"}, "runtime": {"device": "cuda"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"^run.yaml: runtime.device: expected cpu, cuda or cuda:N, got 'gpu'$"):
        parse_config({"model": {"path": "m"}, "runtime": {"device": "gpu"}}, "run.yaml")


class _FakeCuda:
    """torch.cuda as a GPU of `free` free bytes, with this process's allocator holding
    `reserved` bytes of which `allocated` are in use; `integrated`: it shares the host's RAM."""

    def __init__(self, integrated, free=5 << 30, reserved=1 << 30, allocated=1 << 28):
        self.integrated, self.free, self.reserved, self.allocated = integrated, free, reserved, allocated

    def patch(self, monkeypatch):
        props = type("Props", (), {"is_integrated": int(self.integrated)})()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, 80 << 30))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)


def test_free_memory_of_a_discrete_gpu_is_its_own_and_of_a_jetson_the_hosts(monkeypatch):
    """Weights on a discrete GPU go to its memory, which the host's RAM says nothing about; a
    Jetson's GPU draws on the host's RAM (MemAvailable and the cgroup, as for the CPU)."""
    from mdi.system import memory
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 3 << 30)
    gpu = _FakeCuda(integrated=False)
    gpu.patch(monkeypatch)
    expected = gpu.free + gpu.reserved - gpu.allocated  # the allocator's unused blocks are free to this process
    assert memory.free_bytes_on("cuda") == memory.free_bytes_on("cuda:0") == expected
    assert memory.free_bytes_on("cpu") == 3 << 30
    _FakeCuda(integrated=True).patch(monkeypatch)
    assert memory.free_bytes_on("cuda") == 3 << 30


class _FakeGgml:
    """ggml's device registry with one GPU, CUDA1, of `free` free bytes (`kind`: ggml's device type)."""

    def __init__(self, kind=1, free=6 << 30):
        self.kind, self.free = kind, free

    def ggml_backend_dev_by_name(self, name):
        return 7 if name == b"CUDA1" else None

    def ggml_backend_dev_type(self, dev):
        return self.kind

    def ggml_backend_dev_memory(self, dev, free, total):
        free._obj.value, total._obj.value = self.free, 8 << 30


def test_a_node_computing_with_ggml_plans_a_discrete_gpu_by_ggmls_figure(monkeypatch):
    """Where torch cannot say (not loaded in a ggml node, or without CUDA), the GPU's free
    memory is ggml's; a GPU ggml lacks, or one sharing the host's RAM, is the host's."""
    import sys
    from mdi.system import memory
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 3 << 30)
    monkeypatch.setattr(memory, "_torch_gpu_free", lambda device: None)
    ggml = _FakeGgml()
    monkeypatch.setitem(sys.modules, "ggml.ggml", ggml)
    assert memory.free_bytes_on("cuda:1") == 6 << 30
    assert memory.free_bytes_on("cuda:0") == memory.free_bytes_on("cpu") == 3 << 30
    ggml.kind = 2  # an integrated GPU (a Jetson's): the host's RAM
    assert memory.free_bytes_on("cuda:1") == 3 << 30
    monkeypatch.delitem(sys.modules, "ggml.ggml")  # neither torch nor ggml can say: the host's
    assert memory.free_bytes_on("cuda:1") == 3 << 30


def test_starter_refuses_a_chunk_its_discrete_gpu_cannot_hold_whatever_the_host_has(monkeypatch):
    from mdi.model.config import ModelConfig
    from mdi.runconfig import ConfigError
    from mdi.starter.planning.capacity import check_fits_here
    from mdi.system import memory
    config = ModelConfig(vocab_size=1000, n_layer=4, n_head=4, n_embd=256, block_size=512)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 64 << 30)  # a roomy host
    _FakeCuda(integrated=False, free=1 << 20, reserved=0, allocated=0).patch(monkeypatch)
    from mdi.starter.planning.node_budget import RunMemory
    budget = RunMemory(config, 512, torch.float32, ()).budget("starter", (0, 4), {}, 2, True)
    with pytest.raises(ConfigError, match="available on cuda here"):
        check_fits_here(budget, "cuda", False)
    assert check_fits_here(budget, "cpu", False) > 0


def test_cudnn_attention_is_switched_off_for_a_gpu_chunk_only(monkeypatch):
    """cuDNN attention compiles a graph per key length and thread (see use_shape_agnostic_attention):
    a chunk on a GPU turns it off, once; a CPU chunk leaves torch's switches alone."""
    from mdi.system.devices import use_shape_agnostic_attention
    state = {"on": True}
    # (raising=False: torch before 2.4 has no such switch, as the function itself allows for)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: state["on"], raising=False)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: state.update(on=on), raising=False)
    assert not use_shape_agnostic_attention("cpu") and state["on"]
    assert use_shape_agnostic_attention("cuda:0") and not state["on"]
    assert not use_shape_agnostic_attention("cuda")  # already off: nothing to do


def test_the_plan_counts_a_torch_kv_cache_in_the_dtype_it_computes_in(monkeypatch):
    """A worker keeps its KV cache in the dtype it computes in (ModelChunk.activation_dtype) and
    checks its load with that size (chunk_loading.run_cache_bytes): model.compute_dtype float32
    over bfloat16 weights, or a CPU torch without float16 arithmetic (torch 2.0), double the
    cache. The plan's budgets count the same bytes, so the planner never places layers a worker
    then refuses at /init."""
    from mdi.model.config import ModelConfig
    from mdi.model.layout import torch_kv_cache_bytes
    from mdi.runconfig import parse_config
    from mdi.starter.planning.node_budget import run_memory
    from mdi.system import devices
    config = ModelConfig(vocab_size=1000, n_layer=4, n_head=4, n_embd=256, block_size=512)

    def kv_of(model: dict) -> int:
        cfg = parse_config({"model": dict({"path": "m", "device": "cpu"}, **model),
                            "nodes": [{"name": "starter", "layers": 4}]}, "test")
        return run_memory(cfg, config, 512, cfg.model.dtype).budget("starter", (0, 4), {}, 1, True).kv_per_slot

    def expect(dtype: torch.dtype) -> int:
        return torch_kv_cache_bytes(config, 4, 1, 512, dtype)
    assert kv_of({"dtype": "bfloat16"}) == expect(torch.bfloat16)
    assert kv_of({"dtype": "bfloat16", "compute_dtype": "float32"}) == expect(torch.float32)
    monkeypatch.setitem(devices._CPU_ARITHMETIC, torch.float16, False)  # as torch 2.0 on a CPU
    assert kv_of({"dtype": "float16"}) == expect(torch.float32)
    assert resolve_compute_dtype("cpu", torch.float16, None)[0] == torch.float32  # what its worker computes in
