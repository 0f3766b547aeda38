"""Run configuration: the YAML file users write, validated on load.

Every error is a `ConfigError` whose message names the file, the key and what was expected,
so the CLI can print one line and exit with code 2.
"""
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import yaml

from mdi.model.backend import (BACKENDS, KV_TYPES, PREFILL_WEIGHTS, default_backend, kv_type_name,
                               prefill_weights_for)
from mdi.model.constraints.grammar_cost import MASK_DEADLINE_S
from mdi.model.layout import DTYPE_NAMES, WIRE_CODECS, group_size_problem, layer_ranges, quant_mode_problem
from mdi.model.torch_settings import fused_decode_default
from mdi.model.torch_settings import DEFAULT_POLICY, POLICY_NAMES
# ConfigError, check_keys and the speculation setting live in their own modules; callers
# import them from here as they always have.
from mdi.runconfig.checks import ConfigError, FileRoot, IntOrAuto, check_keys
from mdi.runconfig.speculation import SpeculationSpec, parse_speculation
# The nodes' part of the file lives in its own module; NodeSpec is imported from here by many.
from mdi.runconfig.nodes import (AUTO_LAYERS, NodeSpec, check_device, check_nodes, parse_node, partition,
                                 runtime_device)

# Tokens per prefill pass. A short request arriving during a long prefill waits about one chunk
# at each node: on this 2-core machine (SmolLM2, 3 nodes) 64 keeps its time to first token at
# 1.75x an idle ring's, 128 gives 2.65x, 256 5.4x (scripts/bench_serve.py --compare ttft).
DEFAULT_PREFILL_CHUNK = 64


@dataclass
class ModelSpec:
    path: str
    dtype: str = "float32"
    device: str = "cpu"
    compute_dtype: Optional[str] = None  # e.g. store float16, compute float32 (old GPUs)
    quant: str = "auto"  # none | int8 | int4 | auto (as stored: a GGUF's own precision class)
    group_size: Optional[int] = None  # int8/int4 groups; None: int8 per channel, int4 32


@dataclass
class GenerationSpec:
    n_samples: Optional[int] = None
    n_tokens: int = 100
    temperature: float = 0.8
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 1
    prompts: List[str] = field(default_factory=list)
    # At the end of the context: stop the sample (finish_reason "context"), or drop the oldest
    # half of its generated tokens and go on (llama.cpp's context shift; re-prefilled).
    context_shift: bool = False
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)


def _env_backend() -> str:
    """runtime.backend's default ($MDI_BACKEND, else auto); a typo there is a config error."""
    try:
        return default_backend()
    except ValueError as e:
        raise ConfigError(str(e))


