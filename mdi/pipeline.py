"""The starter's side of the recurrent pipeline.

With S samples in flight the starter keeps one pass of every unfinished sample travelling the
ring. When a sample's activations come back it runs the head, samples the next token and
immediately sends that sample's next pass, so every node works on a different sample at every
step. A one-node run uses the same loop with a local loopback instead of sockets.
"""
import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

import torch

from .models.model import ModelChunk
from .sampling import SamplingParams, sample_generator, sample_next
from .wire import Frame


class RingTimeout(RuntimeError):
    pass


@dataclass
class Sample:
    index: int
    prompt: str
    prompt_ids: List[int]
    max_new_tokens: int
    rng: torch.Generator
    token_ids: List[int] = field(default_factory=list)
    token_times: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "eos" | "length"

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


class LocalLoop:
    """Transport of a one-node ring: what the starter sends comes straight back."""

    def __init__(self) -> None:
        self.queue = collections.deque()  # type: Deque[Frame]

    def send(self, frame: Frame) -> None:
        self.queue.append(frame)

    def recv(self, timeout: float) -> Frame:
        if not self.queue:
            raise RingTimeout("local loop is empty")
        return self.queue.popleft()


class Pipeline:
    def __init__(self, chunk: ModelChunk, transport, run_id: int, params: SamplingParams,
                 eos_id: Optional[int], recv_timeout: float = 30.0,
                 on_token: Optional[Callable[[Sample, int], None]] = None,
                 watch: Optional[Callable[[], None]] = None) -> None:
        self.chunk, self.transport, self.run_id = chunk, transport, run_id
        self.params, self.eos_id = params, eos_id
        self.recv_timeout = recv_timeout
        self.on_token = on_token
        self.watch = watch  # raises when a node is known to have failed
        self.device = next(chunk.parameters()).device
        self.t0 = 0.0

    def _send_pass(self, sample: Sample, ids: List[int], start: int) -> None:
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        x = self.chunk.forward_blocks(self.chunk.embed(ids_t, start), sample.index, start)
        kind = "prefill" if start == 0 else "decode"
        self.transport.send(Frame(kind, self.run_id, [sample.index], [start], [len(ids)], x))

    def _finish_pass(self, sample: Sample, last_hidden: torch.Tensor) -> None:
        logits = self.chunk.head(last_hidden.to(self.device))[-1]
        token = sample_next(logits, self.params, sample.rng)
        sample.token_ids.append(token)
        sample.token_times.append(time.perf_counter() - self.t0)
        if self.eos_id is not None and token == self.eos_id:
            sample.finish_reason = "eos"
        elif len(sample.token_ids) >= sample.max_new_tokens:
            sample.finish_reason = "length"
        if self.on_token is not None:
            self.on_token(sample, token)

    def _next_frame(self) -> Frame:
        """Wait for the next frame in short slices, asking the watchdog in between, so a dead
        node is reported by name instead of after the whole ring timeout."""
        deadline = time.monotonic() + self.recv_timeout
        while True:
            try:
                return self.transport.recv(min(0.2, self.recv_timeout))
            except RingTimeout:
                if self.watch is not None:
                    self.watch()
                if time.monotonic() > deadline:
                    raise RingTimeout("no activations came back round the ring for %.0f s" % self.recv_timeout)

    def run(self, samples: List[Sample], t0: Optional[float] = None) -> None:
        """Generate until every sample hits EOS or its token limit."""
        self.t0 = time.perf_counter() if t0 is None else t0
        by_index = {s.index: s for s in samples}  # type: Dict[int, Sample]
        in_flight = 0
        with torch.inference_mode():
            for s in samples:
                if not s.done:
                    # The prompt plus any tokens already generated (a replayed sample).
                    self._send_pass(s, s.prompt_ids + s.token_ids, 0)
                    in_flight += 1
            while in_flight:
                frame = self._next_frame()
                if frame.tensor is None:
                    continue  # a stray stop/reset: nothing to finish
                # Rows are either every position of every sample or only each one's last.
                all_rows = frame.tensor.shape[0] == sum(frame.count)
                row = 0
                for idx, count in zip(frame.samples, frame.count):
                    row += count if all_rows else 1
                    sample = by_index.get(idx)
                    if sample is None or sample.done:
                        continue  # not ours to finish (validated frames only name our slots)
                    self._finish_pass(sample, frame.tensor[row - 1:row])
                    if sample.done:
                        in_flight -= 1
                    else:
                        self._send_pass(sample, [sample.token_ids[-1]], sample.length - 1)
