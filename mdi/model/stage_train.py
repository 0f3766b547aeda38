"""One node's share of training: its blocks' forward and backward for each micro-batch of a
batch, and its own optimizer step over its own LoRA parameters once the batch is complete.

The same on the starter (its first blocks) and on every worker (mdi.worker.training), so a
1-node and an N-node run do the same arithmetic per layer. What backward needs is kept per
micro-batch until its gradient comes: the recorded graph (default), or with `recompute` only
the input, the forward being run again under autograd when the gradient arrives (Petals'
servers do this; for boards short of memory, at the cost of a second forward). Gradients of
the micro-batches add up in the parameters' .grad, exactly what one batch gives when each
micro-batch's loss is its share of the batch mean (the starter scales it so).
"""
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import torch

from mdi.model.lora_train import LoraSpec, TrainableLora


@dataclass
class _Pending:
    x: torch.Tensor  # the micro-batch's input [B, T, C], a leaf (requires grad where an input grad is wanted)
    out: Optional[torch.Tensor]  # its output, graph attached; None under recompute


class StageTrainer:
    def __init__(self, chunk, spec: LoraSpec, pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]],
                 lr: float, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, recompute: bool = False) -> None:
        self.chunk = chunk
        p = next(chunk.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        with torch.inference_mode(False):
            for w in chunk.parameters():
                w.requires_grad_(False)  # the base stays frozen: no gradient is computed for it
            self.lora = TrainableLora(chunk.config, spec, chunk.first, chunk.last, pairs, device)
            params = self.lora.parameters()
            self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay) \
                if params else None
        self.recompute = recompute
        self.pending: Dict[Tuple[int, int], _Pending] = {}  # (step, micro) -> what its backward needs
        self.done: Dict[int, int] = {}  # step -> micro-batches whose backward ran here
        self.steps = 0

    @property
    def has_blocks(self) -> bool:
        return self.chunk.last > self.chunk.first

    def forward(self, step: int, micro: int, x: torch.Tensor, input_grad: bool = True) -> torch.Tensor:
        """The blocks over x [B, T, C]; the output, detached (it leaves for the next node)."""
        key = (step, micro)
        if key in self.pending:
            raise ValueError("micro-batch %d of step %d came forward twice" % (micro, step))
        with torch.inference_mode(False), torch.enable_grad():
            x = x.detach().clone().requires_grad_(input_grad)
            if self.recompute:
                with torch.no_grad():
                    out = self.lora.forward_blocks(self.chunk, x)
                self.pending[key] = _Pending(x, None)
            else:
                out = self.lora.forward_blocks(self.chunk, x)
                self.pending[key] = _Pending(x, out)
            return out.detach()

    def backward(self, step: int, micro: int, grad_out: torch.Tensor) -> Optional[torch.Tensor]:
        """Accumulate this micro-batch's parameter gradients; the gradient for its input (None
        when its forward wanted none)."""
        pending = self.pending.pop((step, micro), None)
        if pending is None:
            raise ValueError("a gradient came for micro-batch %d of step %d, which this node has not run forward"
                             % (micro, step))
        with torch.inference_mode(False), torch.enable_grad():
            out = pending.out if pending.out is not None else self.lora.forward_blocks(self.chunk, pending.x)
            grad = grad_out.detach().clone().to(out.dtype).view(out.shape)
            if out.requires_grad:
                out.backward(grad)
        self.done[step] = self.done.get(step, 0) + 1
        if pending.x.grad is not None:
            return pending.x.grad
        return torch.zeros_like(pending.x) if pending.x.requires_grad else None

    def step(self, step: int, n_micro: int) -> None:
        """The batch of `step` is complete: AdamW over its summed gradients, then zero them."""
        done = self.done.pop(step, 0)
        if done != n_micro or any(k[0] == step for k in self.pending):
            raise ValueError("step %d: %d micro-batches completed backward here, the batch has %d"
                             % (step, done, n_micro))
        if self.optimizer is not None:
            with torch.inference_mode(False):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def pairs(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        return {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in self.lora.pairs.items()}
