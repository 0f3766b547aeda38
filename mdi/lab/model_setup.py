"""The models a sweep runs: found on disk, or built with random weights from a `random:` spec."""
import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

from mdi.lab.nodes import read_json
from mdi.lab.spec import ExperimentError, ModelEntry
from mdi.model import layout


# --------------------------------------------------------------------------- models

def resolve_path(path: str, source: str) -> str:
    """Relative paths are tried from the current directory, then from the experiment file's
    folder and its two parents (configs/experiments/x.yaml may say models/...)."""
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    here = os.path.dirname(os.path.abspath(source))
    for base in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
        if os.path.exists(os.path.join(base, path)):
            return os.path.join(base, path)
    return os.path.abspath(path)


CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
PAD_CHARS_FROM = 0x4E00  # a random model's vocabulary beyond CHARS: one CJK (then Yi, Hangul...) character per id
RANDOM_BUILD_KEYS = ("seed", "std", "quant", "group_size", "gguf")  # how the weights are made, not the model's shape
RANDOM_SPEC_FILE = "mdi_bench_random.json"  # the `random:` spec a model with a model.gguf was built from
ROWS_PER_BLOCK = 2048  # rows of one matrix generated (and quantized) at a time in a quantized build


def random_model_config(name: str, spec: Dict[str, Any]):
    from mdi.model.config import ModelConfig
    kw = {k: v for k, v in spec.items() if k not in RANDOM_BUILD_KEYS}
    kw.setdefault("block_size", 256)
    kw.setdefault("vocab_size", len(CHARS))
    if kw["vocab_size"] < len(CHARS):
        raise ValueError("vocab_size %d is smaller than the %d characters of the random model's tokenizer"
                         % (kw["vocab_size"], len(CHARS)))
    if kw["family"] == "gpt2":
        kw.update(bias=True, tied_head=True, gelu_approximate="tanh")
    else:
        kw.setdefault("tied_head", False)
    return ModelConfig(name=name, **kw)


def random_vocabulary(vocab_size: int) -> List[str]:
    """The character tokenizer of a random model: printable ASCII and newline, then (for a
    vocabulary as large as a real model's, e.g. 32000) one distinct placeholder character for
    every further id, so that every token the model can sample decodes."""
    if vocab_size - len(CHARS) > 0xD800 - PAD_CHARS_FROM:  # stop short of the surrogates
        raise ValueError("vocab_size %d: a random model's character vocabulary holds at most %d"
                         % (vocab_size, len(CHARS) + 0xD800 - PAD_CHARS_FROM))
    return CHARS + [chr(PAD_CHARS_FROM + i) for i in range(vocab_size - len(CHARS))]


def _checked_random_config(name: str, spec: Dict[str, Any], where: str):
    try:
        config = random_model_config(name, spec)
        random_vocabulary(config.vocab_size)
        return config
    except (TypeError, ValueError) as e:
        raise ExperimentError("%s.random: %s" % (where, e))


def random_quant_layout(config, spec: Dict[str, Any], where: str) -> Dict[str, Any]:
    """What a `random:` spec's `quant:` (+ `group_size`) stores quantized: every quantizable
    weight (QuantSpec by weight name); {} without quant. ExperimentError naming the layer when
    a group size does not divide its width."""
    from mdi.model.quantization.quant import uniform_layout
    if not spec.get("quant"):
        return {}
    try:
        return uniform_layout(config, (0, config.n_layer), True, True, spec["quant"], spec.get("group_size"))
    except ValueError as e:  # CheckpointError
        raise ExperimentError("%s.random.group_size: %s" % (where, e))


def build_random_model(path: str, name: str, spec: Dict[str, Any], where: str) -> None:
    """A random-initialised model with a character tokenizer, saved as a prepared mdi dir.
    With `quant:` its weights are made quantized one matrix at a time (random_quantized_weights)."""
    import torch
    from mdi.model.files.store import save_model_dir
    from mdi.model.tokenizers import char_tokenizer
    config = _checked_random_config(name, spec, where)
    layout = random_quant_layout(config, spec, where)
    if layout:
        weights = random_quantized_weights(config, layout, spec.get("seed", 0), float(spec.get("std", 0.02)))
    else:
        from mdi.model.transformer import full_model
        torch.manual_seed(spec.get("seed", 0))
        model = full_model(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, float(spec.get("std", 0.02)))
        weights = model.state_dict()
    save_model_dir(path, config, weights, "mdi-bench random: %s" % json.dumps(spec, sort_keys=True))
    char_tokenizer(random_vocabulary(config.vocab_size)).save(path)
    if spec.get("gguf"):  # model.gguf in that type by ggml's quantizer, the torch weights read back from it
        from mdi.model.files import prepare
        from mdi.system.files import write_json
        prepare.prepare(path, path, [], None, spec["gguf"], None, None)
        write_json(os.path.join(path, RANDOM_SPEC_FILE), spec)


