"""A worker's part in training (mdi-train): POST /train makes its current run a training run,
and the compute loop hands it every training frame (mdi.ring.wire's TRAINING_KINDS).

  train  a micro-batch's hidden states at this node's first layer: its blocks run forward with
         the LoRA (mdi.model.adapters.stage_train keeps what backward needs) and the output goes on.
  grad   the gradient at a layer boundary: when the boundary is this node's last layer + 1,
         backward runs and the gradient for its input goes on, tagged with its first layer;
         any other boundary is passed on untouched. Gradients travel the ring's one direction,
         so one reaches the node before it by going once round (why: docs in
         mdi.starter.train.training).
  step   the batch is complete: AdamW steps this node's parameters; the frame goes on.
  eval   a held-out micro-batch: its blocks run forward, nothing kept, the output goes on.
  clip   (--clip) phase 0: this node adds its gradients' squared norm to the frame's value;
         phase 1: the value is the global clip factor, this node scales its gradients by it.
  state  a copy of another worker's output on its way to the starter: passed on untouched. A
         train or eval frame whose tag asks for copies makes this node send one of its own
         output too (after the output, which the next node is waiting for), unless it is the last.
"""
import dataclasses
import time
from typing import Any, Dict, List, Optional

import torch

from mdi.model.adapters.stage_train import StageTrainer, train_dtype_problem
from mdi.ring.init_request import RequestError, TooLarge
from mdi.ring.train_request import pairs_reply, read_train_body
from mdi.ring.wire import Frame, FrameKind, TrainTag
from mdi.system.transfers import to_device, to_host

OPTIMIZER_COPIES = 4  # parameters, their gradients and AdamW's two moments, all float32


class WorkerTraining:
    def __init__(self, name: str, stage: StageTrainer, nbytes: int) -> None:
        self.name = name
        self.stage = stage
        self.nbytes = nbytes  # its LoRA pairs and their optimizer state: held beside the run's weights
        self.seconds = 0.0

    def handle(self, frame: Frame) -> List[Frame]:
        """What to send on for a training frame, in order."""
        tag = frame.train
        assert tag is not None  # wire.decode guarantees it on training kinds
        chunk = self.stage.chunk
        if frame.kind == FrameKind.STATE:
            return [frame]
        out = self._handle(frame, tag)
        if tag.copy and frame.kind in (FrameKind.TRAIN, FrameKind.EVAL) and chunk.last < chunk.config.n_layer:
            copy = out[0]
            assert copy.train is not None
            out.append(dataclasses.replace(copy, kind=FrameKind.STATE, train=dataclasses.replace(copy.train, copy=False)))
        return out

    def _handle(self, frame: Frame, tag: TrainTag) -> List[Frame]:
        chunk = self.stage.chunk
        t0 = time.perf_counter()
        try:
            if frame.kind == FrameKind.STEP:
                self.stage.step(tag.step, tag.micro)
                return [frame]
            if frame.kind == FrameKind.CLIP:
                assert frame.tensor is not None
                value = frame.tensor.clone()
                if tag.layer == 0:
                    value[0, 0] += self.stage.grad_sq_norm()
                else:
                    self.stage.scale_grads(float(value[0, 0].item()))
                return [Frame(frame.kind, frame.run, frame.samples, frame.start, frame.count, value, train=tag)]
            if frame.kind in (FrameKind.TRAIN, FrameKind.EVAL):
                if tag.layer != chunk.first:
                    raise ValueError("%s: a training forward at layer %d reached layers [%d, %d)"
                                     % (self.name, tag.layer, chunk.first, chunk.last))
                if frame.kind == FrameKind.EVAL:
                    return [self._frame(frame, FrameKind.EVAL, self.stage.evaluate(self._windows(frame)), chunk.last)]
                y = self.stage.forward(tag.step, tag.micro, self._windows(frame))
                return [self._frame(frame, FrameKind.TRAIN, y, chunk.last)]
            if tag.layer != chunk.last:
                return [frame]  # another node's gradient: on round the ring
            grad = self.stage.backward(tag.step, tag.micro, self._windows(frame))
            return [self._frame(frame, FrameKind.GRAD, grad, chunk.first)]
        finally:
            self.seconds += time.perf_counter() - t0

    def _windows(self, frame: Frame) -> torch.Tensor:
        """The frame's rows as [windows, length, hidden] on this node's device and dtype."""
        p = next(self.stage.chunk.parameters())
        assert frame.tensor is not None  # wire.decode: train and grad frames carry one
        x = to_device(frame.tensor, p.device, self.stage.chunk.activation_dtype)
        return x.reshape(len(frame.samples), frame.count[0], -1)

    @staticmethod
    def _frame(frame: Frame, kind: str, y: Optional[torch.Tensor], layer: int) -> Frame:
        assert y is not None and frame.train is not None
        return Frame(kind, frame.run, frame.samples, frame.start, frame.count, to_host(y.reshape(-1, y.shape[-1])),
                     train=dataclasses.replace(frame.train, layer=layer))


def start_training(worker: Any, body: bytes) -> Dict[str, Any]:
    """POST /train: the run in progress becomes a training run with the body's LoRA pairs."""
    setup, pairs, state = read_train_body(body)
    with worker.lock:
        run = worker.run
        if run is None or not run.holds_worker() or run.chunk is None:
            raise RequestError("no run in progress: training comes after /init")
        if run.training is not None:
            raise RequestError("run %d is training already" % run.id)
        need = OPTIMIZER_COPIES * sum(t.numel() * 4 for ab in pairs.values() for t in ab)
        limit, what = worker._memory_limit(worker.loaded.device if worker.loaded else "cpu")
        held = worker._held_bytes()
        if limit is not None and held + need > limit:
            raise TooLarge("training layers [%d, %d) needs %.1f MB for the LoRA and its optimizer state, but this "
                           "worker holds %.1f MB of the %.1f MB it may use (%s)"
                           % (run.chunk.first, run.chunk.last, need / 2 ** 20, held / 2 ** 20, limit / 2 ** 20, what))
        p = next(run.chunk.parameters(), None)
        problem = train_dtype_problem(run.chunk.activation_dtype, str(p.device) if p is not None else "cpu")
        if problem is not None:
            raise RequestError("%s cannot train in %s: %s" % (run.endpoint.name, run.chunk.activation_dtype, problem))
        try:
            stage = StageTrainer(run.chunk, setup.spec, pairs, setup.lr, setup.betas, setup.eps, setup.weight_decay,
                                 setup.recompute, state)
        except ValueError as e:
            raise RequestError(str(e))
        run.training = WorkerTraining(run.endpoint.name, stage, need)
        return {"ok": True, "parameters": sum(t.numel() for t in stage.lora.parameters()), "bytes": need}


def stop_training(worker: Any) -> Dict[str, Any]:
    """DELETE /train: the run stops training and keeps serving; its LoRA pairs, their AdamW
    state and every kept activation are dropped. The starter sends it once no training frame
    of the job is left in the ring (mdi.serving.train_job), so none comes after."""
    with worker.lock:
        run = worker.run
        if run is None or run.training is None:
            raise RequestError("this worker's run is not training")
        run.training, run.training_dropped = None, True
    return {"ok": True}


def training_pairs(worker: Any) -> Dict[str, Any]:
    """GET /train: the LoRA pairs of this worker's layers and their AdamW state as they are now."""
    run = worker.run
    training = run.training if run is not None else None
    if training is None:
        raise RequestError("this worker's run is not training")
    return pairs_reply(training.stage.pairs(), training.stage.optimizer_state())
