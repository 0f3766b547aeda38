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

With speculation (mdi.starter.speculation) a decoding sample's pass carries drafted tokens too,
and, while the ring has idle boards, several passes of one sample travel at once.
"""
import dataclasses
import functools
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple, cast

from mdi.model.prefix_store import PrefixStore
from mdi.model.sampling import SamplingError, SamplingParams
from mdi.model.sliding_cache import SlidingRing
from mdi.ring.status import BatchCounter
from mdi.ring.transport import Deferred, LocalLoop, RingTimeout, Transport
from mdi.ring.wire import TRAINING_KINDS, Frame, FrameKind
from mdi.starter.frame_rows import adapters_together, returned_rows, virtual_rows
from mdi.starter.pass_compute import computes_logits, head_groups, head_rows, logits_of, pass_inputs, takes_host_arrays
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.prefix_cache import PrefixIndex
from mdi.starter.prompt_passes import replay_pass_rows
from mdi.starter.sample import FinishReason, Sample, draw_next
from mdi.starter.speculation.costs import PassCosts
from mdi.starter.speculation.decoder import SpecDecoder
from mdi.starter.speculation.draft_model import DraftModel
from mdi.starter.speculation.drafters import Drafter

if TYPE_CHECKING:  # torch's chunk and cache; a ggml starter's pipeline never imports torch
    from mdi.model.kv_cache import KVCache
    from mdi.model.transformer import ModelChunk

log = logging.getLogger(__name__)


def _decoder_field(name: str) -> Any:
    """A pipeline attribute that is its speculative decoder's (the engine, the benchmarks and
    the tests set and read them on the pipeline)."""
    return property(lambda self: getattr(self.decoder, name), lambda self, value: setattr(self.decoder, name, value))


class Pipeline:
    """Keeps one pass of every admitted sample travelling the ring.

    `admit` queues a sample's prefill; `step` sends what is queued, waits for the next frames
    to come back, samples each returning sample's next token and sends the next passes at once.
    `run` does both for a fixed batch; the serving scheduler calls them itself to admit
    requests between steps.
    """
    speculation = _decoder_field("speculation")
    n_stages = _decoder_field("n_stages")
    pass_costs = _decoder_field("pass_costs")
    spec_counters = _decoder_field("counters")
    drafter_factory = _decoder_field("drafter_factory")
    draft_model = _decoder_field("draft_model")

    def __init__(self, chunk: "ModelChunk", transport: Transport, run_id: int, params: SamplingParams,
                 eos_id: Any, settings: Optional[PipelineSettings] = None,
                 on_token: Optional[Callable[[Sample, int], None]] = None, watch: Optional[Callable[[], None]] = None,
                 drafter_factory: Optional[Callable[[Sample], Drafter]] = None,
                 draft_model: Optional[DraftModel] = None, pass_costs: Optional[PassCosts] = None,
                 on_train: Optional[Callable[[Frame], None]] = None) -> None:
        settings = self.settings = settings or PipelineSettings()  # the plan's part (mdi.starter.pipeline_settings)
        self.chunk, self.params, self.device = chunk, params, chunk.device
        # The ids that end a sample ("eos"): one id, several (EOS and end-of-turn ids), or none.
        self.end_ids = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
        self.on_token, self.watch = on_token, watch  # watch: raises when a node is known to have failed
        self.max_batch, self.prefill_chunk = settings.max_batch, settings.prefill_chunk
        self.recv_timeout = settings.recv_timeout
        self.context_shift = settings.context_shift  # a full cache slot shifts the window instead of ending the sample
        self.context_shifts = 0
        self.active: Dict[int, Sample] = {}  # cache slot -> admitted, unfinished sample
        self.ready: List[Sample] = []  # samples whose next pass waits to be sent
        self.t0 = time.perf_counter()
        self.compute_seconds = 0.0  # this node's own work (layers, head, sampling): its busy time
        self.batching = BatchCounter()  # rows and samples per forward of the starter's layers
        self.last_progress = time.monotonic()  # a pass came back, or the ring went from idle to busy
        # Speculation (mdi.starter.speculation): its decoder sends passes (_dispatch) and verifies them (_sample_all)
        self._epochs = itertools.count(1)
        self.decoder = SpecDecoder(settings.speculation, settings.n_stages, self._epochs, drafter_factory)
        if pass_costs is not None:  # measured by the engine (measure_pass_costs); else a linear guess
            self.decoder.pass_costs = pass_costs
        self.decoder.draft_model = draft_model  # method draft's model (the engine loads it)
        # Frames carry each sample's pass epoch once any sample may speculate (tag_epochs: one
        # may later, e.g. a served request): only then can a stale pass be in flight.
        self.tag_epochs = settings.tag_epochs or self.speculation.on
        # The prefix cache (enable_prefix_cache): the starter's index of what every node holds, and its own store
        self.prefix: Optional[PrefixIndex] = None
        self.prefix_store: Optional[PrefixStore] = None
        # A training job beside serving (mdi.serving.train_job) gets its frames back here: the
        # scheduler's thread stays the one reader of the ring.
        self.on_train = on_train
        self.reconnect(transport, run_id)

    def reconnect(self, transport: Transport, run_id: int, chunk: Optional["ModelChunk"] = None,
                  n_stages: Optional[int] = None, ggml_cuts: bool = False) -> List[Sample]:
        """Continue on a new ring (after a node failed; `n_stages`: its boards; `ggml_cuts`:
        whether one of them computes on ggml): the passes in flight are lost, so the samples
        that had one are returned for the caller to `admit` again."""
        self.transport, self.run_id = transport, run_id
        if n_stages is not None:
            self.settings, self.n_stages = self.settings.for_ring(n_stages, ggml_cuts), n_stages
        self.last_progress = time.monotonic()
        if chunk is not None:
            self.chunk = chunk
        self._host_arrays = takes_host_arrays(self.chunk)
        # A one-node ring whose chunk computes logits in its blocks' graph (ggml's): a decode
        # frame of up to `_graph_logits` samples then carries each one's logits back, not its rows
        # (`_logit_frames`: by id, while they wait in the loop), and the head is not run again.
        self._head_rows = head_rows(self.chunk)  # logits computed at once (pass_compute.LOGITS_BUDGET_BYTES)
        self._graph_logits = self._head_rows if isinstance(transport, LocalLoop) and computes_logits(self.chunk) else 0
        self._logit_frames: Set[int] = set()
        lost = sorted(self.active.values(), key=lambda s: s.index)
        self.active, self.ready = {}, []
        self.enable_prefix_cache(0, 0)  # the new ring's nodes hold nothing: the engine enables it again
        return lost

    def enable_prefix_cache(self, token_budget: int, store_bytes: int) -> None:
        """Keep earlier prompts' KV: entries of `token_budget` positions on every node, `store_bytes` here (0: none)."""
        if self.prefix_store is not None:
            self.prefix_store.clear()
        on = token_budget > 0 and self.chunk.cache is not None
        ring = on and self.settings.ggml_cuts and SlidingRing.of(self.chunk.config, self.cache.max_len,
                                                                  self.prefill_chunk)
        self.prefix = PrefixIndex(token_budget, ring or None) if on else None
        self.prefix_store = PrefixStore(self.chunk.cache, store_bytes) if on else None

    def choose_slot(self, sample: Sample, free: List[int]) -> int:
        """The free slot for `sample`: with a prefix cache, the one whose last sequence it
        shares most with (mdi.starter.prefix_cache), else the first."""
        if self.prefix is None:
            return free[0]
        tokens = sample.window_tokens(0, sample.window_len) if sample.reuse_prefix else []
        return self.prefix.choose_slot(free, tokens, sample.cache_key, self.settings.ggml_cuts)

    @property
    def cache(self) -> "KVCache":
        """The starter's chunk's KV cache (the engine allocates it before the pipeline runs)."""
        if self.chunk.cache is None:
            raise RuntimeError("the starter's chunk has no KV cache allocated")
        return self.chunk.cache

    @property
    def free_slots(self) -> List[int]:
        return [i for i in range(self.cache.n_slots) if i not in self.active]

    def admit(self, sample: Sample) -> None:
        """Queue the sample's prefill: its prompt plus any tokens it already has (a replay
        after a failure rebuilds every node's cache from the starter's history). It leaves
        with the next `step`, grouped with the other passes ready then."""
        if sample.slot in self.active:
            raise ValueError("cache slot %d is busy" % sample.slot)
        if not self.active:
            self.last_progress = time.monotonic()
        sample.fed = sample.cached_tokens = 0
        spec = sample.speculation or self.speculation
        self.tag_epochs = self.tag_epochs or spec.on  # safe at any time: no pass before it was speculative
        sample.epoch = next(self._epochs) if self.tag_epochs else 0  # a replay's passes in flight are gone
        if sample.window_len > self.cache.max_len:
            raise ValueError("sample %d: %d tokens do not fit a cache slot of %d positions"
                             % (sample.index, sample.window_len, self.cache.max_len))
        if self.prefix is not None:  # start after what the nodes hold of its window already
            sample.fed = sample.cached_tokens = self.prefix.admit(
                sample.slot, sample.window_tokens(0, sample.window_len), sample.cache_key, sample.reuse_prefix,
                self.settings.ggml_cuts)
        self.active[sample.slot] = sample
        self.ready.append(sample)

    # --- sending -------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Send every ready pass, in frames of at most `max_batch` samples and `prefill_chunk`
        prompt tokens (a decode row always fits). Shortest first: decode steps and short
        prompts leave in the first frames, and nodes serve frames in order, so they do not
        queue behind a long prompt's chunk. Speculating samples' passes (and the passes that
        fill the ring for them) leave in frames of their own, whose every row comes back."""
        ready = sorted(self.ready, key=lambda s: s.unsent)  # stable: arrival order among equals
        self.ready = []
        ready = self.decoder.send(ready, list(self.active.values()), self.cache.max_len, self.max_batch,
                                  self.prefill_chunk, self._send_pass)
        while ready:
            group: List[Sample]
            counts: List[int]
            group, counts, budget, rest = [], [], self.prefill_chunk, []
            for sample in adapters_together(ready, self.max_batch):
                take = self._pass_rows(sample, budget, first_prompt=all(c == 1 for c in counts))
                if len(group) >= self.max_batch or take < 1:
                    rest.append(sample)
                    continue
                group.append(sample)
                counts.append(take)
                budget -= take
            self._send_pass(group, counts)
            ready = sorted(rest, key=lambda s: s.unsent)

    def _pass_rows(self, sample: Sample, budget: int, first_prompt: bool) -> int:
        """Rows of `sample`'s next pass in a frame with `budget` rows left (0: not this frame).
        On ggml a prompt's cuts (mdi.starter.prompt_passes) are never shortened to fit: one
        over the budget goes as the frame's `first_prompt` pass, or in a later frame."""
        if sample.unsent == 1:
            return 1
        if not self.settings.ggml_cuts:
            return min(sample.unsent, self.prefill_chunk, budget)
        rows = replay_pass_rows(sample.window_prompt_len, sample.window_len, sample.fed, self.prefill_chunk)
        return rows if rows <= budget or first_prompt else 0

    def _send_pass(self, group: List[Sample], counts: List[int],
                   inputs: Optional[List[Tuple[int, List[int]]]] = None) -> None:
        """One frame: each sample's next `count` tokens of its window, or, for speculative
        passes, its given (start, tokens), whose every row comes back."""
        t0 = time.perf_counter()
        speculative = inputs is not None
        if inputs is None:
            inputs = []
            for sample, count in zip(group, counts):
                inputs.append((sample.fed, sample.window_tokens(sample.fed, count)))
                sample.fed += count
        if any(s.adapter for s in group):  # samples of one adapter side by side: nodes add its delta to a slice
            order = sorted(range(len(group)), key=lambda i: group[i].adapter)
            group, counts, inputs = [group[i] for i in order], [counts[i] for i in order], [inputs[i] for i in order]
        if speculative:
            kind = FrameKind.VERIFY if any(c > 1 for c in counts) else FrameKind.DECODE
        else:  # a decode frame carries one generated token per sample; anything else is a prefill
            decoding = all(c == 1 and start >= s.window_prompt_len for s, c, (start, _) in zip(group, counts, inputs))
            kind = FrameKind.DECODE if decoding else FrameKind.PREFILL
        starts = [start for start, _ in inputs]
        ids = [t for _, tokens in inputs for t in tokens]
        slots = [s.slot for s in group]
        adapters = [s.adapter for s in group]
        virtual = virtual_rows(group, starts, counts, self._host_arrays)  # a soft prompt's rows
        batch, ids_in = pass_inputs(self._host_arrays, slots, starts, counts, adapters,
                                    kind == FrameKind.VERIFY, ids, self.device)
        ops = self.prefix.take_ops() if self.prefix is not None else []
        store, chunk = self.prefix_store, cast(Any, self.chunk)  # torch's ModelChunk, or ggml's, which has more
        logits = kind == FrameKind.DECODE and virtual is None and len(group) <= self._graph_logits
        self.batching.add(batch.rows, len(group))

        def compute() -> Any:
            t1 = time.perf_counter()
            if ops:  # this node's copies first, then every node's as the frame reaches it
                assert store is not None  # set with self.prefix (enable_prefix_cache)
                store.apply(ops)
            if logits:  # every sample draws from its one row: the head in the same graph (lent: _step)
                x = chunk.embed_forward_logits(ids_in, batch, lend=True)
            else:
                x = chunk.embed_forward_rows(ids_in, batch, virtual)
            self.compute_seconds += time.perf_counter() - t1
            return x
        self.compute_seconds += time.perf_counter() - t0
        # one node: computed as it comes back (LocalLoop), in order
        x = Deferred(compute) if isinstance(self.transport, LocalLoop) else compute()
        frame = Frame(kind, self.run_id, slots, starts, counts, x, adapters if any(adapters) else [],
                      [s.epoch for s in group] if self.tag_epochs else [], ops)
        if logits:
            self._logit_frames.add(id(frame))
        self.transport.send(frame)

    # --- receiving -----------------------------------------------------------------
    def _take(self, sample: Sample, token: int) -> None:
        """A token the target chose for `sample` (Sample.take: it may end, or shift its window)."""
        shifts = len(sample.shifts)
        error = sample.take(token, time.perf_counter() - self.t0, self.end_ids, self.cache.max_len, self.context_shift)
        if error is not None:
            self._fail(sample, error)
        self.context_shifts += len(sample.shifts) - shifts
        if self.on_token is not None:
            self.on_token(sample, token)

    def _fail(self, sample: Sample, e: SamplingError) -> None:
        # This sample ends here; its neighbours in the frame and the ring go on.
        sample.finish_reason, sample.error = FinishReason.ERROR, "sample %d: %s" % (sample.index, e)
        log.warning("mdi: %s", sample.error)

    def _sample_all(self, pending: List[Tuple[Sample, Optional[int], Any]], scored: bool = False) -> None:
        """The head over the rows that sample, in groups of up to `_head_rows`, then each sample's
        tokens: one from its last row (`epoch` None), or a verification's (`epoch`: the sample's
        when it came). `scored`: the rows are logits already (a frame whose graph ran the head),
        each frame's drawn from where it is, not stacked into a copy of vocabulary x samples floats."""
        t0 = time.perf_counter()
        for group in [pending] if scored else head_groups(pending, self._head_rows):
            self._draw_group(group, None if scored else logits_of(self.chunk, [r for _, _, r in group], self.device))
        self.compute_seconds += time.perf_counter() - t0

    def _draw_group(self, group: List[Tuple[Sample, Optional[int], Any]], logits: Any) -> None:
        row = 0
        for sample, epoch, rows in group:
            mine = (rows if logits is None else logits[row:row + rows.shape[0]])[:, :self.settings.drawable]
            row += rows.shape[0]
            draw = functools.partial(draw_next, sample, params=self.params if sample.params is None else sample.params,
                                     end_ids=self.end_ids)
            if epoch is not None:
                self.decoder.verify(sample, epoch, mine, draw, self._take, self._fail, len(self.active))
                continue
            try:
                token = draw(mine[-1])
            except SamplingError as e:
                self._fail(sample, e)
                continue
            self._take(sample, token)

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
            frame = self.transport.recv_nowait()  # (those on the socket too: recv(0)'s had taken the inbox's only)
            if frame is None:
                return
            frames.append(frame)
            n += len(frame.samples)

    def _generation_frames(self, frames: List[Frame]) -> List[Frame]:
        """`frames` less the training ones, handed to `on_train` (dropped without a job)."""
        if all(f.kind not in TRAINING_KINDS for f in frames):
            return frames
        for f in frames:
            if f.kind in TRAINING_KINDS and self.on_train is not None:
                self.on_train(f)
        return [f for f in frames if f.kind not in TRAINING_KINDS]

    def step(self, timeout: Optional[float] = None) -> List[Sample]:
        """Send the passes ready, then handle the next frames back from the ring; return the
        samples they advanced, or [] when nothing came back within `timeout` (default
        `recv_timeout`). A ring with passes in flight that has been silent for `recv_timeout`
        raises RingTimeout, however the wait was sliced: a lost frame must not hang its
        samples for ever."""
        if self._host_arrays:  # a ggml chunk: no torch op on the step's way to track
            return self._step(timeout)
        import torch
        with torch.inference_mode():  # entered once per step: it is per token at S = 1
            return self._step(timeout)

    def _step(self, timeout: Optional[float]) -> List[Sample]:
        self._dispatch()
        for waiting in self.active.values():  # grammar masks for the next draws, while the passes travel
            if waiting.constraint is not None and not waiting.done:
                try:
                    waiting.constraint.allowed()
                except SamplingError as e:  # its mask took too long: it ends when its pass is back
                    self._fail(waiting, e)
        frame = self._next_frame(self.recv_timeout if timeout is None else timeout)
        if frame is None:
            if self.active and time.monotonic() - self.last_progress >= self.recv_timeout:
                raise RingTimeout("no activations came back round the ring for %.0f s" % self.recv_timeout)
            return []
        advanced: Dict[int, Sample] = {}  # by identity, in order: two passes of one sample may come back
        # A one-node ring's frames are computed as they are taken (Deferred rows), and each is
        # drawn from before the next is: its logits are read where the head wrote them (lent).
        one_by_one, frames, taken, drawn = isinstance(self.transport, LocalLoop), [frame], 0, False
        if not one_by_one:
            self._more_frames(frames)
        while frames:
            frames = self._generation_frames(frames)
            if frames:
                drawn, self.last_progress = True, time.monotonic()
                self._draw_frames(frames, advanced)
                taken += sum(len(f.samples) for f in frames)
            more = self.transport.recv_nowait() if one_by_one and taken < self.max_batch else None
            frames = [more] if more is not None else []
        if not drawn:
            return []
        for sample in advanced.values():
            if sample.done:
                self.active.pop(sample.slot, None)  # with its drafter, if any (SpecDecoder.send lets it go)
                if self.prefix is not None:  # what its slot holds is cache now
                    self.prefix.release(sample.slot, sample.window_tokens(0, sample.cached_len), sample.cache_key,
                                        not sample.shifts, drafted=sample.drafted)
            elif not sample.verifying:
                self.ready.append(sample)  # its next token, or the next chunk of its prompt
        self._dispatch()
        return list(advanced.values())

    def _draw_frames(self, frames: List[Frame], advanced: Dict[int, Sample]) -> None:
        """Each returning sample's next tokens from its rows in `frames` (the samples into `advanced`)."""
        pending: List[Tuple[Sample, Optional[int], Any]] = []
        scored: List[Tuple[Sample, Optional[int], Any]] = []  # their rows are logits
        for frame in frames:
            if frame.tensor is None:
                continue  # a stray stop/reset: nothing to finish
            into = scored if id(frame) in self._logit_frames else pending
            self._logit_frames.discard(id(frame))
            for slot, count, epoch, rows in returned_rows(frame):
                sample = self.active.get(slot)
                if sample is None:
                    continue  # not ours to finish (validated frames only name our slots)
                if self.tag_epochs and epoch != sample.epoch:
                    self.spec_counters.stale(count)  # built on a guess that failed
                    continue
                if sample.cancelled and not sample.done:
                    sample.finish_reason = FinishReason.CANCELLED
                if sample.verifying:
                    if not sample.done:
                        into.append((sample, epoch, rows))
                elif not sample.done and sample.unsent == 0:
                    into.append((sample, None, rows[-1:]))
                advanced[id(sample)] = sample
        self._sample_all(scored, scored=True)  # first: the head below would end their logits' lend
        self._sample_all(pending)

    def prefix_metrics(self) -> Dict[str, Any]:
        """The prefix cache's index counters and this node's store, or {} without one."""
        if self.prefix is None or self.prefix_store is None:
            return {}
        return dict(self.prefix.metrics(), **dataclasses.asdict(self.prefix_store.stats))

    def speculation_metrics(self) -> Dict[str, Any]:
        """The run's drafting counters and the pass costs k was chosen by, or {} when no sample
        could speculate."""
        if not self.tag_epochs:
            return {}
        out = dict(self.spec_counters.metrics(), pass_costs=self.pass_costs.to_json())
        if self.draft_model is not None:
            out["draft_backend"] = self.draft_model.backend
        return out

    def run(self, samples: List[Sample], step: Optional[Callable[[], List[Sample]]] = None,
            t0: Optional[float] = None) -> None:
        """Generate until every sample hits EOS or its token limit; `step` wraps `self.step`
        (the engine's adds recovery from node failures); token times count from `t0` if given."""
        self.t0 = self.t0 if t0 is None else t0
        for s in samples:
            if not s.done:
                self.admit(s)
        while self.active:
            (step or self.step)()
