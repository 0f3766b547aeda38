"""LoRA adapters users already have, read into mdi's own naming (`mdi.model.adapters.lora` holds the
values and the maths).

Sources: a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors, as
``PeftModel.save_pretrained`` writes it), a LoRA GGUF (llama.cpp's convert_lora_to_gguf.py) and
a PEFT prompt-tuning directory. A LoRA becomes an `Adapter`, each source module's A / B checked
against the base model and fused into mdi's layers (`fuse_parts`); prompt tuning a `SoftPrompt`.

What changes the computation and is not modelled (DoRA, LoRA biases, modules_to_save, adapters
on the embedding or the LM head, other PEFT variants) is refused with one line naming the file
and the key or tensor, never dropped.

Tensors are read as numpy arrays (float32), torch never imported, so a starter computing with
ggml serves adapters without it.
"""
import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np

from mdi.model.adapters.lora import Adapter, AdapterError, LoraPart, SoftPrompt, fuse_parts, layer_shapes, part_rows
from mdi.model.adapters.peft_targets import PatternError, resolve_bounded
from mdi.model.config import ModelConfig
from mdi.model.files.gguf_config import ARCHITECTURES, GGUF_NAMES, PERMUTED_QK, gguf_value, unpermuted_rows
from mdi.model.files.gguf_layout import open_reader
from mdi.model.sampling import host_array

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
UNSAFE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")  # torch.save: reading runs code
# The largest entry an adapter's weight change (scale * B @ A) may reach. A trained LoRA's stay
# well under 1, as the base weights do; lora_alpha 1e30 kept B finite and then overflowed every
# request's activations ("non-finite logits") instead of being refused at load.
MAX_DELTA = 1e4

# Hugging Face module name inside a block -> (mdi layer, fused part or None)
HF_MODULES: Dict[str, Dict[str, Tuple[str, Optional[str]]]] = {
    "gpt2": {"attn.c_attn": ("attn.qkv", None), "attn.c_proj": ("attn.proj", None),
             "mlp.c_fc": ("mlp.fc", None), "mlp.c_proj": ("mlp.proj", None)},
    "llama": {"self_attn.q_proj": ("attn.qkv", "q"), "self_attn.k_proj": ("attn.qkv", "k"),
              "self_attn.v_proj": ("attn.qkv", "v"), "self_attn.o_proj": ("attn.proj", None),
              "mlp.gate_proj": ("mlp.gate_up", "gate"), "mlp.up_proj": ("mlp.gate_up", "up"),
              "mlp.down_proj": ("mlp.down", None)},
}
HF_MODULES["gemma3"] = HF_MODULES["llama"]  # Gemma 3 names its blocks' modules as Llama does
# the container of the blocks in Hugging Face names (GPT2LMHeadModel: transformer.h.N; Gemma 3's
# multimodal model: model.language_model.layers.N, its text model: model.layers.N)
HF_BLOCKS = {"gpt2": "h", "llama": "layers", "gemma3": "layers"}
# modules outside the blocks that adapters may target: refused as not supported yet
EMBEDDING_OR_HEAD = ("embed_tokens", "lm_head", "wte", "wpe", "score", "embed_out")


def write_adapter_files(path: str, tensors: Mapping[str, Any], config: Dict[str, Any]) -> None:
    """A PEFT adapter folder's weights (torch tensors) and config, written in a staging folder
    inside it and renamed into place, the config last (what marks a folder as an adapter): a
    full disk had left a traceback and half the files. RuntimeError, naming the folder, when a
    write fails."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".partial-", dir=path)
    try:
        save_file(dict(tensors), os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        os.replace(os.path.join(staging, WEIGHTS_FILE), os.path.join(path, WEIGHTS_FILE))
        os.replace(os.path.join(staging, CONFIG_FILE), os.path.join(path, CONFIG_FILE))
    except Exception as e:  # OSError, or safetensors' own error for the same full disk
        raise RuntimeError("writing the adapter in %s failed: %s" % (path, str(e).splitlines()[0])) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_pair(where: str, a_name: str, b_name: str, a: np.ndarray, b: np.ndarray,
                r: int, n_out: int, n_in: int, rank_from: str) -> None:
    """A must be [r, n_in] and B [n_out, r]: a wrong in/out is an adapter for another base
    model; a wrong rank disagrees with the adapter's own config."""
    for tname, t, want in ((a_name, a, (r, n_in)), (b_name, b, (n_out, r))):
        got = tuple(t.shape)
        if len(got) != 2:
            raise AdapterError("%s: %s has shape %s, a LoRA matrix needs 2 dimensions" % (where, tname, list(got)))
        base_dim = 1 if t is a else 0  # the dimension the base model fixes
        if got[base_dim] != want[base_dim]:
            raise AdapterError("%s: %s has shape %s, the base model needs %s" % (where, tname, list(got), list(want)))
        if got != want:
            raise AdapterError("%s: %s has shape %s, its rank %d is not the %d %s gives"
                               % (where, tname, list(got), got[1 - base_dim], r, rank_from))


