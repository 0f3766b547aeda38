"""`mdi-start --check`: contact every node and say whether the run would fit, generating nothing."""
from typing import List

from .checkpoints import expected_shapes
from .config import RunConfig, partition
from .control import ControlClient, NodeError
from .loading import ModelSource, torch_dtype
from .models.model import KVCache
from .engine import layer_ranges
from .worker import available_memory_bytes

MB = 1024 * 1024


def weight_bytes(source: ModelSource, first: int, last: int, with_ends: bool, itemsize: int) -> int:
    total = 0
    for shape in expected_shapes(source.config, (first, last), with_ends, with_ends).values():
        n = 1
        for d in shape:
            n *= d
        total += n * itemsize
    return total


def preflight(cfg: RunConfig, prompts: List[str]) -> int:
    source = ModelSource(cfg.model.path)
    config = source.config
    ranges = layer_ranges(partition(config.n_layer, cfg.nodes, cfg.source))
    dtype = torch_dtype(cfg.model.dtype)
    itemsize = 4 if cfg.model.dtype == "float32" else 2
    gen = cfg.generation
    longest = max([len(source.tokenizer.encode(p)) for p in prompts] or [0]) if source.tokenizer else 0
    max_len = min(config.block_size, longest + gen.n_tokens)
    n_slots = max(gen.n_samples or 1, len(prompts), 1)
    print("model %s: %s, %d layers, %s; %d samples x %d positions" % (
        cfg.model.path, config.family, config.n_layer, cfg.model.dtype, n_slots, max_len))
    ok = True
    for i, (node, (first, last)) in enumerate(zip(cfg.nodes, ranges)):
        need = weight_bytes(source, first, last, i == 0, itemsize) + \
            KVCache.nbytes_for(config, last - first, n_slots, max_len, dtype)
        where = "%-10s %-21s layers %3d-%-3d needs %7.1f MB" % (node.name, node.address if i else "(this machine)",
                                                               first, last - 1, need / MB)
        if i == 0:
            free = available_memory_bytes()
            info, reachable = "starter", True
        else:
            try:
                client = ControlClient(node, cfg.runtime.connect_timeout, token=cfg.runtime.token)
                health = client.health()
                status = client.status()
                free = status["memory"]["available_bytes"]
                info = "v%s %s %s" % (health.get("version"), status.get("device"), status.get("state"))
                reachable = True
            except NodeError as e:
                print("%s  UNREACHABLE: %s" % (where, e))
                ok = False
                continue
        fits = free is None or need <= free
        ok = ok and fits and reachable
        print("%s  free %s  %s  %s" % (where, "%.0f MB" % (free / MB) if free is not None else "unknown",
                                       info, "fits" if fits else "DOES NOT FIT"))
    print("check: %s" % ("all nodes ready" if ok else "problems found"))
    return 0 if ok else 1
