"""What the planner plans on: every node's measured speed, memory and link, as `NodeCost`s.

Workers time the model's blocks themselves (POST /profile, mdi.ring.profile_request), the
starter times its own blocks, embedding, head and sampling in its process, and times a small
and a larger body to each worker (POST /probe) for the link's round trip and bandwidth. Nothing
of the model's weights moves. The timings are cached per (node, address, model shape, dtype,
quantization, device, threads, fused decode, ...: everything the ProfileRequest sends, see
`_cached`'s callers) in $MDI_PROFILE_CACHE/profiles.json (default ~/.cache/mdi),
so a second plan is instant; `refresh` measures again (a board was changed or is busy).
Memory is read fresh every time (GET /status): it changes with what else runs there.
"""
import functools
import hashlib
import importlib.util
import json
import logging
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from mdi import __version__
from mdi.model.backend_select import layer_types, select_backend
from mdi.model.layout import layout_to_json, weight_bytes
from mdi.model.timing_loop import PROFILE_LAYERS
from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.system.memory import collect_freed_memory
from mdi.system.parallel import run_all
from mdi.system.loopback import is_loopback
from mdi.ring.backend_request import BackendRequest
from mdi.ring.profile_request import MAX_BATCH_SIZES, MAX_PROFILE_ROWS, ProfileReply, ProfileRequest
from mdi.system.memory import LOAD_HEADROOM_BYTES
from mdi.ring.wire import payload_nbytes
from mdi.runconfig import NodeSpec, RunConfig
from mdi.timing.node import profile_here, profile_positions
from mdi.starter.planning.capacity import node_quant, starter_free_bytes
from mdi.starter.control import NodeError, NodeRegistry
from mdi.starter.speculation.draft_model import open_draft
from mdi.starter.planning.node_budget import RunMemory, run_memory
from mdi.starter.planning.planner import NodeCost, groups
from mdi.system.files import write_json
from mdi.system.machine_cache import MERGE_WAIT_S, MachineCache, cache_dir

log = logging.getLogger(__name__)

PROBE_BYTES = 256 * 1024  # the larger probe body: enough to see a slow link's bandwidth
PROBE_REPEATS = 5
CACHE_FILE = "profiles.json"