# ----------------------------------------------------------------------------- PEFT directories

# adapter_config.json keys that change what the layers compute, refused when set (truthy)
PEFT_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "trainable_token_indices": "trainable tokens (embedding rows)",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "BD-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}


def _soft_prompt(cfg: Mapping, path: str, config: ModelConfig, name: str, where: str, cfg_path: str,
                 st_path: str) -> SoftPrompt:
    n, dim, parts = cfg.get("num_virtual_tokens"), cfg.get("token_dim"), cfg.get("num_transformer_submodules", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
        raise AdapterError("%s: %s: num_virtual_tokens must be an integer in [1, 4096], got %r" % (where, cfg_path, n))
    if parts not in (1, None):
        raise AdapterError("%s: %s: num_transformer_submodules %r (encoder-decoder models) is not supported"
                           % (where, cfg_path, parts))
    if dim is not None and dim != config.n_embd:
        raise AdapterError("%s: %s: token_dim %r, the base model's embeddings are %d wide"
                           % (where, cfg_path, dim, config.n_embd))
    tensors = _read_safetensors(st_path, where)
    emb = tensors.get("prompt_embeddings")
    if emb is None or set(tensors) != {"prompt_embeddings"}:
        raise AdapterError("%s: %s: expected one tensor, prompt_embeddings, got %s" % (where, st_path, sorted(tensors)[:3]))
    if tuple(emb.shape) != (n, config.n_embd) or not _floating(emb):
        raise AdapterError("%s: %s: prompt_embeddings has shape %s, the base model needs [%d, %d]"
                           % (where, st_path, list(emb.shape), n, config.n_embd))
    _check_finite(where, st_path, ("prompt_embeddings", emb))
    return SoftPrompt(name, path, host_array(emb))


def _floating(t: np.ndarray) -> bool:
    return bool(np.issubdtype(t.dtype, np.floating))


def _check_finite(where: str, path: str, *named: Tuple[str, np.ndarray]) -> None:
    """Refused at load, naming the file and tensor: a NaN loaded on the starter failed every
    request naming the adapter, and a worker's refusal named only its own layer."""
    for tname, t in named:
        if _floating(t) and not np.isfinite(t).all():
            raise AdapterError("%s: %s: %s holds NaN or infinite values" % (where, path, tname))


def _check_delta(where: str, path: str, name: str, a: np.ndarray, folded: np.ndarray) -> None:
    """Refused at load when the weight change scale * B @ A may pass MAX_DELTA (bounded by the
    largest |B| entry times the largest column sum of |A|), naming the file and tensor."""
    bound = float(np.abs(folded).max(initial=0.0)) * float(np.abs(a).sum(axis=0).max(initial=0.0))
    if not bound <= MAX_DELTA:
        raise AdapterError("%s: %s: %s scaled by its alpha / r changes weights by up to %.3g, past the %.0e an "
                           "adapter can take (is lora_alpha right?)" % (where, path, name, bound, MAX_DELTA))


def _read_safetensors(st_path: str, where: str) -> Dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy; AdapterError naming the file if unreadable.
    bfloat16, which numpy lacks, is widened to float32 from the file's own bytes (exactly)."""
    import safetensors
    from safetensors import safe_open
    unreadable = (OSError, ValueError, getattr(safetensors, "SafetensorError", OSError))  # older releases lack the name
    try:
        out, bf16 = {}, []
        with safe_open(st_path, framework="numpy") as f:
            for k in f.keys():
                if f.get_slice(k).get_dtype() == "BF16":
                    bf16.append(k)
                else:
                    out[k] = f.get_tensor(k)
        if bf16:
            with open(st_path, "rb") as fh:
                raw = dict(safetensors.deserialize(fh.read()))  # each tensor's bytes, the header checked
            for k in bf16:
                halves = np.frombuffer(raw[k]["data"], dtype="<u2")
                out[k] = (halves.astype(np.uint32) << 16).view(np.float32).reshape(raw[k]["shape"])
        return out
    except unreadable as e:
        raise AdapterError("%s: %s is not a readable safetensors file (%s)" % (where, st_path, e))


def load_any(path: str, config: ModelConfig, name: Optional[str] = None):
    """A LoRA (`load_adapter`, GGUF included) or a prompt-tuning adapter (`SoftPrompt`), by what
    its adapter_config.json says."""
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, CONFIG_FILE)) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            cfg = None  # load_adapter says what is wrong
        if isinstance(cfg, dict) and cfg.get("peft_type") == "PROMPT_TUNING":
            name = name or os.path.basename(os.path.normpath(path))
            st_path = os.path.join(path, WEIGHTS_FILE)
            if not os.path.isfile(st_path):
                raise AdapterError("adapter %s: %s is missing" % (name, st_path))
            return _soft_prompt(cfg, path, config, name, "adapter %s" % name, os.path.join(path, CONFIG_FILE), st_path)
    return load_adapter(path, config, name)


