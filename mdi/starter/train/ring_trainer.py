"""The starter's side of one training step through the ring (the schedule mdi.starter.train.training
describes): micro-batches embedded and sent round as train frames, the loss and its gradient
when they come back, other nodes' gradients relayed, the clip frames, the step frame, eval
frames, and every node's pairs and optimizer state collected at the end or after a recovery."""
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F

from mdi.model.adapters.lora_train import key_layer
from mdi.model.adapters.prompt_train import PromptTrainer
from mdi.model.adapters.stage_train import OptimizerState, StageTrainer, clip_scale
from mdi.ring.train_request import read_pairs_reply, train_body
from mdi.ring.transport import RingTimeout
from mdi.ring.wire import Frame, FrameKind, TrainTag
from mdi.model.transformer import ModelChunk
from mdi.starter.pipeline import Pipeline
from mdi.starter.train.train_recovery import merge_states
from mdi.starter.train.train_options import Pairs, StepRecord, TrainOptions
from mdi.starter.train.train_data import Windows, eval_batches
from mdi.system.transfers import to_device, to_host


def _layers_of(d: Dict[str, Any], first: int, last: int) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if first <= key_layer(k) < last}


@dataclass
class Returned:
    """What a frame back at the starter during a step asks of it (RingTrainer.on_frame)."""
    send: Optional[Frame] = None  # the loss's gradient for a micro-batch, or another node's gradient to relay
    loss: float = 0.0  # a micro-batch's share of the batch loss (a train frame back from the last node)
    backward_done: bool = False  # the starter's own backward of one micro-batch ran


class RingOwner(Protocol):
    """What a trainer reads of the engine whose ring it trains (mdi.starter.engine.Engine, which
    builds trainers for serving: named by its shape, not imported)."""
    cfg: Any
    plan: Any
    ring: Any
    chunk: Any
    pipeline: Any

    def _check(self) -> None: ...

    def named_failure(self, e: BaseException) -> BaseException: ...


