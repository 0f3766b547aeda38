"""A LoRA that trains: its parameters per source module (PEFT's), their seeded initialisation,
the fused pairs mdi's layers compute with, and a chunk's cacheless forward with it applied.

Parameters are kept as PEFT keeps them, one (A [r, in], B [out, r]) per Hugging Face module
(q_proj, k_proj, ...), unscaled: the optimizer steps exactly what PEFT's would, and the adapter
directory written at the end is those tensors. mdi fuses q/k/v into attn.qkv and gate/up into
mlp.gate_up; each forward builds the fused pair from the parameters the way
`mdi.model.adapters.lora.fuse_parts` does for a loaded adapter (A stacked, B block-diagonal, the scale
alpha / r folded into B), with differentiable ops, so the zero blocks of B stay zero and get
no gradient. The forward then goes through the same `LoraDeltas.add` a served adapter uses,
under a reserved adapter id (TRAINING_ADAPTER) that frames can never name.

Initialisation (`init_pairs`): PEFT's default (init_lora_weights=True): A ~ kaiming_uniform
with a = sqrt(5), i.e. uniform in [-1/sqrt(in), 1/sqrt(in)], and B = 0, so the first forward
is the base model's. Drawn from one torch.Generator seeded with --seed, module by module in
layer order and then TARGET order, so any node split draws the same values.
"""
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mdi.model.adapters.lora import layer_shapes, part_rows
from mdi.model.config import ModelConfig

TRAINING_ADAPTER = -1  # the LoraDeltas id of the adapter being trained (frames name ids >= 0)
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # what --targets names, in drawing order

# --targets name -> (Hugging Face module inside a block, mdi layer, fused part or None). GPT-2
# has one fused c_attn (q, k and v together) and a two-matrix MLP: q/k/v all name c_attn,
# gate/up name c_fc, down names the MLP's c_proj.
MODULES: Dict[str, Dict[str, Tuple[str, str, Optional[str]]]] = {
    "llama": {"q": ("self_attn.q_proj", "attn.qkv", "q"), "k": ("self_attn.k_proj", "attn.qkv", "k"),
              "v": ("self_attn.v_proj", "attn.qkv", "v"), "o": ("self_attn.o_proj", "attn.proj", None),
              "gate": ("mlp.gate_proj", "mlp.gate_up", "gate"), "up": ("mlp.up_proj", "mlp.gate_up", "up"),
              "down": ("mlp.down_proj", "mlp.down", None)},
    "gpt2": {"q": ("attn.c_attn", "attn.qkv", None), "k": ("attn.c_attn", "attn.qkv", None),
             "v": ("attn.c_attn", "attn.qkv", None), "o": ("attn.c_proj", "attn.proj", None),
             "gate": ("mlp.c_fc", "mlp.fc", None), "up": ("mlp.c_fc", "mlp.fc", None),
             "down": ("mlp.c_proj", "mlp.proj", None)},
}
MODULES["gemma3"] = MODULES["llama"]  # Gemma 3 names its blocks' modules as Llama does
# where PEFT names the blocks (Gemma 3: Gemma3ForCausalLM's, the text model's)
HF_BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "gemma3": "model.layers"}


@dataclass(frozen=True)
class LoraSpec:
    """What is trained: which modules, at which rank and alpha (PEFT's r and lora_alpha)."""
    targets: Tuple[str, ...]  # --targets names (TARGETS)
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self, config: ModelConfig) -> List[str]:
        """The Hugging Face module names inside a block, each once, in TARGET order."""
        out: List[str] = []
        for t in TARGETS:
            if t in self.targets:
                module = MODULES[config.family][t][0]
                if module not in out:
                    out.append(module)
        return out


def check_targets(targets: Sequence[str]) -> Tuple[str, ...]:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError("--targets: %s is not among %s" % (",".join(unknown) or "nothing", ",".join(TARGETS)))
    return tuple(t for t in TARGETS if t in targets)


def _module_layer(config: ModelConfig, module: str) -> Tuple[str, Optional[str]]:
    """(mdi layer, fused part) of a Hugging Face module name inside a block."""
    for hf, mdi, part in MODULES[config.family].values():
        if hf == module:
            return mdi, part
    raise KeyError(module)


