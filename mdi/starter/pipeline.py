"""The starter's side of the recurrent pipeline.

With S samples in flight the starter keeps one pass of every unfinished sample travelling the
ring. When a sample's activations come back it runs the head, samples the next token and
immediately sends that sample's next pass, so every node works on a different sample at every
step. A one-node run uses the same loop with a local loopback instead of sockets.
"""
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional  # noqa: F401  (type comments)

import torch

from mdi.model.transformer import ModelChunk
from mdi.model.sampling import SamplingError, SamplingParams, sample_generator, sample_next
from mdi.ring.transport import RingTimeout, Transport
from mdi.ring.wire import Frame

log = logging.getLogger(__name__)


@dataclass
class Sample:
    index: int
    prompt: str
    prompt_ids: List[int]
    max_new_tokens: int
    rng: torch.Generator
    slot: int = -1  # KV cache slot on every node; defaults to the index
    params: Optional[SamplingParams] = None  # per-sample sampling (serving); None: the run's
    token_ids: List[int] = field(default_factory=list)
    token_times: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "eos" | "length" | "cancelled" | "error"
    error: Optional[str] = None  # why this sample alone failed (finish_reason "error")
    cancelled: bool = False  # set from any thread; takes effect when the sample's pass returns

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.index

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


def make_samples(prompts: List[str], prompt_ids: List[List[int]], max_new_tokens: int,
                 seed: int) -> List[Sample]:
    return [Sample(i, p, ids, max_new_tokens, sample_generator(seed, i))
            for i, (p, ids) in enumerate(zip(prompts, prompt_ids))]


class Pipeline:
    """Keeps one pass of every admitted sample travelling the ring.

    `admit` sends a sample's prefill; `step` waits for the next frame to come back, samples
    each returning sample's next token and sends its next pass at once. `run` does both for a
    fixed batch; the serving scheduler calls them itself to admit requests between steps.
    """

    def __init__(self, chunk: ModelChunk, transport: Transport, run_id: int, params: SamplingParams,
                 eos_id: Optional[int], recv_timeout: float = 30.0,
                 on_token: Optional[Callable[[Sample, int], None]] = None,
                 watch: Optional[Callable[[], None]] = None) -> None:
        self.chunk, self.params, self.eos_id = chunk, params, eos_id
        self.recv_timeout = recv_timeout
        self.on_token = on_token
        self.watch = watch  # raises when a node is known to have failed
        self.device = next(chunk.parameters()).device
        self.active = {}  # type: Dict[int, Sample]  # cache slot -> sample with a pass in flight
        self.t0 = time.perf_counter()
        self.compute_seconds = 0.0  # this node's own work (layers, head, sampling): its busy time
        self.last_progress = time.monotonic()  # a pass came back, or the ring went from idle to busy
        self.reconnect(transport, run_id)

    def reconnect(self, transport: Transport, run_id: int, chunk: Optional[ModelChunk] = None) -> List[Sample]:
        """Continue on a new ring (after a node failed): the passes in flight are lost, so
        the samples that had one are returned for the caller to `admit` again."""
        self.transport, self.run_id = transport, run_id
        self.last_progress = time.monotonic()
        if chunk is not None:
            self.chunk = chunk
        lost = sorted(self.active.values(), key=lambda s: s.index)
        self.active = {}
        return lost

    @property
    def free_slots(self) -> List[int]:
        return [i for i in range(self.chunk.cache.n_slots) if i not in self.active]

    def admit(self, sample: Sample) -> None:
        """Send the sample's prefill: its prompt plus any tokens it already has (a replay
        after a failure rebuilds every node's cache from the starter's history)."""
        if sample.slot in self.active:
            raise ValueError("cache slot %d is busy" % sample.slot)
        if not self.active:
            self.last_progress = time.monotonic()
        self.active[sample.slot] = sample
        with torch.inference_mode():
            self._send_pass(sample, sample.prompt_ids + sample.token_ids, 0)

    def _send_pass(self, sample: Sample, ids: List[int], start: int) -> None:
        t0 = time.perf_counter()
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        x = self.chunk.forward_blocks(self.chunk.embed(ids_t, start), sample.slot, start)
        self.compute_seconds += time.perf_counter() - t0
        kind = "prefill" if start == 0 else "decode"
        self.transport.send(Frame(kind, self.run_id, [sample.slot], [start], [len(ids)], x))

    def _finish_pass(self, sample: Sample, last_hidden: torch.Tensor) -> None:
        t0 = time.perf_counter()
        logits = self.chunk.head(last_hidden.to(self.device))[-1]
        try:
            token = sample_next(logits, self.params if sample.params is None else sample.params, sample.rng)
        except SamplingError as e:
            # This sample ends here; its neighbours in the frame and the ring go on.
            self.compute_seconds += time.perf_counter() - t0
            sample.finish_reason, sample.error = "error", "sample %d: %s" % (sample.index, e)
            log.warning("mdi: %s", sample.error)
            return
        now = time.perf_counter()
        self.compute_seconds += now - t0
        sample.token_ids.append(token)
        sample.token_times.append(now - self.t0)
        if self.eos_id is not None and token == self.eos_id:
            sample.finish_reason = "eos"
        elif len(sample.token_ids) >= sample.max_new_tokens:
            sample.finish_reason = "length"
        if self.on_token is not None:
            self.on_token(sample, token)

    def _next_frame(self, timeout: float) -> Optional[Frame]:
        """Wait for the next frame in short slices, asking the watchdog in between, so a dead
        node is reported by name instead of after the whole ring timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.transport.recv(max(0.0, min(0.2, deadline - time.monotonic())))
            except RingTimeout:
                if self.watch is not None:
                    self.watch()
                if time.monotonic() >= deadline:
                    return None

    def step(self, timeout: Optional[float] = None) -> List[Sample]:
        """Handle the next frame back from the ring; return the samples it advanced, or []
        when nothing came back within `timeout` (default `recv_timeout`). A ring with passes
        in flight that has been silent for `recv_timeout` raises RingTimeout, however the
        wait was sliced: a lost frame must not hang its samples for ever."""
        frame = self._next_frame(self.recv_timeout if timeout is None else timeout)
        if frame is None:
            if self.active and time.monotonic() - self.last_progress >= self.recv_timeout:
                raise RingTimeout("no activations came back round the ring for %.0f s" % self.recv_timeout)
            return []
        if frame.tensor is None:
            return []  # a stray stop/reset: nothing to finish
        self.last_progress = time.monotonic()
        advanced = []
        # Rows are either every position of every sample or only each one's last.
        all_rows = frame.tensor.shape[0] == sum(frame.count)
        row = 0
        with torch.inference_mode():
            for slot, count in zip(frame.samples, frame.count):
                row += count if all_rows else 1
                sample = self.active.pop(slot, None)
                if sample is None:
                    continue  # not ours to finish (validated frames only name our slots)
                if sample.cancelled and not sample.done:
                    sample.finish_reason = "cancelled"
                if not sample.done:
                    self._finish_pass(sample, frame.tensor[row - 1:row])
                    if not sample.done:
                        self.active[slot] = sample
                        self._send_pass(sample, [sample.token_ids[-1]], sample.length - 1)
                advanced.append(sample)
        return advanced

    def run(self, samples: List[Sample], step: Optional[Callable[[], List[Sample]]] = None) -> None:
        """Generate until every sample hits EOS or its token limit; `step` wraps `self.step`
        (the engine's adds recovery from node failures)."""
        for s in samples:
            if not s.done:
                self.admit(s)
        while self.active:
            (step or self.step)()
