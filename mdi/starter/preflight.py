"""`mdi-start --check`: contact every node and say whether the run would fit, generating nothing."""
from typing import List, Optional

import torch

from mdi.runconfig import NodeSpec, RunConfig, partition
from mdi.starter.control import NodeError
from mdi.model import qkernels
from mdi.model.layout import layer_ranges, torch_dtype
from mdi.model.source import ModelSource
from mdi.starter.adapters import adapter_layer_bytes
from mdi.starter.autoplan import resolve_layers
from mdi.starter.capacity import MB, chunk_bytes_needed, node_quant, starter_free_bytes
from mdi.starter.planner import format_plan
from mdi.starter.session import client_for


def preflight(cfg: RunConfig, prompts: List[str]) -> int:
    source = ModelSource(cfg.model.path)
    config = source.config
    dtype = torch_dtype(cfg.model.dtype)
    gen = cfg.generation
    longest = max([len(source.tokenizer.encode(p)) for p in prompts] or [0]) if source.tokenizer else 0
    max_len = min(config.block_size, longest + gen.n_tokens)
    n_slots = max(gen.n_samples or 1, len(prompts), 1)
    if cfg.auto_layers:  # the plan the run would make (measured, or from the profile cache)
        try:
            cfg, plan, _ = resolve_layers(cfg, source, n_slots, max_len)
        except NodeError as e:
            print("plan: UNREACHABLE: %s" % e)
            print("check: problems found")
            return 1
        print(format_plan(plan))
    ranges = layer_ranges(partition(config.n_layer, cfg.nodes, cfg.source))
    adapter_bytes = adapter_layer_bytes(cfg.adapters, config)  # each node holds its layers' part
    print("model %s: %s, %d layers, %s, quant %s; %d samples x %d positions" % (
        cfg.model.path, config.family, config.n_layer, cfg.model.dtype, cfg.model.quant, n_slots, max_len))
    print(kernels_line(cfg))
    ok = True
    for i, (node, layers) in enumerate(zip(cfg.nodes, ranges)):
        quant = node_quant(cfg, source, node, layers, with_ends=i == 0)
        need = chunk_bytes_needed(config, layers, n_slots, max_len, dtype, with_ends=i == 0, quant=quant) \
            + sum(adapter_bytes[layers[0]:layers[1]])
        where = "%-10s %-21s layers %3d-%-3d needs %7.1f MB" % (
            node.name, node.address if i else "(this machine)", layers[0], layers[1] - 1, need / MB)
        ok = _report(cfg, node if i else None, where, need) and ok
    for spare in cfg.spares:
        ok = _report(cfg, spare, "%-10s %-21s spare" % (spare.name, spare.address), None) and ok
    print("check: %s" % ("all nodes ready" if ok else "problems found"))
    return 0 if ok else 1


def kernels_line(cfg: RunConfig) -> str:
    policy = cfg.runtime.quant_kernel
    return ("kernels: runtime.quant_kernel %s: each quantized layer takes the kernel measured fastest on its shape "
            "at load among %s (here; a kernel that holds more than the stored weight only within the memory a node "
            "spares beside its plan); the run's summary line and metrics name the choices"
            % (policy, ", ".join(qkernels.available(policy, torch.device(cfg.model.device.split(":")[0])))))


def _report(cfg: RunConfig, node: Optional[NodeSpec], where: str, need: Optional[int]) -> bool:
    """Print one node's line; False if it is unreachable or its layers do not fit."""
    if node is None:
        free, info = starter_free_bytes(cfg.device_of(cfg.starter)), "starter"
    else:
        try:
            client = client_for(cfg, node)
            health = client.health()
            status = client.status()
        except NodeError as e:
            print("%s  UNREACHABLE: %s" % (where, e))
            return False
        free = status.capacity_bytes()
        info = "v%s %s %s" % (health.get("version"), status.device, status.state)
        if status.kernels:
            info += " (kernels held now: %s)" % qkernels.summary(status.kernels)
    fits = need is None or free is None or need <= free
    print("%s  free %s  %s  %s" % (where, "%.0f MB" % (free / MB) if free is not None else "unknown",
                                   info, "fits" if fits else "DOES NOT FIT"))
    return fits
