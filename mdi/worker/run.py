"""One run on a worker: its data-plane endpoint and the compute loop that pops a frame,
selects each sample's KV cache slot, runs this node's blocks and pushes the result on.

The chunk is a torch one (mdi.model.transformer) or a ggml one (mdi.model.ggml.chunk): frames
carry torch tensors where the process has torch loaded, numpy arrays in a worker computing
with ggml, which never loads torch (mdi.ring.wire decodes to either)."""
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

import numpy as np

from mdi.model.pass_rows import PassRows
from mdi.model.prefix_store import PrefixStore
from mdi.ring.init_request import InitRequest
from mdi.ring.status import BatchCounter
from mdi.ring.transport import RingEndpoint, RingTimeout
from mdi.ring.wire import ALL_ROWS_KINDS, Frame, FrameKind, GENERATION_KINDS, TRAINING_KINDS
from mdi.system.memory import IdleTrim, release_freed_memory

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT = 8.0  # seconds without any sign of the starter before a run ends
READ_AHEAD = 64  # frames read into the inbox before the next is handled (the transport bounds its own queue)
IDLE_GAPS = 2.0  # generation passes overdue by this many of their usual gaps: the ring serves no request now
MAX_GAP_S = 2.0  # the longest gap between generation passes counted as "usual"
TRAIN_WAIT_S = 0.005  # a training frame waiting its turn looks again after this long
TURN_WINDOW = 0.3  # a training frame starts within this share of the usual gap after a pass, or waits for the next


