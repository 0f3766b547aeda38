"""Prompt tuning (mdi-train --method prompt): PEFT's soft prompt, n learned virtual-token
embeddings put before every window, trained on the starter while the base stays frozen on
every node (workers train nothing; they run backward only to pass their input's gradient on).

The virtual tokens go where serving puts them (mdi.starter.adapter_set.prepare and
mdi.starter.frame_rows.virtual_rows): positions 0..n-1, the window's tokens at n..n+L-1, the
embeddings replacing placeholder rows in ModelChunk.embed_rows (GPT-2's learned positions added
to them as to any token). PEFT's PeftModelForCausalLM does the same (inputs_embeds =
cat(prompt, embeds), positions counted from 0 over both), so a prompt serves as it trained.

Gradient: a virtual row of the embedding output is the prompt row plus a constant (its position
embedding, or nothing), so the prompt's gradient is the embedding output's gradient at the
virtual rows, summed over the windows: the starter's blocks run backward to their input, and
nothing differentiates through the embedding table.
"""
import json
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from mdi.model.config import ModelConfig

PROMPT_KEY = "prompt_embeddings"  # PEFT's tensor name in adapter_model.safetensors
PROMPT_INITS = ("random", "text")


@dataclass(frozen=True)
class PromptSpec:
    """What --method prompt trains: n virtual tokens, initialised as PEFT's PromptTuningInit."""
    n_virtual: int
    init: str = "random"  # random: N(0, 1) as torch.nn.Embedding (PEFT's RANDOM); text: init_text's embeddings
    init_text: Optional[str] = None


def text_init_ids(ids: Sequence[int], n: int) -> list:
    """PEFT's PromptTuningInit.TEXT: the text's ids cut to n, or repeated until they cover n."""
    if not ids:
        raise ValueError("--prompt-init-text encodes to no tokens")
    ids = list(ids) * math.ceil(n / len(ids)) if len(ids) < n else list(ids)
    return ids[:n]


def init_prompt(chunk, spec: PromptSpec, seed: int, text_ids: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The initial embeddings [n, n_embd], float32: seeded N(0, 1), or the token embeddings of
    `text_ids` (the --prompt-init-text as the tokenizer encodes it) by PEFT's rule."""
    if spec.init == "text":
        if text_ids is None:
            raise ValueError("--prompt-init text needs --prompt-init-text")
        index = torch.tensor(text_init_ids(text_ids, spec.n_virtual), dtype=torch.long)
        with torch.no_grad():
            return chunk.tok_emb(index.to(chunk.device)).float().cpu().clone()
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.n_virtual, chunk.config.n_embd, generator=gen, dtype=torch.float32)