def _read_cache() -> Dict[str, Any]:
    path = os.path.join(cache_dir(), CACHE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}  # none yet
    except (OSError, ValueError) as e:  # damaged: said (every node had been timed again, unsaid), rewritten
        log.warning("mdi: plan: %s cannot be read (%s): its profiles are timed again", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(entries: Dict[str, Any]) -> None:
    """Merge `entries` into the file under its lock: two starters planning at once on one machine
    each keep what they timed (a plain rewrite had dropped the other's)."""
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        with MachineCache(CACHE_FILE, 0).locked(MERGE_WAIT_S):
            merged = _read_cache()
            merged.update(entries)
            write_json(os.path.join(cache_dir(), CACHE_FILE), merged)
    except OSError as e:  # a read-only home is no reason to fail the run
        log.warning("mdi: plan: cannot write the profile cache in %s: %s", cache_dir(), e)
    except RuntimeError as e:  # another process held it too long: timed again next time
        log.warning("mdi: plan: %s", e)


def batch_sizes(samples: int, n_nodes: int, max_batch: Any = "auto") -> List[int]:
    """Rows per decode pass to time: one sample alone, two, and the groups `samples` in flight
    make on this ring and on every smaller one (the planner may leave nodes out: the same
    samples then travel in bigger groups, and a kernel's cost per row can jump either way
    between sizes), within runtime.max_batch, what /profile takes and MAX_BATCH_SIZES sizes,
    the smallest rings' last (the planner extends the rest)."""
    cap = MAX_PROFILE_ROWS if max_batch == "auto" else min(MAX_PROFILE_ROWS, int(max_batch))
    sizes: List[int] = []
    for rows in [1, 2] + [groups(samples, n, max_batch)[0] for n in range(n_nodes, 0, -1)]:
        if min(rows, cap) not in sizes:
            sizes.append(min(rows, cap))
    return sorted(sizes[:MAX_BATCH_SIZES])


def _connect_seconds(node: NodeSpec, timeout: float) -> float:
    t0 = time.perf_counter()
    try:
        socket.create_connection((node.host, node.port), timeout=timeout).close()
    except OSError as e:
        raise NodeError("node %s (%s): cannot connect to time the link: %s" % (node.name, node.address, e), node.name)
    return time.perf_counter() - t0


def _key(parts: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# the modules that set a pass's time
_SPEED_CODE = tuple("mdi.model." + m for m in ("transformer", "rope", "row_batch", "kv_cache", "layers", "attention",
                                                 "fused_decode", "quantization.qkernels", "quantization.kernel_choice",
                                                 "quantization.quant", "sampling", "block_timing")) + (
    "mdi.timing.relay", "mdi.timing.node", "mdi.starter.pipeline", "mdi.starter.planning.loop_timing",
    "mdi.timing.ggml_profile") + tuple("mdi.model.ggml." + m for m in ("chunk", "graph", "products", "kv_cache",
                                                                     "row_split", "dequant_rows", "built"))
_code_ids: List[str] = []  # computed once per process


def code_id() -> str:
    """A hash of the code that sets how fast a node runs a pass: a profile measured by other
    code (before a speed-up, say) is stale, and mdi's version does not change with every one."""
    if not _code_ids:
        digest = hashlib.sha256()
        for name in _SPEED_CODE:
            spec = importlib.util.find_spec(name)  # found, not imported: most import torch
            path = spec.origin if spec is not None else None
            assert path is not None  # each is a module of mdi's own, read from a file
            with open(path, "rb") as f:
                digest.update(f.read())
        _code_ids.append(digest.hexdigest()[:16])
    return _code_ids[0]


class Profiler:
    """Measures (or finds in the cache) the NodeCost of each node for one run's model and shapes."""

    def __init__(self, cfg: RunConfig, source: ModelSource, n_slots: int, max_len: int, samples: int,
                 params: Optional[SamplingParams] = None, refresh: bool = False,
                 say: Callable[[str], None] = log.info, sizes: Sequence[int] = (),
                 registry: Optional[NodeRegistry] = None, memory: Optional[RunMemory] = None) -> None:
        self.cfg, self.source, self.n_slots, self.max_len = cfg, source, n_slots, max_len
        self._memory = memory  # the run's budget parts (node_budget.RunMemory); None: built from cfg when needed
        self._owns_registry = registry is None
        self.registry = registry or NodeRegistry.for_run(cfg)
        self.params = params or SamplingParams(cfg.generation.temperature, cfg.generation.top_k, cfg.generation.top_p)
        self.samples, self.refresh, self.say = samples, refresh, say
        self.config = source.config
        self.dtype = cfg.model.dtype  # its name: the profiler sizes without torch
        # The rows per pass timed: given (a spare joining a planned ring is timed as its peers were).
        self.sizes = list(sizes) if sizes else batch_sizes(samples, len(cfg.nodes), cfg.runtime.max_batch)
        self.context = max(0, min(self.config.block_size - 1, max_len // 2))  # a run's average position
        self.prefill_tokens = max(1, min(cfg.runtime.prefill_chunk, self.config.block_size, 256))
        self.cache = _read_cache()
        self.seconds = 0.0  # spent measuring (0 when everything came from the cache)
        self.cache_dirty = False
        self._bytes: Dict[Optional[str], List[int]] = {}  # node quant -> layer bytes

    def close(self) -> None:
        """Close the connections to the nodes this profiler opened (a registry it was given
        belongs to its giver, who closes it)."""
        if self._owns_registry:
            self.registry.close()

    def costs(self, nodes: Sequence[NodeSpec]) -> List[NodeCost]:
        """NodeCosts in ring order; `nodes[0]` is this process (the starter)."""
        t0 = time.perf_counter()
        mates = machine_mates(nodes)  # part of each profile's cache key
        links: List[Optional[Dict[str, float]]] = [None] + [self._link(n) for n in nodes[1:]]
        statuses = self._statuses(nodes[1:])  # one read: its device and memory
        # Memory is read before any node profiles: a profile's random blocks, freed, may not be
        # back with the OS yet (the starter's held 70 MB of a 320 MB board and its plan left out
        # layers that fit).
        capacities = [starter_free_bytes(self.cfg.device_of(self.cfg.starter))] + [s.capacity_bytes() for s in statuses]
        # Every node times its blocks at once, the starter too: a plan is ready in the time of
        # the slowest board, not the sum, and boards that share anything (a host's cores, its
        # memory bandwidth and cache, as emulated ones do) are timed as loaded as the ring's
        # steady state loads them.
        # A node that fails (or dies) while timing ends the start-up at once, named.
        timings = run_all([functools.partial(self._starter_timing, mates[nodes[0].name])] +
                          [functools.partial(self._worker_timing, n, s.device, mates[n.name])
                           for n, s in zip(nodes[1:], statuses)], "mdi-profile")
        # A worker's memory is read again once it has profiled, and the smaller figure kept:
        # what its profile held is not all back with the OS (a 230 MiB board could give 31.9 MB
        # before profiling and 30.7 MB after, and refused its 31.9 MB share at /init).
        after = [status.capacity_bytes() for status in self._statuses(nodes[1:])]
        capacities = capacities[:1] + [_smaller(a, b) for a, b in zip(capacities[1:], after)]
        out = []
        for i, node in enumerate(nodes):
            # A node's output goes to the next one: the slower of the two links to the starter
            # stands for the path between them (boards usually hang off one switch).
            nxt = links[(i + 1) % len(nodes)]
            link = [l for l in (links[i], nxt) if l is not None]
            out.append(self._cost(i, node, timings[i], link, capacities[i]))
        if self.cache_dirty:
            _write_cache(self.cache)
        self.seconds += time.perf_counter() - t0
        return out

    def _statuses(self, nodes: Sequence[NodeSpec]) -> List[Any]:
        """Each node's /status, read at once (the first that fails is named at once)."""
        return run_all([self.registry.client(n).status for n in nodes], "mdi-status")

    def worker_cost(self, node: NodeSpec) -> NodeCost:
        """One worker alone (a spare joining the ring): its blocks, its link and its memory."""
        link = self._link(node)
        status = self.registry.client(node).status()
        timing = self._worker_timing(node, status.device, [])
        capacity = _smaller(status.capacity_bytes(), self.registry.client(node).status().capacity_bytes())
        cost = self._cost(1, node, timing, [link], capacity)
        if self.cache_dirty:
            _write_cache(self.cache)
        return cost

    # --- measuring -------------------------------------------------------------------
    def _cached(self, what: str, parts: Dict[str, Any], measure: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        key = _key(dict(parts, what=what, mdi=__version__, code=code_id()))
        entry = self.cache.get(key)
        if entry is None or self.refresh:
            node = parts.get("node", "?")
            self.say("mdi: plan: " + {"worker": "timing %s's blocks" % node, "link": "timing the link to %s" % node,
                                      "starter": "timing the starter's blocks, head and sampling"}[what])
            entry = measure()
            self.cache[key] = entry
            self.cache_dirty = True
        return entry

    def _request(self, node: NodeSpec, with_ends: bool) -> ProfileRequest:
        layers = [0, min(PROFILE_LAYERS, self.config.n_layer)]
        cfg = self.cfg
        quant = dict(node_quant(cfg, self.source, node, layers, with_ends))
        backend = self._backend(node, with_ends, quant)
        types = self.source.gguf_types(0, self.config.n_layer, with_ends, with_ends) if backend == "ggml" else {}
        return ProfileRequest(self.config, cfg.model.dtype, cfg.device_of(node), self.sizes, self.context,
                              self.prefill_tokens, cfg.runtime.threads, cfg.model.compute_dtype, quant,
                              cfg.runtime.quant_kernel, cfg.runtime.fused_decode, backend,
                              layer_types(types, 0, self.config.n_layer),
                              {n: t for n, t in types.items() if not n.startswith("blk.")}, cfg.runtime.kv_type,
                              cfg.runtime.repack)

    def _backend(self, node: NodeSpec, starter: bool, quant: Dict[str, Any]) -> str:
        """What `node` would compute with (a plan times what runs): asked, or auto's choice on
        that node for the model's shapes (measured there once per machine, then recalled)."""
        cfg = self.cfg
        asked = cfg.backend_of(node)
        if asked != "auto":
            return asked
        n = self.config.n_layer
        gguf = self.source.gguf_types(0, n, starter, starter) if self.source.gguf_path else None
        threads = cfg.runtime.threads if isinstance(cfg.runtime.threads, int) else None
        if starter:
            return select_backend("auto", self.config, 0, n, gguf, cfg.device_of(node), threads, max(self.sizes),
                                  bool(cfg.adapters), cfg.model.dtype, layout_to_json(quant), cfg.runtime.quant_kernel,
                                  cfg.runtime.kv_type, prefill_weights=cfg.prefill_weights_of(node),
                                  prefill_chunk=cfg.runtime.prefill_chunk, repack=cfg.runtime.repack,
                                  compute_dtype=cfg.model.compute_dtype).backend
        request = BackendRequest(self.config, [0, n], "auto", cfg.device_of(node), cfg.model.dtype, cfg.runtime.threads,
                                 max(self.sizes), gguf or {}, {}, cfg.runtime.quant_kernel, cfg.runtime.kv_type,
                                 bool(cfg.adapters), cfg.prefill_weights_of(node), cfg.runtime.prefill_chunk,
                                 repack=cfg.runtime.repack, compute_dtype=cfg.model.compute_dtype)
        return self.registry.client(node).backend(request).backend

    def _worker_timing(self, node: NodeSpec, device: str, alongside: Sequence[str]) -> Dict[str, Any]:
        """`device`: the one the worker reports; its own --device wins over the run's, so it is
        part of what is timed. (Its own --threads too, but /status cannot tell an override from
        the last run's setting: --refresh.) `alongside`: the nodes timed at once on its machine
        (machine_mates)."""
        request = self._request(node, False)

        def measure() -> Dict[str, Any]:
            return self.registry.client(node).profile(request).to_json()
        try:
            # The key: all the request says (model shape, dtype, quant, device, threads, rows,
            # fused decode...).
            return self._cached("worker", dict(request.to_json(), node=node.name, address=node.address,
                                               worker_device=device, alongside=list(alongside)),
                                measure)
        except NodeError as e:
            if "HTTP 413" not in str(e):
                raise
            return {"unusable": "too little memory to time even two blocks (%s)" % str(e).split(": ")[-1]}

    def _starter_timing(self, alongside: Sequence[str]) -> Dict[str, Any]:
        node = self.cfg.nodes[0]
        request = self._request(node, True)

        def measure() -> Dict[str, Any]:  # (the timing modules import torch: here, not at the top)
            from mdi.model.profile_size import profile_blocks
            from mdi.starter.planning.loop_timing import time_starter_loop

            def time_loop(chunk: Any) -> Dict[int, float]:
                return time_starter_loop(chunk, request.batch_sizes, self.params, self.cfg.runtime.wire_codec,
                                         self.cfg.runtime.token)
            # Less the embedding and head, which the profile holds too, and the headroom a worker
            # keeps: the profile is this process's first compute, its working memory comes on top
            # (with none kept, a 240 MiB starter was OOM-killed profiling GPT-2).
            free = starter_free_bytes(self.cfg.device_of(self.cfg.starter))
            if free is not None:
                ends = weight_bytes(self.config, (0, 0), self.cfg.model.dtype, True, request.quant)
                free -= ends + LOAD_HEADROOM_BYTES
            n_blocks = profile_blocks(self.config, self.cfg.model.dtype, request.quant, request.device, free,
                                      max(request.batch_sizes), profile_positions(request))
            try:
                return profile_here(request, request.device, with_ends=True, params=self.params,
                                    time_loop=time_loop, n_blocks=n_blocks).to_json()
            finally:
                collect_freed_memory()  # the random blocks' memory goes back before the weights come
        sampling = {"temperature": self.params.temperature, "top_k": self.params.top_k, "top_p": self.params.top_p}
        return self._cached("starter", dict(request.to_json(), node=node.name, sampling=sampling,
                                            alongside=list(alongside)), measure)

    def _link(self, node: NodeSpec) -> Dict[str, float]:
        def measure() -> Dict[str, float]:
            # The round trip from TCP connects (answered by the board's kernel: no Python there,
            # as on the data plane); the bandwidth from a large probe body less a small one
            # (the HTTP handling costs both the same).
            rtt = min(_connect_seconds(node, self.cfg.runtime.connect_timeout) for _ in range(PROBE_REPEATS))
            client = self.registry.client(node)
            client.probe(0)  # a connection kept alive from here on
            small = min(client.probe(0) for _ in range(3))
            big = min(client.probe(PROBE_BYTES) for _ in range(3))
            bandwidth = PROBE_BYTES / (big - small) if big > small * 1.05 else 1e10  # faster than we can time
            return {"rtt_s": rtt, "bytes_per_s": bandwidth}
        return self._cached("link", {"node": node.name, "address": node.address}, measure)

    # --- in the planner's terms ------------------------------------------------------
    def _cost(self, i: int, node: NodeSpec, timing: Dict[str, Any], links: List[Dict[str, float]],
              capacity: Optional[int]) -> NodeCost:
        if "unusable" in timing:  # the planner leaves it out, saying why
            never = {1: float("inf")}
            return NodeCost(node.name, never, never, never, [0] * self.config.n_layer, capacity_bytes=capacity,
                            note=timing["unusable"])
        reply = ProfileReply.from_json(timing)
        fixed = {rows: s + reply.ends_s.get(rows, 0.0) for rows, s in reply.frame_s.items()}
        for rows, seconds in reply.loop_s.items():  # the node's whole pass less its timed blocks, where that is more
            if rows in fixed and rows in reply.layer_s:
                fixed[rows] = max(fixed[rows], seconds - reply.blocks * reply.layer_s[rows])
        hop = {}
        for rows in self.sizes:
            nbytes = payload_nbytes(rows, self.config.n_embd, self.dtype, self.cfg.runtime.wire_codec)
            hop[rows] = max([l["rtt_s"] / 2 + nbytes / l["bytes_per_s"] for l in links] or [0.0])
        # The node's budget (mdi.starter.planning.node_budget) split as the planner adds it up: a fixed
        # part (the prefix reserve; the starter's embedding, head and draft model) and each
        # layer's; the planner's fit is the budget's against the same limit.
        fixed_bytes = self.memory.fixed_bytes(node_quant(self.cfg, self.source, node, [0, 0], True) if i == 0 else {},
                                              self.n_slots, i == 0)
        return NodeCost(node.name, reply.layer_s, fixed, hop, self._layer_bytes(node), fixed_bytes, capacity,
                        reply.prefill_token_s)

    @property
    def memory(self) -> RunMemory:
        if self._memory is None:
            self._memory = run_memory(self.cfg, self.config, self.max_len, self.dtype, open_draft(self.cfg, self.source))
        return self._memory

    def _layer_bytes(self, node: NodeSpec) -> List[int]:
        """Each layer's share of this node's budget (weights as its own quant keeps them, KV
        cache, adapters' matrices)."""
        if node.quant not in self._bytes:
            self._bytes[node.quant] = [
                self.memory.layer_bytes(j, node_quant(self.cfg, self.source, node, [j, j + 1]), self.n_slots)
                for j in range(self.config.n_layer)]
        return self._bytes[node.quant]


def machine_mates(nodes: Sequence[NodeSpec]) -> Dict[str, List[str]]:
    """Each node's name -> the other nodes of `nodes` on its machine (the starter, `nodes[0]`,
    and workers on loopback are this one; others share a machine when their host is the same).
    Profiled at once, they share its cores, memory bandwidth and cache: what a profile measured
    depends on them, so they are part of its cache key, and a plan that leaves some out times
    the others again (autoplan.plan_ring)."""
    machines = ["this" if i == 0 or is_loopback(n.host) else n.host for i, n in enumerate(nodes)]
    return {n.name: sorted(o.name for o, m in zip(nodes, machines) if m == here and o is not n)
            for n, here in zip(nodes, machines)}


def _smaller(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """The smaller of two memory figures, either of which may be unknown (None)."""
    return b if a is None else a if b is None else min(a, b)