def load_adapter(path: str, config: ModelConfig, name: Optional[str] = None) -> Adapter:
    """Read a PEFT LoRA directory (or, for a .gguf file, `load_gguf_lora`) for the base model
    `config`: the Adapter in mdi names, or AdapterError naming the file and the key or tensor."""
    if path.endswith(".gguf") and os.path.isfile(path):
        return load_gguf_lora(path, config, name)
    name = name or os.path.basename(os.path.normpath(path))
    where = "adapter %s" % name
    cfg_path, st_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise AdapterError("%s: %s is not a directory holding %s and %s" % (where, path, CONFIG_FILE, WEIGHTS_FILE))
    if not os.path.isfile(st_path):
        unsafe = [f for f in UNSAFE_FILES if os.path.isfile(os.path.join(path, f))]
        if unsafe:  # loading a torch.save file can run code: never opened
            raise AdapterError("%s: %s is a torch.save file, which mdi never reads (loading it can run code); "
                               "convert it to %s" % (where, os.path.join(path, unsafe[0]), WEIGHTS_FILE))
        raise AdapterError("%s: %s is missing" % (where, st_path))
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: JSON nested past Python's stack)
        raise AdapterError("%s: cannot read %s (%s)" % (where, cfg_path, str(e).splitlines()[0] if str(e) else e))
    if not isinstance(cfg, dict):
        raise AdapterError("%s: %s is not a JSON object" % (where, cfg_path))
    _check_peft_config(cfg, config, where, cfg_path)

    return _from_peft(cfg, _read_safetensors(st_path, where), config, name, path, where, st_path)


