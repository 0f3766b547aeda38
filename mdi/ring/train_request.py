"""POST /train (contract): make the worker's current run a training run. The body is
safetensors: the initial LoRA pairs of the worker's layers ("<layer>.<module>.lora_A" [r, in]
and ".lora_B" [out, r], PEFT's modules, unscaled: mdi.model.adapters.lora_train) and, in the file's
metadata under "mdi_train", the JSON of a `TrainSetup`; a resumed run adds the AdamW state
("<layer>.<module>.lora_A.exp_avg" and ".exp_avg_sq", the steps taken in the metadata under
"adam_steps"). GET /train answers the pairs and their AdamW state as they are now, the same
safetensors, base64 in a JSON body. Safetensors only, nothing that runs code
when read. Both ends use these functions."""
import base64
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from safetensors.torch import load as safetensors_load, save as safetensors_save

from mdi.model.adapters.lora_train import LoraSpec, check_targets
from mdi.model.adapters.stage_train import OptimizerState
from mdi.ring.init_request import RequestError

from mdi.ring.body_limits import MAX_TRAIN_BYTES  # noqa: E402,F401  (named from here too)
METADATA_KEY = "mdi_train"
STEPS_KEY = "adam_steps"
MOMENTS = ("exp_avg", "exp_avg_sq")
Pairs = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TrainSetup:
    """How every node trains its part: the LoRA's shape and the optimizer (torch's AdamW). No
    targets: the node trains nothing and only passes gradients on (--method prompt)."""
    targets: Tuple[str, ...]
    rank: int
    alpha: float
    lr: float
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    recompute: bool = False  # keep only each micro-batch's input and run the forward again for backward

    @property
    def spec(self) -> LoraSpec:
        return LoraSpec(self.targets, self.rank, self.alpha)

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["targets"], d["betas"] = list(self.targets), list(self.betas)
        return d

    @classmethod
    def from_json(cls, d: Any) -> "TrainSetup":
        if not isinstance(d, dict):
            raise RequestError("mdi_train must be a JSON object")
        try:
            targets = list(d["targets"])
            setup = cls(targets=check_targets(targets) if targets else (), rank=int(d["rank"]), alpha=float(d["alpha"]),
                        lr=float(d["lr"]), betas=(float(d["betas"][0]), float(d["betas"][1])),
                        eps=float(d["eps"]), weight_decay=float(d["weight_decay"]), recompute=bool(d["recompute"]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise RequestError("mdi_train: %s" % (e,))
        numbers = (setup.alpha, setup.lr, setup.eps, setup.weight_decay) + setup.betas
        if not (1 <= setup.rank <= 4096 and all(math.isfinite(x) for x in numbers) and setup.lr > 0
                and setup.eps > 0 and setup.weight_decay >= 0 and all(0 <= b < 1 for b in setup.betas)):
            raise RequestError("mdi_train: rank, alpha, lr, betas, eps or weight_decay out of range")
        return setup


def _tensors(pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]],
             state: Optional[OptimizerState]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    tensors = {}
    for key, (a, b) in pairs.items():
        tensors[key + ".lora_A"] = a.detach().float().contiguous().cpu()
        tensors[key + ".lora_B"] = b.detach().float().contiguous().cpu()
    metadata = {}
    if state is not None and state.moments:
        for name, moments in state.moments.items():
            for moment, t in zip(MOMENTS, moments):
                tensors["%s.%s" % (name, moment)] = t.detach().float().contiguous().cpu()
        metadata[STEPS_KEY] = str(state.steps)
    return tensors, metadata


def train_body(setup: TrainSetup, pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]],
               state: Optional[OptimizerState] = None) -> bytes:
    tensors, metadata = _tensors(pairs, state)
    metadata[METADATA_KEY] = json.dumps(setup.to_json())
    return safetensors_save(tensors, metadata=metadata)


