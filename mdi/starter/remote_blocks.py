"""The ring as a Python module (issue 38; Petals' RemoteSequential): a run config's ring opened
from Python, its blocks one differentiable callable, so a researcher can put a head, a probe or
a training loop of their own on a model that only the boards together hold.

    with RemoteBlocks(cfg, seq_len=64) as ring:
        x = ring.embed(ids).requires_grad_(True)      # [B, T, n_embd], the input of block 0
        out = ring(x)                                 # train frames round the ring
        loss = my_head(out.hidden).sum()
        loss.backward()                               # grad frames back: x.grad, d loss / d x

It is mdi-train's machinery (mdi.starter.train.training) driven one call at a time: a forward under
autograd sends the batch round as a "train" frame (micro-batch i of the current step); the
backward sends the gradient for the last hidden states as a "grad" frame, each node runs its
backward and sends the gradient for its input on, and the starter's own backward gives the
gradient for `x`. Without autograd (torch.no_grad, or nothing that needs a gradient) the batch
goes as an "eval" frame and no node keeps anything.

Why mdi-train drives RingTrainer itself rather than through this callable: a call here returns
only when its frame is back, so micro-batches would go round one after another; mdi-train keeps
all of a step's micro-batches in flight at once (GPipe), every board busy, and computes each
loss as its micro-batch returns. Both share one machinery (frames, stages, optimizer steps).

The workers' training protocol (POST /train) trains a LoRA, so the ring always holds one:
by default a frozen stand-in (rank 1 on q, A = B = 0) that adds exactly zero to every output
and to every gradient, and is never stepped; pass a `TrainSetup` (and pairs, PEFT's
initialisation by default) to train a real LoRA: `step()` makes every node take an AdamW step
over the gradients of the forwards since the last one, `pairs()` reads every node's back.

Node boundaries: a worker's output goes to the next node only (the data plane is one PUSH
socket per node, mdi.ring.transport), so for the states between two workers a forward asks
every worker to send a copy of its output on round the ring (a "state" frame, which the later
workers pass on); `forward(x, boundaries=False)` spares those copies.
"""
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from mdi.model.adapters.lora_train import init_pairs
from mdi.model.source import ModelSource
from mdi.ring.train_request import TrainSetup
from mdi.ring.wire import Frame, FrameKind, TrainTag
from mdi.runconfig import RunConfig
from mdi.starter.engine import Engine
from mdi.starter.train.ring_trainer import RingTrainer
from mdi.starter.train.train_options import Pairs, TrainOptions
from mdi.starter.train.training import open_engine, training_config

log = logging.getLogger(__name__)

# The stand-in LoRA of a ring that trains nothing: the smallest the protocol takes, all zero.
FROZEN = TrainSetup(targets=("q",), rank=1, alpha=1.0, lr=1e-3)


@dataclass
class RingOutput:
    hidden: torch.Tensor  # [B, T, n_embd] after the last block; differentiable in the input
    boundaries: Dict[int, torch.Tensor]  # layer -> the states entering it, at every node boundary (detached)


