"""Loading a GGUF keeps its quantized blocks, and its peak memory shows it.

Loading the shipped SmolLM2 GGUF as it is stored (`quant: auto`) peaked at 0.77x the memory
of the float32 run of the same weights, where quantized weights should need well under 0.6x:
transients, not weights, set the peak. The file's pages stayed resident while it was read
(98 MB), each layer's kernel timing made a fresh 2x-last-level-cache buffer (64 MB on a 32 MB
L3), the head's candidate kernels were packed two at a time, and glibc kept the temporaries
of its conversions as resident holes. Later it rose to 1.63x (1.87x in CI): with no
allowance set, kernels that hold more than the stored weight (fbgemm's padded int8 rows, 26 MB
beyond the head's) took whatever the machine spared, and which won (and so the peak) depended
on timings. Now the allowance is 0 unless runtime.kernel_memory sets one: such kernels are not
even packed, and every candidate left holds the stored bytes, whichever is fastest. Measured
here in child processes (a process's peak RSS cannot be reset from Python portably), not timed.
"""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from mdi.model.files.gguf_layout import open_reader
from mdi.model.layout import QuantSpec
from mdi.model.quantization import kernel_choice, kernel_timing, qkernels
from mdi.model.quantization.quant import dequantize, quantize

CPU = torch.device("cpu")

# A child that loads a model's whole chunk as a one-node starter does (ModelSource.load_chunk,
# consuming what it holds) and prints its RSS after imports and its peak RSS after the load.
LOAD = r"""
import sys
import torch
torch.set_num_threads(1)
from mdi.model.source import ModelSource

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

before = status("VmRSS")
source = ModelSource(sys.argv[1])
n = source.config.n_layer
quant = source.layout(0, n, True, sys.argv[2])
chunk = source.load_chunk(0, n, True, True, torch.float32, "cpu", None, quant, consume=True)
print(before, status("VmHWM"))
"""


