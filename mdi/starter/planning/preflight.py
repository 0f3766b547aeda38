"""`mdi-start --check`: contact every node and say whether the run would fit, generating nothing."""
from typing import Any, Callable, Optional, Sequence

from mdi.ring.status import WorkerState
from mdi.runconfig import ConfigError, NodeSpec, RunConfig
from mdi.starter.control import NodeError, NodeRegistry, NodeTimeout, NodeUnreachable
from mdi.model.quantization import kernel_report
from mdi.model.layout import format_layers
from mdi.model.prefix_store import budget_bytes as prefix_budget
from mdi.model.source import ModelSource
from mdi.starter.planning.capacity import MB, TORCH_BESIDE_BUDGET_BYTES, starter_free_bytes
from mdi.starter.planning.planner import format_plan
from mdi.starter.planning.run_plan import backend_request, plan_run
from mdi.starter.planning.run_shape import RunShape, batch_samples, batch_shape, expand_prompts
from mdi.system.cpu import cpu_info, isa_text
from mdi.model.backend_select import device_unusable
from mdi.system.memory import LOAD_HEADROOM_BYTES


def preflight(cfg: RunConfig, cli_prompts: Sequence[str] = (), n_samples: Optional[int] = None,
              adapters: Sequence[str] = ()) -> int:
    """Check the run that `mdi-start --prompt ... --n-samples N --adapter ...` would make: its
    samples, slots and positions are the run's own (mdi.starter.planning.run_shape). Without any prompt,
    `n_samples` (else generation.n_samples, else 1) slots of the tokens to generate."""
    source = ModelSource(cfg.model.path)
    config = source.config
    gen = cfg.generation
    prompts = expand_prompts(cfg, cli_prompts, n_samples) if cli_prompts or gen.prompts else []
    samples, _ = batch_samples(cfg, source, prompts, adapters) if prompts else ([], None)
    shape = batch_shape(config, samples, gen.n_tokens)
    shape = RunShape(shape.n_slots or n_samples or gen.n_samples or 1, shape.max_len)
    try:  # the plan the run would make (`layers: auto`: measured, or from the profile cache)
        plan = plan_run(cfg, source, shape, recover=False)  # a lost worker is said, not replaced
    except NodeError as e:
        print("plan: UNREACHABLE: %s" % e)
        print("check: problems found")
        return 1
    except ConfigError as e:  # a draft model of another vocabulary, found before any weight is read
        print("plan: REFUSED: %s" % e)
        print("check: problems found")
        return 1
    cfg = plan.cfg
    if plan.layer_plan is not None:
        print(format_plan(plan.layer_plan))
    print("model %s: %s, %d layers, %s, quant %s; %d samples x %d positions" % (
        cfg.model.path, config.family, config.n_layer, cfg.model.dtype, cfg.model.quant, plan.n_slots, plan.max_len))
    print(kernels_line(cfg))
    starter_device = cfg.device_of(cfg.starter)
    unusable = device_unusable(starter_device)
    if unusable is not None:  # the run would stop here with this line, before any weight moves
        print("starter: UNUSABLE: %s" % unusable)
    print(prefix_line(cfg))
    print(kernel_memory_line(cfg))
    draft, draft_need = plan.draft, plan.budgets[0].draft
    if draft is not None:
        print("draft model %s: %s, %d layers, quant %s: %.1f MB (weights and KV cache), counted in the starter's need"
              % (draft.path, draft.config.family, draft.config.n_layer,
                 cfg.generation.speculation.quant or cfg.model.quant, draft_need / MB))
    ok = True
    registry = NodeRegistry.for_run(cfg)
    try:
        for i, (node, budget) in enumerate(zip(plan.nodes, plan.budgets)):
            # the plan's budget, as serving's slots, recovery and the engine's load check read it
            def where(need: int, node: Any = node, i: int = i) -> str:
                return "%-10s %-21s %-17s needs %7.1f MB" % (
                    node.name, node.spec.address if i else "(this machine)", format_layers(*node.layers), need / MB)
            ok = _report(cfg, registry, node.spec if i else None, where, budget, plan, source, node) and ok
        for spare in plan.spares:
            # the least a spare takes: the smallest worker's layers, counted as recovery counts them
            smallest = min((plan.budget_on(cfg.backend_of(spare), spare, w.layers, source) for w in plan.nodes[1:]),
                           key=lambda b: b.total, default=None)

            def spare_line(need: int, spare: NodeSpec = spare) -> str:
                return "%-10s %-21s spare%s" % (spare.name, spare.address, ", the smallest worker's layers need "
                                                "%.1f MB" % (need / MB) if need else "")
            ok = _report(cfg, registry, spare, spare_line, smallest) and ok
    finally:
        registry.close()
    ok = ok and unusable is None
    print("check: %s" % ("all nodes ready" if ok else "problems found"))
    return 0 if ok else 1