class Run:
    """One run's state on this worker: its id, data-plane endpoint and compute thread."""

    def __init__(self, request: InitRequest, chunk: Any, endpoint: RingEndpoint, peer: str = "?",
                 threads: Optional[int] = None, prefix_bytes: int = 0) -> None:
        self.request = request
        self.id = request.run_id
        self.chunk: Optional[Any] = chunk  # None once the run is stopped
        self.endpoint = endpoint
        self.peer = peer
        self.threads = threads
        self.is_last = request.data.is_last
        hb = request.heartbeat_timeout
        self.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT if hb is None else hb
        self.stopped = threading.Event()
        # Set before the stop frame is passed on: from then on the run no longer holds the
        # worker (its starter may send the next /init before this thread has finished).
        self.ending = threading.Event()
        self.frames_done = 0
        self.compute_seconds = 0.0  # time spent in _forward: per-node step time for /metrics
        self.pass_started: Optional[float] = None  # monotonic start of the pass in hand (None: none)
        self._clock = _PassClock(self)
        self.idle = IdleTrim()
        self.batching = BatchCounter()
        self.max_batch = request.max_batch
        self.max_rows = request.max_rows
        self.inbox: Deque[Frame] = deque()  # frames read ahead of the one in hand, in arrival order
        self.latest_epoch: Dict[int, int] = {}  # slot -> the latest pass epoch seen for it
        self.passes_cancelled = 0  # stale speculative passes dropped here unrun
        self.rows_cancelled = 0
        # Earlier prompts' KV, kept as the starter's frames say (mdi.model.prefix_store).
        self.prefix: Optional[PrefixStore] = PrefixStore(chunk.cache, prefix_bytes) \
            if prefix_bytes and chunk.cache is not None else None
        self.error: Optional[str] = None
        self.training: Optional[Any] = None  # a mdi.worker.training.WorkerTraining once POST /train made this run train
        self.training_dropped = False  # DELETE /train ended its training: late training frames are dropped
        # Training beside serving waits its turn (_training_turn): when the last generation pass
        # ended here, the usual gap between two, and whether a training frame ran since.
        self.last_generation = 0.0
        self.generation_gap = 0.0
        self.trained_since_generation = True
        self._placement: Optional[Tuple[Any, Any]] = None  # (device, dtype): set by the first torch _forward
        self.thread = threading.Thread(target=self._compute_loop, name="mdi-compute", daemon=True)

    def holds_worker(self) -> bool:
        """Whether this run still holds the worker: not stopped, no stop frame seen."""
        return not (self.stopped.is_set() or self.ending.is_set())

    def _compute_loop(self) -> None:
        try:
            torch = sys.modules.get("torch")  # loaded where the chunk computes with torch
            if self.threads and torch is not None:
                # torch reads its thread count per thread on first use: set it in this thread too.
                torch.set_num_threads(self.threads)
            with torch.inference_mode() if torch is not None else contextlib.nullcontext():
                while not self.stopped.is_set():
                    frame = self._next_frame()
                    if frame is None:
                        self.idle.idle()  # its heap's free pages go back once idle a while
                        continue
                    self.idle.worked()
                    if frame.kind in (FrameKind.STOP, FrameKind.RESET):
                        if frame.kind == FrameKind.STOP:
                            self.ending.set()
                        self.endpoint.send(frame)
                        if frame.kind == FrameKind.STOP:
                            self.endpoint.flush(timeout=5)
                            self.stopped.set()
                        continue
                    if frame.kind in TRAINING_KINDS:
                        for out in self._train(frame):
                            self.endpoint.send(out)
                        continue
                    if frame.kind in GENERATION_KINDS:
                        frame = self._gather(frame)
                    with self._computing():
                        self._apply_cache_ops(frame)
                        out = self._forward(frame)
                    self.endpoint.send(out)
                    self.frames_done += 1
                    if frame.kind in GENERATION_KINDS:
                        self._generation_done()
        except Exception as e:  # report, never die silently
            if self.stopped.is_set():  # the run was ended under a long computation: not its failure
                log.info("compute loop ended after its run was stopped: %s", e)
            else:
                self.error = "%s: %s" % (type(e).__name__, e)
                log.exception("compute loop failed")
        finally:
            self.stopped.set()
            chunk = self.chunk
            if self.prefix is not None:
                self.prefix.clear()
            if chunk is not None:
                chunk.free_cache()  # a finished or failed run gives its cache memory back
                # ... to the OS, not to this thread's malloc arena: the next run allocates from
                # other threads, and a worker serving run after run grew 33 MB in 12 GPT-2 runs.
                release_freed_memory()
            # Unbind the data port now, not at the next /init: a neighbour configured for the
            # next run must find nothing there (and retry) rather than this run's socket.
            self.endpoint.close()

    def _computing(self) -> "_PassClock":
        """A pass in hand: its time counted in compute_seconds, and seen while it runs (pass_seconds)."""
        return self._clock

    @property
    def pass_seconds(self) -> float:
        """How long the pass in hand has been computing (0: none): a ring gone silent names
        the node stuck in one (short of memory, starved of CPU)."""
        started = self.pass_started
        return 0.0 if started is None else round(time.monotonic() - started, 3)

    def _next_frame(self) -> Optional[Frame]:
        """The next frame to handle (None after a short wait for one): the oldest in the inbox,
        after reading what has arrived behind it, without its stale passes."""
        while True:
            if not self.inbox:
                try:
                    self._note(self.endpoint.recv(timeout=0.1))
                except RingTimeout:
                    return None
            self._read_ahead()
            head = self._take_next()
            if head is None:  # a training frame waits for its turn
                try:
                    self._note(self.endpoint.recv(timeout=TRAIN_WAIT_S))
                except RingTimeout:
                    pass
                return None
            frame = self._live(head)
            if frame is not None:
                return frame
            if not self.inbox:
                return None

    def _take_next(self) -> Optional[Frame]:
        """The inbox's oldest frame, except that a training job beside --serve yields to the
        requests' decode and prefill passes (mdi.serving.train_job): a generation frame waiting
        behind training frames goes first, and while requests run a training frame waits for
        its turn (None). Each kind keeps its own order (a training step's frames depend on theirs
        only, never on generation frames), and a stop, reset or other frame is never passed."""
        inbox = self.inbox
        if inbox[0].kind in TRAINING_KINDS:
            for i, frame in enumerate(inbox):
                if frame.kind in GENERATION_KINDS:
                    del inbox[i]
                    return frame
                if frame.kind not in TRAINING_KINDS:
                    break
            if not self._training_turn(inbox[0]):
                return None
        return inbox.popleft()

    def _generation_done(self) -> None:
        now = time.monotonic()
        if self.last_generation:
            gap = min(now - self.last_generation, MAX_GAP_S)
            self.generation_gap = gap if not self.generation_gap else 0.8 * self.generation_gap + 0.2 * gap
        self.last_generation, self.trained_since_generation = now, False

    def _training_turn(self, frame: Frame) -> bool:
        """Whether a training frame may run now. While requests run, one costly training frame
        (a forward, or the backward of this node's layers) runs right after each generation
        pass, in the time before the next one comes (at S = 1 a node waits a whole round for
        it): the passes keep their pace and the job still moves. One that arrives later in
        the gap waits for the next pass, so it never starts just before a pass comes. Relays (of
        gradients and state copies), steps and clip frames cost nothing and always go; with no
        pass overdue, nothing waits."""
        tag, chunk = frame.train, self.chunk
        if frame.kind in (FrameKind.STEP, FrameKind.CLIP, FrameKind.STATE) or (
                frame.kind == FrameKind.GRAD and tag is not None and chunk is not None and tag.layer != chunk.last):
            return True
        since = time.monotonic() - self.last_generation
        if not self.trained_since_generation and since <= TURN_WINDOW * self.generation_gap + 0.002:
            self.trained_since_generation = True
            return True
        return since > IDLE_GAPS * self.generation_gap + 0.05  # no request is being served here now

    def _read_ahead(self) -> None:
        """Frames already here join the inbox, and the latest epoch of each slot is noted: a
        speculating starter starts a new epoch for a sample when a verification rejects, so
        its passes of earlier epochs still queued here are stale and are dropped unrun."""
        while len(self.inbox) < READ_AHEAD:
            more = self.endpoint.recv_nowait()
            if more is None:
                break
            self._note(more)

    def _note(self, frame: Frame) -> None:
        self.inbox.append(frame)
        for slot, epoch in zip(frame.samples, frame.epochs):
            if epoch > self.latest_epoch.get(slot, 0):
                self.latest_epoch[slot] = epoch

    def _live(self, frame: Frame) -> Optional[Frame]:
        """`frame` without the passes a later epoch made stale (None: nothing left), or None
        when it cannot be computed on."""
        if not self._computable(frame):
            return None
        # A frame bringing prefix cache ops runs whole: its ops must reach every node, and a
        # stale pass only writes positions its sample's later passes write again.
        if not frame.epochs or frame.kind not in GENERATION_KINDS or frame.cache_ops:
            return frame
        keep = [i for i, (slot, epoch) in enumerate(zip(frame.samples, frame.epochs))
                if epoch >= self.latest_epoch.get(slot, 0)]
        if len(keep) == len(frame.samples):
            return frame
        self.passes_cancelled += len(frame.samples) - len(keep)
        self.rows_cancelled += sum(frame.count) - sum(frame.count[i] for i in keep)
        if not keep:
            return None
        starts = [sum(frame.count[:i]) for i in keep]  # each kept sample's first row
        rows = [r for i, first in zip(keep, starts) for r in range(first, first + frame.count[i])]
        ids = frame.adapter_ids()
        adapters = [ids[i] for i in keep]
        return Frame(frame.kind, frame.run, [frame.samples[i] for i in keep], [frame.start[i] for i in keep],
                     [frame.count[i] for i in keep], _rows_of(frame)[rows], adapters if any(adapters) else [],
                     [frame.epochs[i] for i in keep])

    def _gather(self, frame: Frame) -> Frame:
        """Opportunistic batching: generation frames already queued behind `frame` join it,
        up to `max_batch` samples and `max_rows` rows, so one forward serves them all; the
        first frame that cannot join stays first in the inbox."""
        frames = [frame]
        n, rows, slots, kinds = len(frame.samples), sum(frame.count), set(frame.samples), {frame.kind}
        while n < self.max_batch and self.inbox:
            if self.inbox[0].cache_ops:  # its ops come after these frames' compute: it leads the next forward
                break
            more = self._live(self.inbox[0])
            if more is None:
                self.inbox.popleft()
                continue
            if (more.kind not in GENERATION_KINDS or n + len(more.samples) > self.max_batch
                    or rows + sum(more.count) > self.max_rows or slots & set(more.samples)
                    or not _mergeable(kinds | {more.kind})):
                self.inbox[0] = more
                break
            self.inbox.popleft()
            frames.append(more)
            n, rows = n + len(more.samples), rows + sum(more.count)
            slots.update(more.samples)
            kinds.add(more.kind)
        return _merge(frames)

    def _computable(self, frame: Frame) -> bool:
        """Only the last node cuts rows: a frame cut before it cannot be computed on. Checked
        before merging, so a bad frame is dropped alone, never with the frames merged with it."""
        if frame.tensor is not None and frame.tensor.shape[0] != sum(frame.count):
            # counted and said as the transport's drops are: its node named, a flood summed up
            self.endpoint.dropped_after_decode("a %s frame of %d rows for %d tokens (only the last node cuts rows)"
                                               % (frame.kind, frame.tensor.shape[0], sum(frame.count)))
            return False
        return True

    def _forward(self, frame: Frame) -> Frame:
        rows = sum(frame.count)
        # For generation the starter needs only each sample's last position to pick the next
        # token; a score pass (perplexity) or a verification needs every position's. With one
        # row per sample (decode) every row is a last one already.
        cut = self.is_last and frame.kind not in ALL_ROWS_KINDS and rows != len(frame.samples)
        chunk = self.chunk
        if chunk is None:  # stop() took it from under this computation
            raise RuntimeError("the run was stopped")
        if chunk.backend == "ggml":  # numpy rows in and out (torch tensors where torch is loaded)
            y = chunk.forward_rows(frame.tensor, PassRows(frame.samples, frame.start, frame.count,
                                                               frame.adapters or None))
            if cut:
                y = y[np.cumsum(frame.count) - 1]
        else:
            y = self._forward_torch(chunk, frame, cut)
        self.batching.add(rows, len(frame.samples))
        return Frame(frame.kind, frame.run, frame.samples, frame.start, frame.count, y, frame.adapters,
                     frame.epochs, frame.cache_ops)

    def _forward_torch(self, chunk: Any, frame: Frame, cut: bool) -> Any:
        from mdi.model.row_batch import RowBatch
        from mdi.system.transfers import ints_to_device, to_device, to_host
        if self._placement is None:  # the chunk's device and activation dtype, looked up once per run
            self._placement = (chunk.device, chunk.activation_dtype)
        device, dtype = self._placement
        x = to_device(_rows_of(frame), device, dtype)
        batch = RowBatch.of(frame.samples, frame.start, frame.count, device, frame.adapters or None,
                            row_wise=frame.kind == FrameKind.VERIFY)
        y = chunk.forward_rows(x, batch)
        if cut:
            y = y.index_select(0, ints_to_device(batch.last_rows(), y.device))
        # On a GPU the frame's one wait is here, so compute_seconds holds the GPU's work too.
        return to_host(y)

    def _train(self, frame: Frame) -> List[Frame]:
        """A training frame (mdi.worker.training), refused, ending the run with a line naming
        this node, when the run was not made a training run (POST /train); dropped (none to send)
        when its training was ended (DELETE /train: a job stopped beside serving)."""
        training = self.training
        if training is None and self.training_dropped:
            log.info("%s: dropped a %s frame of an ended training job", self.endpoint.name, frame.kind)
            return []
        if training is None:
            raise RuntimeError("%s: a %s frame came for run %d, which was not configured for training (POST /train)"
                               % (self.endpoint.name, frame.kind, self.id))
        with self._computing():
            out = training.handle(frame)
        self.frames_done += 1
        return out

    def _apply_cache_ops(self, frame: Frame) -> None:
        """The frame's prefix cache ops, before its compute (they travel on with it)."""
        if not frame.cache_ops:
            return
        if self.prefix is None:
            raise RuntimeError("a frame brought prefix cache ops to a node without a prefix cache")
        self.prefix.apply(frame.cache_ops)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.endpoint.close()
        chunk, self.chunk = self.chunk, None  # the worker owns the weights: an ended run keeps none
        if chunk is not None:
            chunk.free_cache()


