"""mdi-bench: which partition of which model over how many boards gives what throughput and memory.

An experiment YAML lists models, node counts, partitions, samples in flight, tokens, dtype,
repeats and the board emulation (see configs/experiments/ and results/README.md). For every
combination mdi-bench starts the node processes itself, runs the starter, keeps each run's
metrics JSON, and writes one CSV row per run, a summary with the pipeline efficiency, a short
report, the machine and emulation record, and PNG plots, all in one output folder.

Run order: for each model, every ring (node count x partition) is started once and kept up;
then repeat by repeat, ring by ring, samples ascending. Interleaving the repeats across rings
spreads a noisy neighbour's load over every configuration instead of one.
"""
import argparse
import csv
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import queue
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from .config import read_yaml
from .emulation import Emulation, EmulationError, EmulationSettings, peak_rss_bytes, remove_leftovers, reset_peak_rss

EXIT_CONFIG = 2
EXIT_RUN = 1
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
BIN = os.path.dirname(os.path.abspath(sys.executable))

# One row per run. List-valued cells (one value per node, starter first) are joined with ";".
CSV_COLUMNS = [
    "model", "nodes", "partition", "samples", "tokens", "tokens_per_s", "ttft_s",
    "peak_memory_mb", "decode_bytes_per_hop", "repeat",
    "decode_tokens_per_s", "generated_tokens", "seconds", "ttft_max_s", "partition_kind", "dtype",
    "weights_mb", "cache_mb", "cgroup_memory_mb", "bytes_sent", "emulation", "starter_mode",
    "load_1min", "experiment", "status", "metrics_file",
]
SUMMARY_COLUMNS = [
    "model", "nodes", "partition", "samples", "tokens", "runs_ok",
    "decode_tokens_per_s_median", "decode_tokens_per_s_min", "decode_tokens_per_s_max",
    "tokens_per_s_median", "ttft_s_median", "efficiency_median", "efficiency_min", "efficiency_max",
    "speedup_vs_1_node", "peak_memory_mb_max",
]


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
              "samples": (list,), "nodes": (list,), "partitions": (list,), "dtype": (str,), "weights": (str,)}
SHARED_KEYS = ("prompt", "tokens", "samples", "nodes", "partitions", "dtype", "weights")
TOP_KEYS = {"name": (str,), "description": (str,), "output": (str,), "models": (list,), "repeats": (int,),
            "temperature": NUM, "warmup": (bool,), "starter": (str,), "run_timeout": NUM,
            "start_timeout": NUM, "emulation": (dict,), "auth": (bool,)}
TOP_KEYS.update({k: MODEL_KEYS[k] for k in SHARED_KEYS})
EMULATION_KEYS = {"enabled": (bool, str), "cpu_quota": NUM, "cpu_period_us": (int,), "memory_limit_mb": (int,),
                  "bandwidth_mbit": NUM, "latency_ms": NUM}
RANDOM_KEYS = {"family": (str,), "n_layer": (int,), "n_embd": (int,), "n_head": (int,), "n_kv_head": (int,),
               "intermediate_size": (int,), "block_size": (int,), "seed": (int,), "std": NUM}
KIND_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true/false",
              dict: "a mapping"}


def _fields(where: str, data: Any, allowed: Dict[str, Tuple[type, ...]], required: Sequence[str] = ()) -> Dict[str, Any]:
    """Check a mapping's keys and value types; every error names `where` and the key."""
    if not isinstance(data, dict):
        raise ExperimentError("%s: expected a mapping, got %s" % (where, type(data).__name__))
    for key in data:
        if key not in allowed:
            raise ExperimentError("%s: unknown key %r (expected one of: %s)" % (where, key, ", ".join(sorted(allowed))))
    for key in required:
        if data.get(key) is None:
            raise ExperimentError("%s.%s: required key is missing" % (where, key))
    out = {}
    for key, value in data.items():
        kinds = allowed[key]
        if value is None:
            continue
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ExperimentError("%s.%s: expected %s, got %r"
                                  % (where, key, " or ".join(KIND_NAMES[k] for k in kinds), value))
        out[key] = value
    return out


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


def _parse_model(where: str, raw: Any, defaults: Dict[str, Any]) -> ModelEntry:
    m = _fields(where, raw, MODEL_KEYS, required=("name", "path"))
    for key in SHARED_KEYS:
        if key not in m and key in defaults:
            m[key] = defaults[key]
    entry = ModelEntry(**m)
    _check_common(where, entry)
    if entry.random is not None:
        _fields(where + ".random", entry.random, RANDOM_KEYS, required=("family", "n_layer", "n_embd", "n_head"))
    return entry


def _check_common(where: str, e: ModelEntry) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", e.name):
        raise ExperimentError("%s.name: expected letters, digits, '-', '_' or '.', got %r" % (where, e.name))
    if e.tokens < 1:
        raise ExperimentError("%s.tokens: expected a positive integer" % where)
    if e.dtype not in DTYPE_BYTES:
        raise ExperimentError("%s.dtype: expected one of %s, got %r" % (where, ", ".join(DTYPE_BYTES), e.dtype))
    if e.weights not in ("local", "push"):
        raise ExperimentError("%s.weights: expected 'local' or 'push', got %r" % (where, e.weights))
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
    from .models.config import ModelConfig
    kw = {k: v for k, v in spec.items() if k not in ("seed", "std")}
    kw.setdefault("block_size", 256)
    if kw["family"] == "gpt2":
        kw.update(bias=True, tied_head=True, gelu_approximate="tanh")
    else:
        kw.setdefault("tied_head", False)
    return ModelConfig(name=name, vocab_size=len(CHARS), **kw)