@dataclass
class RuntimeSpec:
    # torch threads per node: an integer; "auto", each node times passes of its own loaded chunk
    # at 1, 2, 4... threads and keeps the fastest (mdi.model.threads); None leaves torch's default
    threads: Optional[IntOrAuto] = None
    connect_timeout: float = 5.0  # seconds to reach a node's control plane
    init_timeout: float = 600.0  # seconds for a node to load its weights
    ring_timeout: float = 30.0  # seconds without any frame before the ring is declared stuck
    heartbeat_interval: float = 1.0  # seconds between the starter's /status polls of each worker
    heartbeat_timeout: float = 8.0  # seconds a worker waits for a sign of the starter before ending a run
    token_file: Optional[str] = None  # file holding the shared secret (else $MDI_TOKEN_FILE / $MDI_TOKEN)
    token: Optional[str] = None  # the secret itself: never from the YAML, read via token_file/env
    # Re-plans after a node failure; None: 2 when spares are listed, else 0 (fail at once).
    recovery_attempts: Optional[int] = None
    quant_kernel: str = DEFAULT_POLICY  # fast (measured fastest) | exact (float32 maths) | a kernel's name (mdi.model.quantization.qkernels)
    # Samples per frame (one forward per node over all of them); "auto": samples in flight / nodes,
    # so they travel as about one group per node; 1: every sample alone (the unbatched ring).
    max_batch: IntOrAuto = "auto"
    # A prompt longer than this travels in passes of this many tokens, so decode steps of other
    # samples keep flowing between them (chunked prefill).
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    wire_codec: str = "raw"  # activations on the wire: raw | float16 | bfloat16 | int8 (mdi.ring.wire)
    # CPU decode frames run each node's blocks as one TorchScript call (mdi.model.fused_decode);
    # false: the eager blocks, to compare. Sent in /init and /profile; part of a profile's cache
    # key. Default true, or false under MDI_FUSED_DECODE=0.
    fused_decode: bool = field(default_factory=fused_decode_default)
    # Earlier prompts' KV kept on every node for later prompts that start the same way
    # (mdi.starter.prefix_cache): "auto" (half of what each node spares beside its weights and
    # KV cache), a byte count per node, or 0 (none).
    prefix_cache: IntOrAuto = "auto"
    # What quantized kernels may hold beyond the stored weights on each node (fbgemm's padded
    # int8 rows, second copies for prefill passes; mdi.model.quantization.kernel_choice): 0 (none: a node
    # holds its stored weights and no more), a byte count per node (within what the node's
    # memory spares beside its plan), or "auto" (whatever it spares).
    kernel_memory: IntOrAuto = 0
    # What each node computes with (mdi.model.backend): ggml (llama.cpp's kernels on the GGUF's
    # own tensors), torch, or auto: each node measures both on its own shapes and keeps the
    # faster (remembered per machine). A node's own `backend:` wins.
    backend: str = field(default_factory=_env_backend)  # $MDI_BACKEND, else auto
    kv_type: str = "f16"  # the ggml backend's KV cache: f16 | q8_0 | f32 (llama.cpp's -ctk / -ctv)
    # ggml re-lays the matrices of some GGUF types for its faster matrix kernels (llama.cpp's
    # default): prefill runs up to 2.6x faster, but a pass of 4 rows or more then rounds them
    # differently from a one-row pass, so greedy ids may depend on batching. false: never.
    repack: bool = True
    # ggml: a prompt's passes multiply the weights as stored ("quantized": a prompt's bits are
    # llama.cpp's) or, where this CPU measured it faster, dequantized in the graph (up to 3x
    # faster prefill where the CPU has bfloat16 arithmetic; mdi.model.ggml.dequant_rows).
    # "dequantized": from the fewest rows measured faster (greedy ids may then depend on a
    # prompt's chunking and the prefix cache); "auto": from the rows where ggml's attention
    # changes kernel too, so ids keep to the window, on nodes whose backend auto chose only.
    prefill_weights: str = "auto"


ADMISSION_POLICIES = ("iteration", "static")


@dataclass
class ServeSpec:
    """`mdi-start --serve`: the HTTP API and the scheduler (see mdi/serving/)."""
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: the starter node's `port`
    max_in_flight: Optional[int] = None  # samples in flight (KV slots); None: what fits, at most 16
    max_len: Optional[int] = None  # positions per slot (prompt + max_tokens); None: min(context, 2048)
    max_queue: int = 256  # requests waiting for a slot beyond this are refused (HTTP 429)
    model_name: Optional[str] = None  # id in /v1/models; None: the model folder's name
    chat_template: Optional[str] = None  # a Jinja chat template file, used instead of the model's own
    admission: str = "iteration"  # iteration: a freed slot is refilled at the next step;
    #                               static: whole batches (a baseline for benchmarks)
    # CPU time one grammar token mask may take; over it its sample ends (mdi/model/constraints/grammar_cost.py)
    mask_deadline_ms: float = MASK_DEADLINE_S * 1e3


FLAGS_SOURCE = "<flags>"  # a RunConfig's source when the command line made it (--model, no --config)