def _check_peft_config(cfg: Mapping, config: ModelConfig, where: str, cfg_path: str) -> None:
    def refuse(key: str, what: str) -> None:
        raise AdapterError("%s: %s sets %s = %s: %s is not supported" % (where, cfg_path, key, json.dumps(cfg[key]),
                                                                          what))

    if cfg.get("peft_type") != "LORA":
        raise AdapterError("%s: %s has peft_type %s, only LORA adapters are supported"
                           % (where, cfg_path, json.dumps(cfg.get("peft_type"))))
    for key, what in PEFT_UNSUPPORTED.items():
        if cfg.get(key):
            refuse(key, what)
    if cfg.get("bias", "none") != "none":
        refuse("bias", "training the base model's biases")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf or (
                key == "r" and v != int(v)):
            raise AdapterError("%s: %s: %s must be a positive finite number, got %s"
                               % (where, cfg_path, key, json.dumps(v)))
    for key in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(key) or {}
        # ranks are whole: a rank of 0.5 became int 0, and a division by zero
        if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                              and 0 < x < math.inf
                                              and (key == "alpha_pattern" or x == int(x)) for x in v.values()):
            raise AdapterError("%s: %s: %s must map module patterns to positive %s" % (
                where, cfg_path, key, "numbers" if key == "alpha_pattern" else "whole numbers"))
    targets = cfg.get("target_modules")
    for key in ("target_modules", "exclude_modules"):
        v = cfg.get(key)
        names = isinstance(v, list) and all(isinstance(x, str) for x in v)
        if v is not None and not isinstance(v, str) and not names:
            raise AdapterError("%s: %s: %s must be a regex or a list of module names, got %s"
                               % (where, cfg_path, key, json.dumps(v)))
    if isinstance(targets, list):
        for t in targets:
            if t.split(".")[-1] in EMBEDDING_OR_HEAD:
                raise AdapterError("%s: %s targets %s: adapters on the embedding or the LM head are not supported yet"
                                   % (where, cfg_path, t))
    layers = cfg.get("layers_to_transform")
    for i in [layers] if isinstance(layers, int) else layers or []:
        if not isinstance(i, int) or not 0 <= i < config.n_layer:
            raise AdapterError("%s: %s: layers_to_transform names layer %s, outside the base model's %d layers"
                               % (where, cfg_path, json.dumps(i), config.n_layer))


