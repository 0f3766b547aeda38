"""The experiment YAML (models, node counts, partitions, samples in flight, emulation) and
the rings it asks for; every error names the file and the key."""
import itertools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from mdi.model.backend import BACKENDS, default_backend
from mdi.model.layout import (DTYPE_NAMES, EXPORT_TYPES, QUANT_KINDS, balanced, group_size_problem, partition_label,
                              quant_mode_problem)
from mdi.model.torch_settings import DEFAULT_POLICY, POLICY_NAMES
from mdi.ring.wire import CODECS
from mdi.runconfig import check_keys, read_yaml
from mdi.runconfig.checks import FileRoot, key_path
from mdi.lab.emulation import EmulationSettings



class ExperimentError(ValueError):
    """A bad experiment file; the message names the file and the key."""


# --------------------------------------------------------------------------- schema

@dataclass
class ModelEntry:
    name: str
    path: str
    random: Optional[Dict[str, Any]] = None  # build a random-initialised model there if missing
    prompt: str = "Once upon a time"
    tokens: int = 32
    samples: List[Any] = field(default_factory=lambda: ["1..2N"])
    nodes: List[int] = field(default_factory=lambda: [1, 2, 3])
    # balanced | auto (mdi-start's planner picks the counts) | all (every split) | [counts]
    partitions: List[Any] = field(default_factory=lambda: ["balanced"])
    partition_step: int = 1  # `all` makes only the splits whose counts are multiples of this
    dtype: str = "float32"
    weights: str = "local"  # local: workers read their layers from the model dir; push: over HTTP
    quant: str = "auto"  # the run's model.quant: none | auto (as stored) | int8 | int4
    quant_kernel: str = DEFAULT_POLICY  # the run's runtime.quant_kernel: fast | exact | a kernel's name
    # The runs' runtime.max_batch, an axis like samples: 1 = every sample alone (unbatched),
    # k = at most k samples per forward, auto = samples in flight / nodes.
    max_batch: List[Any] = field(default_factory=lambda: ["auto"])
    prefill_chunk: Optional[int] = None  # the runs' runtime.prefill_chunk; None: mdi's default
    wire_codec: str = "raw"  # the runs' runtime.wire_codec (mdi.ring.wire.CODECS)
    # the runs' runtime.backend (auto | ggml | torch; None: mdi's default, $MDI_BACKEND else auto):
    # each node's choice is in the CSV's `backends`
    backend: Optional[str] = None

    @property
    def asked_backend(self) -> str:
        """runtime.backend as its runs ask it: its own, else mdi's default ($MDI_BACKEND, else auto)."""
        return self.backend or default_backend()


@dataclass
class Experiment:
    name: str
    source: str
    models: List[ModelEntry]
    output: str
    repeats: int = 3
    temperature: float = 0.0
    warmup: bool = True
    starter: str = "persistent"  # persistent: one starter process per ring; process: mdi-start per run
    run_timeout: float = 600.0
    start_timeout: float = 300.0
    emulation: EmulationSettings = field(default_factory=EmulationSettings)
    description: str = ""
    auth: bool = False  # shared secret (MDI_TOKEN) on the control plane and the ring
    speculation: Any = None  # every run's generation.speculation, as written (None: off)


NUM = (int, float)
MODEL_KEYS = {"name": (str,), "path": (str,), "random": (dict,), "prompt": (str,), "tokens": (int,),
              "samples": (list,), "nodes": (list,), "partitions": (list,), "dtype": (str,), "weights": (str,),
              "quant": (str,), "quant_kernel": (str,), "max_batch": (list,), "prefill_chunk": (int,),
              "wire_codec": (str,), "partition_step": (int,), "backend": (str,)}
SHARED_KEYS = ("prompt", "tokens", "samples", "nodes", "partitions", "dtype", "weights", "quant", "quant_kernel",
               "max_batch", "prefill_chunk", "wire_codec", "partition_step", "backend")
TOP_KEYS = {"name": (str,), "description": (str,), "output": (str,), "models": (list,), "repeats": (int,),
            "temperature": NUM, "warmup": (bool,), "starter": (str,), "run_timeout": NUM,
            "start_timeout": NUM, "emulation": (dict,), "auth": (bool,), "speculation": (str, dict, bool)}
TOP_KEYS.update({k: MODEL_KEYS[k] for k in SHARED_KEYS})
# cpu_quota and memory_limit_mb: one value for every node, or a list per node index (starter first)
EMULATION_KEYS = {"enabled": (bool, str), "cpu_quota": (int, float, list), "cpu_period_us": (int,),
                  "memory_limit_mb": (int, list), "bandwidth_mbit": NUM, "latency_ms": NUM}