@dataclass
class RunConfig:
    model: ModelSpec
    nodes: List[NodeSpec]
    generation: GenerationSpec
    runtime: RuntimeSpec
    source: str = FLAGS_SOURCE
    spares: List[NodeSpec] = field(default_factory=list)  # idle workers that can replace a dead one
    serve: ServeSpec = field(default_factory=ServeSpec)
    # LoRA adapters over the base, name -> PEFT directory or LoRA GGUF; ids 1..K in this order.
    adapters: Dict[str, str] = field(default_factory=dict)

    @property
    def starter(self) -> NodeSpec:
        return self.nodes[0]

    @property
    def workers(self) -> List[NodeSpec]:
        return self.nodes[1:]

    def layer_ranges(self, n_layer: int) -> List[List[int]]:
        """Each node's half-open [first, last) layers, in ring order (layers planned first)."""
        return layer_ranges(partition(n_layer, self.nodes, self.source))

    def backend_of(self, node: NodeSpec) -> str:
        """What `node` asks to compute with: its own `backend`, else runtime.backend."""
        return node.backend or self.runtime.backend

    def quant_of(self, node: NodeSpec) -> str:
        """What `node` keeps its torch weights as: its own `quant:`, else model.quant."""
        return node.quant or self.model.quant

    def prefill_weights_of(self, node: NodeSpec) -> str:
        """runtime.prefill_weights on `node`: auto is quantized where the node's backend is asked
        for by name (mdi.model.backend.prefill_weights_for)."""
        return prefill_weights_for(self.runtime.prefill_weights, self.backend_of(node))

    def device_of(self, node: NodeSpec) -> str:
        """Where `node` computes: its own `device`, else model.device."""
        return node.device or self.model.device

    def max_batch(self, in_flight: int, n_nodes: int) -> int:
        """Samples per frame for `in_flight` samples on a ring of `n_nodes` (samples_per_frame)."""
        return samples_per_frame(self.runtime.max_batch, in_flight, n_nodes)

    @property
    def auto_layers(self) -> bool:
        """Whether the planner splits the layers at start (`layers: auto` on the nodes)."""
        return self.nodes[0].layers == AUTO_LAYERS

    @property
    def recovery_attempts(self) -> int:
        given = self.runtime.recovery_attempts
        return given if given is not None else (2 if self.spares else 0)


NUM = (int, float)