class RemoteBlocks:
    """Every block of `cfg`'s model, held by its ring, as one callable (see the module doc).
    `seq_len` bounds the windows (the run is planned for them); `setup` and `pairs` a LoRA to
    train (None: a frozen ring)."""

    def __init__(self, cfg: RunConfig, seq_len: int = 128, setup: Optional[TrainSetup] = None,
                 pairs: Optional[Pairs] = None, seed: int = 0) -> None:
        self.cfg = training_config(cfg)
        self.source = ModelSource(self.cfg.model.path)
        self.config = self.source.config
        if not 1 <= seq_len <= self.config.block_size:
            raise ValueError("seq_len %d: expected 1 to the model's context of %d" % (seq_len, self.config.block_size))
        self.seq_len = seq_len
        self.trains = setup is not None
        self.setup = setup if setup is not None else FROZEN
        if pairs is None:
            pairs = init_pairs(self.config, self.setup.spec, seed)
            if not self.trains:
                pairs = {k: (torch.zeros_like(a), torch.zeros_like(b)) for k, (a, b) in pairs.items()}
        self._pairs = pairs
        self.engine: Optional[Engine] = None
        self._trainer: Optional[RingTrainer] = None
        self._step = 0  # the batch that forwards join (a step frame closes it)
        self._micro = 0  # forwards of this batch so far
        self._evals = 0

    # --- lifetime -----------------------------------------------------------------------------
    def open(self) -> "RemoteBlocks":
        engine = open_engine(self.cfg, self.source, self.seq_len)
        try:
            self._trainer = RingTrainer(engine, TrainOptions("", self.setup, seq_len=self.seq_len), self._pairs)
        except BaseException:
            engine.abort()
            raise
        self.engine = engine
        return self

    def close(self) -> None:
        """Stop the ring's run (the workers stay up for the next)."""
        engine, self.engine, self._trainer = self.engine, None, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> "RemoteBlocks":
        return self.open()

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        elif self.engine is not None:
            self.engine.abort()  # an error mid-pass: the ring may hold frames in flight
            self.engine, self._trainer = None, None

    @property
    def trainer(self) -> RingTrainer:
        if self._trainer is None:
            raise RuntimeError("the ring is not open: use `with RemoteBlocks(cfg) as ring:` or open()")
        return self._trainer

    @property
    def node_layers(self) -> List[Tuple[int, int]]:
        """Each node's layers [first, last), the starter's first."""
        engine = self.trainer.engine
        return [(engine.chunk.first, engine.chunk.last)] + [tuple(n.layers) for n in engine.plan.workers]  # type: ignore

    # --- the model's ends, on the starter -------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> the input of block 0 [B, T, n_embd] (positions from 0)."""
        return self.trainer._embed(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head (frozen; differentiable in `hidden`)."""
        with torch.inference_mode(False):
            return self.trainer.chunk.head(hidden)

    # --- the blocks ---------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, boundaries: bool = True) -> RingOutput:
        return self.forward(x, boundaries)

    def forward(self, x: torch.Tensor, boundaries: bool = True) -> RingOutput:
        """Every block over `x` [B, T, n_embd] (or token ids [B, T], embedded first): whole
        windows from position 0, no KV cache. Differentiable in `x` (and in the LoRA).
        `boundaries`: the states at every node boundary too (False: at the starter's only)."""
        if not x.is_floating_point():
            x = self.embed(x)
        if x.dim() != 3 or x.shape[-1] != self.config.n_embd or not 1 <= x.shape[1] <= self.seq_len:
            raise ValueError("expected hidden states [B, T <= %d, %d], got %s"
                             % (self.seq_len, self.config.n_embd, list(x.shape)))
        states: Dict[int, torch.Tensor] = {}
        if torch.is_grad_enabled() and (x.requires_grad or self.trains):
            # the anchor makes the output need a gradient when only the LoRA does
            anchor = torch.zeros(0, requires_grad=self.trains)
            hidden = _ThroughRing.apply(x, anchor, self, boundaries, states)
        else:
            hidden = self._forward(x, False, boundaries, states)
        states[self.config.n_layer] = hidden.detach()
        return RingOutput(hidden, dict(sorted(states.items())))

    def _forward(self, x: torch.Tensor, keep: bool, copies: bool, states: Dict[int, torch.Tensor]) -> torch.Tensor:
        """The last block's output; `keep`: a train frame whose backward every node awaits, else
        an eval frame. `states` gets the states entering each node after the first (`copies`:
        every worker's, else the first worker's only)."""
        t = self.trainer
        x = x.detach().to(t.device, t.chunk.activation_dtype)
        copies = copies and len(self.node_layers) > 2  # with one worker, its output is the hidden states
        if keep:
            tag = TrainTag(self._step, self._micro, t.chunk.last, copies)
            if self.trains:
                self._micro += 1  # micro-batches of the batch step() closes
            else:
                self._step += 1  # never stepped: each forward its own batch, so no micro count runs past the wire's bound
            y = t.stage.forward(tag.step, tag.micro, x, input_grad=True)
            kind = FrameKind.TRAIN
        else:
            tag = TrainTag(self._evals, 0, t.chunk.last, copies)
            self._evals += 1
            y = t.stage.evaluate(x)
            kind = FrameKind.EVAL
        if 0 < t.chunk.last < self.config.n_layer:
            states[t.chunk.last] = y.detach()
        t._send(kind, tag.step, tag.micro, tag.layer, y, copies)
        # the workers before the last send a copy each
        want = len(states) + (len(self.node_layers) - 2 if copies else 0)
        hidden: Optional[torch.Tensor] = None
        while hidden is None or len(states) < want:
            frame = self._wait((kind, FrameKind.STATE), tag)
            assert frame.train is not None
            if frame.kind == FrameKind.STATE:
                states[frame.train.layer] = t._rows(frame)
            else:
                hidden = t._rows(frame)
        return hidden

    def _backward(self, tag: TrainTag, grad: torch.Tensor) -> torch.Tensor:
        """The gradient for a kept forward's input: `grad` (for its last hidden states) sent
        round as a grad frame, relayed by the starter on its way to every node before it."""
        t = self.trainer
        t._send(FrameKind.GRAD, tag.step, tag.micro, self.config.n_layer, grad.to(t.chunk.activation_dtype))
        while True:
            frame = self._wait((FrameKind.GRAD,), tag)
            assert frame.train is not None
            if frame.train.layer == t.chunk.last:
                x_grad = t.stage.backward(tag.step, tag.micro, t._rows(frame))
                assert x_grad is not None  # the starter's forward asked for an input gradient
                return x_grad
            t.transport.send(frame)  # a worker's gradient on its way round

    def _wait(self, kinds: Tuple[str, ...], tag: TrainTag) -> Frame:
        while True:
            frame = self.trainer._recv()
            got = frame.train
            if frame.kind in kinds and got is not None and (got.step, got.micro) == (tag.step, tag.micro):
                return frame

    # --- a LoRA of one's own ------------------------------------------------------------------
    def step(self) -> None:
        """AdamW on every node over the gradients of this batch's forwards (each must have had
        its backward); the next forward starts the next batch."""
        if not self.trains:
            raise RuntimeError("this ring trains no LoRA: pass a TrainSetup to RemoteBlocks to step one")
        if self._micro == 0:
            raise RuntimeError("step() with no forward since the last step")
        t = self.trainer
        t.transport.send(Frame(FrameKind.STEP, t.run_id, train=TrainTag(self._step, self._micro, 0)))
        t.stage.step(self._step, self._micro)
        t._wait(FrameKind.STEP, self._step)  # every node has stepped once the step frame is back
        self._step, self._micro = self._step + 1, 0

    def pairs(self) -> Pairs:
        """Every node's LoRA pairs as they are now (mdi.model.adapters.lora_train keys)."""
        return self.trainer.collect()[0]


class _ThroughRing(torch.autograd.Function):
    """forward: a train frame round the ring; backward: the grad frame back (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, ring: RemoteBlocks,  # type: ignore[override]
                copies: bool, states: Dict[int, torch.Tensor]) -> torch.Tensor:
        ctx.ring, ctx.tag = ring, TrainTag(ring._step, ring._micro, 0)
        ctx.x_shape, ctx.x_dtype, ctx.x_device = x.shape, x.dtype, x.device
        return ring._forward(x, True, copies, states)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, None, None, None, None]:  # type: ignore[override]
        x_grad = ctx.ring._backward(ctx.tag, grad.contiguous())
        return x_grad.to(ctx.x_device, ctx.x_dtype).view(ctx.x_shape), None, None, None, None