MAX_ALL_RINGS = 2000  # `partitions: [all]` refuses to make more rings than this
RANDOM_KEYS = {"family": (str,), "n_layer": (int,), "n_embd": (int,), "n_head": (int,), "n_kv_head": (int,),
               "intermediate_size": (int,), "block_size": (int,), "seed": (int,), "std": NUM,
               "vocab_size": (int,), "quant": (str,), "group_size": (int,),
               # the family variants (mdi.model.config): Qwen2 q/k/v biases, Qwen3 q/k norms and
               # wide heads, Llama 3 RoPE scaling
               "qkv_bias": (bool,), "qk_norm": (bool,), "head_size": (int,), "rope_theta": NUM,
               "rope_scaling": (dict,), "tied_head": (bool,),
               # a model.gguf beside the weights, in this GGUF type (f16, q8_0, q4_k...): what ggml nodes compute
               "gguf": (str,)}
def _fields(where: str, data: Any, allowed: Mapping[str, Tuple[type, ...]],
            required: Sequence[str] = ()) -> Dict[str, Any]:
    return check_keys(where, data, allowed, required, error=ExperimentError)


SAMPLE_TERM = r"(\d*)(N?)"


def _sample_term(text: str, n: int) -> int:
    m = re.fullmatch(SAMPLE_TERM, text.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(text)
    k = int(m.group(1)) if m.group(1) else 1
    return k * n if m.group(2) else k


def samples_for(items: Sequence[Any], n: int) -> List[int]:
    """Samples in flight for a ring of n nodes: items are integers, 'kN' or ranges 'A..B'."""
    out = set()
    for item in items:
        if isinstance(item, int):
            out.add(item)
        elif ".." in item:
            lo, hi = item.split("..", 1)
            out.update(range(_sample_term(lo, n), _sample_term(hi, n) + 1))
        else:
            out.add(_sample_term(item, n))
    return sorted(s for s in out if s >= 1)


def _check_samples(where: str, items: List[Any]) -> None:
    for i, item in enumerate(items):
        ok = isinstance(item, int) and not isinstance(item, bool) and item >= 1
        if isinstance(item, str):
            try:
                ok = bool(samples_for([item], 1))
            except ValueError:
                ok = False
        if not ok:
            raise ExperimentError("%s[%d]: expected a positive integer, 'N', '2N' or a range like '1..2N', got %r"
                                  % (where, i, item))
    if not items:
        raise ExperimentError("%s: expected at least one entry" % where)


def _check_nodes(where: str, items: List[Any]) -> None:
    if not items:
        raise ExperimentError("%s: expected at least one node count" % where)
    for i, n in enumerate(items):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ExperimentError("%s[%d]: expected a positive integer (number of nodes), got %r" % (where, i, n))


PARTITION_WORDS = ("balanced", "auto", "all")


def _check_partitions(where: str, items: List[Any]) -> None:
    if not items:
        raise ExperimentError("%s: expected at least one partition" % where)
    for i, p in enumerate(items):
        if isinstance(p, str) and p in PARTITION_WORDS:
            continue
        if not isinstance(p, list) or not p or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                                                         for c in p):
            raise ExperimentError("%s[%d]: expected 'balanced', 'auto', 'all' or a list of layer counts like "
                                  "[6, 12, 12], got %r" % (where, i, p))


def max_batches(items: Sequence[Any]) -> List[Any]:
    """The max_batch axis without repeats, in the order given."""
    out: List[Any] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def _check_max_batch(where: str, items: List[Any]) -> None:
    if not items:
        raise ExperimentError("%s: expected at least one entry (1 = unbatched, auto or a positive integer)" % where)
    for i, item in enumerate(items):
        if item != "auto" and (isinstance(item, bool) or not isinstance(item, int) or item < 1):
            raise ExperimentError("%s[%d]: expected a positive integer (1 = unbatched) or 'auto', got %r"
                                  % (where, i, item))


def _parse_model(where: str, raw: Any, defaults: Dict[str, Any]) -> ModelEntry:
    m = _fields(where, raw, MODEL_KEYS, required=("name", "path"))
    for key in SHARED_KEYS:
        if key not in m and key in defaults:
            m[key] = defaults[key]
    entry = ModelEntry(**m)
    _check_common(where, entry)
    if entry.random is not None:
        _fields(where + ".random", entry.random, RANDOM_KEYS, required=("family", "n_layer", "n_embd", "n_head"))
        _check_random_quant(where + ".random", entry.random)
    return entry