def kernels_line(cfg: RunConfig) -> str:
    """How the run's quantized layers will multiply, by runtime.quant_kernel (each node's line
    below names the kernels its own torch and CPU offer; which win is measured at load)."""
    policy = cfg.runtime.quant_kernel
    if all_ggml(cfg):
        return ("kernels: ggml's, on each GGUF block type as stored (every node's runtime.backend is ggml: "
                "runtime.quant_kernel does not apply)")
    if cfg.model.quant == "none":
        return "kernels: none (model.quant none: every weight is float)"
    if policy == "exact":
        how = "every quantized layer multiplies with dequant (float32 arithmetic: the dequantized model's bits)"
    elif policy == "fast":
        how = ("each quantized layer takes the kernel measured fastest on its shape at load among those its node "
               "offers (listed per node below; a kernel that holds more than the stored weight only within "
               "runtime.kernel_memory)")
    else:
        how = "every quantized layer takes %s where it runs, else dequant" % policy
    return "kernels%s: runtime.quant_kernel %s: %s; the run's summary line and metrics name the choices" % (
        _on_torch(cfg), policy, how)


def _on_torch(cfg: RunConfig) -> str:
    """The scope of a torch-only line when some node's backend is chosen there (auto)."""
    if any(cfg.backend_of(n) == "auto" for n in cfg.nodes):
        return " (for nodes that runtime.backend auto puts on torch; each node's line names its backend)"
    return ""


def all_ggml(cfg: RunConfig) -> bool:
    """Every node of the run computes with ggml (asked so: `auto` decides on the node)."""
    return all(cfg.backend_of(n) == "ggml" for n in cfg.nodes)


def kernels_offered_line(policy: str, offered: Sequence[str]) -> str:
    """What one node would try under `policy`, given what `fast` may try there (`offered`)."""
    if policy == "exact":
        return "kernels: dequant"
    if policy == "fast":
        return "kernels to measure: %s" % (", ".join(offered) or "none (device unusable)")
    if policy in offered:
        return "kernels: %s" % policy
    return "kernels: dequant (%s does not run here)" % policy


def prefix_line(cfg: RunConfig) -> str:
    setting = cfg.runtime.prefix_cache
    if not setting:
        return "prefix cache: off (runtime.prefix_cache): every prompt is computed whole"
    if setting == "auto":
        return ("prefix cache: auto (runtime.prefix_cache): each node keeps earlier prompts' KV in half of what it "
                "spares beside its weights and KV cache; the run's log says how many positions that is")
    return "prefix cache: %.1f MB per node (runtime.prefix_cache), counted in each node's need below" % (setting / MB)


def kernel_memory_line(cfg: RunConfig) -> str:
    """What quantized kernels may hold beyond the stored weights (runtime.kernel_memory)."""
    setting = cfg.runtime.kernel_memory
    if all_ggml(cfg):
        return "kernel memory: none needed (every node computes with ggml, on the GGUF's blocks as stored)"
    if cfg.model.quant == "none" and not any(n.quant for n in cfg.nodes):
        return "kernel memory: none needed (model.quant none: every weight is float)"
    if not setting:
        return ("kernel memory%s: 0 (runtime.kernel_memory): each node holds its stored weights, KV cache and prefix "
                "cache and no kernel copies; faster kernels that hold more (int8dyn-fbgemm/qnnpack, second copies "
                "for prefill passes) need runtime.kernel_memory: auto or a size" % _on_torch(cfg))
    if setting == "auto":
        return ("kernel memory%s: auto (runtime.kernel_memory): kernels may hold whatever each node's memory spares "
                "beside its plan and prefix cache (per node below)" % _on_torch(cfg))
    return ("kernel memory%s: %.1f MB per node (runtime.kernel_memory), within what each node spares beside its plan "
            "and prefix cache (per node below)" % (_on_torch(cfg), setting / MB))


def kernel_admits(cfg: RunConfig, need: Optional[int], free: Optional[int]) -> str:
    """What runtime.kernel_memory admits on a node that needs `need` of its `free` bytes: the
    allowance it would load with (mdi.model.quantization.kernel_choice.allowance_for), as its line says it."""
    setting = cfg.runtime.kernel_memory
    if not setting:
        return "kernel copies 0 MB"
    spare = None
    if need is not None and free is not None:
        spare = free - need - LOAD_HEADROOM_BYTES
        spare -= prefix_budget(cfg.runtime.prefix_cache, spare) if cfg.runtime.prefix_cache == "auto" else 0
    from mdi.model.quantization.kernel_choice import allowance_for  # torch's kernels: a torch node's line
    allowance = allowance_for(setting, spare)
    if allowance is None:
        return "kernel copies: no limit (its memory is unknown)"
    return "kernel copies up to %.1f MB" % (allowance / MB)


