"""The models a sweep runs: found on disk, or built with random weights from a `random:` spec."""
import json
import os
from typing import Any, Callable, Dict, List, Tuple

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


def random_model_config(name: str, spec: Dict[str, Any]):
    from mdi.model.config import ModelConfig
    kw = {k: v for k, v in spec.items() if k not in ("seed", "std")}
    kw.setdefault("block_size", 256)
    if kw["family"] == "gpt2":
        kw.update(bias=True, tied_head=True, gelu_approximate="tanh")
    else:
        kw.setdefault("tied_head", False)
    return ModelConfig(name=name, vocab_size=len(CHARS), **kw)


def _checked_random_config(name: str, spec: Dict[str, Any], where: str):
    try:
        return random_model_config(name, spec)
    except (TypeError, ValueError) as e:
        raise ExperimentError("%s.random: %s" % (where, e))


def build_random_model(path: str, name: str, spec: Dict[str, Any], where: str) -> None:
    """A random-initialised model with a character tokenizer, saved as a prepared mdi dir."""
    import torch
    from mdi.model.store import save_model_dir
    from mdi.model.transformer import full_model
    from mdi.model.tokenizers import char_tokenizer
    config = _checked_random_config(name, spec, where)
    torch.manual_seed(spec.get("seed", 0))
    model = full_model(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, float(spec.get("std", 0.02)))
    save_model_dir(path, config, model.state_dict(), "mdi-bench random: %s" % json.dumps(spec, sort_keys=True))
    char_tokenizer(CHARS).save(path)


def ensure_model(entry: ModelEntry, where: str, source: str, log: Callable[[str], None]) -> str:
    path = resolve_path(entry.path, source)
    if os.path.exists(path):
        if entry.random is not None:
            _check_random_matches(path, entry, where)
        return path
    if entry.random is None:
        raise ExperimentError("%s.path: %s does not exist (prepare it with mdi-prepare, or give 'random:' to "
                              "build a random-initialised model there)" % (where, path))
    log("mdi-bench: building random model %s at %s" % (entry.name, path))
    build_random_model(path, entry.name, entry.random, where)
    return path


def sweep_model(entry: ModelEntry, where: str, source: str, log: Callable[[str], None],
                build: bool = True) -> Tuple[str, Any, bool]:
    """(path, ModelConfig, whether workers can read their own layers from it) for one model
    of a sweep. A missing random model is built first; with build=False (a dry run) it is
    planned from its spec instead and nothing is written."""
    path = resolve_path(entry.path, source)
    if not build and entry.random is not None and not os.path.exists(path):
        log("mdi-bench: would build random model %s at %s" % (entry.name, path))
        return path, _checked_random_config(entry.name, entry.random, where), True
    path = ensure_model(entry, where, source, log)
    try:
        config, local = model_layout(path)
    except (ValueError, OSError) as e:  # CheckpointError, TokenizerError: the model cannot be read
        raise ExperimentError("%s.path: %s" % (where, e))
    return path, config, local


def _check_random_matches(path: str, entry: ModelEntry, where: str) -> None:
    from mdi.model.store import read_mdi_config
    try:
        have = read_mdi_config(path).to_dict()
    except Exception:  # not a prepared dir: certainly not what 'random' builds
        have = None
    want = random_model_config(entry.name, entry.random).to_dict()
    if have != want:
        raise ExperimentError("%s.random: %s exists but is not this random model; delete it or change path"
                              % (where, path))


def model_layout(path: str):
    """(ModelConfig, whether workers can read their own layers from `path`)."""
    from mdi.model.source import ModelSource, is_mdi_dir
    return ModelSource(path).config, is_mdi_dir(path)


def weight_bytes(config, counts: List[int], dtype: str) -> List[int]:
    """Bytes of each node's weights (the starter holds the embedding, final norm and head)."""
    return [layout.weight_bytes(config, r, dtype, with_ends=k == 0) for k, r in enumerate(layout.layer_ranges(counts))]