def _check_random_quant(where: str, spec: Dict[str, Any]) -> None:
    """`quant: int8 | int4` (+ `group_size`) builds the random model quantized, one weight at a
    time: the float model never exists (a 7B float32 one would need 27 GB)."""
    gguf = spec.get("gguf")
    if gguf is not None:
        if gguf not in EXPORT_TYPES:
            raise ExperimentError("%s.gguf: expected one of %s, got %r" % (where, ", ".join(EXPORT_TYPES), gguf))
        if spec.get("quant") is not None:  # (the GGUF is made from float weights: int8/int4 ones re-rounded)
            raise ExperimentError("%s: give quant (torch's int8/int4) or gguf (a GGUF type), not both" % where)
    quant = spec.get("quant")
    if quant is not None and quant not in QUANT_KINDS:
        raise ExperimentError("%s.quant: expected one of %s, got %r" % (where, ", ".join(QUANT_KINDS), quant))
    group = spec.get("group_size")
    problem = group_size_problem(quant, group) if group is not None else None
    if problem is not None:
        raise ExperimentError("%s.group_size: %s" % (where, problem))


def _check_common(where: str, e: ModelEntry) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", e.name):
        raise ExperimentError("%s: expected letters, digits, '-', '_' or '.', got %r"
                              % (key_path(where, "name"), e.name))
    if e.tokens < 2:  # (a run of one token has no decode interval to measure: it counted as failed)
        raise ExperimentError("%s: expected an integer >= 2 (a decode rate needs two tokens)"
                              % key_path(where, "tokens"))
    if e.dtype not in DTYPE_NAMES:
        raise ExperimentError("%s: expected one of %s, got %r"
                              % (key_path(where, "dtype"), ", ".join(DTYPE_NAMES), e.dtype))
    if e.weights not in ("local", "push"):
        raise ExperimentError("%s: expected 'local' or 'push', got %r" % (key_path(where, "weights"), e.weights))
    problem = quant_mode_problem(e.quant)
    if problem is not None:
        raise ExperimentError("%s: %s" % (key_path(where, "quant"), problem))
    if e.quant_kernel not in POLICY_NAMES:
        raise ExperimentError("%s: expected one of %s, got %r"
                              % (key_path(where, "quant_kernel"), ", ".join(POLICY_NAMES), e.quant_kernel))
    if e.prefill_chunk is not None and e.prefill_chunk < 1:
        raise ExperimentError("%s: expected a positive integer (tokens per prefill pass), got %r"
                              % (key_path(where, "prefill_chunk"), e.prefill_chunk))
    if e.partition_step < 1:
        raise ExperimentError("%s: expected a positive integer (layers), got %r"
                              % (key_path(where, "partition_step"), e.partition_step))
    if e.wire_codec not in CODECS:
        raise ExperimentError("%s: expected one of %s, got %r"
                              % (key_path(where, "wire_codec"), ", ".join(CODECS), e.wire_codec))
    if e.backend is not None and e.backend not in BACKENDS:
        raise ExperimentError("%s: expected one of %s, got %r"
                              % (key_path(where, "backend"), ", ".join(BACKENDS), e.backend))
    _check_max_batch(key_path(where, "max_batch"), e.max_batch)
    _check_samples(key_path(where, "samples"), e.samples)
    _check_nodes(key_path(where, "nodes"), e.nodes)
    _check_partitions(key_path(where, "partitions"), e.partitions)


def _parse_emulation(where: str, raw: Any) -> EmulationSettings:
    e = _fields(where, raw or {}, EMULATION_KEYS)
    enabled = e.pop("enabled", "auto")
    # YAML reads on/off/yes/no as booleans: accept both spellings.
    mode = {True: "on", False: "off"}.get(enabled, enabled) if isinstance(enabled, bool) else enabled
    if mode not in ("auto", "on", "off"):
        raise ExperimentError("%s.enabled: expected auto, on (true) or off (false), got %r" % (where, enabled))
    s = EmulationSettings(mode=mode, **e)
    _check_per_node(where + ".cpu_quota", s.cpu_quota, NUM, lambda q: 0.01 <= q <= 64,
                    "cores per node between 0.01 and 64")
    if not 1000 <= s.cpu_period_us <= 1000000:
        raise ExperimentError("%s.cpu_period_us: expected 1000 to 1000000 microseconds" % where)
    _check_per_node(where + ".memory_limit_mb", s.memory_limit_mb, (int,), lambda mb: mb >= 64, "at least 64 MB")
    if s.bandwidth_mbit is not None and s.bandwidth_mbit <= 0:
        raise ExperimentError("%s.bandwidth_mbit: expected a positive number" % where)
    if s.latency_ms < 0 or s.latency_ms > 10000:
        raise ExperimentError("%s.latency_ms: expected 0 to 10000 ms" % where)
    return s


