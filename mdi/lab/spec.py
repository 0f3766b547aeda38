"""The experiment YAML (models, node counts, partitions, samples in flight, emulation) and
the rings it asks for; every error names the file and the key."""
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mdi.model.layout import DTYPE_NAMES, INT4_GROUPS, QUANT_KINDS, QUANT_MODES, balanced, partition_label
from mdi.model.qkernels import POLICY_NAMES
from mdi.ring.wire import CODECS
from mdi.runconfig import check_keys, read_yaml
from mdi.lab.emulation import EmulationSettings

from mdi.cli import EXIT_CONFIG, EXIT_RUN  # noqa: F401  (mdi-bench exits like mdi-start)


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
    partitions: List[Any] = field(default_factory=lambda: ["balanced"])
    dtype: str = "float32"
    weights: str = "local"  # local: workers read their layers from the model dir; push: over HTTP
    quant: str = "auto"  # the run's model.quant: none | auto (as stored) | int8 | int4
    quant_kernel: str = "exact"  # the run's runtime.quant_kernel: exact | fast | a kernel's name
    # The runs' runtime.max_batch, an axis like samples: 1 = every sample alone (unbatched),
    # k = at most k samples per forward, auto = samples in flight / nodes.
    max_batch: List[Any] = field(default_factory=lambda: ["auto"])
    prefill_chunk: Optional[int] = None  # the runs' runtime.prefill_chunk; None: mdi's default
    wire_codec: str = "raw"  # the runs' runtime.wire_codec (mdi.ring.wire.CODECS)


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


NUM = (int, float)
MODEL_KEYS = {"name": (str,), "path": (str,), "random": (dict,), "prompt": (str,), "tokens": (int,),
              "samples": (list,), "nodes": (list,), "partitions": (list,), "dtype": (str,), "weights": (str,),
              "quant": (str,), "quant_kernel": (str,), "max_batch": (list,), "prefill_chunk": (int,),
              "wire_codec": (str,)}
SHARED_KEYS = ("prompt", "tokens", "samples", "nodes", "partitions", "dtype", "weights", "quant", "quant_kernel",
               "max_batch", "prefill_chunk", "wire_codec")
TOP_KEYS = {"name": (str,), "description": (str,), "output": (str,), "models": (list,), "repeats": (int,),
            "temperature": NUM, "warmup": (bool,), "starter": (str,), "run_timeout": NUM,
            "start_timeout": NUM, "emulation": (dict,), "auth": (bool,)}
TOP_KEYS.update({k: MODEL_KEYS[k] for k in SHARED_KEYS})
EMULATION_KEYS = {"enabled": (bool, str), "cpu_quota": NUM, "cpu_period_us": (int,), "memory_limit_mb": (int,),
                  "bandwidth_mbit": NUM, "latency_ms": NUM}
RANDOM_KEYS = {"family": (str,), "n_layer": (int,), "n_embd": (int,), "n_head": (int,), "n_kv_head": (int,),
               "intermediate_size": (int,), "block_size": (int,), "seed": (int,), "std": NUM,
               "vocab_size": (int,), "quant": (str,), "group_size": (int,),
               # the family variants (mdi.model.config): Qwen2 q/k/v biases, Qwen3 q/k norms and
               # wide heads, Llama 3 RoPE scaling
               "qkv_bias": (bool,), "qk_norm": (bool,), "head_size": (int,), "rope_theta": NUM,
               "rope_scaling": (dict,), "tied_head": (bool,)}
def _fields(where: str, data: Any, allowed: Dict[str, Tuple[type, ...]], required: Sequence[str] = ()) -> Dict[str, Any]:
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


def _check_partitions(where: str, items: List[Any]) -> None:
    if not items:
        raise ExperimentError("%s: expected at least one partition" % where)
    for i, p in enumerate(items):
        if p == "balanced":
            continue
        if not isinstance(p, list) or not p or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                                                         for c in p):
            raise ExperimentError("%s[%d]: expected 'balanced' or a list of layer counts like [6, 12, 12], got %r"
                                  % (where, i, p))


def max_batches(items: Sequence[Any]) -> List[Any]:
    """The max_batch axis without repeats, in the order given."""
    out = []  # type: List[Any]
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
    quant = spec.get("quant")
    if quant is not None and quant not in QUANT_KINDS:
        raise ExperimentError("%s.quant: expected one of %s, got %r" % (where, ", ".join(QUANT_KINDS), quant))
    group = spec.get("group_size")
    if group is not None:
        if quant is None:
            raise ExperimentError("%s.group_size: needs quant int8 or int4" % where)
        if group < 2 or (quant == "int4" and group not in INT4_GROUPS):
            raise ExperimentError("%s.group_size: expected %s, got %d" % (
                where, "one of %s" % ", ".join(map(str, INT4_GROUPS)) if quant == "int4" else "at least 2", group))


