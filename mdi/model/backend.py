"""A node's compute backend, chosen once per node at load: ggml (llama.cpp's kernels over the
GGUF's tensors as stored, mdi.model.ggml) or torch (mdi.model.transformer: training, and the
exact reference the tests compare against). LoRA adapters and soft prompts serve on either.

`runtime.backend` (or a node's own `backend`) asks for one; `auto`, the default, measures both
on the node's own shapes (a few random blocks of the real dims and weight types: decode passes
and a prefill pass, nothing else held) and keeps the faster for the run's work, remembering the
outcome per machine (CPU, library versions, shapes, threads) so a second start measures nothing.
A backend that cannot serve the run is never measured: ggml needs the model's GGUF and its
binding, and has no backward pass (training runs on torch); under auto torch does not serve a
node whose GGUF tensors it would re-round (K-quants, IQ types: mdi.model.backend_select).
"""
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

from mdi.system.machine_cache import MEASURE_WAIT_S, MachineCache, digest

log = logging.getLogger(__name__)

BACKENDS = ("auto", "ggml", "torch")
AUTO = "auto"
# The ggml KV cache's types (runtime.kv_type, llama.cpp's -ctk / -ctv) -> ggml's type names. f32
# doubles f16's bytes for torch's float32 bits (ggml's CPU attention sums an f16 V in f16).
KV_GGML_TYPES = {"f16": "F16", "q8_0": "Q8_0", "f32": "F32"}
KV_TYPES = tuple(KV_GGML_TYPES)
KV_TYPE_ALIASES = {"float16": "f16", "float32": "f32"}  # model.dtype's spelling of the same types
# runtime.prefill_weights (ggml): a prompt's passes multiply the weights as stored, or dequantized
# where measured faster (mdi.model.ggml.dequant_rows); auto, the default, dequantizes on a node
# whose backend auto chose (from as many rows as keep a row's bits its window's alone) and keeps
# the weights as stored where ggml was asked for by name (a prompt's bits are then llama.cpp's)
PREFILL_WEIGHTS = ("auto", "quantized", "dequantized")
CACHE = MachineCache("backends.json", 2)  # what auto measured, by machine and shapes
# The work auto weighs: a sample's prompt and its answer, in tokens. Serving's requests and the
# demo's runs are both of about this shape; the measured costs are per prompt token and per
# decode step, so the choice is the backend with the smaller P * prefill + N * decode.
WORKLOAD_PROMPT = 256
WORKLOAD_TOKENS = 256
# A measurement taken while other work kept every core busy (1-minute load per core) may have
# timed that work: it is said so, and taken again once the machine is quiet.
BUSY_LOAD = 1.0
QUIET_LOAD = 0.5


def kv_type_name(value: str) -> Optional[str]:
    """runtime.kv_type / --kv-type as KV_TYPES spells it (float16 -> f16, Q8_0 -> q8_0, as ggml's
    type names go), or None where it is none."""
    name = KV_TYPE_ALIASES.get(value.lower(), value.lower())
    return name if name in KV_TYPES else None


@dataclass(frozen=True)
class BackendTiming:
    """Seconds per block on this machine: one decode pass of `rows` rows, and one prompt token
    in a prefill pass of `prefill_tokens`."""
    decode_s: float
    prefill_token_s: float
    rows: int = 1
    prefill_tokens: int = 0

    def cost(self, prompt: int = WORKLOAD_PROMPT, tokens: int = WORKLOAD_TOKENS) -> float:
        return prompt * self.prefill_token_s + tokens * self.decode_s / max(1, self.rows)


@dataclass
class BackendChoice:
    """The backend a node computes with and why, in one line (`describe`)."""
    backend: str
    asked: str
    reason: str
    timings: Dict[str, BackendTiming] = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0  # spent measuring (0 when recalled)
    load: Optional[float] = None  # the machine's load per core when it was measured

    def describe(self) -> str:
        if self.asked != AUTO:
            return "%s (asked%s)" % (self.backend, "; " + self.reason if self.reason else "")
        if len(self.timings) < 2:
            return "%s (auto: %s)" % (self.backend, self.reason)
        g, t = self.timings.get("ggml"), self.timings.get("torch")
        assert g is not None and t is not None
        how = "recalled" if self.cached else "measured in %.1f s" % self.seconds
        if self.load is not None and self.load >= BUSY_LOAD:
            how += " while the machine was busy (load %.1f per core)" % self.load
        passes = " in %d-token passes," % g.prefill_tokens if g.prefill_tokens else ""
        return ("%s (auto, %s: decode %.2f ms vs %.2f ms per block, prefill %.3f vs %.3f ms per token and block%s "
                "for ggml vs torch)" % (self.backend, how, 1e3 * g.decode_s, 1e3 * t.decode_s,
                                        1e3 * g.prefill_token_s, 1e3 * t.prefill_token_s, passes))

    def to_json(self) -> Dict[str, object]:
        return {"backend": self.backend, "asked": self.asked, "reason": self.reason, "cached": self.cached,
                "timings": {k: asdict(v) for k, v in self.timings.items()}, "line": self.describe()}


def prefill_weights_for(mode: str, asked: str) -> str:
    """runtime.prefill_weights `mode` on a node that asked for backend `asked`: auto stays auto
    (dequantized where measured faster) where the backend is auto's choice, and is quantized on
    a backend asked for by name."""
    return "quantized" if mode == AUTO and asked != AUTO else mode