def random_quantized_weights(config, layout: Dict[str, Any], seed: int, std: float,
                             rows: Optional[int] = None) -> Dict[str, Any]:
    """The canonical state dict of a random model whose weights named in `layout` are
    `quant.QParts`, made without the float model: each matrix is drawn N(0, std) `rows` output
    rows at a time, each block quantized (rows are independent) straight into the matrix's
    preallocated quantized tensors. Peak memory: the quantized model plus one block of float
    rows and its temporaries. Matrices not in `layout` (GPT-2's positions) are float N(0, std),
    norm weights 1, biases 0."""
    import torch
    from mdi.model.layout import expected_shapes
    from mdi.model.quantization.quant import QParts, quantize
    rows = rows or ROWS_PER_BLOCK
    gen = torch.Generator().manual_seed(seed)
    out: Dict[str, Any] = {}
    for key, shape in expected_shapes(config, (0, config.n_layer), True, True).items():
        spec = layout.get(key[:-len(".weight")]) if key.endswith(".weight") else None
        if spec is None:
            if len(shape) == 2:
                out[key] = torch.empty(shape).normal_(0, std, generator=gen)
            else:
                out[key] = torch.zeros(shape) if key.endswith(".bias") else torch.ones(shape)
            continue
        n_out, n_in = shape
        parts = {s: torch.empty(sh, dtype=dt) for s, (sh, dt) in spec.tensor_shapes(n_out, n_in).items()}
        for a in range(0, n_out, rows):
            block = torch.empty(min(rows, n_out - a), n_in).normal_(0, std, generator=gen)
            for s, t in quantize(block, spec).items():
                parts[s][a:a + block.shape[0]] = t
            del block
        out[key] = QParts(spec, parts, n_in)
    return out


def ensure_model(entry: ModelEntry, where: str, source: str, log: Callable[[str], None]) -> str:
    path = resolve_path(entry.path, source)
    if os.path.exists(path):
        if entry.random is not None:
            _check_random_matches(path, entry.name, entry.random, where)
        return path
    if entry.random is None:
        raise ExperimentError("%s.path: %s does not exist (prepare it with mdi-prepare, or give 'random:' to "
                              "build a random-initialised model there)" % (where, path))
    log("mdi-bench: building random model %s at %s" % (entry.name, path))
    # built beside it and renamed into place: one cut short (a failed GGUF write, Ctrl-C) had left
    # a half-built folder that every later sweep refused
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        build_random_model(partial, entry.name, entry.random, where)
        os.replace(partial, path)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, (ValueError, OSError)) and not isinstance(e, ExperimentError):  # CheckpointError too
            raise ExperimentError("%s.random: building %s failed: %s" % (where, path, e)) from None
        raise
    return path


def sweep_model(entry: ModelEntry, where: str, source: str, log: Callable[[str], None],
                build: bool = True) -> Tuple[str, Any, bool, Dict[str, Any]]:
    """(path, ModelConfig, whether workers can read their own layers from it, the weights a
    run keeps quantized) for one model of a sweep. A missing random model is built first; with
    build=False (a dry run) it is planned from its spec instead and nothing is written."""
    path = resolve_path(entry.path, source)
    if not build and entry.random is not None and not os.path.exists(path):
        log("mdi-bench: would build random model %s at %s" % (entry.name, path))
        config = _checked_random_config(entry.name, entry.random, where)
        return path, config, True, run_quant_layout(entry, config, random_quant_layout(config, entry.random, where),
                                                    where)
    path = ensure_model(entry, where, source, log)
    try:
        config, local, stored = model_layout(path)
    except (ValueError, OSError) as e:  # CheckpointError, TokenizerError: the model cannot be read
        raise ExperimentError("%s.path: %s" % (where, e))
    return path, config, local, run_quant_layout(entry, config, stored, where)