class RingTrainer:
    def __init__(self, engine: RingOwner, options: TrainOptions, pairs: Pairs,
                 state: Optional[OptimizerState] = None, prompt: Optional[PromptTrainer] = None) -> None:
        self.engine, self.options = engine, options
        self.prompt = prompt  # --method prompt: the virtual tokens' trainer; no node trains a LoRA
        self.virtual = prompt.n_virtual if prompt is not None else 0
        self.n_layer = self.chunk.config.n_layer
        # called before a step's "step" frame goes round, while no node has stepped yet
        # (mdi.starter.train.train_recovery settles the snapshot it is reading meanwhile)
        self.before_step: Optional[Callable[[], None]] = None
        self.install(pairs, state)

    def install(self, pairs: Pairs, state: Optional[OptimizerState] = None) -> None:
        """Every node of the ring in hand trains its layers' share of `pairs` (every layer's)
        from `state`: at the start, and again on the new ring after a recovery."""
        chunk, setup = self.chunk, self.options.setup

        def state_of(first: int, last: int) -> Optional[OptimizerState]:
            return OptimizerState(state.steps, _layers_of(state.moments, first, last)) if state is not None else None

        self.stage = StageTrainer(chunk, setup.spec, _layers_of(pairs, chunk.first, chunk.last), setup.lr, setup.betas,
                                  setup.eps, setup.weight_decay, setup.recompute, state_of(chunk.first, chunk.last))
        ring = self.engine.ring
        if ring is not None:
            for client, node in zip(ring.clients, self.engine.plan.workers):
                first, last = node.layers
                client.post_train(train_body(setup, _layers_of(pairs, first, last), state_of(first, last)))
        self.device = chunk.device

    @property
    def chunk(self) -> ModelChunk:
        assert self.engine.chunk is not None  # the engine is open
        return self.engine.chunk

    @property
    def pipeline(self) -> Pipeline:
        assert self.engine.pipeline is not None
        return self.engine.pipeline

    @property
    def transport(self):
        return self.pipeline.transport

    @property
    def run_id(self) -> int:
        return self.pipeline.run_id

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.prompt is not None:
            return self.prompt.embed(self.chunk, ids.to(self.device))
        b, length = ids.shape
        positions = torch.arange(length, device=self.device).repeat(b)
        with torch.no_grad():
            return self.chunk.embed_rows(ids.to(self.device).reshape(-1), positions).view(b, length, -1)

    def step(self, step: int, batch: Windows) -> StepRecord:
        t0 = time.perf_counter()
        chunk = self.chunk
        m = self.options.micro_batches
        micro = list(zip(torch.tensor_split(batch.ids, m), torch.tensor_split(batch.scored, m)))
        scored = batch.n_scored  # the batch's scored tokens: the loss's denominator
        for i, (ids, _) in enumerate(micro):
            y = self.stage.forward(step, i, self._embed(ids), input_grad=self.prompt is not None)
            self._send(FrameKind.TRAIN, step, i, chunk.last, y)
        loss = 0.0
        done = 0
        waiting: List[Frame] = []
        while done < len(micro):
            frame = self._most_urgent(waiting)
            if frame.train is None or frame.train.step != step or frame.kind not in (FrameKind.TRAIN, FrameKind.GRAD):
                continue  # a stray probe, or nothing of this step
            back = self.on_frame(frame, micro, scored)
            loss += back.loss
            done += back.backward_done
            if back.send is not None:
                self.transport.send(back.send)
        if self.options.clip is not None:
            self._clip(step, len(micro), self.options.clip)
        if self.before_step is not None:
            self.before_step()
        self.transport.send(Frame(FrameKind.STEP, self.run_id, train=TrainTag(step, len(micro), 0)))
        self.stage.step(step, len(micro))
        if self.prompt is not None:
            self.prompt.step()
        self._wait(FrameKind.STEP, step)  # every node has stepped once the step frame is back
        seconds = time.perf_counter() - t0
        return StepRecord(step, loss, batch.ids.numel() / seconds if seconds > 0 else 0.0, seconds, scored)

    def on_frame(self, frame: Frame, micro: List[Tuple[torch.Tensor, torch.Tensor]], scored: int) -> "Returned":
        """What a train or grad frame of the step in hand, back at the starter, asks of it
        (mdi-train's loop and a job beside serving, mdi.serving.train_job, both ask here):
        `micro` the step's micro-batches (ids, scored mask), `scored` the batch's scored tokens."""
        tag = frame.train
        assert tag is not None  # wire.decode: training frames carry their tag
        if frame.kind == FrameKind.TRAIN:
            if tag.layer != self.n_layer:
                raise RuntimeError("a train frame came back at layer %d, not after the last (%d)"
                                   % (tag.layer, self.n_layer))
            ids, mask = micro[tag.micro]
            value, grad = self._loss(self._rows(frame), ids.to(self.device), mask.to(self.device), scored)
            return Returned(self.frame(FrameKind.GRAD, tag.step, tag.micro, self.n_layer, grad), loss=value)
        if frame.kind != FrameKind.GRAD:
            raise RuntimeError("a %s frame came back during a training step" % frame.kind)
        if tag.layer != self.chunk.last:
            return Returned(frame)  # a worker's gradient on its way round
        grad_x = self.stage.backward(tag.step, tag.micro, self._rows(frame))
        if self.prompt is not None:
            assert grad_x is not None  # forward asked for the input's gradient
            self.prompt.accumulate(grad_x)
        return Returned(backward_done=True)

    def _most_urgent(self, waiting: List[Frame]) -> Frame:
        """The next frame to handle of those come so far (`waiting` keeps the rest): another
        node's gradient to pass on first (a board waits for it), then a micro-batch back for its
        loss (its gradient starts the way back), then this node's own backward (only the step's
        end waits for it). Arrival order would queue the first two behind the starter's own
        work, and the boards waiting on them idle meanwhile (README: throughput on emulated boards)."""
        while True:
            try:
                waiting.append(self.transport.recv(0.0))
            except RingTimeout:
                break
        if not waiting:
            return self._recv()

        def rank(frame: Frame) -> int:
            if frame.kind == FrameKind.GRAD and frame.train is not None and frame.train.layer != self.chunk.last:
                return 0
            return 2 if frame.kind == FrameKind.GRAD else 1
        best = min(range(len(waiting)), key=lambda i: (rank(waiting[i]), i))
        return waiting.pop(best)

    def _clip(self, step: int, n_micro: int, max_norm: float) -> None:
        """Every node's gradients scaled by one factor from the global norm (clip frames)."""
        value = torch.zeros(1, self.chunk.config.n_embd, dtype=torch.float32)
        value[0, 0] = self.stage.grad_sq_norm() + (self.prompt.grad_sq_norm() if self.prompt is not None else 0.0)
        self.transport.send(Frame(FrameKind.CLIP, self.run_id, [0], [0], [1], value, train=TrainTag(step, n_micro, 0)))
        frame = self._wait(FrameKind.CLIP, step)
        assert frame.tensor is not None
        scale = clip_scale(float(frame.tensor[0, 0].item()), max_norm)
        value[0, 0] = scale
        self.transport.send(Frame(FrameKind.CLIP, self.run_id, [0], [0], [1], value, train=TrainTag(step, n_micro, 1)))
        self.stage.scale_grads(scale)
        if self.prompt is not None:
            self.prompt.scale_grads(scale)

    def _wait(self, kind: str, step: int) -> Frame:
        while True:
            frame = self._recv()
            if frame.kind == kind and frame.train is not None and frame.train.step == step:
                return frame

    def evaluate(self, steps_done: int, windows: Windows) -> Dict[str, Any]:
        """The mean next-token loss over every scored token of the held-out windows."""
        total, count = 0.0, 0
        for e, batch in enumerate(eval_batches(windows, self.options.batch_size)):
            m = min(self.options.micro_batches, len(batch))
            micro = list(zip(torch.tensor_split(batch.ids, m), torch.tensor_split(batch.scored, m)))
            for i, (ids, _) in enumerate(micro):
                self._send(FrameKind.EVAL, e, i, self.chunk.last, self.stage.evaluate(self._embed(ids)))
            for _ in micro:
                frame = self._wait(FrameKind.EVAL, e)
                assert frame.train is not None
                ids, mask = micro[frame.train.micro]
                with torch.no_grad():
                    logits = self.chunk.head(self._rows(frame)[:, self.virtual:]).float()
                    total += float(self._nll(logits, ids.to(self.device), mask.to(self.device)).item())
                count += int(mask.sum().item())
        loss = total / count
        return {"step": steps_done, "loss": loss, "perplexity": float(torch.tensor(loss).exp().item()),
                "tokens": count}

    @staticmethod
    def _nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of the scored predictions (position t - 1 predicts ids[t])."""
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        return (nll * mask[:, 1:].reshape(-1).to(nll.dtype)).sum()

    def _loss(self, h: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, scored: int) -> Tuple[float, torch.Tensor]:
        """This micro-batch's share of the batch loss and its gradient for the last hidden states."""
        with torch.inference_mode(False), torch.enable_grad():
            h = h.clone().requires_grad_(True)
            # the window's own rows (behind a prompt's virtual rows, whose gradient stays 0)
            share = self._nll(self.chunk.head(h[:, self.virtual:]).float(), ids, mask) / scored
            share.backward()
        assert h.grad is not None
        return float(share.item()), h.grad

    def _rows(self, frame: Frame) -> torch.Tensor:
        assert frame.tensor is not None  # wire.decode: train and grad frames carry one
        x = to_device(frame.tensor, self.device, self.chunk.activation_dtype)
        return x.reshape(len(frame.samples), frame.count[0], -1)

    def frame(self, kind: str, step: int, micro: int, layer: int, y: torch.Tensor, copies: bool = False) -> Frame:
        """A training frame of `y` [windows, length, hidden] (the windows as its samples)."""
        b, length = y.shape[0], y.shape[1]
        return Frame(kind, self.run_id, list(range(b)), [0] * b, [length] * b, to_host(y.reshape(b * length, -1)),
                     train=TrainTag(step, micro, layer, copies))

    def _send(self, kind: str, step: int, micro: int, layer: int, y: torch.Tensor, copies: bool = False) -> None:
        self.transport.send(self.frame(kind, step, micro, layer, y, copies))

    def _recv(self) -> Frame:
        """The next frame, asking the watchdog between short waits (a dead node is named)."""
        timeout = self.engine.cfg.runtime.ring_timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.transport.recv(max(0.0, min(0.2, deadline - time.monotonic())))
            except RingTimeout:
                self.engine._check()
                if time.monotonic() >= deadline:
                    raise self.engine.named_failure(
                        RingTimeout("no training frame came back round the ring for %.0f s" % timeout))

    def prompt_embeddings(self) -> Optional[torch.Tensor]:
        return self.prompt.embeddings() if self.prompt is not None else None

    def collect(self) -> Tuple[Pairs, OptimizerState]:
        """Every node's trained pairs and AdamW state, the starter's and each worker's (GET /train);
        --method prompt: no pairs, and the prompt's AdamW state (the only parameter trained)."""
        pairs, state = merge_states([(self.stage.pairs(), self.stage.optimizer_state())] + self.worker_states())
        return (pairs, self.prompt.optimizer_state()) if self.prompt is not None else (pairs, state)

    def worker_states(self) -> List[Tuple[Pairs, Optional[OptimizerState]]]:
        """Each worker's pairs and AdamW state as they are now (GET /train)."""
        ring = self.engine.ring
        return [read_pairs_reply(client.train_pairs()) for client in ring.clients] if ring is not None else []
