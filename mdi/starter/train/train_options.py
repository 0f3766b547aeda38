"""What an mdi-train run is asked (TrainOptions, checked against the model's context) and what
it gives back: a record per step and the result (every layer's trained pairs, the evaluations,
the optimizer's state, a trained prompt)."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from mdi.model.adapters.prompt_train import PromptSpec
from mdi.model.adapters.stage_train import OptimizerState
from mdi.ring.train_request import TrainSetup
from mdi.runconfig import ConfigError
from mdi.starter.train.train_data import ChatRenderer

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
    shuffle: bool = False  # each epoch in a seeded order (mdi.starter.train.train_data.step_index)
    clip: Optional[float] = None  # the global gradient norm's bound (torch's clip_grad_norm_)
    eval_data: Optional[str] = None  # held-out windows: their mean loss before, every eval_every steps, at the end
    eval_every: Optional[int] = None
    checkpoint_every: Optional[int] = None  # a checkpoint under checkpoint_dir every K steps
    checkpoint_dir: Optional[str] = None
    render_chat: Optional[ChatRenderer] = None  # chat JSONL examples: the model's template (mdi.cli.train)
    prompt: Optional[PromptSpec] = None  # --method prompt: train these virtual tokens, no LoRA
    recovery_every: int = 1  # with recovery on: every node's state kept every K steps (mdi.starter.train.train_recovery)


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
    pairs: Pairs  # every layer's trained LoRA pairs (mdi.model.adapters.lora_train keys)
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
