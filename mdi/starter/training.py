"""mdi-train's driver: a LoRA trained through the ring, the base frozen on the boards that hold
it (issue 38). The starter owns the data, the loss and the schedule; every node (the starter
for its first blocks, each worker for its chunk: mdi.model.stage_train) owns its LoRA
parameters and their AdamW state.

One step (GPipe order): the batch's B windows go as M micro-batches; each is embedded, run
through the starter's blocks and sent round as a "train" frame; when its last hidden states
come back the starter computes the loss (its share of the batch mean: the sum of its tokens'
cross-entropy over all B (L - 1) scored tokens, so the micro-batches' gradients add up to the
batch's) and sends the gradient for them as a "grad" frame; each node runs backward when a
gradient for its own output comes and sends the gradient for its input on; when the starter's
own backward of every micro-batch is done, every node's is (the chain passed through them
all), and a "step" frame tells every node to step its optimizer.

Why GPipe (all forwards, then each backward as its loss is known) and not 1F1B: the ring
is FIFO on every link and the batch's gradients must all be in before any node steps, so
1F1B would only lower the activation memory kept per node (M micro-batches' inputs at most;
`--recompute` keeps only those), not the time; GPipe keeps the schedule a plain loop whose
frames never wait on one another.

Why gradients travel the ring's one direction (to the node before, the long way round)
instead of back along each link: the data plane is one PUSH socket from each node to the
next (mdi.ring.transport), so a reverse path needs a second socket pair per node, a second
port in /init and its recovery. Going round costs N hops per stage instead of 1; a hop that
only relays copies no tensor into compute and overlaps with the other micro-batches' work.
On a 3-node ring of boards the backward of a chunk (milliseconds per window row) outweighs
two relays of its [rows, hidden] gradient on gigabit ethernet; a reverse link is the next
step where it does not.
"""
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from mdi.model.lora_train import LoraSpec, init_pairs, key_layer
from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.model.stage_train import StageTrainer
from mdi.ring.train_request import TrainSetup, read_pairs_reply, train_body
from mdi.ring.transport import RingTimeout
from mdi.ring.wire import Frame, FrameKind, TrainTag
from mdi.runconfig import ConfigError, RunConfig
from mdi.model.transformer import ModelChunk
from mdi.starter.engine import Engine
from mdi.starter.pipeline import Pipeline
from mdi.starter.run_plan import plan_run
from mdi.starter.run_shape import RunShape
from mdi.starter.train_data import read_text_ids, step_windows, text_windows
from mdi.system.transfers import to_device, to_host

log = logging.getLogger(__name__)

Pairs = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TrainOptions:
    data: str
    setup: TrainSetup
    steps: int = 10
    batch_size: int = 4
    micro_batches: int = 1  # M: each step's batch travels as M micro-batches (B windows split evenly)
    seq_len: int = 128
    seed: int = 0


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    seconds: float


@dataclass
class TrainResult:
    steps: List[StepRecord]
    pairs: Pairs  # every layer's trained LoRA pairs (mdi.model.lora_train keys)
    n_nodes: int
    n_windows: int
    extra: Dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> Dict[str, Any]:
        record = {"steps": [{"step": s.step, "loss": s.loss, "tokens_per_s": s.tokens_per_s, "seconds": s.seconds}
                            for s in self.steps], "n_nodes": self.n_nodes, "n_windows": self.n_windows}
        record.update(self.extra)
        return record


def check_options(options: TrainOptions, block_size: int) -> None:
    if options.steps < 1 or options.batch_size < 1:
        raise ConfigError("--steps and --batch-size must be at least 1")
    if not 1 <= options.micro_batches <= options.batch_size:
        raise ConfigError("--micro-batches must be 1 to --batch-size (%d)" % options.batch_size)
    if not 2 <= options.seq_len <= block_size:
        raise ConfigError("--seq-len %d: expected 2 to the model's context of %d tokens" % (options.seq_len, block_size))


def run(cfg: RunConfig, options: TrainOptions, on_step: Optional[Callable[[StepRecord, int], None]] = None,
        pairs: Optional[Pairs] = None) -> TrainResult:
    """Train; `pairs` (every layer's initial LoRA) default to the seeded PEFT initialisation."""
    source = ModelSource(cfg.model.path)
    config = source.config
    check_options(options, config.block_size)
    windows = text_windows(read_text_ids(source.tokenizer, options.data), options.seq_len, options.data)
    spec = options.setup.spec
    pairs = pairs if pairs is not None else init_pairs(config, spec, options.seed)
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(plan_run(cfg, source, RunShape(1, options.seq_len), greedy), source, greedy)
    engine.open()
    try:
        trainer = _RingTrainer(engine, options, pairs)
        records = []
        for step in range(options.steps):
            record = trainer.step(step, step_windows(windows, step, options.batch_size))
            records.append(record)
            if on_step is not None:
                on_step(record, options.steps)
        trained = trainer.collect()
        engine.close()
    except BaseException:
        engine.abort()
        raise
    return TrainResult(records, trained, len(engine.nodes), int(windows.shape[0]))


