"""mdi-train's driver: a LoRA trained through the ring, the base frozen on the boards that hold
it (issue 38). The starter owns the data, the loss and the schedule; every node (the starter
for its first blocks, each worker for its chunk: mdi.model.adapters.stage_train) owns its LoRA
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

--method prompt (mdi.model.adapters.prompt_train): the prompt's parameter, its AdamW and the loss live
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
from typing import Any, Callable, Dict, List, Optional

import torch

from mdi.model.adapters.lora_train import init_pairs
from mdi.model.adapters.prompt_train import PromptTrainer, init_prompt
from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.model.layout import torch_dtype
from mdi.model.adapters.stage_train import OptimizerState, train_dtype_problem
from mdi.ring.transport import RingTimeout
from mdi.runconfig import ConfigError, RunConfig
from mdi.starter.control import NodeError
from mdi.starter.engine import Engine
from mdi.starter.planning.run_plan import plan_run
from mdi.starter.train.ring_trainer import RingTrainer
from mdi.starter.planning.run_shape import RunShape
from mdi.starter.train.train_checkpoint import Checkpoint, checkpoint_path, run_fingerprint, save_checkpoint
from mdi.starter.train.train_recovery import TrainRecovery
from mdi.starter.train.train_options import Pairs, StepRecord, TrainOptions, TrainResult, check_options
from mdi.starter.train.train_data import load_windows, step_index

log = logging.getLogger(__name__)

def fingerprint(cfg: RunConfig, options: TrainOptions) -> Dict[str, Any]:
    """The settings a checkpoint of this run is resumed with (mdi.starter.train.train_checkpoint)."""
    s = options.setup
    prompt = {"num_virtual_tokens": options.prompt.n_virtual} if options.prompt is not None else {}
    return run_fingerprint(cfg.model.path, options.data, s.spec, lr=s.lr, betas=list(s.betas),
                           eps=s.eps, weight_decay=s.weight_decay, batch_size=options.batch_size,
                           seq_len=options.seq_len, seed=options.seed, shuffle=options.shuffle, clip=options.clip,
                           **prompt)


def training_config(cfg: RunConfig) -> RunConfig:
    """`cfg` computing on torch with kernels that have a backward (mdi-train's and
    mdi.starter.remote_blocks'): ggml has no backward pass here."""
    everyone = list(cfg.nodes) + list(cfg.spares)  # a spare trains too once it takes a lost node's layers
    asked_ggml = [n.name for n in everyone if cfg.backend_of(n) == "ggml"]
    if asked_ggml:
        from mdi.model.backend import BACKEND_ENV, default_backend
        where = (" (%s=ggml in the environment is the default where the config names none)" % BACKEND_ENV
                 if default_backend() == "ggml" else "")
        own = [n.name for n in everyone if n.backend == "ggml"]  # a node's own key wins over runtime.backend
        fix = "remove %s own backend: ggml" % ("its" if len(own) == 1 else "their") if own else \
            "set runtime.backend to auto or torch"
        raise ConfigError("%s: backend ggml cannot train (training computes on torch): %s%s"
                          % (", ".join(asked_ggml), fix, where))
    nodes = [dataclasses.replace(n, backend=None) for n in cfg.nodes]
    spares = [dataclasses.replace(n, backend=None) for n in cfg.spares]
    runtime = dataclasses.replace(cfg.runtime, backend="torch")
    if cfg.runtime.quant_kernel != "exact":
        # a quantized base's fast kernels (integer products, in-place rescaling) have no
        # backward: the frozen int4 / int8 weights compute in float32 on every node (QLoRA's way)
        log.info("mdi-train: runtime.quant_kernel %s -> exact (training needs kernels with a backward)",
                 cfg.runtime.quant_kernel)
        runtime = dataclasses.replace(runtime, quant_kernel="exact")
    return dataclasses.replace(cfg, nodes=nodes, spares=spares, runtime=runtime)


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
    (options.prompt): `prompt` the initial embeddings, else mdi.model.adapters.prompt_train.init_prompt
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
