"""One node's share of training: its blocks' forward and backward for each micro-batch of a
batch, and its own optimizer step over its own LoRA parameters once the batch is complete.

The same on the starter (its first blocks) and on every worker (mdi.worker.training), so a
1-node and an N-node run do the same arithmetic per layer. What backward needs is kept per
micro-batch until its gradient comes: the recorded graph (default), or with `recompute` only
the input, the forward being run again under autograd when the gradient arrives (Petals'
servers do this; for boards short of memory, at the cost of a second forward). Gradients of
the micro-batches add up in the parameters' .grad, exactly what one batch gives when each
micro-batch's loss is its share of the batch mean (the starter scales it so). A spec with no
targets (mdi-train --method prompt) trains nothing here: the node has no optimizer and runs
backward only for its input's gradient.
"""
import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import torch

from mdi.model.adapters.lora_train import LoraSpec, TrainableLora


@dataclass
class _Pending:
    x: torch.Tensor  # the micro-batch's input [B, T, C], a leaf (requires grad where an input grad is wanted)
    out: Optional[torch.Tensor]  # its output, graph attached; None under recompute


class StageTrainer:
    def __init__(self, chunk, spec: LoraSpec, pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]],
                 lr: float, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, recompute: bool = False,
                 state: Optional["OptimizerState"] = None) -> None:
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
        if state is not None:
            self.load_optimizer_state(state)
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

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks over held-out windows x [B, T, C], nothing kept for backward."""
        with torch.no_grad():
            return self.lora.forward_blocks(self.chunk, x.detach())

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

    def grad_sq_norm(self) -> float:
        """The squared L2 norm of this node's gradients (the batch's, summed over micro-batches):
        its share of the global norm --clip bounds."""
        total = 0.0
        for p in self.lora.parameters():
            if p.grad is not None:
                total += float(torch.linalg.vector_norm(p.grad, 2).item()) ** 2
        return total

    def scale_grads(self, scale: float) -> None:
        """Multiply the gradients by the global clip factor (torch's clip_grad_norm_: grad *= c)."""
        if scale == 1.0:
            return
        with torch.inference_mode(False), torch.no_grad():
            for p in self.lora.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    def optimizer_state(self) -> "OptimizerState":
        """AdamW's state of every parameter by its name ("<key>.lora_A"), and the steps taken."""
        moments: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        steps = 0
        if self.optimizer is not None:
            for key, (a, b) in self.lora.pairs.items():
                for name, p in ((key + ".lora_A", a), (key + ".lora_B", b)):
                    st = self.optimizer.state.get(p)
                    if st:
                        moments[name] = (st["exp_avg"].detach().cpu().clone(), st["exp_avg_sq"].detach().cpu().clone())
                        steps = int(float(st["step"]))
        return OptimizerState(steps, moments)

    def load_optimizer_state(self, state: "OptimizerState") -> None:
        """Continue from `state` (a checkpoint's): the same moments and step count, so the next
        step equals the uninterrupted run's."""
        if self.optimizer is None or not state.moments:
            return
        for key, (a, b) in self.lora.pairs.items():
            for name, p in ((key + ".lora_A", a), (key + ".lora_B", b)):
                m = state.moments.get(name)
                if m is None or m[0].shape != p.shape or m[1].shape != p.shape:
                    raise ValueError("optimizer state for %s is missing or of another shape" % name)
                self.optimizer.state[p] = {"step": torch.tensor(float(state.steps)),
                                           "exp_avg": m[0].to(p.device, torch.float32).clone(),
                                           "exp_avg_sq": m[1].to(p.device, torch.float32).clone()}

    def pairs(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        return {k: (a.detach().cpu(), b.detach().cpu()) for k, (a, b) in self.lora.pairs.items()}


@dataclass
class OptimizerState:
    """AdamW's state of some parameters: steps taken, and each parameter's two moments."""
    steps: int
    moments: Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # "<key>.lora_A" -> (exp_avg, exp_avg_sq)


def train_dtype_problem(dtype: torch.dtype, device: str) -> Optional[str]:
    """Why a node cannot train with its frozen base computing in `dtype` on `device`, or None.

    Training in float16 / bfloat16 keeps the LoRA parameters, their AdamW state and the loss in
    float32 (TrainableLora casts the fused pairs to the activations' dtype; the loss is taken on
    float32 logits), so what the device must have is the narrow dtype's matmul and its backward:
    run on a tiny product here rather than kept in a table, because it depends on the device and
    the torch build (float16 matmul on CPU is missing in older torch; bfloat16 on a CUDA card
    before Ampere is emulated at best)."""
    if dtype == torch.float32:
        return None
    name = str(dtype).replace("torch.", "")
    if str(device).startswith("cuda") and dtype == torch.bfloat16:
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)  # type: ignore[call-arg]
        except TypeError:  # torch before 2.3 has no including_emulation
            native = torch.cuda.is_bf16_supported()
        if not native:
            return "%s has no native bfloat16" % device
    try:
        with torch.inference_mode(False), torch.enable_grad():
            w = torch.ones(4, 4, dtype=torch.float32, device=device, requires_grad=True)
            x = torch.ones(2, 4, dtype=dtype, device=device, requires_grad=True)
            (x @ w.to(dtype)).float().sum().backward()
    except (RuntimeError, TypeError) as e:
        return "torch %s on %s cannot run a %s matmul and its backward (%s)" % (
            torch.__version__, device, name, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return None


def clip_scale(sq_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor for a global squared norm: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (math.sqrt(sq_norm) + 1e-6))