def _check_common(where: str, e: ModelEntry) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", e.name):
        raise ExperimentError("%s.name: expected letters, digits, '-', '_' or '.', got %r" % (where, e.name))
    if e.tokens < 1:
        raise ExperimentError("%s.tokens: expected a positive integer" % where)
    if e.dtype not in DTYPE_NAMES:
        raise ExperimentError("%s.dtype: expected one of %s, got %r" % (where, ", ".join(DTYPE_NAMES), e.dtype))
    if e.weights not in ("local", "push"):
        raise ExperimentError("%s.weights: expected 'local' or 'push', got %r" % (where, e.weights))
    if e.quant not in QUANT_MODES:
        raise ExperimentError("%s.quant: expected one of %s, got %r" % (where, ", ".join(QUANT_MODES), e.quant))
    if e.quant_kernel not in POLICY_NAMES:
        raise ExperimentError("%s.quant_kernel: expected one of %s, got %r"
                              % (where, ", ".join(POLICY_NAMES), e.quant_kernel))
    if e.prefill_chunk is not None and e.prefill_chunk < 1:
        raise ExperimentError("%s.prefill_chunk: expected a positive integer (tokens per prefill pass), got %r"
                              % (where, e.prefill_chunk))
    if e.wire_codec not in CODECS:
        raise ExperimentError("%s.wire_codec: expected one of %s, got %r" % (where, ", ".join(CODECS), e.wire_codec))
    _check_max_batch(where + ".max_batch", e.max_batch)
    _check_samples(where + ".samples", e.samples)
    _check_nodes(where + ".nodes", e.nodes)
    _check_partitions(where + ".partitions", e.partitions)


def _parse_emulation(where: str, raw: Any) -> EmulationSettings:
    e = _fields(where, raw or {}, EMULATION_KEYS)
    enabled = e.pop("enabled", "auto")
    # YAML reads on/off/yes/no as booleans: accept both spellings.
    mode = {True: "on", False: "off"}.get(enabled, enabled) if isinstance(enabled, bool) else enabled
    if mode not in ("auto", "on", "off"):
        raise ExperimentError("%s.enabled: expected auto, on (true) or off (false), got %r" % (where, enabled))
    s = EmulationSettings(mode=mode, **e)
    if s.cpu_quota is not None and not 0.01 <= s.cpu_quota <= 64:
        raise ExperimentError("%s.cpu_quota: expected cores per node between 0.01 and 64, got %r" % (where, s.cpu_quota))
    if not 1000 <= s.cpu_period_us <= 1000000:
        raise ExperimentError("%s.cpu_period_us: expected 1000 to 1000000 microseconds" % where)
    if s.memory_limit_mb is not None and s.memory_limit_mb < 64:
        raise ExperimentError("%s.memory_limit_mb: expected at least 64 MB" % where)
    if s.bandwidth_mbit is not None and s.bandwidth_mbit <= 0:
        raise ExperimentError("%s.bandwidth_mbit: expected a positive number" % where)
    if s.latency_ms < 0 or s.latency_ms > 10000:
        raise ExperimentError("%s.latency_ms: expected 0 to 10000 ms" % where)
    return s


def parse_experiment(data: Any, source: str) -> Experiment:
    top = _fields(source, data if data is not None else {}, TOP_KEYS, required=("models",))
    defaults = {k: top[k] for k in SHARED_KEYS if k in top}
    template = ModelEntry("defaults", "-", **defaults)
    _check_common(source, template)  # top-level defaults are checked even if every model overrides them
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
                     description=top.get("description", ""), auth=top.get("auth", False))
    _check_top(source, exp)
    return exp


def _check_top(source: str, exp: Experiment) -> None:
    if exp.repeats < 1:
        raise ExperimentError("%s: repeats: expected a positive integer" % source)
    if exp.temperature < 0:
        raise ExperimentError("%s: temperature: expected a number >= 0" % source)
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
    counts: List[int]
    kind: str  # balanced | explicit
    samples: List[int]
    local_weights: bool = True
    weights: List[int] = field(default_factory=list)
    max_batch: List[Any] = field(default_factory=lambda: ["auto"])  # runs at every S with each of these

    def runs(self) -> List[Tuple[Any, int]]:
        """(max_batch, samples) of every run on this ring, in run order: samples ascending, and
        at each S every max_batch one after the other (so the runs compared run close in time)."""
        return [(b, s) for s in self.samples for b in self.max_batch]

    @property
    def label(self) -> str:
        return partition_label(self.counts)

    def work(self, samples: int) -> int:
        """sample-tokens x weight kB: a proxy for a run's compute, for the progress estimate."""
        return samples * self.model.tokens * max(1, sum(self.weights) // 1000)


def plan_rings(entry: ModelEntry, where: str, n_layer: int) -> List[Tuple[int, List[int], str]]:
    """(nodes, layer counts, kind) for every ring of one model, in node-count order."""
    rings, seen = [], set()
    for i, p in enumerate(entry.partitions):
        if p != "balanced" and sum(p) != n_layer:
            raise ExperimentError("%s.partitions[%d]: %s sums to %d, but %s has %d layers"
                                  % (where, i, partition_label(p), sum(p), entry.name, n_layer))
    for n in entry.nodes:
        if n > n_layer:
            raise ExperimentError("%s.nodes: %d nodes but %s has only %d layers" % (where, n, entry.name, n_layer))
        for p in entry.partitions:
            counts = balanced(n_layer, n) if p == "balanced" else list(p)
            if len(counts) != n or (n, tuple(counts)) in seen:
                continue  # an explicit partition is for the node count of its length
            seen.add((n, tuple(counts)))
            rings.append((n, counts, "balanced" if p == "balanced" else "explicit"))
    if not rings:
        raise ExperimentError("%s.partitions: no partition matches any of the node counts %s" % (where, entry.nodes))
    return rings
