"""A LoRA trained on the serving ring, beside the requests it serves (issue 38, Symbiosis' idea):
the same workers and the same one copy of the frozen base, the job's frames and the requests'
frames on the same data plane, mdi-train's arithmetic (mdi.starter.train.ring_trainer.RingTrainer's stage,
loss and frames) so the adapter equals what mdi-train alone makes from the same seed and data.

Every method runs on the scheduler's thread (mdi.serving.scheduler), the one reader and writer
of the ring's transport: the pipeline hands training frames back through `on_frame`, and the
scheduler calls `pump` once per loop to do the starter's share and send what may go.

How training yields to decoding, so streaming requests keep their pace (training rides behind
the passes, in the time each node waits for the next one):
  - while any request is in flight, at most one training frame is in the ring (a forward, a
    gradient, a relay or the step frame); with the ring free of requests the whole batch's
    micro-batches are in flight at once (GPipe, every node busy);
  - on the starter, `pump` runs after a pipeline step, and while requests run its costly work
    (its blocks' forward or backward, or the loss at the head: one unit) only right after a
    step that sent passes on: it fills the time they spend on the other nodes;
  - on a worker (mdi.worker.run.Run._take_next) a decode or prefill frame waiting behind training
    frames runs first, and while requests run a costly training frame runs only right after a
    generation pass (one per pass); relays and step frames always go.
At S = 1 every node waits a whole round for the next pass, so a training unit that fits in that
time costs the request nothing. Training goes slower while requests run, never the requests;
the step's arithmetic does not change with that order (each node adds its micro-batches'
gradients, then steps when the step frame comes).

Stopping (DELETE) sends nothing new, drops the job's frames as they come back, and once none is
left in the ring tells every worker to drop its training state (DELETE /train): no training
frame can reach a worker that no longer trains. When the job ends, the adapter is written as
mdi-train --out writes it and loaded for serving by the path POST /v1/mdi/adapters uses.
"""
import collections
import functools
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import torch

from mdi.model.adapters.lora_train import init_pairs, save_peft_adapter
from mdi.ring.wire import Frame, FrameKind, TrainTag
from mdi.serving.train_body import TrainJobSpec
from mdi.starter.engine_face import EngineFace, RecoveryEvent
from mdi.starter.train.train_data import Windows, step_index
from mdi.starter.train.train_options import StepRecord, TrainOptions

log = logging.getLogger(__name__)

RUNNING, STOPPING, STOPPED, DONE, FAILED = "running", "stopping", "stopped", "done", "failed"
STOP_WAIT_S = 30.0  # for the job's frames still in the ring to come back before the workers drop it

Outgoing = Union[Frame, Callable[[], Frame]]  # a frame, or the forward that makes it when it may go