def parse_config(data: Any, source: str) -> RunConfig:
    top = check_keys(FileRoot(source), data if data is not None else {},
                      {"model": (dict,), "nodes": (list,), "spares": (list,), "generation": (dict,),
                       "runtime": (dict,), "serve": (dict,), "adapters": (dict,)},
                      required=("model",))
    m = check_keys(source + ": model", top["model"],
                    {"path": (str,), "dtype": (str,), "device": (str,), "compute_dtype": (str,), "quant": (str,),
                     "group_size": (int,)},
                    required=("path",))
    model = ModelSpec(**m)
    check_quant("%s: model.quant" % source, model)
    for key in ("dtype", "compute_dtype"):
        value = getattr(model, key)
        if value is not None and value not in DTYPE_NAMES:
            raise ConfigError("%s: model.%s: expected one of %s, got %r" % (source, key, ", ".join(DTYPE_NAMES), value))
    check_device("%s: model.device" % source, model.device)

    nodes = [parse_node("%s: nodes[%d]" % (source, i), raw, "starter" if i == 0 else "node%d" % i)
             for i, raw in enumerate(top.get("nodes") or [{"name": "starter"}])]
    spares = [parse_node("%s: spares[%d]" % (source, i), raw, "spare%d" % (i + 1))
              for i, raw in enumerate(top.get("spares") or [])]
    for i, spare in enumerate(spares):
        if spare.layers is not None:
            raise ConfigError("%s: spares[%d].layers: a spare takes the layers of the node it replaces"
                              % (source, i))
    check_nodes(source, nodes, spares)

    g = check_keys(source + ": generation", top.get("generation") or {},
                    {"n_samples": (int,), "n_tokens": (int,), "temperature": NUM, "top_k": (int,),
                     "top_p": NUM, "seed": (int,), "prompts": (list,), "context_shift": (bool,),
                     "speculation": (str, dict, bool)})
    g["speculation"] = parse_speculation(source + ": generation.speculation", g.get("speculation"), paths=True)
    gen = GenerationSpec(**g)
    _check_generation(source + ": generation", gen)

    r = check_keys(source + ": runtime", top.get("runtime") or {},
                    {"threads": (int, str), "connect_timeout": NUM, "init_timeout": NUM, "ring_timeout": NUM,
                     "heartbeat_interval": NUM, "heartbeat_timeout": NUM, "token_file": (str,),
                     "recovery_attempts": (int,), "quant_kernel": (str,), "max_batch": (int, str),
                     "prefill_chunk": (int,), "wire_codec": (str,), "fused_decode": (bool,),
                     "prefix_cache": (int, str, bool), "backend": (str,), "kv_type": (str,),
                     "repack": (bool,), "kernel_memory": (int, str, bool), "prefill_weights": (str,),
                     "device": (str,)})
    if "device" in r:
        model.device = runtime_device(source, m.get("device"), r.pop("device"))
    if "prefix_cache" in r:
        r["prefix_cache"] = parse_prefix_cache(source + ": runtime.prefix_cache", r["prefix_cache"])
    if "kernel_memory" in r:
        r["kernel_memory"] = parse_kernel_memory(source + ": runtime.kernel_memory", r["kernel_memory"])
    runtime = RuntimeSpec(**r)
    # sent to every worker in /init (check_keys refused booleans already)
    if runtime.threads is not None and runtime.threads != "auto" and not (
            isinstance(runtime.threads, int) and runtime.threads >= 1):
        raise ConfigError("%s: runtime.threads: expected an integer >= 1 or auto, got %r" % (source, runtime.threads))
    if runtime.quant_kernel not in POLICY_NAMES:
        raise ConfigError("%s: runtime.quant_kernel: expected one of %s, got %r"
                          % (source, ", ".join(POLICY_NAMES), runtime.quant_kernel))
    if runtime.max_batch != "auto" and not (isinstance(runtime.max_batch, int) and runtime.max_batch >= 1):
        raise ConfigError("%s: runtime.max_batch: expected an integer >= 1 or auto, got %r" % (source, runtime.max_batch))
    if runtime.prefill_chunk < 1:
        raise ConfigError("%s: runtime.prefill_chunk: expected an integer >= 1 (tokens per prefill pass)" % source)
    if runtime.wire_codec not in WIRE_CODECS:
        raise ConfigError("%s: runtime.wire_codec: expected one of %s, got %r"
                          % (source, ", ".join(WIRE_CODECS), runtime.wire_codec))
    if runtime.backend not in BACKENDS:
        raise ConfigError("%s: runtime.backend: expected one of %s, got %r" % (source, ", ".join(BACKENDS), runtime.backend))
    kv_type = kv_type_name(runtime.kv_type)
    if kv_type is None:
        raise ConfigError("%s: runtime.kv_type: expected one of %s, got %r" % (source, ", ".join(KV_TYPES), runtime.kv_type))
    runtime.kv_type = kv_type
    if runtime.prefill_weights not in PREFILL_WEIGHTS:
        raise ConfigError("%s: runtime.prefill_weights: expected one of %s, got %r"
                          % (source, ", ".join(PREFILL_WEIGHTS), runtime.prefill_weights))
    if runtime.recovery_attempts is not None and runtime.recovery_attempts < 0:
        raise ConfigError("%s: runtime.recovery_attempts: expected an integer >= 0" % source)
    for key in ("connect_timeout", "init_timeout", "ring_timeout", "heartbeat_interval", "heartbeat_timeout"):
        if getattr(runtime, key) <= 0:
            raise ConfigError("%s: runtime.%s: expected a positive number of seconds" % (source, key))
    serve = _parse_serve(source, top.get("serve") or {})
    adapters = _parse_adapters(source, top.get("adapters") or {})
    return RunConfig(model, nodes, gen, runtime, source, spares, serve, adapters)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_prefix_cache(where: str, raw: Any) -> IntOrAuto:
    """runtime.prefix_cache / --prefix-cache: "auto", off (false, "off", 0) or a size per node:
    bytes, or a number with a unit ("512MB", "1.5G"; binary units)."""
    if raw is False or (isinstance(raw, str) and raw.strip().lower() in ("off", "none", "0")):
        return 0
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return raw
    m = _SIZE.fullmatch(raw.strip()) if isinstance(raw, str) else None
    if m is None:
        raise ConfigError("%s: expected auto, off or a size per node such as 512MB, got %r" % (where, raw))
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_kernel_memory(where: str, raw: Any) -> IntOrAuto:
    """runtime.kernel_memory / --kernel-memory: off (0, false, "off", the default), "auto" or a
    size per node, as parse_prefix_cache reads them."""
    try:
        return parse_prefix_cache(where, raw)
    except ConfigError:
        raise ConfigError("%s: expected off, auto or a size per node such as 64MB, got %r" % (where, raw))


