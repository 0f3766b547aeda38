"""mdi-train's checkpoints (--checkpoint-every K, --resume DIR): everything a run needs to go on
as if it had never stopped.

A checkpoint directory (OUT/checkpoint-<steps done>) holds
  adapter_config.json, adapter_model.safetensors  the adapter so far (PEFT: servable as it is)
  optimizer.safetensors  every node's AdamW moments by parameter name ("<layer>.<module>.lora_A"
                         .exp_avg / .exp_avg_sq), the steps taken in its metadata; keyed by
                         layer, not by node, so a resumed ring may split the layers differently
  trainer_state.json     the steps done (the data position is steps x batch size: the windows a
                         step takes are a function of the step and the seed, mdi.starter.train.train_data,
                         so no random generator state exists to save), the step and eval records
                         so far, and the run's fingerprint.
The fingerprint is what must not change for the resumed run's losses to equal an uninterrupted
run's: the base, the data (its bytes' SHA-256), the windows, the LoRA's shape and the optimizer.
A prompt-tuning run (--method prompt) writes its prompt adapter instead, and the AdamW moments
of its one parameter under "prompt_embeddings".
`--resume` of a checkpoint whose fingerprint differs is refused, naming the first difference.
"""
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file

from mdi.model.adapters.lora_train import LoraSpec, read_peft_pairs, save_peft_adapter
from mdi.model.config import ModelConfig
from mdi.model.adapters.prompt_train import (PROMPT_KEY, PromptSpec, is_prompt_adapter, read_prompt_adapter,
                                            save_prompt_adapter)
from mdi.model.adapters.stage_train import OptimizerState
from mdi.runconfig import ConfigError
from mdi.system.files import sha256_file

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")
Pairs = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Checkpoint:
    steps_done: int
    pairs: Pairs
    optimizer: OptimizerState
    records: List[Dict[str, Any]]  # the StepRecords so far, as metrics write them
    evals: List[Dict[str, Any]]
    prompt: Optional[torch.Tensor] = None  # --method prompt: the embeddings so far (pairs and moments: none / its)
    prompt_spec: Optional[PromptSpec] = None


def checkpoint_path(out: str, steps_done: int) -> str:
    return os.path.join(out, "checkpoint-%d" % steps_done)


def save_checkpoint(path: str, config: ModelConfig, spec: LoraSpec, base: str, cp: Checkpoint,
                    fingerprint: Dict[str, Any]) -> None:
    if cp.prompt is not None:
        assert cp.prompt_spec is not None
        save_prompt_adapter(path, config, cp.prompt_spec, cp.prompt, base)
    else:
        save_peft_adapter(path, config, spec, cp.pairs, base)
    tensors = {"%s.%s" % (name, moment): t.contiguous() for name, moments in cp.optimizer.moments.items()
               for moment, t in zip(MOMENTS, moments)}
    save_file(tensors, os.path.join(path, OPTIMIZER_FILE), metadata={"adam_steps": str(cp.optimizer.steps)})
    state = {"steps_done": cp.steps_done, "fingerprint": fingerprint, "steps": cp.records, "eval": cp.evals}
    tmp = os.path.join(path, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, os.path.join(path, STATE_FILE))  # last: a checkpoint without it was cut short


def load_checkpoint(path: str, config: ModelConfig, fingerprint: Dict[str, Any]) -> Checkpoint:
    """The checkpoint at `path`, refused in one line when it is another run's or incomplete."""
    where = "--resume %s" % path
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        steps_done = int(state["steps_done"])
        saved = state["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("%s: not a complete mdi-train checkpoint (%s: %s)" % (where, STATE_FILE, e))
    for key in sorted(set(saved) | set(fingerprint)):
        if saved.get(key) != fingerprint.get(key):
            raise ConfigError("%s: a checkpoint of another run: its %s is %s, this run's %s"
                              % (where, key, json.dumps(saved.get(key)), json.dumps(fingerprint.get(key))))
    prompt = None
    if is_prompt_adapter(path):
        prompt = read_prompt_adapter(path, config)
        pairs: Pairs = {}
        params = {PROMPT_KEY: prompt}
    else:
        _, pairs = read_peft_pairs(path, config)
        params = {key + ".lora_" + ab: t for key, (a, b) in pairs.items() for ab, t in (("A", a), ("B", b))}
    try:
        tensors = load_file(os.path.join(path, OPTIMIZER_FILE))
        from safetensors import safe_open
        with safe_open(os.path.join(path, OPTIMIZER_FILE), "pt") as f:
            adam_steps = int((f.metadata() or {})["adam_steps"])
    except Exception as e:  # safetensors raises its own error types
        raise ConfigError("%s: %s unreadable (%s)" % (where, OPTIMIZER_FILE, e))
    moments = {}
    for name, p in params.items():
        first, second = [tensors.get("%s.%s" % (name, moment)) for moment in MOMENTS]
        if first is None or second is None or first.shape != p.shape or second.shape != p.shape:
            raise ConfigError("%s: %s has no AdamW state of %s's shape" % (where, OPTIMIZER_FILE, name))
        moments[name] = (first, second)
    return Checkpoint(steps_done, pairs, OptimizerState(adam_steps, moments), list(state.get("steps") or []),
                      list(state.get("eval") or []), prompt)


def run_fingerprint(base: str, data: str, spec: LoraSpec, **settings: Any) -> Dict[str, Any]:
    """What a resumed run must share with the checkpoint's (see the module docstring); not the
    --eval data, which changes no step."""
    out: Dict[str, Any] = {"base": os.path.abspath(base), "data_sha256": sha256_file(data),
                           "targets": list(spec.targets), "rank": spec.rank, "alpha": spec.alpha}
    out.update(settings)
    return out
