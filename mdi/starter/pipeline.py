"""The starter's side of the recurrent pipeline.

With S samples in flight the starter keeps one pass of every unfinished sample travelling the
ring. When a sample's activations come back it runs the head, samples the next token and
immediately sends that sample's next pass, so every node works on a different group at every
step. A one-node run uses the same loop with a local loopback instead of sockets.

Samples travel in groups (ORCA's selective batching): the passes ready at one moment, up to
`max_batch` samples, share one frame, so each node reads its weights once for all of them.
A prompt longer than `prefill_chunk` tokens is sent in passes of that many (chunked prefill);
a frame carries at most that many prompt tokens, so the decode steps sharing the ring with a
long prompt wait for one chunk, not for the whole prompt.
"""
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from mdi.model.row_batch import RowBatch
from mdi.model.transformer import ModelChunk
from mdi.model.sampling import SamplingError, SamplingParams, sample_generator, sample_next
from mdi.ring.status import BatchCounter
from mdi.ring.transport import RingTimeout, Transport
from mdi.ring.wire import Frame, FrameKind
from mdi.runconfig import DEFAULT_PREFILL_CHUNK
from mdi.system.str_enum import StrEnum
from mdi.system.transfers import ints_to_device, to_device, to_host

log = logging.getLogger(__name__)


class FinishReason(StrEnum):
    """Why a sample, or the request it serves, ended: one vocabulary for the pipeline, the
    metrics record and the API (whose finish_reason says "stop" for EOS)."""
    EOS = "eos"  # an end-of-generation token
    LENGTH = "length"  # its token budget
    CONTEXT = "context"  # the model's context is full (without generation.context_shift)
    CANCELLED = "cancelled"  # its client went away, or asked to stop
    ERROR = "error"  # it failed (alone, or with the ring)
    STOP = "stop"  # serving: an end-of-generation token or a stop string


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
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None  # why this sample alone failed (finish_reason "error")
    cancelled: bool = False  # set from any thread; takes effect when the sample's pass returns
    fed: int = 0  # tokens of its window already sent through the ring: in every node's cache
    dropped: int = 0  # generated tokens left out of the window by context shifts
    shifts: List[int] = field(default_factory=list)  # len(token_ids) at each context shift
    adapter: int = 0  # the LoRA adapter it runs with on every node (0: the base model alone)
    # A prompt-tuning adapter's virtual tokens [n, n_embd]: prompt_ids starts with n placeholder
    # ids whose embeddings these replace (positions 0..n-1), on every pass that covers them.
    soft_prompt: Optional[torch.Tensor] = None

    @property
    def virtual(self) -> int:
        return 0 if self.soft_prompt is None else int(self.soft_prompt.shape[0])

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.index

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def window_len(self) -> int:
        """Tokens the caches hold (or will): the prompt and the generated tokens not shifted out."""
        return len(self.prompt_ids) + len(self.token_ids) - self.dropped

    def window_tokens(self, start: int, count: int) -> List[int]:
        """Tokens [start, start + count) of that window, without building all of it."""
        prompt = self.prompt_ids[start:start + count]
        rest = count - len(prompt)
        if rest <= 0:
            return prompt
        first = self.dropped + max(0, start - len(self.prompt_ids))
        return prompt + self.token_ids[first:first + rest]

    @property
    def unsent(self) -> int:
        """Tokens its next pass still has to send: the rest of the prompt, or the last token."""
        return self.window_len - self.fed

    def shift_context(self) -> None:
        """Drop the oldest half of the generated tokens still in the window (llama.cpp's context
        shift) and send the rest again from position 0: every node rebuilds this sample's cache
        from the shorter window, so its positions (RoPE or learned) stay within the context."""
        kept = len(self.token_ids) - self.dropped
        self.dropped += max(1, kept // 2)
        self.shifts.append(len(self.token_ids))
        self.fed = 0


def make_samples(prompts: List[str], prompt_ids: List[List[int]], max_new_tokens: int,
                 seed: int) -> List[Sample]:
    return [Sample(i, p, ids, max_new_tokens, sample_generator(seed, i))
            for i, (p, ids) in enumerate(zip(prompts, prompt_ids))]


def _virtual_rows(group: List[Sample], starts: List[int], counts: List[int]):
    """(rows, embeddings) of the virtual tokens a pass carries (soft prompts), else None."""
    rows: List[int]
    rows, values, row = [], [], 0
    for sample, start, count in zip(group, starts, counts):
        n = sample.virtual
        if start < n:
            end = min(n, start + count)
            rows.extend(range(row, row + end - start))
            values.append(sample.soft_prompt[start:end])
        row += count
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long), torch.cat(values)