# Matched whole (fullmatch): `$` alone would let a trailing newline through ("x\n").
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
BASE_ADAPTER = "base"  # the adapter name that picks none (the base model alone)


def _parse_adapters(source: str, raw: Dict[Any, Any]) -> Dict[str, str]:
    out = {}
    for name, path in raw.items():
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or name == BASE_ADAPTER:
            raise ConfigError("%s: adapters: %r is not an adapter name (letters, digits, '_', '.', '-'; not 'base')"
                              % (source, name))
        if not isinstance(path, str) or not path:
            raise ConfigError("%s: adapters.%s: expected the path of a PEFT directory or a LoRA GGUF" % (source, name))
        out[name] = path
    return out


def _parse_serve(source: str, raw: Any) -> ServeSpec:
    s = check_keys(source + ": serve", raw,
                    {"host": (str,), "port": (int,), "max_in_flight": (int,), "max_len": (int,),
                     "max_queue": (int,), "model_name": (str,), "admission": (str,),
                     "mask_deadline_ms": (int, float), "chat_template": (str,)})
    serve = ServeSpec(**s)
    check_serve(source + ": serve", serve)
    return serve


def check_serve(where: str, serve: ServeSpec) -> None:
    if not serve.host:
        raise ConfigError("%s.host: expected a host name or address" % where)
    if serve.port is not None and not 0 < serve.port < 65536:
        raise ConfigError("%s.port: expected a TCP port 1-65535, got %d" % (where, serve.port))
    if serve.max_in_flight is not None and serve.max_in_flight < 1:
        raise ConfigError("%s.max_in_flight: expected a positive integer" % where)
    if serve.max_len is not None and serve.max_len < 2:
        raise ConfigError("%s.max_len: expected an integer >= 2" % where)
    if serve.max_queue < 1:
        raise ConfigError("%s.max_queue: expected a positive integer" % where)
    if not 0 < serve.mask_deadline_ms < math.inf:
        raise ConfigError("%s.mask_deadline_ms: expected a positive number of milliseconds, got %r"
                          % (where, serve.mask_deadline_ms))
    if serve.model_name is not None and not serve.model_name.strip():
        raise ConfigError("%s.model_name: expected a non-empty string" % where)
    if serve.admission not in ADMISSION_POLICIES:
        raise ConfigError("%s.admission: expected one of %s, got %r"
                          % (where, ", ".join(ADMISSION_POLICIES), serve.admission))