def _check_random_matches(path: str, name: str, spec: Dict[str, Any], where: str) -> None:
    from mdi.model.files.store import read_mdi_config
    try:
        have = read_mdi_config(path).to_dict()
    except Exception:  # not a prepared dir: certainly not what 'random' builds
        have = None
    config = _checked_random_config(name, spec, where)
    want_quant = random_quant_layout(config, spec, where)
    stored = _stored_quant(path)
    built_from = read_json(os.path.join(path, RANDOM_SPEC_FILE))
    built_from = built_from if isinstance(built_from, dict) else None
    def unnamed(d: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:  # (one model listed twice, two names)
        return None if d is None else {k: v for k, v in d.items() if k != "name"}
    if unnamed(have) != unnamed(config.to_dict()):
        differs = "its model config differs"
    elif spec.get("gguf") or built_from is not None:  # its torch weights are what the GGUF's types read back as
        if built_from is None or built_from.get("gguf") != spec.get("gguf"):
            differs = "its model.gguf is %s, this spec gives %s" % (
                (built_from or {}).get("gguf") or "absent", spec.get("gguf") or "none")
        elif any(built_from.get(k) != spec.get(k) for k in RANDOM_BUILD_KEYS):  # (a new seed had been ignored)
            differs = "it was built with %s" % ", ".join("%s %r" % (k, built_from.get(k)) for k in RANDOM_BUILD_KEYS
                                                         if built_from.get(k) != spec.get(k))
        else:
            return
    elif stored is not None and stored != _quant_labels(want_quant):
        # e.g. built before mdi's int4 layout changed (quant.uniform_layout)
        differs = "its weights are stored as %s, this spec gives %s" % (
            _describe_labels(stored), _describe_labels(_quant_labels(want_quant)))
    else:
        return
    raise ExperimentError("%s.random: %s exists but is not this random model (%s); delete it or change path"
                          % (where, path, differs))


def _describe_labels(labels: Dict[str, str]) -> str:
    counts: Dict[str, int] = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    return ", ".join("%s x %d" % kv for kv in sorted(counts.items())) or "float"


def _quant_labels(layout: Dict[str, Any]) -> Dict[str, str]:
    return {base: spec.label() for base, spec in layout.items()}


def _stored_quant(path: str) -> Optional[Dict[str, str]]:
    from mdi.model.files.store import file_layout
    try:
        return _quant_labels(file_layout(path))
    except ValueError:  # CheckpointError: no readable model.safetensors
        return None


def model_layout(path: str):
    """(ModelConfig, whether workers can read their own layers from `path`, the weights it
    stores quantized)."""
    from mdi.model.source import ModelSource, is_mdi_dir
    source = ModelSource(path)
    return source.config, is_mdi_dir(path), dict(source.stored_quant)


def run_quant_layout(entry: ModelEntry, config, stored: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The weights a run of `entry` keeps quantized (whole model, by weight name), as mdi-start
    plans them (capacity.node_quant): model.quant `auto` as `stored`, int8 / int4 everything
    quantizable, none nothing."""
    from mdi.model.quantization.quant import uniform_layout
    if entry.quant == "auto":
        return dict(stored)
    if entry.quant == "none":
        return {}
    try:
        return uniform_layout(config, (0, config.n_layer), True, True, entry.quant)
    except ValueError as e:  # CheckpointError: a width the default group does not divide
        raise ExperimentError("%s.quant: %s" % (where, e))


def weight_bytes(config, counts: List[int], dtype: str, quant: Optional[Dict[str, Any]] = None) -> List[int]:
    """Bytes of each node's weights (the starter holds the embedding, final norm and head),
    the weights named in `quant` at their quantized size."""
    return [layout.weight_bytes(config, r, dtype, with_ends=k == 0, quant=quant)
            for k, r in enumerate(layout.layer_ranges(counts))]


def gguf_model(path: str, where: str) -> Any:
    """The model at `path` as a ModelSource whose GGUF is read (what ggml nodes compute), None
    where it has none; ExperimentError naming `where` for a GGUF that cannot be read."""
    from mdi.model.source import ModelSource, gguf_file_of
    if not os.path.exists(path) or gguf_file_of(path) is None:
        return None
    source = ModelSource(path)
    try:
        source.gguf()
    except ValueError as e:  # CheckpointError: named, not a traceback
        raise ExperimentError("%s.path: %s" % (where, e))
    return source


def weight_types(source: Any, quant: Dict[str, Any], config) -> str:
    """What the runs' weights are stored as, for the CSV (`quant` says what was asked):
    "ggml: Q4_1 x 210, Q8_0 x 1, F32 x 61; torch: int4/g32 x 210, ..." (`source`'s GGUF, which
    ggml nodes compute, counted by type, most first (gguf_model; None: none); the layout torch
    nodes hold, quantized as the run asks)."""
    from mdi.model.files.gguf_export import describe_types
    from mdi.model.quantization.layouts import describe
    torch_part = "torch: " + describe(quant, len(layout.quantizable(config, (0, config.n_layer), True, True)))
    if source is None:
        return torch_part
    return "ggml: %s; %s" % (describe_types(source.gguf_types(0, config.n_layer, True, True)), torch_part)


def gguf_weigher(source: Any) -> Optional[Callable[[List[int]], List[int]]]:
    """Bytes of each node's GGUF tensors for given layer counts (what a node computing with ggml
    holds; the starter's with the embedding and head), for `source` (gguf_model; None: none)."""
    if source is None:
        return None
    return lambda counts: [source.gguf_bytes(a, b, k == 0, k == 0)
                           for k, (a, b) in enumerate(layout.layer_ranges(counts))]