class PromptTrainer:
    """The prompt's parameter and its AdamW (torch's), on the starter."""

    def __init__(self, embeddings: torch.Tensor, lr: float, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, state=None,
                 device: Optional[torch.device] = None) -> None:
        with torch.inference_mode(False):
            self.prompt = embeddings.detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True)
            self.optimizer = torch.optim.AdamW([self.prompt], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if state is not None:
            self.load_optimizer_state(state)

    @property
    def n_virtual(self) -> int:
        return int(self.prompt.shape[0])

    def embed(self, chunk, ids: torch.Tensor) -> torch.Tensor:
        """Windows ids [B, L] embedded behind the virtual tokens: [B, n + L, C], no graph."""
        b, length = ids.shape
        n, total = self.n_virtual, self.n_virtual + ids.shape[1]
        device = ids.device
        placeholders = torch.cat([torch.zeros(b, n, dtype=ids.dtype, device=device), ids], dim=1)
        positions = torch.arange(total, device=device).repeat(b)
        rows = (torch.arange(b, device=device)[:, None] * total + torch.arange(n, device=device)[None]).reshape(-1)
        with torch.no_grad():
            x = chunk.embed_rows(placeholders.reshape(-1), positions, (rows, self.prompt.detach().repeat(b, 1)))
        return x.view(b, total, -1)

    def accumulate(self, grad_x: torch.Tensor) -> None:
        """Add the virtual rows' gradient of one micro-batch's embedding output [B, n + L, C]."""
        with torch.inference_mode(False), torch.no_grad():
            g = grad_x[:, :self.n_virtual].float().sum(0).to(self.prompt.device)
            if self.prompt.grad is None:
                self.prompt.grad = g.clone()
            else:
                self.prompt.grad += g

    def grad_sq_norm(self) -> float:
        g = self.prompt.grad
        return float(torch.linalg.vector_norm(g, 2).item()) ** 2 if g is not None else 0.0

    def scale_grads(self, scale: float) -> None:
        if scale != 1.0 and self.prompt.grad is not None:
            with torch.inference_mode(False), torch.no_grad():
                self.prompt.grad.mul_(scale)

    def step(self) -> None:
        with torch.inference_mode(False):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def embeddings(self) -> torch.Tensor:
        return self.prompt.detach().cpu().clone()

    def optimizer_state(self):
        """AdamW's state as mdi.model.adapters.stage_train.OptimizerState, the moments under PROMPT_KEY."""
        from mdi.model.adapters.stage_train import OptimizerState
        st = self.optimizer.state.get(self.prompt)
        if not st:
            return OptimizerState(0, {})
        return OptimizerState(int(float(st["step"])), {PROMPT_KEY: (st["exp_avg"].detach().cpu().clone(),
                                                                   st["exp_avg_sq"].detach().cpu().clone())})

    def restore(self, embeddings: torch.Tensor, state) -> None:
        """Back to `embeddings` and AdamW `state` (a recovery's snapshot), no gradient pending."""
        with torch.inference_mode(False), torch.no_grad():
            self.prompt.copy_(embeddings.to(self.prompt.device, torch.float32))
        self.prompt.grad = None
        self.optimizer.state.clear()
        self.load_optimizer_state(state)

    def load_optimizer_state(self, state) -> None:
        if not state.moments:
            return
        m = state.moments.get(PROMPT_KEY)
        if m is None or set(state.moments) != {PROMPT_KEY} or m[0].shape != self.prompt.shape \
                or m[1].shape != self.prompt.shape:
            raise ValueError("optimizer state for %s is missing or of another shape" % PROMPT_KEY)
        p = self.prompt
        self.optimizer.state[p] = {"step": torch.tensor(float(state.steps)),
                                   "exp_avg": m[0].to(p.device, torch.float32).clone(),
                                   "exp_avg_sq": m[1].to(p.device, torch.float32).clone()}


def prompt_config(config: ModelConfig, spec: PromptSpec, base: str) -> Dict:
    """adapter_config.json of a trained prompt (what PeftModel.save_pretrained writes for
    PromptTuningConfig; inference_mode, so peft builds no tokenizer to load it)."""
    text = spec.init == "text"
    return {"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "num_virtual_tokens": spec.n_virtual, "token_dim": config.n_embd, "num_transformer_submodules": 1,
            "num_attention_heads": config.n_head, "num_layers": config.n_layer,
            "prompt_tuning_init": "TEXT" if text else "RANDOM",
            "prompt_tuning_init_text": spec.init_text if text else None,
            "tokenizer_name_or_path": base if text else None, "inference_mode": True}


def save_prompt_adapter(path: str, config: ModelConfig, spec: PromptSpec, embeddings: torch.Tensor, base: str) -> None:
    """Write a PEFT prompt-tuning directory that `peft` and mdi's --adapter / adapters: read."""
    from mdi.model.adapters.adapter_files import write_adapter_files
    write_adapter_files(path, {PROMPT_KEY: embeddings.detach().float().contiguous().cpu()},
                        prompt_config(config, spec, base))


def read_prompt_adapter(path: str, config: ModelConfig) -> torch.Tensor:
    """A prompt-tuning adapter's embeddings [n, n_embd] (--init-adapter; a checkpoint's), checked
    for this base by mdi's reader; AdapterError for a LoRA or anything else."""
    from mdi.model.adapters.adapter_files import load_any
    from mdi.model.adapters.lora import AdapterError
    adapter = load_any(path, config)
    if getattr(adapter, "kind", None) != "prompt":
        raise AdapterError("--init-adapter %s: a LoRA, not a prompt-tuning adapter (peft_type PROMPT_TUNING), "
                           "which --method prompt trains" % path)
    return torch.from_numpy(adapter.embeddings)


def is_prompt_adapter(path: str) -> bool:
    """Whether `path` is a directory whose adapter_config.json says PROMPT_TUNING."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return json.load(f).get("peft_type") == "PROMPT_TUNING"
    except (OSError, ValueError, AttributeError):
        return False