def check_quant(where: str, model: ModelSpec) -> None:
    problem = quant_mode_problem(model.quant)
    if problem is not None:
        raise ConfigError("%s: %s" % (where, problem))
    group = model.group_size
    problem = group_size_problem(model.quant, group) if group is not None else None
    if problem is not None:
        raise ConfigError("%s: group_size %s: %s" % (where, group, problem))


def _check_generation(where: str, gen: GenerationSpec, flags: bool = False) -> None:
    """`flags`: the values came from the command line (the file's were checked as it was read):
    errors name the flag (--n-tokens), else `where` and the key (config.yaml: generation.n_tokens)."""
    def name(key: str) -> str:
        return "--" + key.replace("_", "-") if flags else "%s.%s" % (where, key)
    if gen.n_samples is not None and gen.n_samples < 1:
        raise ConfigError("%s: expected a positive integer" % name("n_samples"))
    if gen.n_tokens < 1:
        raise ConfigError("%s: expected a positive integer" % name("n_tokens"))
    if not (math.isfinite(gen.temperature) and gen.temperature >= 0):  # YAML's .nan passes `< 0`
        raise ConfigError("%s: expected a finite number >= 0" % name("temperature"))
    if gen.top_k is not None and gen.top_k < 1:
        raise ConfigError("%s: expected a positive integer" % name("top_k"))
    if gen.top_p is not None and not (math.isfinite(gen.top_p) and 0 < gen.top_p <= 1):
        raise ConfigError("%s: expected a number in (0, 1]" % name("top_p"))
    if not all(isinstance(p, str) for p in gen.prompts):
        raise ConfigError("%s: expected a list of strings" % name("prompts"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader, refusing a mapping that names a key twice (PyYAML keeps the last:
    a second `generation:` block silently dropped the first one's temperature: 0)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, "key %r appears twice in one mapping" % (key,),
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str, error: type = ConfigError, what: str = "config") -> Any:
    """A YAML file's data (safe_load only), or one `error` line naming the file and the line."""
    if not os.path.isfile(path):
        raise error("%s: %s" % (path, "a directory, not a %s file" % what if os.path.isdir(path)
                                else "%s file not found" % what))
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise error("%s: not UTF-8 text (byte 0x%02x at offset %d)" % (path, e.object[e.start], e.start))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = " at line %d" % (mark.line + 1) if mark is not None else ""
        raise error("%s: invalid YAML%s: %s" % (path, at, getattr(e, "problem", None) or e))


def load_config(path: str) -> RunConfig:
    cfg = parse_config(read_yaml(path), path)
    cfg.model.path = resolve_model_path(cfg.model.path, path)
    cfg.adapters = {name: resolve_model_path(p, path) for name, p in cfg.adapters.items()}
    if cfg.generation.speculation.draft:  # found as model.path is, from any directory
        cfg.generation.speculation.draft = resolve_model_path(cfg.generation.speculation.draft, path)
    if cfg.serve.chat_template:
        cfg.serve.chat_template = resolve_model_path(cfg.serve.chat_template, path)
    return cfg


def resolve_model_path(model_path: str, config_path: str) -> str:
    """Relative model paths are tried from the current directory, then from the config's
    directory and its parent (so `configs/x.yaml` may say `models/...`)."""
    if os.path.isabs(model_path) or os.path.exists(model_path):
        return model_path
    here = os.path.dirname(os.path.abspath(config_path))
    for base in (here, os.path.dirname(here)):
        candidate = os.path.join(base, model_path)
        if os.path.exists(candidate):
            return candidate
    return model_path


def samples_per_frame(max_batch: IntOrAuto, in_flight: int, n_nodes: int) -> int:
    """runtime.max_batch resolved for `in_flight` samples on a ring of `n_nodes`: "auto" makes
    them travel as about one group per node; a number caps a frame (at the samples there are)."""
    if max_batch == "auto":
        return max(1, math.ceil(in_flight / n_nodes))
    return min(int(max_batch), max(1, in_flight))