def _check_per_node(where: str, value: Any, kinds: Tuple[type, ...], ok: Callable[[Any], bool], expected: str) -> None:
    """A number for every node, or a list with one per node index (null: no limit for that node)."""
    if not isinstance(value, list):
        if value is not None and not ok(value):
            raise ExperimentError("%s: expected %s, got %r" % (where, expected, value))
        return
    if not value:
        raise ExperimentError("%s: expected a number or a list with one per node (starter first), got []" % where)
    for i, v in enumerate(value):
        if v is not None and (isinstance(v, bool) or not isinstance(v, kinds) or not ok(v)):
            raise ExperimentError("%s[%d]: expected %s (or null: no limit), got %r" % (where, i, expected, v))


def check_node_lists(exp: Experiment) -> None:
    """Every ring has an entry of each per-node emulation list for each of its nodes."""
    for key, length in sorted(exp.emulation.node_lists().items()):
        for i, m in enumerate(exp.models):
            if max(m.nodes) > length:
                raise ExperimentError("%s: emulation.%s: %d %s (one per node index) but models[%d] (%s) has "
                                      "rings of %d nodes" % (exp.source, key, length,
                                                             "entry" if length == 1 else "entries", i, m.name,
                                                             max(m.nodes)))


def parse_experiment(data: Any, source: str) -> Experiment:
    top = _fields(FileRoot(source), data if data is not None else {}, TOP_KEYS, required=("models",))
    defaults = {k: top[k] for k in SHARED_KEYS if k in top}
    template = ModelEntry("defaults", "-", **defaults)
    _check_common(FileRoot(source), template)  # top-level defaults are checked even if every model overrides them
    models = [_parse_model("%s: models[%d]" % (source, i), raw, defaults) for i, raw in enumerate(top["models"])]
    if not models:
        raise ExperimentError("%s: models: expected at least one model" % source)
    names = [m.name for m in models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ExperimentError("%s: models[%d].name: model %r is listed twice" % (source, i, name))
    name = top.get("name") or os.path.splitext(os.path.basename(source))[0]
    exp = Experiment(name=name, source=source, models=models, output=top.get("output") or os.path.join("results", name),
                     repeats=top.get("repeats", 3), temperature=float(top.get("temperature", 0.0)),
                     warmup=top.get("warmup", True), starter=top.get("starter", "persistent"),
                     run_timeout=float(top.get("run_timeout", 600)), start_timeout=float(top.get("start_timeout", 300)),
                     emulation=_parse_emulation(source + ": emulation", top.get("emulation")),
                     description=top.get("description", ""), auth=top.get("auth", False),
                     speculation=top.get("speculation"))
    _check_top(source, exp)
    check_node_lists(exp)
    return exp


def _check_top(source: str, exp: Experiment) -> None:
    if exp.repeats < 1:
        raise ExperimentError("%s: repeats: expected a positive integer" % source)
    if exp.temperature < 0:
        raise ExperimentError("%s: temperature: expected a number >= 0" % source)
    if exp.speculation is not None:
        from mdi.runconfig import ConfigError, parse_speculation
        try:
            parse_speculation(source + ": speculation", exp.speculation, paths=True)
        except ConfigError as e:
            raise ExperimentError(str(e))
    if exp.starter not in ("persistent", "process"):
        raise ExperimentError("%s: starter: expected 'persistent' or 'process', got %r" % (source, exp.starter))
    for key in ("run_timeout", "start_timeout"):
        if getattr(exp, key) <= 0:
            raise ExperimentError("%s: %s: expected a positive number of seconds" % (source, key))


def load_experiment(path: str) -> Experiment:
    return parse_experiment(read_yaml(path, ExperimentError, "experiment"), path)


# --------------------------------------------------------------------------- plan

@dataclass
class RingPlan:
    index: int  # unique over the whole sweep (ports and cgroup names derive from it)
    model: ModelEntry
    path: str
    n_nodes: int
    counts: List[int]  # auto: the balanced split, an estimate until mdi-start's planner picks
    kind: str  # balanced | explicit | auto
    samples: List[int]
    local_weights: bool = True
    weights: List[int] = field(default_factory=list)
    max_batch: List[Any] = field(default_factory=lambda: ["auto"])  # runs at every S with each of these
    # bytes of each node's weights for given layer counts (an auto ring's, once its planner chose)
    weigh: Optional[Callable[[List[int]], List[int]]] = field(default=None, repr=False, compare=False)
    weight_types: str = ""  # what the weights are stored as, per backend (model_setup.weight_types)
    # bytes of each node's GGUF tensors for given layer counts: a ggml node's weights (None: no GGUF)
    weigh_gguf: Optional[Callable[[List[int]], List[int]]] = field(default=None, repr=False, compare=False)

    def runs(self) -> List[Tuple[Any, int]]:
        """(max_batch, samples) of every run on this ring, in run order: samples ascending, and
        at each S every max_batch one after the other (so the runs compared run close in time)."""
        return [(b, s) for s in self.samples for b in self.max_batch]

    @property
    def label(self) -> str:
        return "auto" if self.kind == "auto" else partition_label(self.counts)

    def work(self, samples: int) -> int:
        """sample-tokens x weight kB: a proxy for a run's compute, for the progress estimate."""
        return samples * self.model.tokens * max(1, sum(self.weights) // 1000)


def all_splits(n_layer: int, n: int, step: int = 1) -> List[List[int]]:
    """Every split of n_layer layers over n nodes into positive multiples of `step`."""
    units = n_layer // step
    return [[(b - a) * step for a, b in zip((0,) + cuts, cuts + (units,))]
            for cuts in itertools.combinations(range(1, units), n - 1)]


def _check_all(entry: ModelEntry, where: str, n_layer: int, i: int) -> None:
    """`all` at partitions[i]: the step divides the layers and the rings stay countable."""
    step = entry.partition_step
    if n_layer % step:
        raise ExperimentError("%s.partition_step: %d does not divide the %d layers of %s"
                              % (where, step, n_layer, entry.name))
    units = n_layer // step
    for n in entry.nodes:
        if n > units:
            raise ExperimentError("%s.partitions[%d]: 'all' has no split of %s's %d layers over %d nodes in steps of "
                                  "%d (partition_step)" % (where, i, entry.name, n_layer, n, step))
    total = sum(math.comb(units - 1, n - 1) for n in set(entry.nodes))
    if total > MAX_ALL_RINGS:
        raise ExperimentError("%s.partitions[%d]: 'all' makes %d rings (%s's %d layers over %s nodes in steps of %d), "
                              "more than %d: raise partition_step" % (where, i, total, entry.name, n_layer,
                                                                       "/".join(map(str, sorted(set(entry.nodes)))),
                                                                       step, MAX_ALL_RINGS))


def plan_rings(entry: ModelEntry, where: str, n_layer: int) -> List[Tuple[int, List[int], str]]:
    """(nodes, layer counts, kind) for every ring of one model, in node-count order. An auto
    ring's counts are the balanced split: an estimate, mdi-start's planner picks its own."""
    seen: Set[Tuple[int, Union[str, Tuple[int, ...]]]]  # (nodes, "auto" or the layer counts)
    rings, seen = [], set()
    for i, p in enumerate(entry.partitions):
        if isinstance(p, list) and sum(p) != n_layer:
            raise ExperimentError("%s.partitions[%d]: %s sums to %d, but %s has %d layers"
                                  % (where, i, partition_label(p), sum(p), entry.name, n_layer))
        if isinstance(p, list) and len(p) not in entry.nodes:  # it would be left out without a word
            raise ExperimentError("%s.partitions[%d]: %s is for %d nodes, but nodes is %s"
                                  % (where, i, partition_label(p), len(p), entry.nodes))
        if p == "all":
            _check_all(entry, where, n_layer, i)
    for n in entry.nodes:
        if n > n_layer:
            raise ExperimentError("%s.nodes: %d nodes but %s has only %d layers" % (where, n, entry.name, n_layer))
        for p in entry.partitions:
            if p == "auto":
                if (n, "auto") not in seen:
                    seen.add((n, "auto"))
                    rings.append((n, balanced(n_layer, n), "auto"))
                continue
            even = balanced(n_layer, n)
            if p == "all":
                splits = all_splits(n_layer, n, entry.partition_step)
            else:
                splits = [even if p == "balanced" else list(p)]
            for counts in splits:
                if len(counts) != n or (n, tuple(counts)) in seen:
                    continue  # an explicit partition is for the node count of its length
                seen.add((n, tuple(counts)))
                # the balanced split that `all` makes is the balanced ring, whatever the order
                kind = "balanced" if p == "balanced" or (p == "all" and counts == even) else "explicit"
                rings.append((n, counts, kind))
    if not rings:
        raise ExperimentError("%s.partitions: no partition matches any of the node counts %s" % (where, entry.nodes))
    return rings