def _adapters_together(ready: List[Sample], max_batch: int) -> List[Sample]:
    """`ready` (shortest pass first) reordered for filling one frame: the shortest pass leads,
    then the passes of the adapters already in the frame, then the rest in order. A node adds
    each distinct adapter's delta once per frame, so a frame's adapter cost grows with the
    adapters in it: 8 samples over 4 adapters in frames of 3 go as 2 + 2 + 1 adapters instead
    of 3 + 3 + 2. A frame still holds at most `prefill_chunk` prompt tokens, and the passes
    that circulate together after prefill keep this grouping."""
    if len(ready) <= max_batch or not any(s.adapter for s in ready):
        return ready
    chosen: List[Sample] = []
    rest = list(ready)
    while rest and len(chosen) < max_batch:
        # The shortest pass left leads (or tops the frame up) and pulls in its adapter's fellows.
        head = rest.pop(0)
        same = [s for s in rest if s.adapter == head.adapter][:max_batch - len(chosen) - 1]
        chosen += [head] + same
        taken = set(id(s) for s in same)  # by identity: a Sample's == compares its tensors
        rest = [s for s in rest if id(s) not in taken]
    return chosen + rest


class Pipeline:
    """Keeps one pass of every admitted sample travelling the ring.

    `admit` queues a sample's prefill; `step` sends what is queued, waits for the next frames
    to come back, samples each returning sample's next token and sends the next passes at once.
    `run` does both for a fixed batch; the serving scheduler calls them itself to admit
    requests between steps.
    """

    def __init__(self, chunk: ModelChunk, transport: Transport, run_id: int, params: SamplingParams,
                 eos_id: Any, recv_timeout: float = 30.0,
                 on_token: Optional[Callable[[Sample, int], None]] = None,
                 watch: Optional[Callable[[], None]] = None, max_batch: int = 1,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, context_shift: bool = False) -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        self.chunk, self.params = chunk, params
        # The ids that end a sample ("eos"): one id, several (EOS and end-of-turn ids), or none.
        self.end_ids = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
        self.recv_timeout = recv_timeout
        self.on_token = on_token
        self.watch = watch  # raises when a node is known to have failed
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.context_shift = context_shift  # a full cache slot shifts the window instead of ending the sample
        self.context_shifts = 0
        self.device = next(chunk.parameters()).device
        self.active: Dict[int, Sample] = {}  # cache slot -> admitted, unfinished sample
        self.ready: List[Sample] = []  # samples whose next pass waits to be sent
        self.t0 = time.perf_counter()
        self.compute_seconds = 0.0  # this node's own work (layers, head, sampling): its busy time
        self.batching = BatchCounter()  # rows and samples per forward of the starter's layers
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
        self.active, self.ready = {}, []
        return lost

    @property
    def free_slots(self) -> List[int]:
        return [i for i in range(self.chunk.cache.n_slots) if i not in self.active]

    def admit(self, sample: Sample) -> None:
        """Queue the sample's prefill: its prompt plus any tokens it already has (a replay
        after a failure rebuilds every node's cache from the starter's history). It leaves
        with the next `step`, grouped with the other passes ready then."""
        if sample.slot in self.active:
            raise ValueError("cache slot %d is busy" % sample.slot)
        if not self.active:
            self.last_progress = time.monotonic()
        sample.fed = 0
        if sample.window_len > self.chunk.cache.max_len:
            raise ValueError("sample %d: %d tokens do not fit a cache slot of %d positions"
                             % (sample.index, sample.window_len, self.chunk.cache.max_len))
        self.active[sample.slot] = sample
        self.ready.append(sample)

    # --- sending -------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Send every ready pass, in frames of at most `max_batch` samples and `prefill_chunk`
        prompt tokens (a decode row always fits). Shortest first: decode steps and short
        prompts leave in the first frames, and nodes serve frames in order, so they do not
        queue behind a long prompt's chunk."""
        ready = sorted(self.ready, key=lambda s: s.unsent)  # stable: arrival order among equals
        self.ready = []
        while ready:
            group: List[Sample]
            group, counts, budget, rest = [], [], self.prefill_chunk, []
            for sample in _adapters_together(ready, self.max_batch):
                want = sample.unsent
                take = 1 if want == 1 else min(want, self.prefill_chunk, budget)
                if len(group) >= self.max_batch or take < 1:
                    rest.append(sample)
                    continue
                group.append(sample)
                counts.append(take)
                budget -= take
            self._send_pass(group, counts)
            ready = sorted(rest, key=lambda s: s.unsent)

    def _send_pass(self, group: List[Sample], counts: List[int]) -> None:
        t0 = time.perf_counter()
        if any(s.adapter for s in group):  # samples of one adapter side by side: nodes add its delta to a slice
            order = sorted(range(len(group)), key=lambda i: group[i].adapter)
            group, counts = [group[i] for i in order], [counts[i] for i in order]
        ids, starts = [], []
        # A decode frame carries one generated token per sample; anything else is a prefill.
        decoding = all(c == 1 and s.fed >= len(s.prompt_ids) for s, c in zip(group, counts))
        kind = FrameKind.DECODE if decoding else FrameKind.PREFILL
        for sample, count in zip(group, counts):
            ids.extend(sample.window_tokens(sample.fed, count))
            starts.append(sample.fed)
            sample.fed += count
        slots = [s.slot for s in group]
        adapters = [s.adapter for s in group]
        batch = RowBatch.of(slots, starts, counts, self.device, adapters)
        ids_t = ints_to_device(ids, self.device)
        x = self.chunk.forward_rows(self.chunk.embed_rows(ids_t, batch.positions, _virtual_rows(group, starts, counts)),
                                    batch)
        self.batching.add(batch.rows, len(group))
        self.compute_seconds += time.perf_counter() - t0
        self.transport.send(Frame(kind, self.run_id, slots, starts, counts, x, adapters if any(adapters) else []))

    # --- receiving -----------------------------------------------------------------
    def _sample_all(self, pending: List[Sample], rows: List[torch.Tensor]) -> None:
        """The head over every row that samples, at once, then each sample's own next token."""
        if not pending:
            return
        t0 = time.perf_counter()
        # Every row's logits come to the host in one copy (one wait on a GPU), not one per sample.
        logits = to_host(self.chunk.head(to_device(torch.stack(rows), self.device)))
        for sample, row_logits in zip(pending, logits):
            try:
                token = sample_next(row_logits, self.params if sample.params is None else sample.params, sample.rng)
            except SamplingError as e:
                # This sample ends here; its neighbours in the frame and the ring go on.
                sample.finish_reason, sample.error = FinishReason.ERROR, "sample %d: %s" % (sample.index, e)
                log.warning("mdi: %s", sample.error)
                continue
            sample.token_ids.append(token)
            sample.token_times.append(time.perf_counter() - self.t0)
            if token in self.end_ids:
                sample.finish_reason = FinishReason.EOS
            elif len(sample.token_ids) >= sample.max_new_tokens:
                sample.finish_reason = FinishReason.LENGTH
            elif sample.window_len > self.chunk.cache.max_len:  # its next position is past the slot
                if self.context_shift:
                    sample.shift_context()
                    self.context_shifts += 1
                else:
                    sample.finish_reason = FinishReason.CONTEXT
            if self.on_token is not None:
                self.on_token(sample, token)
        self.compute_seconds += time.perf_counter() - t0

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

    def _more_frames(self, frames: List[Frame]) -> None:
        """Frames already waiting join the first one, up to `max_batch` samples: their next
        passes then share one forward here and one frame round the ring."""
        n = sum(len(f.samples) for f in frames)
        while n < self.max_batch:
            try:
                frame = self.transport.recv(0.0)
            except RingTimeout:
                return
            frames.append(frame)
            n += len(frame.samples)

    def step(self, timeout: Optional[float] = None) -> List[Sample]:
        """Send the passes ready, then handle the next frames back from the ring; return the
        samples they advanced, or [] when nothing came back within `timeout` (default
        `recv_timeout`). A ring with passes in flight that has been silent for `recv_timeout`
        raises RingTimeout, however the wait was sliced: a lost frame must not hang its
        samples for ever."""
        with torch.inference_mode():
            self._dispatch()
        frame = self._next_frame(self.recv_timeout if timeout is None else timeout)
        if frame is None:
            if self.active and time.monotonic() - self.last_progress >= self.recv_timeout:
                raise RingTimeout("no activations came back round the ring for %.0f s" % self.recv_timeout)
            return []
        frames = [frame]
        self._more_frames(frames)
        self.last_progress = time.monotonic()
        advanced, sampling, rows = [], [], []
        for frame in frames:
            if frame.tensor is None:
                continue  # a stray stop/reset: nothing to finish
            # Rows are either every position of every sample or only each one's last.
            all_rows = frame.tensor.shape[0] == sum(frame.count)
            row = 0
            for slot, count in zip(frame.samples, frame.count):
                row += count if all_rows else 1
                sample = self.active.get(slot)
                if sample is None:
                    continue  # not ours to finish (validated frames only name our slots)
                if sample.cancelled and not sample.done:
                    sample.finish_reason = FinishReason.CANCELLED
                if not sample.done and sample.unsent == 0:
                    sampling.append(sample)
                    rows.append(frame.tensor[row - 1])
                advanced.append(sample)
        with torch.inference_mode():
            self._sample_all(sampling, rows)
            for sample in advanced:
                if sample.done:
                    self.active.pop(sample.slot, None)
                else:
                    self.ready.append(sample)  # its next token, or the next chunk of its prompt
            self._dispatch()
        return advanced

    def run(self, samples: List[Sample], step: Optional[Callable[[], List[Sample]]] = None) -> None:
        """Generate until every sample hits EOS or its token limit; `step` wraps `self.step`
        (the engine's adds recovery from node failures)."""
        for s in samples:
            if not s.done:
                self.admit(s)
        while self.active:
            (step or self.step)()