def param_key(layer: int, module: str) -> str:
    """The parameter pair's name: PEFT's module path (e.g. "model.layers.3.self_attn.q_proj"
    without the family's prefix is not unique across families, so the full path is kept)."""
    return "%d.%s" % (layer, module)


def key_layer(key: str) -> int:
    return int(key.split(".", 1)[0])


def init_pairs(config: ModelConfig, spec: LoraSpec, seed: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (A, B), float32, as PEFT initialises them (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(config)
    out = {}
    for layer in range(config.n_layer):
        for module in spec.modules(config):
            mdi, part = _module_layer(config, module)
            start, end = part_rows(config, mdi, part)
            n_in = shapes[mdi][1]
            bound = 1.0 / math.sqrt(n_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
            a = (torch.rand(spec.rank, n_in, generator=gen, dtype=torch.float32) * 2 - 1) * bound
            out[param_key(layer, module)] = (a, torch.zeros(end - start, spec.rank))
    return out


class TrainableLora:
    """The trained pairs of layers [first, last) as leaf tensors that require grad."""

    def __init__(self, config: ModelConfig, spec: LoraSpec, first: int, last: int,
                 pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], device: Optional[torch.device] = None) -> None:
        self.config, self.spec, self.first, self.last = config, spec, first, last
        expected = {param_key(layer, m) for layer in range(first, last) for m in spec.modules(config)}
        if set(pairs) != expected:
            raise ValueError("LoRA pairs %s do not match layers [%d, %d) of targets %s (expected %s)"
                             % (sorted(pairs)[:4], first, last, ",".join(spec.targets), sorted(expected)[:4]))
        shapes = layer_shapes(config)
        self.pairs: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        for key in sorted(pairs, key=lambda k: (key_layer(k), k)):
            a, b = pairs[key]
            mdi, part = _module_layer(config, key.split(".", 1)[1])
            start, end = part_rows(config, mdi, part)
            if tuple(a.shape) != (spec.rank, shapes[mdi][1]) or tuple(b.shape) != (end - start, spec.rank):
                raise ValueError("LoRA %s: A %s and B %s, expected [%d, %d] and [%d, %d]"
                                 % (key, list(a.shape), list(b.shape), spec.rank, shapes[mdi][1], end - start,
                                    spec.rank))
            self.pairs[key] = (a.detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True),
                               b.detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True))

    def parameters(self) -> List[torch.Tensor]:
        return [t for ab in self.pairs.values() for t in ab]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def fused(self, dtype: torch.dtype) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """{mdi layer name: (A.T [in, R], B.T [R, out])} as LoraDeltas holds them, the scale
        folded into B, differentiable in the parameters."""
        shapes = layer_shapes(self.config)
        groups: Dict[str, List[Tuple[Optional[str], torch.Tensor, torch.Tensor]]] = {}
        for key, (a, b) in self.pairs.items():
            mdi, part = _module_layer(self.config, key.split(".", 1)[1])
            groups.setdefault("blocks.%d.%s" % (key_layer(key), mdi), []).append((part, a, b))
        out = {}
        for name, parts in groups.items():
            n_out = shapes[name.split(".", 2)[2]][0]
            at = torch.cat([a for _, a, _ in parts], dim=0).t()
            bts = []
            for part, _, b in parts:
                start, end = part_rows(self.config, name.split(".", 2)[2], part)
                bts.append(F.pad(b.t() * self.spec.scale, (start, n_out - end)))  # its own output columns
            out[name] = (at.to(dtype), torch.cat(bts, dim=0).to(dtype))
        return out

    def forward_blocks(self, chunk, x: torch.Tensor) -> torch.Tensor:
        """`chunk`'s blocks over whole windows x [B, T, C] from position 0, without a KV cache,
        with this LoRA added to every layer it targets (recorded by autograd when enabled)."""
        lora = chunk.lora
        lora.adapters[TRAINING_ADAPTER] = self.fused(x.dtype)
        lora.groups = [(TRAINING_ADAPTER, slice(0, x.shape[0] * x.shape[1]))]
        try:
            for block in chunk.blocks.values():
                x = block.forward_batch(x, chunk.rope)
        finally:
            lora.groups = []
            lora.adapters.pop(TRAINING_ADAPTER, None)
        return x