class TrainJob:
    def __init__(self, spec: TrainJobSpec, engine: EngineFace, windows: Windows,
                 register: Callable[[str, str], int], out_problem: Callable[[str], Optional[str]]) -> None:
        """`out_problem`: why the adapter may not be written to a folder now (train_body.out_problem)."""
        self.spec, self.engine, self.windows, self.register = spec, engine, windows, register
        self.out_problem = out_problem
        self.state = RUNNING
        self.error: Optional[str] = None
        self.steps: List[StepRecord] = []
        self.adapter_id: Optional[int] = None
        self.started_at = time.monotonic()
        self.ended_at: Optional[float] = None
        self.inbox: Deque[Frame] = collections.deque()  # training frames back from the ring
        self.urgent: Deque[Outgoing] = collections.deque()  # gradients, relays, step frames: before forwards
        self.forwards: Deque[Outgoing] = collections.deque()
        self.in_flight = 0  # the job's frames in the ring
        self.last_back = time.monotonic()
        self.stop_at = 0.0
        self.lock = threading.Lock()  # the records another thread reads (report)
        self.trainer: Any = None  # the engine's RingTrainer (mdi.starter.train.ring_trainer) while it trains
        self.run_id = 0
        self.rebuilt_after: Optional[str] = None  # the cause of the ring's last recovery meanwhile

    # --- start -----------------------------------------------------------------------------
    def start(self) -> None:
        """Give every node its LoRA (seeded as mdi-train seeds it); a worker that refuses
        (NodeError, naming it) leaves none of them training."""
        spec = self.spec
        options = TrainOptions(spec.data, spec.setup, steps=spec.steps, batch_size=spec.batch_size,
                               micro_batches=spec.micro_batches, seq_len=spec.seq_len, seed=spec.seed)
        pairs = init_pairs(self.engine.source.config, spec.setup.spec, spec.seed)
        try:
            self.trainer = self.engine.ring_trainer(options, pairs)
        except BaseException:
            self._drop_workers()
            raise
        self.run_id = self.trainer.run_id
        self._begin_step()

    # --- the scheduler's calls ---------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.state in (RUNNING, STOPPING)

    def on_recovery(self, event: RecoveryEvent) -> None:
        """The engine re-planned the ring: the job's workers lost it (the next pump fails it)."""
        self.rebuilt_after = event.cause

    def on_frame(self, frame: Frame) -> None:
        if self.active:
            self.inbox.append(frame)

    def stop(self) -> None:
        if self.state == RUNNING:
            self.state, self.stop_at = STOPPING, time.monotonic()
            self.urgent.clear()
            self.forwards.clear()
            log.info("mdi: serve: training job stopping after %d steps", len(self.steps))

    def fail(self, why: str) -> None:
        """The job ends with `why` (the ring it ran on failed or is gone)."""
        if self.active:
            self.error, self.state, self.ended_at = why, FAILED, time.monotonic()
            self.trainer = None
            log.error("mdi: serve: training job failed: %s", why)

    def pump(self, busy: bool, turn: bool = True) -> None:
        """Handle the frames back, then send what may go; `busy`: requests are in flight;
        `turn`: a pass has just left (while busy, the starter's costly work waits for one)."""
        if not self.active:
            return
        try:
            self._pump(busy, turn)
        except Exception as e:  # a worker's refusal (NodeError) names it
            self.fail(str(e) if isinstance(e, RuntimeError) else "%s: %s" % (type(e).__name__, e))
            self._drop_workers()

    def _pump(self, busy: bool, turn: bool) -> None:
        if self.engine.run_id != self.run_id:
            self.fail("the ring was rebuilt%s; its workers lost the job"
                      % (" after: %s" % self.rebuilt_after if self.rebuilt_after is not None else ""))
            return
        costly = 1 if turn else 0  # units of the starter's own compute this call may do while busy
        while self.inbox and self.active:
            if busy and self._costly(self.inbox[0]):
                if costly <= 0:
                    break
                costly -= 1
            self._handle(self.inbox.popleft())
        now = time.monotonic()
        if self.state == STOPPING:
            if self.in_flight == 0 or now - self.stop_at > STOP_WAIT_S:
                self._drop_workers()
                self.state, self.ended_at, self.trainer = STOPPED, now, None
            return
        if self.state != RUNNING:
            return
        limit = 1 if busy else max(1, self.spec.micro_batches)
        while self.in_flight < limit and (self.urgent or self.forwards):
            queue = self.urgent or self.forwards
            if busy and not isinstance(queue[0], Frame):  # a forward to run here first
                if costly <= 0:
                    break
                costly -= 1
            item = queue.popleft()
            self.engine.send_frame(item if isinstance(item, Frame) else item())
            self.in_flight += 1
        if busy or not self.in_flight:
            self.last_back = now  # a request's frames are ahead of ours on the workers: not silence
        elif now - self.last_back > self.engine.cfg.runtime.ring_timeout:
            raise RuntimeError("no training frame came back round the ring for %.0f s"
                               % self.engine.cfg.runtime.ring_timeout)

    def _costly(self, frame: Frame) -> bool:
        """Whether handling `frame` runs the starter's compute: a loss at the head, or the
        backward of its blocks (a relay or a step frame only moves on)."""
        trainer, tag = self.trainer, frame.train
        if self.state != RUNNING or trainer is None or tag is None:
            return False
        return frame.kind == FrameKind.TRAIN or (frame.kind == FrameKind.GRAD and tag.layer == trainer.chunk.last)

    # --- one step, as RingTrainer.step does it, a frame at a time ----------------------------
    def _begin_step(self) -> None:
        spec, trainer = self.spec, self.trainer
        assert trainer is not None
        step = len(self.steps)
        batch = self.windows.take(step_index(len(self.windows), step, spec.batch_size))
        self.batch_tokens = batch.ids.numel()
        self.scored = batch.n_scored
        self.micro = list(zip(torch.tensor_split(batch.ids, spec.micro_batches),
                              torch.tensor_split(batch.scored, spec.micro_batches)))
        self.step_loss, self.backwards, self.step_t0 = 0.0, 0, time.perf_counter()
        for i in range(len(self.micro)):
            self.forwards.append(functools.partial(self._forward, step, i))

    def _forward(self, step: int, i: int) -> Frame:
        trainer = self.trainer
        assert trainer is not None
        ids = self.micro[i][0]
        y = trainer.stage.forward(step, i, trainer._embed(ids), input_grad=False)
        return trainer.frame(FrameKind.TRAIN, step, i, trainer.chunk.last, y)

    def _handle(self, frame: Frame) -> None:
        self.in_flight -= 1
        self.last_back = time.monotonic()
        tag, trainer = frame.train, self.trainer
        if self.state != RUNNING or tag is None or trainer is None:
            return  # stopping: the job's frames leave the ring here
        step = len(self.steps)
        if tag.step != step:
            raise RuntimeError("a %s frame of step %d came back during step %d" % (frame.kind, tag.step, step))
        if frame.kind in (FrameKind.TRAIN, FrameKind.GRAD):
            back = trainer.on_frame(frame, self.micro, self.scored)
            self.step_loss += back.loss
            if back.send is not None:
                self.urgent.append(back.send)
            if back.backward_done:
                self.backwards += 1
                if self.backwards == len(self.micro):
                    self.urgent.append(Frame(FrameKind.STEP, self.run_id, train=TrainTag(step, len(self.micro), 0)))
                    trainer.stage.step(step, len(self.micro))
        elif frame.kind == FrameKind.STEP:
            seconds = time.perf_counter() - self.step_t0
            record = StepRecord(step, self.step_loss, self.batch_tokens / seconds if seconds > 0 else 0.0, seconds,
                                self.scored)
            with self.lock:
                self.steps.append(record)
            log.info("mdi: serve: training step %d/%d  loss %.4f  %.1f tokens/s", step + 1, self.spec.steps,
                     record.loss, record.tokens_per_s)
            if len(self.steps) == self.spec.steps:
                self._finish()
            else:
                self._begin_step()
        else:
            raise RuntimeError("a %s frame came back to a training job" % frame.kind)

    def _finish(self) -> None:
        """Every node's pairs, written as mdi-train --out writes them, then served by name."""
        trainer = self.trainer
        assert trainer is not None
        pairs, _ = trainer.collect()
        self._drop_workers()
        engine, spec = self.engine, self.spec
        problem = self.out_problem(spec.out)  # as at the request and the start: another job may have written there
        if problem is not None:
            raise RuntimeError("'out' %s: the trained adapter is not saved" % problem)
        save_peft_adapter(spec.out, engine.source.config, spec.setup.spec, pairs, engine.cfg.model.path)
        if spec.name is not None:
            self.adapter_id = self.register(spec.name, spec.out)
            log.info("mdi: serve: trained adapter %s served (id %d) from %s", spec.name, self.adapter_id, spec.out)
        self.state, self.ended_at, self.trainer = DONE, time.monotonic(), None

    def _drop_workers(self) -> None:
        """Every worker stops training (best effort: a worker that is gone has nothing to drop)."""
        for said in self.engine.stop_training():  # NodeError: named; "not training" after a refused start
            log.info("mdi: serve: %s", said)

    # --- GET /v1/mdi/train ---------------------------------------------------------------------
    def report(self) -> Dict[str, Any]:
        spec = self.spec
        with self.lock:
            steps = list(self.steps)
        done = len(steps)
        mean = sum(s.seconds for s in steps) / done if done else None
        rate = sum(s.tokens_per_s for s in steps) / done if done else None
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return {"state": self.state, "step": done, "steps": spec.steps,
                "loss": [s.loss for s in steps], "tokens_per_s": [s.tokens_per_s for s in steps],
                "mean_tokens_per_s": rate, "eta_s": mean * (spec.steps - done) if mean is not None and self.active
                else None, "seconds": end - self.started_at, "error": self.error, "out": spec.out, "name": spec.name,
                "adapter_id": self.adapter_id, "data": spec.data, "batch_size": spec.batch_size,
                "micro_batches": spec.micro_batches, "seq_len": spec.seq_len, "rank": spec.setup.rank,
                "alpha": spec.setup.alpha, "targets": list(spec.setup.targets), "lr": spec.setup.lr,
                "seed": spec.seed}