BACKEND_ENV = "MDI_BACKEND"  # the default of runtime.backend where a config names none (e.g. a whole test suite on ggml)


def default_backend() -> str:
    """runtime.backend's default: $MDI_BACKEND where set (ValueError naming it when it names no
    backend: a typo had quietly run auto), else auto."""
    value = os.environ.get(BACKEND_ENV) or AUTO
    if value not in BACKENDS:
        raise ValueError("$%s must be one of %s, got %r" % (BACKEND_ENV, ", ".join(BACKENDS), value))
    return value


class WouldMeasure(RuntimeError):
    """auto would have to measure (seconds of every core), and the node is busy: why."""


def choose(asked: str, cannot: Dict[str, Optional[str]], measure: Callable[[str], BackendTiming],
           key: Optional[Dict[str, object]] = None, refresh: bool = False, busy: Optional[str] = None) -> BackendChoice:
    """The backend for a node: `asked` if it can serve (else ValueError saying why), or for
    auto the one whose measured cost is lower. `cannot[backend]`: why it cannot serve this run
    (None: it can). `key`: what the measurement depends on, for the per-machine cache.
    `busy`: why measuring now would disturb other work (WouldMeasure, unless the answer is
    remembered)."""
    if asked != AUTO:
        why = cannot.get(asked)
        if why is not None:
            raise ValueError("backend %s cannot run here: %s" % (asked, why))
        return BackendChoice(asked, asked, "")
    able = [b for b in ("ggml", "torch") if cannot.get(b) is None]
    if not able:
        raise ValueError("no backend can run here: ggml: %s; torch: %s" % (cannot.get("ggml"), cannot.get("torch")))
    if len(able) == 1:
        other = "torch" if able[0] == "ggml" else "ggml"
        return BackendChoice(able[0], AUTO, "%s cannot: %s" % (other, cannot.get(other)))
    name = digest(key) if key is not None else None
    said: List[bool] = []

    def recall() -> Optional[BackendChoice]:
        held = CACHE.read().get(name) if name is not None and not refresh else None
        if held is None:
            return None
        was, now = held.get("load"), machine_load()
        if isinstance(was, (int, float)) and was >= BUSY_LOAD and now is not None and now < QUIET_LOAD:
            if not said:
                said.append(True)
                log.info("mdi: measuring the backends again: the last measurement was taken while the machine "
                         "was busy (load %.1f per core, now %.1f)", was, now)
            return None
        try:
            timings = {b: BackendTiming(**held["timings"][b]) for b in able}
        except (KeyError, TypeError):
            return None
        return _decide(timings, cached=True, seconds=0.0, load=was if isinstance(was, (int, float)) else None)

    # A remembered answer is read without the lock (a start had waited up to MEASURE_WAIT_S for
    # a process measuring another model, then failed where that one was stopped). Measuring is
    # one process at a time per machine: the nodes of a ring started on one machine would time
    # each other's load, and the second finds the first's result. (Each probe is bounded by
    # backend_probe.PROBE_TIMEOUT_S; the wait and a probe fit within the starter's /backend
    # call, runtime.init_timeout.)
    return CACHE.recall_or_measure(recall, lambda: _measure(able, measure, name, key, busy), MEASURE_WAIT_S)


def _measure(able: List[str], measure: Callable[[str], BackendTiming], name: Optional[str],
             key: Optional[Dict[str, object]], busy: Optional[str]) -> BackendChoice:
    """Time each backend in `able` (under the cache's lock) and keep the timings under `name`."""
    if busy is not None:
        raise WouldMeasure(busy)
    now = machine_load()
    log.info("mdi: measuring the ggml and torch backends on this node's shapes (once per machine) ...")
    t0 = time.perf_counter()
    timings, failed = {}, {}
    for b in able:
        try:
            timings[b] = measure(b)
        except Exception as e:  # a probe that dies or hangs: the other backend serves, said why
            failed[b] = str(e).splitlines()[0] if str(e) else type(e).__name__
    seconds = time.perf_counter() - t0
    if failed:
        if len(failed) == len(able):
            raise RuntimeError("measuring the backends failed: %s" % "; ".join(
                "%s: %s" % kv for kv in sorted(failed.items())))
        (bad, why), = failed.items()
        good = next(b for b in able if b != bad)
        log.warning("mdi: timing the %s backend failed (%s): computing with %s", bad, why, good)
        return BackendChoice(good, AUTO, "timing %s failed: %s" % (bad, why), seconds=seconds)
    load = machine_load()
    load = max(now, load) if now is not None and load is not None else load
    if name is not None:
        cache = CACHE.read()
        cache[name] = {"timings": {b: asdict(t) for b, t in timings.items()}, "key": key, "at": time.time(),
                       "load": load}
        CACHE.write(cache)
    return _decide(timings, cached=False, seconds=seconds, load=load)


def machine_load() -> Optional[float]:
    """The 1-minute load average per core (None where the OS has none)."""
    try:
        return os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def _decide(timings: Dict[str, BackendTiming], cached: bool, seconds: float,
            load: Optional[float] = None) -> BackendChoice:
    g, t = timings["ggml"].cost(), timings["torch"].cost()
    best = "ggml" if g <= t else "torch"
    ratio = max(g, t) / max(1e-12, min(g, t))
    return BackendChoice(best, AUTO, "%.2fx faster on a %d-token prompt and %d tokens" % (
        ratio, WORKLOAD_PROMPT, WORKLOAD_TOKENS), timings, cached, seconds, load)