def _report(cfg: RunConfig, registry: NodeRegistry, node: Optional[NodeSpec], where_for: Callable[[int], str],
            budget: Any, plan: Any = None, source: Optional[ModelSource] = None, node_plan: Any = None) -> bool:
    """Print one node's line; False if it is unreachable, its layers do not fit, or its backend
    cannot serve the run. A node of the ring says what it would compute with (its backend, as
    the run would choose it: auto measures there once per machine), and needs what that backend
    holds: on ggml its GGUF tensors as stored and ggml's cache, as its own load check counts."""
    policy = cfg.runtime.quant_kernel
    need = None if budget is None else budget.total
    where = where_for(need or 0)
    if node is None:
        device = cfg.device_of(cfg.starter)
        assert source is not None and plan is not None
        try:
            backend = _starter_backend(cfg, plan, source, node_plan)
        except ConfigError as e:
            print("%s  REFUSED: %s" % (where, e))
            return False
        info = "starter; backend %s; cpu %s" % (backend.describe(), isa_text(cpu_info()))
        on_torch = backend.backend == "torch"
        if on_torch:
            from mdi.model.quantization import qkernels  # (imports torch: a ggml starter's check never does)
            info += "; " + kernels_offered_line(policy, qkernels.offered_on(device))
        # read once what the run's backend imports is here, as the run's own load check reads it:
        # torch took 127 MB of a 240 MB board's free memory after a check that had not counted it
        free = starter_free_bytes(device)
    else:
        try:
            client = registry.client(node)
            health = client.health()
            status = client.status()
        except NodeError as e:  # not there, a wrong token, or not an mdi worker
            print("%s  UNREACHABLE: %s" % (where, e))
            return False
        try:
            chosen = client.backend(backend_request(plan, source, node_plan)) \
                if node_plan is not None and source is not None else None
        except NodeError as e:  # a worker that answered: it cannot run what the config asks of it
            print("%s  %s: %s" % (where, "UNREACHABLE" if isinstance(e, (NodeUnreachable, NodeTimeout)) else "REFUSED",
                                  e))
            return False
        free = status.capacity_bytes()
        info = "v%s %s %s" % (health.get("version"), status.device, status.state)
        if chosen is not None:
            info += "; backend %s" % chosen.line
        elif node_plan is None:  # a spare: it is asked for its backend once it takes a lost node's layers
            info += "; backend %s (asked)" % cfg.backend_of(node)
        on_torch = chosen.backend == "torch" if chosen is not None else cfg.backend_of(node) != "ggml"
        if status.cpu:  # an older worker does not say
            info += "; cpu %s" % status.cpu
            if on_torch:
                info += "; " + kernels_offered_line(policy, chosen.kernels_here if chosen else status.kernels_here)
        if status.kernels:
            info += " (the layers it holds from an earlier run use %s)" % kernel_report.summary(status.kernels)
    if budget is not None and not on_torch and node_plan is not None:  # (a spare's: budget_on counted its backend)
        need = plan.ggml_budget(plan.nodes.index(node_plan), source).total
        where = where_for(need)
    fits = need is None or free is None or need <= free
    if need is not None and fits and on_torch:  # ggml computes with the GGUF's blocks: no kernel copies
        info += "; " + kernel_admits(cfg, need, free)
        if free is not None and free - need < TORCH_BESIDE_BUDGET_BYTES:
            info += ("; TIGHT: %.0f MB left beside it, and torch holds about %.0f MB more than its weights and KV "
                     "cache (runtime.backend: ggml about 100 MB)" % ((free - need) / MB,
                                                                      TORCH_BESIDE_BUDGET_BYTES / MB))
    # another starter's run holds it (a check starts none): a new run's /init is refused (409)
    busy = node is not None and status.state in (WorkerState.RUNNING, WorkerState.LOADING)
    print("%s  free %s  %s  %s%s" % (where, "%.0f MB" % (free / MB) if free is not None else "unknown",
                                     info, "fits" if fits else "DOES NOT FIT",
                                     "; BUSY: run %s holds it until it ends or its starter falls silent"
                                     % status.run_id if busy else ""))
    return fits and not busy


def _starter_backend(cfg: RunConfig, plan: Any, source: ModelSource, node_plan: Any) -> Any:
    """What the starter's chunk would compute with, decided as the engine decides it."""
    from mdi.model.backend_select import select_backend
    from mdi.model.layout import layout_to_json
    first, last = node_plan.layers
    try:
        return select_backend(cfg.backend_of(cfg.starter), source.config, first, last,
                              source.gguf_types(first, last, True, True) if source.gguf_path else None,
                              cfg.device_of(cfg.starter), cfg.runtime.threads if isinstance(cfg.runtime.threads, int)
                              else None, plan.max_batch, adapters=bool(cfg.adapters), dtype=cfg.model.dtype,
                              quant=layout_to_json(node_plan.quant), quant_kernel=cfg.runtime.quant_kernel,
                              kv_type=cfg.runtime.kv_type, prefill_weights=cfg.prefill_weights_of(cfg.starter),
                              prefill_chunk=cfg.runtime.prefill_chunk, repack=cfg.runtime.repack,
                              compute_dtype=cfg.model.compute_dtype)
    except (ValueError, RuntimeError) as e:
        raise ConfigError("backend: %s" % e)