def build_random_model(path: str, name: str, spec: Dict[str, Any], where: str) -> None:
    """A random-initialised model with a character tokenizer, saved as a prepared mdi dir."""
    import torch
    from .checkpoints import save_model_dir
    from .models.model import full_model
    from .tokenizers import char_tokenizer
    try:
        config = random_model_config(name, spec)
    except (TypeError, ValueError) as e:
        raise ExperimentError("%s.random: %s" % (where, e))
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


def _check_random_matches(path: str, entry: ModelEntry, where: str) -> None:
    from .checkpoints import read_mdi_config
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
    from .loading import ModelSource, is_mdi_dir
    return ModelSource(path).config, is_mdi_dir(path)


def weight_bytes(config, counts: List[int], dtype: str) -> List[int]:
    """Bytes of each node's weights (the starter holds the embedding, final norm and head)."""
    from .checkpoints import expected_shapes
    out, first = [], 0
    for k, c in enumerate(counts):
        shapes = expected_shapes(config, (first, first + c), k == 0, k == 0)
        n = 0
        for shape in shapes.values():
            size = 1
            for d in shape:
                size *= d
            n += size
        out.append(n * DTYPE_BYTES[dtype])
        first += c
    return out


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

    @property
    def label(self) -> str:
        return partition_label(self.counts)


def partition_label(counts: Sequence[int]) -> str:
    return "+".join(str(c) for c in counts)