def load_peak(path: str, quant: str):
    """(RSS after imports, peak RSS after loading) of a child loading `path` with `quant`."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", LOAD, path, quant], env=env, cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, universal_newlines=True, timeout=300).stdout
    before, peak = (int(x) for x in out.split()[-2:])
    return before, peak


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="reads peak RSS from /proc (Linux)")
def test_the_shipped_gguf_loads_in_well_under_its_float32_memory(smollm2_gguf, smollm2_dir):
    """What loading adds to a process (peak RSS over the RSS after imports): the GGUF as stored
    with the defaults (int4 blocks, an int8 tied head and the kernels chosen for them within
    the default allowance, none) against the float32 load of the same weights (the prepared
    model, dequantized). Before: 0.61 (570 MB peak of the whole process against 788), then
    0.39, then 1.24-1.87 with kernels' copies unbounded; with the default allowance 0: ~0.35
    (202 MB added against 575). The bound, under the 0.6 target, leaves slack both ways."""
    assert kernel_choice.DEFAULT_ALLOWANCE == 0  # what the child loads with: no runtime.kernel_memory
    g_before, g_peak = load_peak(smollm2_gguf, "auto")
    f_before, f_peak = load_peak(smollm2_dir, "none")
    gguf_mb, float_mb = (g_peak - g_before) / 2 ** 20, (f_peak - f_before) / 2 ** 20
    assert gguf_mb <= 0.5 * float_mb, (
        "loading the GGUF as stored added %.0f MB at its peak (%.0f MB in all), the float32 load %.0f MB "
        "(%.0f MB in all): %.2fx" % (gguf_mb, g_peak / 2 ** 20, float_mb, f_peak / 2 ** 20, gguf_mb / float_mb))


def test_kernel_timing_fills_caches_from_resident_weights(monkeypatch):
    """Before each timed call the caches are filled by reading twice the last-level cache: from
    the chunk's other weights, which are resident anyway, and a new buffer only for what they
    fall short of (a fresh 2x-cache buffer per layer set the GGUF load's peak)."""
    monkeypatch.setattr(kernel_timing, "last_level_cache_bytes", lambda device: 2 ** 20)
    big, mid, small = (torch.zeros(n, dtype=torch.uint8) for n in (3 * 2 ** 19, 2 ** 20, 100))
    reads = kernel_timing.cache_fill(CPU, 2 ** 20, [small, mid, big])
    assert [id(t) for t in reads] == [id(big), id(mid)]  # 2.5 MB of weights cover 2 MB: nothing new
    reads = kernel_timing.cache_fill(CPU, 2 ** 20, [small])
    assert reads[0] is small and len(reads) == 2
    assert reads[1].numel() * reads[1].element_size() == 2 * 2 ** 20 - 100  # only the shortfall
    assert kernel_timing.cache_fill(CPU, 1024, [big]) == []  # a small layer is timed hot
    # a huge reported cache (a VM shown its host's 300 MB L3) gets a bounded buffer
    monkeypatch.setattr(kernel_timing, "last_level_cache_bytes", lambda device: 300 * 2 ** 20)
    reads = kernel_timing.cache_fill(CPU, 2 ** 20, [small])
    assert reads[1].numel() * reads[1].element_size() == kernel_timing.EVICT_BUFFER_BYTES


def test_an_int8_weight_read_to_fill_caches_is_not_copied(monkeypatch):
    """Reading an int8 / uint8 weight with sum() first copied it as int64 (8x its size: 240 MB
    for SmolLM2's head); the timing loop reads with max()."""
    monkeypatch.setattr(kernel_timing, "last_level_cache_bytes", lambda device: 2 ** 20)
    weight = torch.zeros(2 ** 21, dtype=torch.int8)
    calls = []

    def fake_max(t, *args, **kwargs):
        calls.append(t)
        return torch.zeros((), dtype=t.dtype)
    monkeypatch.setattr(torch.Tensor, "max", fake_max)
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: pytest.fail("sum() copies an int8 tensor"))
    kernel_timing.time_call(lambda: torch.zeros(1), CPU, 2 ** 20, [weight])
    assert calls and all(t is weight for t in calls)


@pytest.mark.skipif(not qkernels._op("_convert_weight_to_int4pack_for_cpu"), reason="no packed int4 CPU kernel")
def test_int4_cpu_packing_in_row_blocks_is_the_whole_packing(monkeypatch):
    """The CPU int4 packing goes PACK_ROWS rows at a time into one tensor (no list of blocks
    then a concatenated copy): the same bytes as packing every row at once."""
    q = torch.randint(0, 16, (320, 128), generator=torch.Generator().manual_seed(0))
    whole = qkernels._int4_pack_cpu_rows(lambda a, b: q[a:b], q.shape[0])
    monkeypatch.setattr(qkernels, "PACK_ROWS", 64)
    assert torch.equal(qkernels._int4_pack_cpu_rows(lambda a, b: q[a:b], q.shape[0]), whole)


def test_a_gguf_tensor_reads_the_same_after_its_pages_are_dropped(smollm2_gguf):
    """read_gguf lets each tensor's file pages go once copied out; a later read faults them in
    again from the file (nothing is lost, only residency)."""
    reader = open_reader(smollm2_gguf)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    before = bytes(tensor.data.tobytes())
    reader.drop_pages(tensor)
    assert bytes(tensor.data.tobytes()) == before


def test_per_channel_rounding_in_place_matches_the_reference():
    """per_channel_int8 rounds a block of rows in place: the same int8 values as round(w / s)."""
    spec = QuantSpec("int4", 32)
    parts = quantize(torch.randn(70, 64, generator=torch.Generator().manual_seed(1)), spec)
    q, scales = qkernels.per_channel_int8(parts, spec, 64)
    w = dequantize(parts, spec, 64)
    s = w.abs().amax(1) / 127.0
    assert torch.equal(scales, s)
    assert torch.equal(q, torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8))