class _RingTrainer:
    def __init__(self, engine: Engine, options: TrainOptions, pairs: Pairs) -> None:
        self.engine, self.options = engine, options
        chunk = self.chunk
        self.n_layer = chunk.config.n_layer
        setup = options.setup
        own = {k: ab for k, ab in pairs.items() if chunk.first <= key_layer(k) < chunk.last}
        self.stage = StageTrainer(chunk, setup.spec, own, setup.lr, setup.betas, setup.eps, setup.weight_decay,
                                  setup.recompute)
        ring = engine.ring
        if ring is not None:
            for client, node in zip(ring.clients, engine.plan.workers):
                first, last = node.layers
                client.post_train(train_body(setup, {k: ab for k, ab in pairs.items() if first <= key_layer(k) < last}))
        self.device = next(chunk.parameters()).device

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

    def step(self, step: int, ids: torch.Tensor) -> StepRecord:
        t0 = time.perf_counter()
        chunk = self.chunk
        micro = list(torch.tensor_split(ids, self.options.micro_batches))
        scored = ids.shape[0] * (ids.shape[1] - 1)  # the batch's scored tokens: the loss's denominator
        for m, part in enumerate(micro):
            b, length = part.shape
            part = part.to(self.device)
            positions = torch.arange(length, device=self.device).repeat(b)
            with torch.no_grad():
                x = chunk.embed_rows(part.reshape(-1), positions).view(b, length, -1)
            y = self.stage.forward(step, m, x, input_grad=False)
            self._send(FrameKind.TRAIN, step, m, chunk.last, y, b, length)
        loss = 0.0
        done = 0
        while done < len(micro):
            frame = self._recv()
            tag = frame.train
            if tag is None or tag.step != step:
                continue  # a stray probe, or nothing of this step
            if frame.kind == FrameKind.TRAIN:
                if tag.layer != self.n_layer:
                    raise RuntimeError("a train frame came back at layer %d, not after the last (%d)"
                                       % (tag.layer, self.n_layer))
                part = micro[tag.micro].to(self.device)
                value, grad = self._loss(frame, part, scored)
                loss += value
                self._send(FrameKind.GRAD, step, tag.micro, self.n_layer, grad, part.shape[0], part.shape[1])
            elif frame.kind == FrameKind.GRAD:
                if tag.layer != chunk.last:
                    self.transport.send(frame)  # a worker's gradient on its way round
                    continue
                self.stage.backward(step, tag.micro, self._rows(frame))
                done += 1
        self.transport.send(Frame(FrameKind.STEP, self.run_id, train=TrainTag(step, len(micro), 0)))
        self.stage.step(step, len(micro))
        while True:  # every node has stepped once the step frame is back
            frame = self._recv()
            if frame.kind == FrameKind.STEP and frame.train is not None and frame.train.step == step:
                break
        seconds = time.perf_counter() - t0
        return StepRecord(step, loss, ids.numel() / seconds if seconds > 0 else 0.0, seconds)

    def _loss(self, frame: Frame, ids: torch.Tensor, scored: int) -> Tuple[float, torch.Tensor]:
        """This micro-batch's share of the batch loss and its gradient for the last hidden states."""
        chunk = self.chunk
        with torch.inference_mode(False), torch.enable_grad():
            h = self._rows(frame).clone().requires_grad_(True)
            logits = chunk.head(h).float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="sum")
            share = nll / scored
            share.backward()
        assert h.grad is not None
        return float(share.item()), h.grad

    def _rows(self, frame: Frame) -> torch.Tensor:
        assert frame.tensor is not None  # wire.decode: train and grad frames carry one
        x = to_device(frame.tensor, self.device, self.chunk.activation_dtype)
        return x.reshape(len(frame.samples), frame.count[0], -1)

    def _send(self, kind: str, step: int, micro: int, layer: int, y: torch.Tensor, b: int, length: int) -> None:
        self.transport.send(Frame(kind, self.run_id, list(range(b)), [0] * b, [length] * b,
                                  to_host(y.reshape(b * length, -1)), train=TrainTag(step, micro, layer)))

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
                    raise RingTimeout("no training frame came back round the ring for %.0f s" % timeout)

    def collect(self) -> Pairs:
        """Every node's trained pairs, the starter's and each worker's (GET /train)."""
        pairs = self.stage.pairs()
        ring = self.engine.ring
        if ring is not None:
            for client in ring.clients:
                pairs.update(read_pairs_reply(client.train_pairs()))
        return pairs