def _from_peft(cfg: Mapping, tensors: Mapping[str, np.ndarray], config: ModelConfig, name: str, path: str,
               where: str, st_path: str) -> Adapter:
    family = config.family
    block_re = re.compile(r"^(?P<prefix>(?:.*?\.)?)%s\.(?P<layer>\d+)\.(?P<sub>.+)$" % HF_BLOCKS[family])
    modules: Dict[str, Dict[str, str]] = {}  # module name -> {"A": tensor name, "B": ...}
    for tname in sorted(tensors):
        m = re.match(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$", tname)
        if m is None:
            if "lora_embedding_" in tname:
                raise AdapterError("%s: %s holds %s: adapters on the embedding are not supported yet"
                                   % (where, st_path, tname))
            if "lora_magnitude_vector" in tname:
                raise AdapterError("%s: %s holds %s: DoRA is not supported" % (where, st_path, tname))
            raise AdapterError("%s: %s holds %s, not a LoRA A or B matrix" % (where, st_path, tname))
        modules.setdefault(m.group("module"), {})[m.group("ab")] = tname
    if not modules:
        raise AdapterError("%s: %s holds no LoRA tensors" % (where, st_path))

    shapes = layer_shapes(config)
    parts: List[LoraPart] = []
    prefixes: Set[str] = set()
    ranks: List[int] = []
    patterns_r, patterns_a = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    # Every name the checks below ask about, matched against the config's patterns at once
    # (in a bounded child process when they are regexes: mdi.model.adapters.peft_targets).
    stacks = sorted({m.group("prefix") for m in map(block_re.match, modules) if m is not None})[:2]
    candidates = set(modules) | {"%s%s.%d.%s" % (p, HF_BLOCKS[family], layer, sub) for p in stacks
                                 for layer in range(config.n_layer) for sub in HF_MODULES[family]}
    try:
        matched = resolve_bounded(cfg, sorted(candidates))
    except PatternError as e:
        raise AdapterError("%s: %s" % (where, e))
    for module in sorted(modules):
        pair = modules[module]
        some = pair.get("A") or pair.get("B")
        if module.split(".")[-1] in EMBEDDING_OR_HEAD:
            raise AdapterError("%s: %s holds %s: adapters on the embedding or the LM head are not supported yet"
                               % (where, st_path, some))
        m = block_re.match(module)
        if m is None or m.group("sub") not in HF_MODULES[family]:
            raise AdapterError("%s: %s holds %s: %s is not a linear layer mdi knows in a %s block (it knows %s)"
                               % (where, st_path, some, module, family, ", ".join(HF_MODULES[family])))
        layer = int(m.group("layer"))
        if layer >= config.n_layer:
            raise AdapterError("%s: %s holds %s, for layer %d; the base model has %d layers"
                               % (where, st_path, some, layer, config.n_layer))
        for ab in "AB":
            if ab not in pair:
                raise AdapterError("%s: %s holds %s but not its lora_%s" % (where, st_path, some, ab))
        if not matched[module][0]:
            raise AdapterError("%s: %s holds %s, a module adapter_config.json does not target (target_modules %s, "
                               "layers_to_transform %s)" % (where, st_path, some, json.dumps(cfg.get("target_modules")),
                                                            json.dumps(cfg.get("layers_to_transform"))))
        prefixes.add(m.group("prefix"))
        if len(prefixes) > 1:  # two stacks of blocks (a vision tower's and the LM's) on one model's layers
            raise AdapterError("%s: %s holds %s, of a second stack of blocks (module prefixes %s): mdi runs one"
                               % (where, st_path, some, " and ".join(sorted(repr(p) for p in prefixes))))
        mdi, part = HF_MODULES[family][m.group("sub")]
        start, end = part_rows(config, mdi, part)
        _, r_key, a_key = matched[module]
        r = int(patterns_r.get(r_key, cfg["r"]))
        alpha = float(patterns_a.get(a_key, cfg["lora_alpha"]))
        a, b = tensors[pair["A"]], tensors[pair["B"]]
        # PEFT's lora_A / lora_B are nn.Linear weights, [r, in] / [out, r], even on GPT-2's
        # Conv1D (fan_in_fan_out transposes only the merged delta, to Conv1D's [in, out])
        _check_pair("%s: %s" % (where, st_path), pair["A"], pair["B"], a, b, r, end - start, shapes[mdi][1],
                    "adapter_config.json" + (" rank_pattern" if r_key in patterns_r else " r"))
        if not (_floating(a) and _floating(b)):
            raise AdapterError("%s: %s holds %s as %s, not floating point" % (where, st_path, pair["A"], a.dtype))
        _check_finite(where, st_path, (pair["A"], a), (pair["B"], b))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        folded = host_array(b) * np.float32(scale)
        _check_finite(where, st_path, (pair["B"] + " scaled by lora_alpha / r", folded))  # (alpha 1e30: inf)
        _check_delta(where, st_path, pair["B"], host_array(a), folded)
        parts.append(LoraPart(layer, mdi, part, host_array(a), folded))
        ranks.append(r)

    # every module the config targets must be there: a missing one would silently run as the base
    prefix = prefixes.pop()
    for layer in range(config.n_layer):
        for sub in HF_MODULES[family]:
            module = "%s%s.%d.%s" % (prefix, HF_BLOCKS[family], layer, sub)
            if module not in modules and matched[module][0]:
                raise AdapterError("%s: %s has no base_model.model.%s.lora_A.weight, which adapter_config.json "
                                   "targets" % (where, st_path, module))
    return Adapter(name=name, path=path, kind="lora", rank=max(ranks), alpha=float(cfg["lora_alpha"]),
                   weights=fuse_parts(parts, config))


# ----------------------------------------------------------------------------- LoRA GGUF

def load_gguf_lora(path: str, config: ModelConfig, name: Optional[str] = None) -> Adapter:
    """Read a LoRA GGUF as llama.cpp's convert_lora_to_gguf.py writes it (general.type adapter,
    adapter.type lora, adapter.lora.alpha; tensors blk.N.<tensor>.weight.lora_a / .lora_b) for
    the base model `config`. llama.cpp scales by alpha / rank (rank from each lora_b; alpha 0:
    no scaling): rslora and per-module alphas did not survive the conversion."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    where = "adapter %s" % name
    try:
        # an A and a B per linear layer mdi knows, in every layer
        reader = open_reader(path, max_tensors=2 * len(GGUF_NAMES) * config.n_layer)
    except Exception as e:  # the reader raises assorted errors for non-GGUF input
        raise AdapterError("%s: %s is not a readable GGUF file (%s)" % (where, path, str(e).splitlines()[0] if str(e)
                                                                          else type(e).__name__))
    for key, want in (("general.type", "adapter"), ("adapter.type", "lora")):
        got = gguf_value(reader, key)
        if got != want:
            raise AdapterError("%s: %s has %s = %r, a LoRA adapter GGUF has %r" % (where, path, key, got, want))
    arch = gguf_value(reader, "general.architecture")
    if ARCHITECTURES.get(arch) != "llama" or config.family != "llama":
        raise AdapterError("%s: %s has general.architecture %r; LoRA GGUFs are read for %s bases, and the base "
                           "model is of family %s" % (where, path, arch,
                                                      ", ".join(a for a, f in ARCHITECTURES.items() if f == "llama"),
                                                      config.family))
    alpha = float(gguf_value(reader, "adapter.lora.alpha", 0.0) or 0.0)
    if gguf_value(reader, "adapter.alora.invocation_tokens") is not None:
        raise AdapterError("%s: %s has adapter.alora.invocation_tokens: activated LoRA (aLoRA) is not supported"
                           % (where, path))

    hf_to_mdi = HF_MODULES["llama"]
    tensors = {t.name: t for t in reader.tensors}
    pairs: Dict[Tuple[int, str], Dict[str, str]] = {}
    for tname in sorted(tensors):
        m = re.match(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$", tname)
        if m is None:
            if re.match(r"^(token_embd|output)\.weight\.lora_[ab]$", tname):
                raise AdapterError("%s: %s holds %s: adapters on the embedding or the LM head are not supported yet"
                                   % (where, path, tname))
            raise AdapterError("%s: %s holds %s, not a LoRA tensor of a block's linear layer mdi knows"
                               % (where, path, tname))
        layer, gname = int(m.group(1)), m.group(2)
        if GGUF_NAMES.get(gname) not in hf_to_mdi:
            raise AdapterError("%s: %s holds %s: %s is not a linear layer mdi knows in a llama block"
                               % (where, path, tname, gname))
        if layer >= config.n_layer:
            raise AdapterError("%s: %s holds %s, for layer %d; the base model has %d layers"
                               % (where, path, tname, layer, config.n_layer))
        pairs.setdefault((layer, gname), {})[m.group(3)] = tname
    if not pairs:
        raise AdapterError("%s: %s holds no LoRA tensors" % (where, path))

    shapes = layer_shapes(config)
    parts: List[LoraPart] = []
    ranks: List[int] = []
    for (layer, gname), pair in sorted(pairs.items()):
        for ab in "ab":
            if ab not in pair:
                raise AdapterError("%s: %s holds %s but not its lora_%s"
                                   % (where, path, pair.get("a") or pair["b"], ab))
        a, b = _gguf_floats(path, tensors[pair["a"]], where), _gguf_floats(path, tensors[pair["b"]], where)
        mdi, part = hf_to_mdi[GGUF_NAMES[gname]]
        start, end = part_rows(config, mdi, part)
        r = int(b.shape[-1]) if b.ndim == 2 else 0  # llama.cpp takes the rank from lora_b
        _check_pair("%s: %s" % (where, path), pair["a"], pair["b"], a, b, r, end - start, shapes[mdi][1], "its lora_b")
        _check_finite(where, path, (pair["a"], a), (pair["b"], b))
        if arch in PERMUTED_QK and part in ("q", "k"):
            # convert_hf_to_gguf permutes q/k rows for llama.cpp's RoPE layout; on a LoRA that
            # reorders B's rows (A's rows are the rank): undone there
            b = b[unpermuted_rows(b.shape[0], config.n_head if part == "q" else config.kv_heads)]
        scale = alpha / r if alpha else 1.0
        folded = b * np.float32(scale)
        _check_finite(where, path, (pair["b"] + " scaled by alpha / r", folded))
        _check_delta(where, path, pair["b"], a, folded)
        parts.append(LoraPart(layer, mdi, part, a, folded))
        ranks.append(r)
    return Adapter(name=name, path=path, kind="lora", rank=max(ranks), alpha=alpha, weights=fuse_parts(parts, config))


def _gguf_floats(path: str, t: Any, where: str) -> np.ndarray:
    """A LoRA GGUF tensor as float32 [rows, cols] (gguf's own dequantizer for a quantized one)."""
    try:
        return t.values().astype(np.float32)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise AdapterError("%s: %s: tensor %s has type %s, which cannot be read (%s)"
                           % (where, path, t.name, t.tensor_type.name, e))