def read_peft_pairs(path: str, config: ModelConfig) -> Tuple[LoraSpec, Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT LoRA directory (--init-adapter) as the spec and unscaled pairs training starts
    from: checked for this base first by mdi's adapter reader (AdapterError names what does not
    fit), then its tensors as they are. Training keeps one rank and alpha over every layer, so a
    rank or alpha pattern, rsLoRA or a subset of layers is refused."""
    from mdi.model.adapters.adapter_files import CONFIG_FILE, WEIGHTS_FILE, load_adapter
    from mdi.model.adapters.lora import AdapterError
    from safetensors.torch import load_file
    load_adapter(path, config)
    with open(os.path.join(path, CONFIG_FILE)) as f:
        cfg = json.load(f)
    for key in ("rank_pattern", "alpha_pattern", "use_rslora", "layers_to_transform"):
        if cfg.get(key):
            raise AdapterError("--init-adapter %s: adapter_config.json sets %s; mdi-train trains one rank and alpha "
                               "on every layer" % (path, key))
    block = re.compile(r"^(?:base_model\.model\.)?%s\.(\d+)\.(.+)\.lora_([AB])\.weight$"
                       % re.escape(HF_BLOCKS[config.family]))
    raw: Dict[str, List[Optional[torch.Tensor]]] = {}
    for name, t in load_file(os.path.join(path, WEIGHTS_FILE)).items():
        m = block.match(name)
        if m is None:
            raise AdapterError("--init-adapter %s: %s is not a LoRA matrix of a block" % (path, name))
        raw.setdefault(param_key(int(m.group(1)), m.group(2)), [None, None])[m.group(3) == "B"] = t.float()
    modules = sorted({key.split(".", 1)[1] for key in raw})
    targets = tuple(t for t in TARGETS if MODULES[config.family][t][0] in modules)
    spec = LoraSpec(targets, int(cfg["r"]), float(cfg["lora_alpha"]))
    expected = {param_key(layer, m) for layer in range(config.n_layer) for m in spec.modules(config)}
    if set(raw) != expected or sorted(spec.modules(config)) != modules:
        missing = sorted(expected - set(raw))
        raise AdapterError("--init-adapter %s: mdi-train needs the same modules on every layer (%s missing)"
                           % (path, missing[0] if missing else "modules of no target"))
    pairs = {}
    for key, (a, b) in raw.items():
        assert a is not None and b is not None  # load_adapter checked both are there
        pairs[key] = (a, b)
    return spec, pairs


def peft_tensor_name(config: ModelConfig, key: str, ab: str) -> str:
    layer, module = key.split(".", 1)
    return "base_model.model.%s.%s.%s.lora_%s.weight" % (HF_BLOCKS[config.family], layer, module, ab)


def peft_config(config: ModelConfig, spec: LoraSpec, base: str) -> Dict:
    """adapter_config.json of the trained adapter (what `PeftModel.save_pretrained` writes,
    the keys mdi's reader and peft's need)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted({m.rsplit(".", 1)[1] for m in spec.modules(config)}),
            "fan_in_fan_out": config.family == "gpt2", "init_lora_weights": True, "use_rslora": False,
            "inference_mode": True}


def save_peft_adapter(path: str, config: ModelConfig, spec: LoraSpec,
                      pairs: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], base: str) -> None:
    """Write `pairs` as a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors),
    which `peft` and mdi's `--adapter` / adapters: read (mdi.model.adapters.adapter_files)."""
    from mdi.model.adapters.adapter_files import write_adapter_files
    tensors = {}
    for key, (a, b) in pairs.items():
        tensors[peft_tensor_name(config, key, "A")] = a.detach().float().contiguous().cpu()
        tensors[peft_tensor_name(config, key, "B")] = b.detach().float().contiguous().cpu()
    write_adapter_files(path, tensors, peft_config(config, spec, base))