def _read_state(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                pairs: Pairs) -> Optional[OptimizerState]:
    """The AdamW moments among `tensors` (each the shape of its parameter), or None."""
    names = [n for n in tensors if n.rpartition(".")[2] in MOMENTS]
    if not names:
        return None
    try:
        steps = int(metadata[STEPS_KEY])
    except (KeyError, ValueError):
        raise RequestError("training body holds AdamW moments but no %s metadata" % STEPS_KEY)
    moments: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for key, (a, b) in pairs.items():
        for name, p in ((key + ".lora_A", a), (key + ".lora_B", b)):
            first, second = [tensors.get("%s.%s" % (name, moment)) for moment in MOMENTS]
            if first is None or second is None or any(
                    t.shape != p.shape or not t.is_floating_point() or not torch.isfinite(t).all() for t in (first, second)):
                raise RequestError("training body: AdamW moments of %r missing or not finite [%s]"
                                   % (name[:120], ", ".join(map(str, p.shape))))
            moments[name] = (first, second)
    if not 0 <= steps <= (1 << 62) or len(names) != 2 * len(moments):
        raise RequestError("training body: AdamW state of other parameters, or a step count out of range")
    return OptimizerState(steps, moments)


def _load(body: bytes) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The body's tensors and metadata, read once, or a RequestError naming what is wrong."""
    if not body or len(body) > MAX_TRAIN_BYTES:
        raise RequestError("a training body is 1 to %d bytes of safetensors" % MAX_TRAIN_BYTES)
    try:
        tensors = safetensors_load(bytes(body))
        # the metadata, from the header safetensors has just checked: 8 bytes of length, then JSON
        header_len = int.from_bytes(bytes(body[:8]), "little")
        metadata = json.loads(bytes(body[8:8 + header_len])).get("__metadata__") or {}
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise RequestError("training body is not a safetensors file: %s" % e)
    return tensors, metadata


def _pairs(tensors: Mapping[str, torch.Tensor]) -> Pairs:
    """The LoRA pairs among `tensors` (the AdamW moments are _read_state's)."""
    pairs: Pairs = {}
    for name in tensors:
        if name.rpartition(".")[2] in MOMENTS:
            continue  # AdamW state: _read_state
        key, _, ab = name.rpartition(".")
        if ab not in ("lora_A", "lora_B") or not key:
            raise RequestError("training tensor %r: expected <layer>.<module>.lora_A or .lora_B" % name[:120])
        a, b = tensors.get(key + ".lora_A"), tensors.get(key + ".lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() \
                or not b.is_floating_point() or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise RequestError("training pair %r: needs finite float lora_A [r, in] and lora_B [out, r]" % key[:120])
        pairs[key] = (a, b)
    return pairs


def _read_all(body: bytes) -> Tuple[Pairs, Optional[OptimizerState], Dict[str, str]]:
    tensors, metadata = _load(body)  # parsed once: pairs and moments come from the same tensors
    pairs = _pairs(tensors)
    return pairs, _read_state(tensors, metadata, pairs), metadata


def read_train_body(body: bytes) -> Tuple[TrainSetup, Pairs, Optional[OptimizerState]]:
    pairs, state, metadata = _read_all(body)
    try:
        setup = json.loads(metadata[METADATA_KEY])
    except (KeyError, ValueError):
        raise RequestError("training body has no %s metadata (a TrainSetup's JSON)" % METADATA_KEY)
    return TrainSetup.from_json(setup), pairs, state


def pairs_reply(pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]],
                state: Optional[OptimizerState] = None) -> Dict[str, Any]:
    """GET /train's JSON: the pairs (and their AdamW state) as safetensors, base64."""
    tensors, metadata = _tensors(pairs, state)
    return {"ok": True, "pairs": base64.b64encode(safetensors_save(tensors, metadata=metadata or None)).decode("ascii")}


def read_pairs_reply(reply: Mapping[str, Any]) -> Tuple[Pairs, Optional[OptimizerState]]:
    try:
        body = base64.b64decode(reply["pairs"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError("GET /train reply holds no base64 pairs: %s" % e)
    pairs, state, _ = _read_all(body)
    return pairs, state