def balanced(n_layer: int, n: int) -> List[int]:
    base, extra = divmod(n_layer, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


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


# --------------------------------------------------------------------------- processes

def free_ports(n: int) -> List[int]:
    """n TCP ports free on loopback right now (the OS picks them; bound together, so distinct)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class NodeProcess:
    """One node process this tool started; only its own PID is ever signalled."""

    def __init__(self, name: str, cmd: List[str], log_path: str, env: Dict[str, str], pipes: bool = False) -> None:
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "ab")
        extra = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE} if pipes else {"stdout": self.log}
        # A session of its own: Ctrl-C reaches only mdi-bench, which then stops the nodes in order.
        self.proc = subprocess.Popen(cmd, stderr=self.log, env=env, start_new_session=True, **extra)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """Wait `grace` s for it to exit, then SIGTERM, then SIGKILL (this PID only)."""
        for action, wait in ((None, grace), (self.proc.terminate, 5.0), (self.proc.kill, 5.0)):
            if self.proc.poll() is not None:
                break
            if action is not None:
                action()
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        self.log.close()

    def tail(self, n: int = 3) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])


class StarterService:
    """A warm starter: `python -m mdi.experiments --serve-starter` runs mdi-start's own main
    once per request, so torch's import and process start are paid once per ring."""

    def __init__(self, proc: NodeProcess) -> None:
        self.proc = proc
        self.replies = queue.Queue()  # type: queue.Queue
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.proc.stdout:
            try:
                self.replies.put(json.loads(line.decode()))
            except ValueError:
                continue
        self.replies.put(None)  # the process ended

    def _reply(self, timeout: float) -> Dict[str, Any]:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("starter did not answer within %.0f s" % timeout)
        if reply is None:
            raise RuntimeError("starter process exited (%s)" % self.proc.tail())
        return reply

    def wait_ready(self, timeout: float) -> None:
        if not self._reply(timeout).get("ready"):
            raise RuntimeError("starter did not report ready")

    def run(self, argv: List[str], timeout: float) -> Dict[str, Any]:
        try:
            self.proc.proc.stdin.write((json.dumps({"argv": argv}) + "\n").encode())
            self.proc.proc.stdin.flush()
        except OSError:
            raise RuntimeError("starter process is gone (%s)" % self.proc.tail())
        return self._reply(timeout)

    def stop(self) -> None:
        try:
            self.proc.proc.stdin.close()  # the service ends when its input ends
        except OSError:
            pass
        self.proc.stop(grace=5.0)


def _auth(token: Optional[str]) -> Dict[str, str]:
    return {"Authorization": "Bearer " + token} if token else {}


def wait_healthy(url: str, token: Optional[str], proc: NodeProcess, timeout: float) -> None:
    import requests
    session = requests.Session()
    session.trust_env = False  # never through an HTTP proxy from the environment
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError("%s exited with code %s: %s" % (proc.name, proc.proc.returncode, proc.tail()))
        try:
            if session.get(url + "/health", headers=_auth(token), timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError("%s did not answer %s/health within %.0f s" % (proc.name, url, timeout))


def post_shutdown(url: str, token: Optional[str]) -> None:
    import requests
    try:
        requests.post(url + "/shutdown", headers=_auth(token), timeout=3,
                      proxies={"http": None, "https": None})
    except requests.RequestException:
        pass


@dataclass
class RunOutcome:
    code: int
    error: Optional[str]
    metrics: Optional[Dict[str, Any]]
    peak_rss: List[Optional[int]]  # per node, measured by mdi-bench (None: use the metrics' value)
    cgroup_peak: List[Optional[int]]
    load_1min: float
    wall_s: float


class Ring:
    """The processes of one ring: a starter (persistent or per run) and its workers."""

    def __init__(self, plan: RingPlan, exp: Experiment, emu: Emulation, token: Optional[str], work: str,
                 log: Callable[[str], None]) -> None:
        self.plan, self.exp, self.emu, self.token, self.work, self.log = plan, exp, emu, token, work, log
        self.keys = ["g%dk%d" % (plan.index, k) for k in range(plan.n_nodes)]
        self.workers = []  # type: List[NodeProcess]
        self.service = None  # type: Optional[StarterService]
        self.config_path = os.path.join(work, "ring%d.yaml" % plan.index)
        self.hosts, self.ports, self.data_ports = self._addresses()
        self.env = dict(os.environ)
        for key in ("MDI_TOKEN", "MDI_TOKEN_FILE"):
            self.env.pop(key, None)
        if token:
            self.env["MDI_TOKEN"] = token

    def _addresses(self) -> Tuple[List[str], List[int], List[int]]:
        n = self.plan.n_nodes
        hosts = [self.emu.host(k) for k in range(n)]
        if self.emu.net is not None:
            # One namespace per node index: the ring's index keeps its ports apart from other rings'.
            port = 8100 + self.plan.index
            return hosts, [port] * n, [port + 1000] * n
        ports = free_ports(2 * n)
        return hosts, ports[:n], ports[n:]

    def url(self, k: int) -> str:
        return "http://%s:%d" % (self.hosts[k], self.ports[k])

    def run_config(self) -> Dict[str, Any]:
        p = self.plan
        nodes = []
        for k in range(p.n_nodes):
            node = {"name": "starter" if k == 0 else "node%d" % k, "host": self.hosts[k],
                    "port": self.ports[k], "data_port": self.data_ports[k]}
            if p.kind == "explicit":
                node["layers"] = p.counts[k]
            if k > 0 and p.local_weights and p.model.weights == "local":
                node["weights"] = p.path  # as a board with the model on its own disk
            nodes.append(node)
        return {"model": {"path": p.path, "dtype": p.model.dtype, "device": "cpu"}, "nodes": nodes,
                "generation": {"n_tokens": p.model.tokens, "temperature": self.exp.temperature, "seed": 1,
                               "prompts": [p.model.prompt]},
                # heartbeat_timeout: a throttled, shared machine must not end runs by mistake
                "runtime": {"threads": 1, "connect_timeout": 10, "init_timeout": self.exp.start_timeout,
                            "ring_timeout": 120, "heartbeat_timeout": 60}}

    # --- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        with open(self.config_path, "w") as f:
            yaml.safe_dump(self.run_config(), f, sort_keys=False)
        for k, key in enumerate(self.keys):
            self.emu.prepare_process(key)
        for k in range(1, self.plan.n_nodes):
            cmd = [_tool("mdi-worker"), "--port", str(self.ports[k]), "--host", self.hosts[k], "--threads", "1"]
            if not self.token and self.hosts[k] != "127.0.0.1":
                cmd.append("--insecure")  # a private namespace network that this tool made
            self.workers.append(self._spawn("node%d" % k, cmd, k))
        if self.exp.starter == "persistent":
            cmd = [sys.executable, "-m", "mdi.experiments", "--serve-starter"]
            self.service = StarterService(self._spawn("starter", cmd, 0, pipes=True))
        self._add_delays()

    def _spawn(self, name: str, cmd: List[str], k: int, pipes: bool = False) -> NodeProcess:
        log_path = os.path.join(self.work, "ring%d-%s.log" % (self.plan.index, name))
        return NodeProcess("ring %d %s" % (self.plan.index, name), self.emu.command(cmd, self.keys[k], k),
                           log_path, self.env, pipes)

    def _add_delays(self) -> None:
        """Delay proxies for every connection a node opens: starter -> each worker's control
        port, and each node -> the next node's data port."""
        n = self.plan.n_nodes
        for k in range(1, n):
            self.emu.add_delay(0, k, self.ports[k])
        for k in range(n):
            if n > 1:
                nxt = (k + 1) % n
                self.emu.add_delay(k, nxt, self.data_ports[nxt])

    def wait_ready(self, timeout: float) -> None:
        for k, w in enumerate(self.workers, start=1):
            wait_healthy(self.url(k), self.token, w, timeout)
        if self.service is not None:
            self.service.wait_ready(timeout)

    def limit(self) -> None:
        for key in self.keys:
            self.emu.limit_cpu(key, True)

    def processes(self) -> List[Optional[NodeProcess]]:
        """Per node index; the starter is None when it is a fresh mdi-start per run."""
        return [self.service.proc if self.service else None] + self.workers

    def stop(self) -> None:
        for k, w in enumerate(self.workers, start=1):
            if w.alive():
                post_shutdown(self.url(k), self.token)
        if self.service is not None:
            self.service.stop()
        for w in self.workers:
            w.stop()
        for key in self.keys:
            self.emu.release_process(key)

    # --- one run ---------------------------------------------------------------------
    def starter_argv(self, samples: int, tokens: int, metrics_path: str) -> List[str]:
        return ["--config", self.config_path, "--prompt", self.plan.model.prompt, "--n-samples", str(samples),
                "--n-tokens", str(tokens), "--temperature", repr(self.exp.temperature), "--seed", "1",
                "--metrics-out", metrics_path, "--quiet"]

    def run(self, samples: int, tokens: int, metrics_path: str) -> RunOutcome:
        try:
            self._restart_starter()
        except RuntimeError as e:
            return RunOutcome(EXIT_RUN, str(e), None, [], [], os.getloadavg()[0], 0.0)
        procs = self.processes()
        for k, p in enumerate(procs):
            if p is not None:
                reset_peak_rss(p.pid)
            self.emu.reset_memory_peak(self.keys[k])
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        code, error = self._start_run(self.starter_argv(samples, tokens, metrics_path))
        wall = time.monotonic() - t0
        peaks = [peak_rss_bytes(p.pid) if p is not None else None for p in procs]
        cg = [self.emu.memory_peak(key) for key in self.keys]
        metrics = _read_json(metrics_path) if code == 0 else None
        return RunOutcome(code, error, metrics, peaks, cg, load, wall)

    def _restart_starter(self) -> None:
        """A starter that died (killed at its memory limit, say) fails its run; the next run
        gets a new one."""
        if self.service is None or self.service.proc.alive():
            return
        self.log("mdi-bench: ring %d: starter exited (%s); starting a new one"
                 % (self.plan.index, self.service.proc.tail(1)))
        self.service.stop()
        cmd = [sys.executable, "-m", "mdi.experiments", "--serve-starter"]
        self.service = StarterService(self._spawn("starter", cmd, 0, pipes=True))
        self.service.wait_ready(self.exp.start_timeout)

    def _start_run(self, argv: List[str]) -> Tuple[int, Optional[str]]:
        timeout = self.exp.run_timeout
        if self.service is not None:
            try:
                reply = self.service.run(argv, timeout)
            except RuntimeError as e:
                return EXIT_RUN, str(e)
            return int(reply.get("code", EXIT_RUN)), reply.get("error")
        cmd = self.emu.command([_tool("mdi-start")] + argv, self.keys[0], 0)
        try:
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return EXIT_RUN, "mdi-start did not finish within %.0f s" % timeout
        return r.returncode, _error_line(r.stderr.decode(errors="replace")) if r.returncode else None


def _tool(name: str) -> str:
    here = os.path.join(BIN, name)
    return here if os.path.exists(here) else (shutil.which(name) or name)


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _error_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("mdi: error:")]
    return (errors or lines or ["no message"])[-1]


# --------------------------------------------------------------------------- the warm starter

def serve_starter() -> int:
    """Answer JSON lines {"argv": [...]} on stdin by running mdi-start's main with those
    arguments; reply {"code", "error"} on stdout. Everything else goes to stderr (the log)."""
    import contextlib
    import io
    from . import cli
    import torch  # noqa: F401  (the import is the slow part; do it before saying ready)
    replies = sys.stdout
    sys.stdout = sys.stderr

    def reply(obj: Dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        try:
            argv = json.loads(line)["argv"]
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a list of strings")
        except (ValueError, KeyError, TypeError) as e:
            reply({"code": EXIT_CONFIG, "error": "bad request: %s" % e})
            continue
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            code = cli.start_main(argv)
        sys.stderr.write(captured.getvalue())
        sys.stderr.flush()
        _release_memory()  # so the next run starts from what a fresh mdi-start would hold
        reply({"code": code, "error": _error_line(captured.getvalue()) if code else None})
    return 0


def _release_memory() -> None:
    """Free the finished run's tensors and hand the freed heap back to the OS (glibc)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------------- rows

def steady_rate(token_times: Sequence[Sequence[float]]) -> Optional[float]:
    """Aggregate decode tokens/s while every sample is decoding: from the last sample's first
    token to the first sample's last token (prefill excluded)."""
    lists = [list(t) for t in token_times if len(t) >= 2]
    if not lists:
        return None
    start, end = max(t[0] for t in lists), min(t[-1] for t in lists)
    n = sum(1 for t in lists for x in t if start < x <= end)
    return n / (end - start) if end > start and n else None


def _mb(n: Optional[float]) -> str:
    return "" if n is None else "%.1f" % (n / 1e6)


def _num(x: Optional[float], fmt: str = "%.3f") -> str:
    return "" if x is None else fmt % x


def _joined(values: Sequence[Any]) -> str:
    return ";".join(str(v) for v in values)


def decode_bytes_per_hop(nodes: List[Dict[str, Any]]) -> Optional[float]:
    sent = sum((n.get("bytes_sent_by_kind") or {}).get("decode", 0) for n in nodes)
    msgs = sum((n.get("messages_sent_by_kind") or {}).get("decode", 0) for n in nodes)
    return sent / msgs if msgs else None


def make_row(exp: Experiment, plan: RingPlan, samples: int, repeat: int, outcome: RunOutcome, emu_tag: str,
             metrics_file: str) -> Dict[str, str]:
    row = {c: "" for c in CSV_COLUMNS}
    row.update(model=plan.model.name, nodes=str(plan.n_nodes), partition=plan.label, samples=str(samples),
               tokens=str(plan.model.tokens), repeat=str(repeat), partition_kind=plan.kind, dtype=plan.model.dtype,
               weights_mb=_joined(_mb(b) for b in plan.weights), emulation=emu_tag, starter_mode=exp.starter,
               load_1min="%.2f" % outcome.load_1min, experiment=exp.name)
    m = outcome.metrics
    if outcome.code != 0 or m is None:
        row["status"] = "failed: %s" % (outcome.error or "exit code %d" % outcome.code)
        return row
    times = [s.get("token_times") or [] for s in m["samples"]]
    firsts = [t[0] for t in times if t]
    nodes = m.get("nodes") or []
    peaks = [p if p is not None else n.get("peak_memory_bytes") for p, n in zip(outcome.peak_rss, nodes)]
    row.update(tokens_per_s=_num(m.get("tokens_per_s")), decode_tokens_per_s=_num(steady_rate(times)),
               generated_tokens=str(m.get("n_tokens", "")), seconds=_num(m.get("seconds")),
               ttft_s=_num(statistics.median(firsts) if firsts else None, "%.4f"),
               ttft_max_s=_num(max(firsts) if firsts else None, "%.4f"),
               peak_memory_mb=_joined(_mb(p) for p in peaks),
               cache_mb=_joined(_mb(n.get("cache_bytes")) for n in nodes),
               cgroup_memory_mb=_joined(_mb(c) for c in outcome.cgroup_peak) if any(outcome.cgroup_peak) else "",
               decode_bytes_per_hop=_num(decode_bytes_per_hop(nodes), "%.1f"),
               bytes_sent=_joined(n.get("bytes_sent", "") for n in nodes),
               status="ok", metrics_file=metrics_file)
    short = [s for s in m["samples"] if len(s.get("token_ids") or []) < plan.model.tokens]
    if short:
        row["status"] = "ok (%d samples stopped early: %s)" % (len(short), short[0].get("finish_reason"))
    return row


# --------------------------------------------------------------------------- progress

class Progress:
    """Which run, how many left, and an estimate from the seconds per sample-token measured
    so far on the same model (plus what is left of the rings' start-ups)."""

    def __init__(self, plan: List[Tuple[str, int]], log: Callable[[str], None]) -> None:
        self.plan = plan  # (model, samples x tokens) per run, in order
        self.log = log
        self.done = 0
        self.t0 = time.monotonic()
        self.spent = {}  # type: Dict[str, List[float]]  # model -> [seconds, work]

    def begin(self, text: str) -> None:
        left = len(self.plan) - self.done
        self.log("mdi-bench: [%d/%d] %s  (%s elapsed, %d runs left%s)"
                 % (self.done + 1, len(self.plan), text, _duration(time.monotonic() - self.t0), left,
                    self._eta()))

    def end(self, model: str, work: int, seconds: float) -> None:
        s = self.spent.setdefault(model, [0.0, 0.0])
        s[0] += seconds
        s[1] += work
        self.done += 1

    def _eta(self) -> str:
        total = [sum(v[0] for v in self.spent.values()), sum(v[1] for v in self.spent.values())]
        if not total[1]:
            return ""
        eta = 0.0
        for model, work in self.plan[self.done:]:
            seconds, done_work = self.spent.get(model) or total
            eta += work * seconds / done_work if done_work else 0.0
        return ", ~%s to go" % _duration(eta)


def _duration(s: float) -> str:
    s = int(round(s))
    return "%dm%02ds" % (s // 60, s % 60) if s >= 60 else "%ds" % s


# --------------------------------------------------------------------------- summary

def _float(x: str) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def read_rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def ok_rows(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    return [r for r in rows if r.get("status", "").startswith("ok") and _float(r.get("decode_tokens_per_s")) is not None]


def summarize(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """Median and spread per (model, nodes, partition, samples), with the pipeline efficiency
    (S-sample tokens/s / (N x 1-sample tokens/s) on the same ring, paired by repeat)."""
    good = ok_rows(rows)
    groups = {}  # type: Dict[Tuple[str, int, str, int], List[Dict[str, str]]]
    for r in good:
        groups.setdefault((r["model"], int(r["nodes"]), r["partition"], int(r["samples"])), []).append(r)
    out = []
    for (model, n, part, s), rs in sorted(groups.items()):
        dec = [float(r["decode_tokens_per_s"]) for r in rs]
        base = {r["repeat"]: float(r["decode_tokens_per_s"]) for r in groups.get((model, n, part, 1), [])}
        eff = [float(r["decode_tokens_per_s"]) / (n * base[r["repeat"]]) for r in rs if r["repeat"] in base]
        one = [float(r["decode_tokens_per_s"]) for (m2, n2, _, s2), g in groups.items()
               if m2 == model and n2 == 1 and s2 == 1 for r in g]
        peaks = _max_per_node([r["peak_memory_mb"] for r in rs])
        out.append({
            "model": model, "nodes": str(n), "partition": part, "samples": str(s), "tokens": rs[0]["tokens"],
            "runs_ok": str(len(rs)), "decode_tokens_per_s_median": "%.3f" % statistics.median(dec),
            "decode_tokens_per_s_min": "%.3f" % min(dec), "decode_tokens_per_s_max": "%.3f" % max(dec),
            "tokens_per_s_median": _num(_median([_float(r["tokens_per_s"]) for r in rs])),
            "ttft_s_median": _num(_median([_float(r["ttft_s"]) for r in rs]), "%.4f"),
            "efficiency_median": _num(statistics.median(eff) if eff else None),
            "efficiency_min": _num(min(eff) if eff else None), "efficiency_max": _num(max(eff) if eff else None),
            "speedup_vs_1_node": _num(statistics.median(dec) / statistics.median(one) if one else None),
            "peak_memory_mb_max": _joined("%.1f" % p for p in peaks),
        })
    return out


def _median(xs: List[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _max_per_node(cells: List[str]) -> List[float]:
    lists = [[float(x) for x in c.split(";") if x] for c in cells if c]
    return [max(col) for col in zip(*lists)] if lists else []


def write_csv(path: str, columns: List[str], rows: List[Dict[str, str]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def scaling_lines(summary: List[Dict[str, str]]) -> List[str]:
    """Per model: the best S >= N throughput for each node count, and whether it rises with N."""
    lines = []
    for model in sorted({r["model"] for r in summary}):
        best = {}  # type: Dict[int, Tuple[float, Dict[str, str]]]
        for r in summary:
            n, s = int(r["nodes"]), int(r["samples"])
            if r["model"] == model and s >= n:
                v = float(r["decode_tokens_per_s_median"])
                if n not in best or v > best[n][0]:
                    best[n] = (v, r)
        ns = sorted(best)
        parts = ["%d node%s %.2f tok/s (S=%s, %s)" % (n, "s" if n > 1 else "", best[n][0], best[n][1]["samples"],
                                                       best[n][1]["partition"]) for n in ns]
        if len(ns) < 2:
            verdict = "one node count only"
        elif all(best[a][0] < best[b][0] for a, b in zip(ns, ns[1:])):
            verdict = "rises with N"
        else:
            verdict = "does NOT rise with N"
        lines.append("- %s: %s: %s" % (model, "; ".join(parts), verdict))
    return lines


def write_report(path: str, summary: List[Dict[str, str]], machine: Dict[str, Any]) -> None:
    """A Markdown digest of summary.csv: scaling check and one table per model."""
    lines = ["# %s" % machine.get("experiment", {}).get("name", "experiment"), ""]
    emu = machine.get("emulation", {}).get("summary")
    if emu:
        lines += [emu, ""]
    load = machine.get("loadavg_start"), machine.get("loadavg_end")
    if all(load):
        lines += ["Load average (1/5/15 min) at start %s, at end %s; %s CPUs." % (
            "/".join("%.2f" % x for x in load[0]), "/".join("%.2f" % x for x in load[1]), machine.get("cpu_count")), ""]
    lines += ["Best decode throughput with S >= N samples in flight (median of repeats):", ""]
    lines += scaling_lines(summary) + [""]
    for model in sorted({r["model"] for r in summary}):
        lines += _model_table(model, [r for r in summary if r["model"] == model])
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _model_table(model: str, rows: List[Dict[str, str]]) -> List[str]:
    samples = sorted({int(r["samples"]) for r in rows})
    rings = sorted({(int(r["nodes"]), r["partition"]) for r in rows})
    out = ["## %s" % model, "",
           "Decode tokens/s, median [min-max] of repeats, and pipeline efficiency "
           "(S-sample rate / (N x 1-sample rate), same ring, paired by repeat).", "",
           "| nodes | partition | " + " | ".join("S=%d" % s for s in samples) + " |",
           "|---|---|" + "---|" * len(samples)]
    for n, part in rings:
        cells = []
        for s in samples:
            r = next((r for r in rows if int(r["nodes"]) == n and r["partition"] == part and int(r["samples"]) == s), None)
            if r is None:
                cells.append("")
                continue
            cell = "%s [%s-%s]" % (r["decode_tokens_per_s_median"][:-1], r["decode_tokens_per_s_min"][:-1],
                                   r["decode_tokens_per_s_max"][:-1])
            if r["efficiency_median"] and n > 1:
                cell += " eff %.2f" % float(r["efficiency_median"])
            cells.append(cell)
        out.append("| %d | %s | %s |" % (n, part, " | ".join(cells)))
    return out + [""]


# --------------------------------------------------------------------------- machine record

def _cmd_text(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10).stdout.decode().strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_record(source: str) -> Dict[str, Any]:
    import platform
    import mdi
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rec = {"time_start": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv),
           "python": platform.python_version(), "mdi": mdi.__version__, "platform": platform.platform(),
           "machine": platform.machine(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
           "memory_total_mb": _meminfo_mb(), "loadavg_start": list(os.getloadavg()),
           "uptime_start": _cmd_text(["uptime"]), "threads_per_node": 1, "experiment_file": source,
           "git_commit": _cmd_text(["git", "-C", repo, "rev-parse", "HEAD"]),
           "git_dirty": bool(_cmd_text(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"]))}
    try:
        import torch
        rec["torch"] = torch.__version__
    except ImportError:
        pass
    return rec


def _meminfo_mb() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- the sweep

class Sweep:
    def __init__(self, exp: Experiment, out: str, log: Callable[[str], None]) -> None:
        self.exp, self.out, self.log = exp, out, log
        self.runs_dir = os.path.join(out, "runs")
        self.csv_path = os.path.join(out, "results.csv")
        self.rows = []  # type: List[Dict[str, str]]
        self.rings = []  # type: List[Ring]
        # No shared secret by default: nodes listen on loopback or on the private namespace
        # network made here, and the ring's per-run PLAIN handshake can race the worker's
        # re-keying under a CPU quota (measured: ~1 run in 10 stalled). auth: true turns it on.
        self.token = secrets.token_hex(16) if exp.auth else None
        self.work = tempfile.mkdtemp(prefix="mdi-bench-")
        self.emu = Emulation(exp.emulation, max(max(m.nodes) for m in exp.models), log)
        self.state_path = os.path.join(tempfile.gettempdir(), "mdi-bench-state-%d.json" % os.getpid())
        self.failed = 0
        self.ring_index = 0

    # --- planning --------------------------------------------------------------------
    def prepare(self) -> List[List[RingPlan]]:
        """Models built or found, rings planned; every error names the key before anything runs."""
        plans = []
        for i, entry in enumerate(self.exp.models):
            where = "%s: models[%d]" % (self.exp.source, i)
            path = ensure_model(entry, where, self.exp.source, self.log)
            try:
                config, local = model_layout(path)
            except (ValueError, OSError) as e:  # CheckpointError, TokenizerError: the model cannot be read
                raise ExperimentError("%s.path: %s" % (where, e))
            rings = []
            for n, counts, kind in plan_rings(entry, where, config.n_layer):
                rings.append(RingPlan(self.ring_index, entry, path, n, counts, kind, samples_for(entry.samples, n),
                                      local, weight_bytes(config, counts, entry.dtype)))
                self.ring_index += 1
            plans.append(rings)
        return plans

    def run_list(self, plans: List[List[RingPlan]]) -> List[Tuple[str, int]]:
        """(model, work) per run; work = sample-tokens x weight bytes, a proxy for its compute
        that lets the estimate carry over from one model to the next."""
        return [(p.model.name, s * p.model.tokens * max(1, sum(p.weights) // 1000))
                for rings in plans for _ in range(self.exp.repeats) for p in rings for s in p.samples]

    # --- running ---------------------------------------------------------------------
    def run(self, plans: List[List[RingPlan]]) -> None:
        os.makedirs(self.runs_dir, exist_ok=True)
        self.emu.start()
        self._save_state()
        self.log("mdi-bench: " + self.emu.describe())
        quota = self.exp.emulation.cpu_quota
        if self.emu.active("cpu") and quota * self.emu.max_nodes > (os.cpu_count() or 1):
            self.log("mdi-bench: warning: %d nodes x %.2f core > %d CPUs: nodes will compete for CPUs"
                     % (self.emu.max_nodes, quota, os.cpu_count() or 1))
        progress = Progress(self.run_list(plans), self.log)
        write_csv(self.csv_path, CSV_COLUMNS, [])
        for rings in plans:
            self._run_model(rings, progress)

    def _run_model(self, plans: List[RingPlan], progress: Progress) -> None:
        self.log("mdi-bench: starting %d ring(s) for %s" % (len(plans), plans[0].model.name))
        self.rings = [Ring(p, self.exp, self.emu, self.token, self.work, self.log) for p in plans]
        try:
            for ring in self.rings:
                ring.start()
                self._save_state()
            for ring in self.rings:
                ring.wait_ready(self.exp.start_timeout)
                ring.limit()  # from here on every node runs under its quota
                if self.exp.warmup:
                    ring.run(1, min(4, ring.plan.model.tokens), os.path.join(self.work, "warmup.json"))
            for repeat in range(1, self.exp.repeats + 1):
                for ring in self.rings:
                    for s in ring.plan.samples:
                        self._one_run(ring, s, repeat, progress)
        finally:
            self._stop_rings()

    def _one_run(self, ring: Ring, samples: int, repeat: int, progress: Progress) -> None:
        p = ring.plan
        progress.begin("%s N=%d %s S=%d repeat %d/%d" % (p.model.name, p.n_nodes, p.label, samples, repeat,
                                                        self.exp.repeats))
        name = "%s_n%d_%s_s%d_r%d.json" % (p.model.name, p.n_nodes, p.label.replace("+", "-"), samples, repeat)
        outcome = ring.run(samples, p.model.tokens, os.path.join(self.runs_dir, name))
        row = make_row(self.exp, p, samples, repeat, outcome, self.emu.tag_for_csv(), os.path.join("runs", name))
        self.rows.append(row)
        write_csv(self.csv_path, CSV_COLUMNS, self.rows)  # rewritten each run: an interrupted sweep keeps its rows
        progress.end(p.model.name, samples * p.model.tokens * max(1, sum(p.weights) // 1000), outcome.wall_s)
        if row["status"].startswith("ok"):
            self.log("mdi-bench:     %s tok/s decode, %s tok/s overall, ttft %s s, %.1f s wall"
                     % (row["decode_tokens_per_s"], row["tokens_per_s"], row["ttft_s"], outcome.wall_s))
        else:
            self.failed += 1
            self.log("mdi-bench:     %s" % row["status"])

    def _stop_rings(self) -> None:
        for ring in self.rings:
            try:
                ring.stop()
            except Exception as e:  # keep stopping the others; report what went wrong
                self.log("mdi-bench: warning: stopping ring %d: %s" % (ring.plan.index, e))
        self.rings = []
        self.emu.clear_delays()
        self._save_state()

    # --- state file and teardown -----------------------------------------------------
    def _save_state(self) -> None:
        """What exists, so `mdi-bench --cleanup` can remove it if this process is killed."""
        pids = [p.pid for r in self.rings for p in r.processes() if p is not None]
        state = {"pid": os.getpid(), "children": pids, "work": self.work}
        state.update(self.emu.resources())
        with open(self.state_path, "w") as f:
            json.dump(state, f)

    def close(self, keep_work: bool) -> None:
        self._stop_rings()
        for problem in self.emu.close():
            self.log("mdi-bench: warning: teardown: %s" % problem)
        if os.path.exists(self.state_path):
            os.remove(self.state_path)
        if keep_work:
            self.log("mdi-bench: node logs kept in %s" % self.work)
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def finish_outputs(out: str, machine: Dict[str, Any], log: Callable[[str], None]) -> None:
    """summary.csv, report.md and the PNGs from results.csv (also what --plot-only does)."""
    rows = read_rows(os.path.join(out, "results.csv"))
    summary = summarize(rows)
    write_csv(os.path.join(out, "summary.csv"), SUMMARY_COLUMNS, summary)
    write_report(os.path.join(out, "report.md"), summary, machine)
    from . import plots
    for path in plots.plot_all(out, rows, summary):
        log("mdi-bench: wrote %s" % path)
    for line in scaling_lines(summary):
        log("mdi-bench: " + line[2:])


def run_experiment(exp: Experiment, out: str, log: Callable[[str], None]) -> int:
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(exp.source, os.path.join(out, "experiment.yaml"))
    machine = machine_record(exp.source)
    machine["experiment"] = {"name": exp.name, "description": exp.description, "repeats": exp.repeats,
                             "starter": exp.starter, "temperature": exp.temperature}
    sweep = Sweep(exp, out, log)
    interrupted = False
    try:
        plans = sweep.prepare()
        sweep.run(plans)
    except KeyboardInterrupt:
        interrupted = True
        log("mdi-bench: interrupted; stopping the nodes and removing the emulation")
    finally:
        machine["emulation"] = sweep.emu.record()
        sweep.close(keep_work=interrupted or sweep.failed > 0)
    machine.update(time_end=time.strftime("%Y-%m-%d %H:%M:%S %z"), loadavg_end=list(os.getloadavg()),
                   uptime_end=_cmd_text(["uptime"]), runs=len(sweep.rows), runs_failed=sweep.failed,
                   interrupted=interrupted)
    from .cli import write_json
    write_json(os.path.join(out, "machine.json"), machine)
    if sweep.rows:
        finish_outputs(out, machine, log)
    if interrupted:
        return 130
    return EXIT_RUN if sweep.failed else 0


def dry_run(exp: Experiment, log: Callable[[str], None]) -> int:
    sweep = Sweep(exp, exp.output, log)
    try:
        plans = sweep.prepare()
    finally:
        shutil.rmtree(sweep.work, ignore_errors=True)
    for rings in plans:
        for p in rings:
            log("%s: %d node(s), partition %s (%s), samples %s, %d tokens, %d repeats"
                % (p.model.name, p.n_nodes, p.label, p.kind, p.samples, p.model.tokens, exp.repeats))
    log("%d runs in all" % len(sweep.run_list(plans)))
    return 0


def cleanup_stale(log: Callable[[str], None]) -> int:
    """Remove what killed mdi-bench processes left: their node processes (by the PIDs they
    recorded, and only if still an mdi process), namespaces, bridge and cgroups."""
    base = tempfile.gettempdir()
    found = 0
    for name in sorted(os.listdir(base)):
        m = re.fullmatch(r"mdi-bench-state-(\d+)\.json", name)
        if not m or os.path.exists("/proc/%s" % m.group(1)):
            continue
        found += 1
        state = _read_json(os.path.join(base, name)) or {}
        for pid in state.get("children") or []:
            if _is_mdi_process(pid):
                os.kill(pid, signal.SIGKILL)
                log("mdi-bench: killed leftover node process %d" % pid)
        time.sleep(0.5)
        for problem in remove_leftovers(state):
            log("mdi-bench: warning: %s" % problem)
        if state.get("work"):
            shutil.rmtree(state["work"], ignore_errors=True)
        os.remove(os.path.join(base, name))
    log("mdi-bench: cleaned up after %d stale run(s)" % found)
    return 0


def _is_mdi_process(pid: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"mdi-worker" in cmd or b"mdi.experiments" in cmd or b"mdi-start" in cmd


# --------------------------------------------------------------------------- CLI

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mdi-bench",
        description="Run an experiment sweep (models x node counts x partitions x samples in flight x repeats): "
                    "start the node processes, run the starter, and write results.csv (one row per run), "
                    "summary.csv, report.md, machine.json and PNG plots into the output folder. Board "
                    "emulation (CPU quota, memory limit, network namespaces with shaping and delay) is used "
                    "when available (root) and reported; otherwise plain loopback, and it says so.",
        epilog="Example: mdi-bench --experiment configs/experiments/boards.yaml   (see results/README.md)")
    p.add_argument("--experiment", metavar="FILE.yaml", action="append", default=[],
                   help="the experiment to run (see configs/experiments/); give several to run them in turn")
    p.add_argument("--out", metavar="DIR", help="output folder (default: the file's 'output', else results/NAME); "
                                                "only with a single --experiment")
    p.add_argument("--emulation", choices=["auto", "on", "off"],
                   help="override emulation.enabled: auto uses what works, on fails if a part cannot be set up, "
                        "off runs plain loopback")
    p.add_argument("--repeats", type=int, help="override the number of repeats")
    p.add_argument("--dry-run", action="store_true", help="check the file, build missing random models, list the runs")
    p.add_argument("--plot-only", action="store_true",
                   help="no runs: rebuild summary.csv, report.md and the PNGs from DIR/results.csv")
    p.add_argument("--cleanup", action="store_true",
                   help="remove processes, namespaces and cgroups left by a killed mdi-bench, then exit")
    p.add_argument("--serve-starter", action="store_true", help=argparse.SUPPRESS)
    return p


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM/SIGHUP tear down like Ctrl-C


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.serve_starter:
        return serve_starter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.cleanup:
        return cleanup_stale(log)
    if not args.experiment:
        return _fail("give --experiment FILE.yaml (see mdi-bench --help)", EXIT_CONFIG)
    try:
        if args.out and len(args.experiment) > 1:
            raise ExperimentError("--out: give it with a single --experiment (each file names its 'output')")
        experiments = [_with_overrides(load_experiment(path), args) for path in args.experiment]
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        code = 0
        for exp in experiments:  # all files are checked before the first one runs
            code = max(code, _one_experiment(exp, args.out or exp.output, args, log))
            if code == 130:
                break
        return code
    except ExperimentError as e:
        return _fail(str(e), EXIT_CONFIG)
    except EmulationError as e:
        return _fail(str(e), EXIT_CONFIG)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _with_overrides(exp: Experiment, args: argparse.Namespace) -> Experiment:
    if args.repeats is not None:
        if args.repeats < 1:
            raise ExperimentError("--repeats: expected a positive integer")
        exp.repeats = args.repeats
    if args.emulation:
        exp.emulation.mode = args.emulation
    return exp


def _one_experiment(exp: Experiment, out: str, args: argparse.Namespace, log: Callable[[str], None]) -> int:
    if args.plot_only:
        if not os.path.isfile(os.path.join(out, "results.csv")):
            raise ExperimentError("%s: no results.csv to plot" % out)
        finish_outputs(out, _read_json(os.path.join(out, "machine.json")) or {}, log)
        return 0
    if args.dry_run:
        return dry_run(exp, log)
    log("mdi-bench: experiment %s -> %s" % (exp.source, out))
    return run_experiment(exp, out, log)


def _fail(message: str, code: int) -> int:
    print("mdi-bench: error: %s" % message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