def _mergeable(kinds: Set[str]) -> bool:
    """A verification's rows all come back, a prefill's last rows only: the two never share a
    frame (a decode pass, one row per sample, joins either)."""
    return not (FrameKind.PREFILL in kinds and FrameKind.VERIFY in kinds)


def _merge(frames: List[Frame]) -> Frame:
    """One frame holding the samples (and rows) of several: in order, or, when some use an
    adapter, ordered by adapter (stable), so each adapter's rows are one slice (LoraDeltas)."""
    if len(frames) == 1:
        return frames[0]
    ops = frames[0].cache_ops  # only a merge's first frame brings ops (Run._gather)
    kinds = set(f.kind for f in frames)
    kind = next((k for k in (FrameKind.VERIFY, FrameKind.PREFILL) if k in kinds), FrameKind.DECODE)
    epochs = any(f.epochs for f in frames)
    if not any(f.adapters for f in frames):  # in order: whole frames, one cat (the decode hot path)
        return Frame(kind, frames[0].run, [s for f in frames for s in f.samples], [s for f in frames for s in f.start],
                     [c for f in frames for c in f.count], _cat([f.tensor for f in frames]), [],
                     [e for f in frames for e in f.epoch_ids()] if epochs else [], ops)
    pieces = []  # (adapter, sample, start, count, rows, epoch) per sample
    for f in frames:
        row = 0
        for sample, start, count, adapter, epoch in zip(f.samples, f.start, f.count, f.adapter_ids(), f.epoch_ids()):
            pieces.append((adapter, sample, start, count, _rows_of(f)[row:row + count], epoch))
            row += count
    pieces.sort(key=lambda p: p[0])
    return Frame(kind, frames[0].run, [p[1] for p in pieces], [p[2] for p in pieces], [p[3] for p in pieces],
                 _cat([p[4] for p in pieces]), [p[0] for p in pieces], [p[5] for p in pieces] if epochs else [],
                 ops)


def _rows_of(frame: Frame) -> Any:
    """A pass frame's rows: the wire format admits none without them (mdi.ring.wire.decode)."""
    assert frame.tensor is not None
    return frame.tensor


def _cat(parts: List[Any]) -> Any:
    """Rows stacked: numpy arrays (a worker without torch) or torch tensors."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return sys.modules["torch"].cat(parts)


class _PassClock:
    """`with` around one pass of a Run: its time counted in compute_seconds, its start in
    pass_started while it runs. A class, not a contextlib generator: entered once a frame on a
    path that runs cold after each graph, where the generator's machinery cost 9 us more."""
    __slots__ = ("run", "t0")

    def __init__(self, run: Run) -> None:
        self.run, self.t0 = run, 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.run.pass_started = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        self.run.pass_started = None
        self.run.compute_seconds += time.perf_counter() - self.t0
