"""A frame's path on a GPU node waits for the GPU at most once (mdi.system.transfers).

A worker takes a frame from the wire, moves it to its GPU with the rows' positions and slots,
runs its layers and encodes the result for the wire; a starter embeds a pass, runs its layers,
then the head and sampling for every row that came back. Host-to-device copies from ordinary
memory and every `.cpu()` wait for the GPU, so a path that used them waited several times per
frame. These tests count the waits with torch's sync debug mode: none inside a worker's forward,
one for the frame it sends; one per starter step. Without a GPU they run on the CPU (CI), with
no waits to count: the paths and their results are still checked there, so a change that breaks
them is caught before a GPU run (one such, a worker attribute the test did not set, was found
only on an H200).
"""
import traceback
import warnings

import pytest
import torch

from conftest import tiny_model
from mdi.model.row_batch import RowBatch
from mdi.model.sampling import SamplingParams, sample_generator
from mdi.ring import wire
from mdi.ring.status import BatchCounter
from mdi.ring.transport import LocalLoop
from mdi.ring.wire import Frame
from mdi.starter.pipeline import Pipeline
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.sample import Sample
from mdi.system.transfers import ints_to_device, to_device, to_host
from mdi.worker.run import Run

CUDA = torch.cuda.is_available()


@pytest.fixture
def device():
    return torch.device("cuda" if CUDA else "cpu")


# What torch's sync debug mode says at each wait. Only that: torch 2.11 on an H200 also warned
# once per process from set_sync_debug_mode itself (a notice that the mode is a prototype), and
# a match on "synchroniz" counted it as a wait of the first step counted.
WAIT_WARNING = "called a synchronizing CUDA operation"


class SyncCounter:
    """Counts the GPU waits torch's sync debug mode reports inside a `with` block (0 on CPU);
    `where` names each wait's caller outside torch (torch's own frame says nothing)."""

    def __enter__(self) -> "SyncCounter":
        self.count, self.where = 0, []
        if CUDA:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._seen
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if WAIT_WARNING in str(message):
            ours = [f for f in traceback.extract_stack()[:-1]
                    if "/torch/" not in f.filename and f.filename != warnings.__file__]
            self.count += 1
            self.where.append("%s:%d" % (ours[-1].filename, ours[-1].lineno) if ours else "%s:%d" % (filename, lineno))

    def __exit__(self, *exc) -> None:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)


def test_cpu_tensors_are_left_where_they_are():
    t = torch.arange(6.0).view(2, 3)
    assert to_host(t) is t
    assert to_device(t, torch.device("cpu")) is t
    assert to_device(t, torch.device("cpu"), torch.float16).dtype == torch.float16
    assert ints_to_device([3, 1, 2], "cpu").tolist() == [3, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@torch.no_grad()
def test_a_worker_frame_waits_once_and_computes_what_the_cpu_does(device, dtype):
    model = tiny_model("llama")
    reference = _worker_pass(model, torch.device("cpu"), torch.float32)
    got, waits = _worker_pass(tiny_model("llama"), device, dtype, count=True)
    assert got.device.type == "cpu" and got.dtype == dtype
    error = (got.float() - reference).abs().max() / reference.abs().max()
    assert error <= (2e-2 if dtype == torch.float16 else 1e-5), error
    if CUDA:
        assert waits.count <= 1, "GPU waits in one worker frame: %s" % waits.where


def _worker_pass(chunk, device, dtype, count=False):
    """Prefill 3 samples (several rows each), then one decode frame for all: what a last node
    sends back (each sample's last row), decoded from the wire as the next node would."""
    chunk = chunk.to(device=device, dtype=dtype)
    chunk.allocate_cache(3, 32)
    run = Run.__new__(Run)
    run.chunk, run.is_last, run.batching, run._placement = chunk, True, BatchCounter(), None
    torch.manual_seed(0)
    prefill = Frame("prefill", 1, [0, 1, 2], [0, 0, 0], [5, 2, 7], torch.randn(14, 64).to(dtype))
    run._forward(prefill)
    frame = Frame("decode", 1, [2, 0, 1], [7, 5, 2], [1, 1, 1], torch.randn(3, 64).to(dtype))
    # once uncounted: a GPU records this step's CUDA graph at its first use (mdi.model.graph_decode),
    # which waits for the device; the frame counted replays it (the same rows at the same positions)
    run._forward(frame)
    with SyncCounter() as waits:
        out = run._forward(frame)
        parts = wire.encode(out)
    got = wire.decode([parts[0], bytes(parts[1])], hidden=64, n_slots=3).tensor
    return (got, waits) if count else got.float()


@torch.no_grad()
def test_a_starter_step_waits_once(device):
    chunk = tiny_model("llama").to(device)
    prompts = ["The quick brown fox", "Hi", "To be, or not"]
    chunk.allocate_cache(len(prompts), 64)
    samples = [Sample(i, p, [ord(c) - 32 for c in p], 8, sample_generator(3, i)) for i, p in enumerate(prompts)]
    pipe = Pipeline(chunk, LocalLoop(), 1, SamplingParams(0.0), None, PipelineSettings(max_batch=3))
    for s in samples:
        pipe.admit(s)
    pipe.step()  # the prefill, and the first token of every sample
    pipe.step()  # the first decode step: a GPU records its CUDA graph (mdi.model.graph_decode), waiting
    steps, waits = 0, 0
    while not all(s.done for s in samples):
        with SyncCounter() as counter:
            pipe.step()
        steps, waits = steps + 1, waits + counter.count
        if CUDA:
            assert counter.count <= 1, "GPU waits in one starter step: %s" % counter.where
    assert steps >= 5 and all(len(s.token_ids) == 8 for s in samples)
    # The same ids as the same model on CPU: nothing was lost on the way to and from the GPU.
    cpu = tiny_model("llama")
    cpu.allocate_cache(len(prompts), 64)
    again = [Sample(i, p, [ord(c) - 32 for c in p], 8, sample_generator(3, i)) for i, p in enumerate(prompts)]
    Pipeline(cpu, LocalLoop(), 1, SamplingParams(0.0), None, PipelineSettings(max_batch=3)).run(again)
    assert [s.token_ids for s in samples] == [s.token_ids for s in again]


def test_row_batch_tensors_live_on_the_device(device):
    batch = RowBatch.of([2, 0], [5, 0], [1, 3], device, adapters=[1, 0])
    assert batch.positions.device.type == device.type and batch.positions.tolist() == [5, 0, 1, 2]
    slots, positions, mask = RowBatch.of([1, 0], [4, 2], [1, 1], device).decode_index(device)
    assert slots.device.type == positions.device.type == mask.device.type == device.type
    assert slots.tolist() == [1, 0] and mask.shape == (2, 1, 1, 5)
