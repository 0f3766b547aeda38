"""Checkpoint readers: Hugging Face directories, GGUF files and nanoGPT ``ckpt.pt`` files into
``(ModelConfig, state_dict)`` with mdi's canonical tensor names (see `mdi.model.layout`).
``mdi-prepare`` then writes an mdi model directory (`mdi.model.files.store`), the only thing the
runtime loads.
"""
import functools
import glob
import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch

from mdi.model.config import ModelConfig
from mdi.system.files import read_json
from mdi.model.files.convert import (StateDict, check_state_dict, check_unused, convert_gemma3, convert_gpt2,
                                     convert_llama, make_getter)
from mdi.model.files.gguf import read_gguf
from mdi.model.files.store import MDI_CONFIG, load_weights, read_mdi_config
from mdi.model.layout import CheckpointError, first_line
from mdi.model.quantization.quant import convert


def _hf_tensor_loaders(path: str) -> Dict[str, Callable[[], torch.Tensor]]:
    """name -> loader for every tensor of an HF directory (safetensors read lazily)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError("%s: no \"weight_map\" of tensor names to file names" % index)
        files = [os.path.join(path, x) for x in sorted(set(weight_map.values()))]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    loaders: Dict[str, Callable[[], torch.Tensor]] = {}
    found_in: Dict[str, str] = {}
    for fn in files:
        for k, loader in _safetensors_loaders(fn).items():
            if k in found_in:  # which one transformers would read depends on an index this directory lacks
                raise CheckpointError("%s: tensor %s is in %s too: keep one file, or give the directory a "
                                      "model.safetensors.index.json" % (fn, k, os.path.basename(found_in[k])))
            loaders[k], found_in[k] = loader, fn
    if files:
        return loaders
    bin_file = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(bin_file):
        sd = load_pickled_weights(bin_file)
        # ignore: mypy cannot match a lambda's default arguments to Callable[[], T]
        return {k: (lambda t=t: t) for k, t in sd.items()}  # type: ignore[misc]
    raise CheckpointError("%s: no *.safetensors or pytorch_model.bin weights found" % path)


def _safetensors_loaders(fn: str) -> Dict[str, Callable[[], torch.Tensor]]:
    """name -> loader for each tensor of one safetensors file; a file that cannot be read is a
    one-line CheckpointError naming it, whether that shows at its header or at a tensor."""
    from safetensors import safe_open
    try:
        # the handle stays alive through the closures; tensors are read on demand
        f = safe_open(fn, framework="pt")
        names = list(f.keys())
    except Exception as e:  # missing, truncated, not safetensors: the library's own error types
        raise CheckpointError("%s: cannot read as safetensors (%s)" % (fn, first_line(e)))

    def load(name: str) -> torch.Tensor:
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise CheckpointError("%s: cannot read tensor %s (%s)" % (fn, name, first_line(e)))
    return {k: functools.partial(load, k) for k in names}


# torch.load(weights_only=True) has known bypasses before 2.6 (CVE-2025-32434): older torch
# (JetPack boards) must not unpickle a checkpoint at all.
SAFE_UNPICKLING_TORCH = (2, 6)


def torch_version() -> Tuple[int, int]:
    return tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])  # type: ignore


def load_pickled_weights(path: str) -> Any:  # whatever the checkpoint pickled
    """torch.load with weights_only=True, refused outright where that is not safe."""
    if torch_version() < SAFE_UNPICKLING_TORCH:
        raise CheckpointError("%s: refusing to unpickle a torch checkpoint with torch %s (weights_only has known "
                              "bypasses before torch 2.6, CVE-2025-32434): convert it with mdi-prepare on a machine "
                              "with torch >= 2.6 and copy the prepared directory (safetensors) here"
                              % (path, torch.__version__))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file or pickled objects weights_only refuses
        raise CheckpointError("%s: cannot load as a weights-only torch checkpoint (%s)" % (path, first_line(e)))


def read_json_object(fn: str) -> Dict[str, Any]:
    """A model file's JSON object, or a one-line CheckpointError naming the file."""
    data = read_json(fn, CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError("%s: expected a JSON object, got %s" % (fn, type(data).__name__))
    return data


# config.json's sizes, checked before any arithmetic on them (a "256" string named, not a TypeError)
HF_SIZE_KEYS = ("vocab_size", "n_layer", "n_embd", "n_head", "n_inner", "n_positions", "num_hidden_layers",
                "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "max_position_embeddings", "head_dim", "sliding_window")
SWIGLU_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# GPT-2's activation_function values that are the GELU mdi computes ("gelu": erf; the rest: tanh's)
GPT2_GELUS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")


def _hf_config(path: str, raw: Dict) -> ModelConfig:
    for key in HF_SIZE_KEYS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError("%s: config.json's %s must be an integer, got %r" % (path, key, value))
    reason = _unmodelled(raw)
    if reason:
        raise CheckpointError("%s: config.json: %s is not supported (mdi would compute another function)"
                              % (path, reason))
    try:
        config = ModelConfig.from_hf(raw, name=os.path.basename(os.path.normpath(path)))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError("%s: unsupported config.json (%s)" % (path, first_line(e)))
    return config


def _unmodelled(raw: Dict[str, Any]) -> Optional[str]:
    """A config.json setting that changes the model's maths in a way mdi does not compute, named
    with its value; None when there is none. Accepted and ignored, each gave other logits than
    transformers' (a Llama with hidden_act gelu: top-1 agreement 0.67)."""
    model_type = raw.get("model_type")
    if raw.get("mlp_bias"):
        return "mlp_bias=True"
    if raw.get("use_sliding_window"):
        return "sliding-window attention (use_sliding_window)"
    if model_type in SWIGLU_FAMILIES and raw.get("hidden_act", "silu") != "silu":
        return "hidden_act %r (only silu)" % (raw["hidden_act"],)
    if model_type == "gpt2":
        if raw.get("activation_function", "gelu_new") not in GPT2_GELUS:
            return "activation_function %r (only %s)" % (raw["activation_function"], ", ".join(GPT2_GELUS))
        if raw.get("scale_attn_weights", True) is not True:
            return "scale_attn_weights=%r" % (raw["scale_attn_weights"],)
        if raw.get("scale_attn_by_inverse_layer_idx"):
            return "scale_attn_by_inverse_layer_idx=True"
    return None


def read_hf_dir(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read a Hugging Face GPT-2, Llama / Qwen or Gemma 3 directory (config.json + safetensors or .bin)."""
    config = _hf_config(path, read_json_object(os.path.join(path, "config.json")))
    raw = _hf_tensor_loaders(path)
    # GPT2LMHeadModel saves "transformer.*", GPT2Model bare names; same for Llama's "model.";
    # Gemma 3's multimodal model its text part under "model.language_model." (transformers >= 4.52)
    # or "language_model.model."
    prefixes = {"gpt2": ("transformer.",), "gemma3": ("model.language_model.", "language_model.model.", "model.")}
    loaders = {_strip(k, prefixes.get(config.family, ("model.",))): v for k, v in raw.items()}
    used: set = set()
    get = make_getter(loaders, dtype, path, used)
    if config.family == "gpt2":
        sd = convert_gpt2(config, get, lambda n: True, conv1d=True)  # HF GPT-2 always has biases
        ignore = r"(^|\.)attn\.(masked_)?bias$|^lm_head\.weight$"  # causal-mask buffers; tied head
    elif config.family == "gemma3":
        sd = convert_gemma3(config, get, norm_shift=1.0)  # HF's norms compute (1 + w)
        # a multimodal checkpoint's vision tower and projector: not the language model mdi runs
        ignore = (r"^(model\.)?(vision_tower|multi_modal_projector)\." +
                  (r"|^(language_model\.)?lm_head\.weight$" if config.tied_head else ""))
    else:
        sd = convert_llama(config, get)
        ignore = r"rotary_emb\.inv_freq$" + (r"|^lm_head\.weight$" if config.tied_head else "")
    check_unused(list(loaders), used, ignore, path)
    check_state_dict(config, sd, where=path)
    return config, sd


def _strip(name: str, prefixes: Tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def read_nanogpt_ckpt(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read a nanoGPT ``ckpt.pt``. nanoGPT uses nn.Linear (no transpose) and a tied head.

    A bias=False nanoGPT has no bias tensors at all (linear or LayerNorm): we return
    ``bias=True`` with zero biases, which computes exactly the same function.
    """
    ckpt = load_pickled_weights(path)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise CheckpointError("%s: not a nanoGPT checkpoint (needs 'model' and 'model_args')" % path)
    args = ckpt["model_args"]
    try:
        config = ModelConfig(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "nanogpt",
            family="gpt2", vocab_size=args["vocab_size"], n_layer=args["n_layer"],
            n_embd=args["n_embd"], n_head=args["n_head"], block_size=args["block_size"],
            norm_eps=1e-5, bias=True, tied_head=True, gelu_approximate="none",  # nn.GELU()
        )
    except KeyError as e:
        raise CheckpointError("%s: model_args lacks %s" % (path, e))
    # torch.compile'd models save parameters under "_orig_mod."
    tensors = {re.sub(r"^_orig_mod\.", "", k): v for k, v in ckpt["model"].items()}
    tensors = {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in tensors.items()}
    used: set = set()
    # ignore: mypy cannot match a lambda's default arguments to Callable[[], T]
    get = make_getter({k: (lambda v=v: v) for k, v in tensors.items()}, dtype, path, used)  # type: ignore[misc]
    sd = convert_gpt2(config, get, lambda n: n in tensors, conv1d=False)
    check_unused(list(tensors), used, r"^lm_head\.weight$|(^|\.)attn\.bias$", path)
    check_state_dict(config, sd, where=path)
    return config, sd


def read_checkpoint(path: str, dtype: torch.dtype = torch.float32, keep_quant: bool = False,
                    requantized: Optional[List[str]] = None) -> Tuple[ModelConfig, StateDict]:
    """Read any supported checkpoint: mdi model dir, HF dir, nanoGPT dir/ckpt, GGUF file.
    `keep_quant`: quantized weights (a quantized mdi dir, a GGUF's blocks) stay quantized, as
    `quant.QParts`; else they are dequantized to `dtype`."""
    if not os.path.exists(path):
        raise CheckpointError("checkpoint %s does not exist" % path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, MDI_CONFIG)):
            config = read_mdi_config(path)
            stored = load_weights(path, (0, config.n_layer), True, True, dtype)
            # cast: a dict of tensors is a StateDict, which mypy's dict invariance does not see
            return config, stored if keep_quant else cast(StateDict, convert(stored, {}, dtype))
        if os.path.isfile(os.path.join(path, "config.json")):
            return read_hf_dir(path, dtype)
        if os.path.isfile(os.path.join(path, "ckpt.pt")):
            return read_nanogpt_ckpt(os.path.join(path, "ckpt.pt"), dtype)
        raise CheckpointError("%s: directory has no mdi_config.json, config.json or ckpt.pt" % path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".gguf":
        return read_gguf(path, dtype, keep_quant, requantized)
    if ext in (".pt", ".pth", ".ckpt"):
        return read_nanogpt_ckpt(path, dtype)
    raise CheckpointError("%s: unrecognised checkpoint (expected a directory, .gguf or .pt)" % path)
