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
all), and a "step" frame tells every node to step its optimizer. With --clip, two "clip"
frames go round first: one adds up every node's squared gradient norm, one brings every node
the factor (torch's clip_grad_norm_) to scale its gradients by. --eval runs held-out windows
forward as "eval" frames (nothing kept) between steps.

--method prompt (mdi.model.prompt_train): the prompt's parameter, its AdamW and the loss live
here; every node's setup has no targets, so nothing is trained on the boards, but each still
runs backward to pass its input's gradient on. Every window travels behind the n virtual
tokens (n + L rows, the loss over the window's own rows), and the starter's blocks run backward
to their input, whose gradient at the virtual rows is the prompt's.

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
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from mdi.model.lora_train import init_pairs, key_layer
from mdi.model.prompt_train import PromptSpec, PromptTrainer, init_prompt
from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.model.layout import torch_dtype
from mdi.model.stage_train import OptimizerState, StageTrainer, clip_scale, train_dtype_problem
from mdi.ring.train_request import TrainSetup, read_pairs_reply, train_body
from mdi.ring.transport import RingTimeout
from mdi.ring.wire import Frame, FrameKind, TrainTag
from mdi.runconfig import ConfigError, RunConfig
from mdi.model.transformer import ModelChunk
from mdi.starter.control import NodeError
from mdi.starter.engine import Engine
from mdi.starter.pipeline import Pipeline
from mdi.starter.run_plan import plan_run
from mdi.starter.run_shape import RunShape
from mdi.starter.train_checkpoint import Checkpoint, checkpoint_path, run_fingerprint, save_checkpoint
from mdi.starter.train_recovery import TrainRecovery, merge_states
from mdi.starter.train_data import ChatRenderer, Windows, eval_batches, load_windows, step_index
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
    shuffle: bool = False  # each epoch in a seeded order (mdi.starter.train_data.step_index)
    clip: Optional[float] = None  # the global gradient norm's bound (torch's clip_grad_norm_)
    eval_data: Optional[str] = None  # held-out windows: their mean loss before, every eval_every steps, at the end
    eval_every: Optional[int] = None
    checkpoint_every: Optional[int] = None  # a checkpoint under checkpoint_dir every K steps
    checkpoint_dir: Optional[str] = None
    render_chat: Optional[ChatRenderer] = None  # chat JSONL examples: the model's template (mdi.cli.train)
    prompt: Optional[PromptSpec] = None  # --method prompt: train these virtual tokens, no LoRA
    recovery_every: int = 1  # with recovery on: every node's state kept every K steps (mdi.starter.train_recovery)


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    seconds: float
    scored: int = 0  # the batch's scored tokens (the loss's denominator)


@dataclass
class TrainResult:
    steps: List[StepRecord]
    pairs: Pairs  # every layer's trained LoRA pairs (mdi.model.lora_train keys)
    n_nodes: int
    n_windows: int
    extra: Dict[str, Any] = field(default_factory=dict)
    evals: List[Dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "perplexity", "tokens"}
    optimizer: Optional[OptimizerState] = None  # every node's AdamW state at the end
    prompt: Optional[torch.Tensor] = None  # --method prompt: the trained embeddings [n, n_embd]

    def metrics(self) -> Dict[str, Any]:
        record: Dict[str, Any] = {
            "steps": [{"step": s.step, "loss": s.loss, "tokens_per_s": s.tokens_per_s, "seconds": s.seconds,
                       "scored_tokens": s.scored} for s in self.steps],
            "n_nodes": self.n_nodes, "n_windows": self.n_windows}
        if self.evals:
            record["eval"] = self.evals
        record.update(self.extra)
        return record


def check_options(options: TrainOptions, block_size: int) -> None:
    if options.steps < 1 or options.batch_size < 1:
        raise ConfigError("--steps and --batch-size must be at least 1")
    if not 1 <= options.micro_batches <= options.batch_size:
        raise ConfigError("--micro-batches must be 1 to --batch-size (%d)" % options.batch_size)
    virtual = options.prompt.n_virtual if options.prompt is not None else 0
    if options.prompt is not None and not 1 <= virtual <= 4096:
        raise ConfigError("--num-virtual-tokens %d: expected 1 to 4096" % virtual)
    if not 2 <= options.seq_len <= block_size - virtual:
        raise ConfigError("--seq-len %d: expected 2 to the model's context of %d tokens%s"
                          % (options.seq_len, block_size, " less %d virtual tokens" % virtual if virtual else ""))
    if options.recovery_every < 1:
        raise ConfigError("--recovery-every must be at least 1")
    if options.checkpoint_every and not options.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --out (checkpoints go to OUT/checkpoint-<step>)")


def fingerprint(cfg: RunConfig, options: TrainOptions) -> Dict[str, Any]:
    """The settings a checkpoint of this run is resumed with (mdi.starter.train_checkpoint)."""
    s = options.setup
    prompt = {"num_virtual_tokens": options.prompt.n_virtual} if options.prompt is not None else {}
    return run_fingerprint(cfg.model.path, options.data, s.spec, lr=s.lr, betas=list(s.betas),
                           eps=s.eps, weight_decay=s.weight_decay, batch_size=options.batch_size,
                           seq_len=options.seq_len, seed=options.seed, shuffle=options.shuffle, clip=options.clip,
                           **prompt)


def training_config(cfg: RunConfig) -> RunConfig:
    """`cfg` computing on torch with kernels that have a backward (mdi-train's and
    mdi.starter.remote_blocks'): ggml has no backward pass here."""
    asked_ggml = [n.name for n in cfg.nodes if cfg.backend_of(n) == "ggml"]
    if asked_ggml:
        raise ConfigError("%s: backend ggml cannot train (training computes on torch): set runtime.backend "
                          "to auto or torch" % ", ".join(asked_ggml))
    nodes = [dataclasses.replace(n, backend=None) for n in cfg.nodes]
    runtime = dataclasses.replace(cfg.runtime, backend="torch")
    if cfg.runtime.quant_kernel != "exact":
        # a quantized base's fast kernels (integer products, in-place rescaling) have no
        # backward: the frozen int4 / int8 weights compute in float32 on every node (QLoRA's way)
        log.info("mdi-train: runtime.quant_kernel %s -> exact (training needs kernels with a backward)",
                 cfg.runtime.quant_kernel)
        runtime = dataclasses.replace(runtime, quant_kernel="exact")
    return dataclasses.replace(cfg, nodes=nodes, runtime=runtime)


def check_train_dtype(cfg: RunConfig) -> None:
    """float16 / bfloat16 compute (model.dtype or model.compute_dtype) where the starter's device
    trains in it, else one line before any work (workers check their own at /train)."""
    name = cfg.model.compute_dtype or cfg.model.dtype
    problem = train_dtype_problem(torch_dtype(name), cfg.model.device)
    if problem is not None:
        raise ConfigError("model dtype %s: mdi-train cannot train in it here: %s; use float32" % (name, problem))


def open_engine(cfg: RunConfig, source: ModelSource, seq_len: int) -> Engine:
    """The ring of `cfg` opened for windows of up to `seq_len` tokens (one sample's plan)."""
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(plan_run(cfg, source, RunShape(1, seq_len), greedy), source, greedy)
    engine.open()
    return engine


def run(cfg: RunConfig, options: TrainOptions, on_step: Optional[Callable[[StepRecord, int], None]] = None,
        pairs: Optional[Pairs] = None, resume: Optional[Checkpoint] = None,
        prompt: Optional[torch.Tensor] = None, prompt_text_ids: Optional[List[int]] = None) -> TrainResult:
    """Train; `pairs` (every layer's initial LoRA) default to the seeded PEFT initialisation;
    `resume` goes on from a checkpoint (its pairs, AdamW state and step). --method prompt
    (options.prompt): `prompt` the initial embeddings, else mdi.model.prompt_train.init_prompt
    (from `prompt_text_ids` for --prompt-init text)."""
    cfg = training_config(cfg)
    check_train_dtype(cfg)
    source = ModelSource(cfg.model.path)
    config = source.config
    check_options(options, config.block_size)
    windows = load_windows(source.tokenizer, options.data, options.seq_len, options.render_chat)
    held_out = load_windows(source.tokenizer, options.eval_data, options.seq_len, options.render_chat, "--eval") \
        if options.eval_data else None
    spec = options.setup.spec
    start, state = 0, None
    records: List[StepRecord] = []
    evals: List[Dict[str, Any]] = []
    if resume is not None:
        pairs, state, start = resume.pairs, resume.optimizer, resume.steps_done
        prompt = resume.prompt if resume.prompt is not None else prompt
        records = [StepRecord(r["step"], r["loss"], r["tokens_per_s"], r["seconds"], r.get("scored_tokens", 0))
                   for r in resume.records]
        evals = list(resume.evals)
        if start >= options.steps:
            raise ConfigError("--resume: the checkpoint has %d steps done, --steps is %d" % (start, options.steps))
    if options.prompt is not None:
        pairs = {}
        state, prompt_state = None, state  # the prompt's AdamW state is the starter's alone
    else:
        pairs, prompt_state = pairs if pairs is not None else init_pairs(config, spec, options.seed), None
    engine = open_engine(cfg, source, options.seq_len + (options.prompt.n_virtual if options.prompt else 0))
    try:
        prompter = _prompt_trainer(engine, options, prompt, prompt_text_ids, prompt_state) \
            if options.prompt is not None else None
        trainer = RingTrainer(engine, options, pairs, state, prompter)
        guard = TrainRecovery(trainer, options.recovery_every, pairs, state, start)
        trainer.before_step = guard.settle
        step = start
        while True:
            try:
                if held_out is not None and step == 0 and not evals:
                    evals.append(trainer.evaluate(0, held_out))
                if step >= options.steps:
                    guard.settle()
                    trained, moments = trainer.collect()
                    break
                batch = windows.take(step_index(len(windows), step, options.batch_size, options.shuffle, options.seed))
                record = trainer.step(step, batch)
                records.append(record)
                if on_step is not None:
                    on_step(record, options.steps)
                done = step + 1
                if held_out is not None and (done == options.steps
                                             or (options.eval_every and done % options.eval_every == 0)):
                    evals.append(trainer.evaluate(done, held_out))
                    log.info("mdi-train: eval after step %d: loss %.4f", done, evals[-1]["loss"])
                collected = None
                if options.checkpoint_every and done % options.checkpoint_every == 0:
                    collected = trainer.collect()
                    assert options.checkpoint_dir is not None  # check_options
                    save_checkpoint(checkpoint_path(options.checkpoint_dir, done), config, spec, cfg.model.path,
                                    Checkpoint(done, collected[0], collected[1],
                                               TrainResult(records, {}, 0, 0).metrics()["steps"], evals,
                                               trainer.prompt_embeddings(), options.prompt),
                                    fingerprint(cfg, options))
                guard.completed(done, collected)
                step = done
            except (NodeError, RingTimeout) as e:
                # a lost node: the ring re-planned, every node back at the snapshot, its steps on
                step = guard.recover(e, step)
                records = [r for r in records if r.step < step]
                evals = [v for v in evals if v["step"] <= step]
        engine.close()
    except BaseException:
        engine.abort()
        raise
    return TrainResult(records, trained, len(engine.nodes), len(windows), extra=guard.metrics(), evals=evals,
                       optimizer=moments, prompt=trainer.prompt_embeddings())


def _prompt_trainer(engine: Engine, options: TrainOptions, prompt: Optional[torch.Tensor],
                    text_ids: Optional[List[int]], state: Optional[OptimizerState]) -> PromptTrainer:
    """--method prompt's trainer on the starter: from `prompt`, else PEFT's init of it."""
    spec, chunk = options.prompt, engine.chunk
    assert spec is not None and chunk is not None  # run: a prompt run, the engine open
    if prompt is None:
        prompt = init_prompt(chunk, spec, options.seed, text_ids)
    if tuple(prompt.shape) != (spec.n_virtual, chunk.config.n_embd):
        raise ConfigError("the initial prompt is %s, --num-virtual-tokens %d needs [%d, %d]"
                          % (list(prompt.shape), spec.n_virtual, spec.n_virtual, chunk.config.n_embd))
    s = options.setup
    return PromptTrainer(prompt, s.lr, s.betas, s.eps, s.weight_decay, state, chunk.device)


def _layers_of(d: Dict[str, Any], first: int, last: int) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if first <= key_layer(k) < last}


@dataclass
class Returned:
    """What a frame back at the starter during a step asks of it (RingTrainer.on_frame)."""
    send: Optional[Frame] = None  # the loss's gradient for a micro-batch, or another node's gradient to relay
    loss: float = 0.0  # a micro-batch's share of the batch loss (a train frame back from the last node)
    backward_done: bool = False  # the starter's own backward of one micro-batch ran


class RingTrainer:
    def __init__(self, engine: Engine, options: TrainOptions, pairs: Pairs,
                 state: Optional[OptimizerState] = None, prompt: Optional[PromptTrainer] = None) -> None:
        self.engine, self.options = engine, options
        self.prompt = prompt  # --method prompt: the virtual tokens' trainer; no node trains a LoRA
        self.virtual = prompt.n_virtual if prompt is not None else 0
        self.n_layer = self.chunk.config.n_layer
        # called before a step's "step" frame goes round, while no node has stepped yet
        # (mdi.starter.train_recovery settles the snapshot it is reading meanwhile)
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
                    raise RingTimeout("no training frame came back round the ring for %.0f s" % timeout)

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
