"""The starter's engine: its own chunk, the ring (or a local loop) and the pipeline over them.

A batch run (`starter.run`) and the serving scheduler both drive it through `admit` and
`step`. When a worker dies the engine re-plans the ring (a spare, or the neighbours take its
layers), re-prefills every sample that had a pass in flight from the starter's token history,
and goes on: the output is what it would have been without the failure.
"""
import logging
import random
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from mdi.model.backend import BackendChoice
from mdi.model.backend_select import device_unusable, select_backend
from mdi.model.layout import layout_to_json, torch_dtype
from mdi.runconfig import ConfigError, NodeSpec
from mdi.starter.control import NodeError, NodeRegistry
from mdi.system.devices import resolve_compute_dtype
from mdi.system.memory import memory_pool
from mdi.model.source import ModelSource
from mdi.model.prefix_store import AUTO as PREFIX_AUTO, NodePrefixRoom, budget_bytes as prefix_budget, budget_positions
from mdi.model.threads import AUTO, choose_threads, usable_cpus, use_fixed as use_fixed_threads
from mdi.ring.status import BatchCounter
from mdi.ring.transport import LocalLoop, RingTimeout
from mdi.starter.pass_compute import takes_host_arrays
from mdi.starter.pipeline import Pipeline
from mdi.starter.pipeline_settings import PipelineSettings, drawable_ids
from mdi.starter.sample import Sample
from mdi.starter.adapter_set import AdapterSet
from mdi.model.ggml.kernel_rows import TILED_ROWS
from mdi.starter.planning.capacity import check_fits_here
from mdi.starter.engine_adapters import RuntimeAdapters
from mdi.starter.engine_face import RecoveryEvent, StarterReading
from mdi.starter.speculation.draft_model import DraftModel, GgmlDraft
from mdi.starter.node_report import NodeReport, backend_line, node_backends, starter_kernels
from mdi.starter.planning.recovery import RecoveryImpossible, check_health, named_worker_lost, replan
from mdi.starter.planning.run_plan import RunPlan
from mdi.starter.recovery_log import RecoveryLog
from mdi.starter.session import RingSession
from mdi.starter.unread_settings import warn_unread_settings
from mdi.model.sampling import SamplingParams

log = logging.getLogger(__name__)


class Engine(RuntimeAdapters, RecoveryLog):
    """The starter's engine; serving sees it through its face (mdi.starter.engine_face.EngineFace)."""

    def __init__(self, plan: RunPlan, source: ModelSource, params: SamplingParams,
                 on_token: Optional[Callable[[Sample, int], None]] = None,
                 adapters: Optional[AdapterSet] = None, registry: Optional[NodeRegistry] = None) -> None:
        # The run's one plan (mdi.starter.planning.run_plan); a recovery replaces it with the new ring's.
        self.plan = plan
        self.cfg, self.source = plan.cfg, source
        self.registry = registry or NodeRegistry.for_run(plan.cfg)  # every node's one control client
        # LoRA adapters (config `adapters:`), numbered 1..K; samples name theirs (Sample.adapter).
        self.adapters = adapters or (AdapterSet(self.cfg.adapters, source.config) if self.cfg.adapters else None)
        self._mix_lock = threading.Lock()
        self.params, self.on_token = params, on_token
        self.device = self.cfg.device_of(self.cfg.starter)
        tok = source.tokenizer
        # EOS and the tokenizer's other end-of-generation ids (end of turn, end of message)
        self.end_ids = tok.end_ids if tok is not None else source.config.eos_token_id
        RecoveryLog.__init__(self)
        self._on_train: Optional[Callable[[Any], None]] = None  # a training job's frames (set_training_hook)
        self.prefix_bytes = 0  # the starter's prefix cache budget (runtime.prefix_cache resolved here)
        self.starter_spare: Optional[int] = None  # its memory beside its budget at load (check_fits_here)
        self.ring: Optional[RingSession] = None  # while workers are in the ring
        self.chunk: Optional[Any] = None  # ModelChunk (torch) or mdi.model.ggml.chunk.GgmlChunk
        self.backend_choice: Optional[BackendChoice] = None  # the starter's, and why
        self.pipeline: Optional[Pipeline] = None
        # Whether samples may draft (the run's generation.speculation; serving may set it for
        # per-request speculation before open)
        self.speculating = self.cfg.generation.speculation.on
        self.drafter_factory: Optional[Callable[[Sample], Any]] = None  # measurement's drafters (mdi.lab)
        self.t0 = time.perf_counter()

    @property
    def dtype(self) -> Any:
        """The torch dtype of a torch chunk's weights and KV cache (imports torch: torch paths only)."""
        return self.plan.dtype

    # The ring in hand, read from the plan (the dashboard, metrics and serving show these).
    @property
    def nodes(self) -> List[NodeSpec]:
        return self.plan.specs

    @property
    def ranges(self) -> List[List[int]]:
        return self.plan.ranges

    @property
    def spares(self) -> List[NodeSpec]:
        return list(self.plan.spares)

    @property
    def n_slots(self) -> int:
        return self.plan.n_slots

    @property
    def max_len(self) -> int:
        return self.plan.max_len

    @property
    def live_chunk(self) -> Any:
        """The starter's chunk, which open() loads (RuntimeError before)."""
        if self.chunk is None:
            raise RuntimeError("the engine is not open")
        return self.chunk

    @property
    def live_pipeline(self) -> Pipeline:
        """The pipeline over the ring, which open() builds (RuntimeError before)."""
        if self.pipeline is None:
            raise RuntimeError("the engine is not open")
        return self.pipeline

    # --- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        lost: Optional[NodeError] = None
        try:  # fail fast, before spending time on our own weights (all at once: the first to fail is named)
            check_health(self.plan, self.registry)
        except NodeError as e:
            if not self.cfg.recovery_attempts:
                raise
            lost = e
        self.chunk = self._starter_chunk(self.ranges[0])
        draft_model = self._draft_model()
        try:
            if lost is not None:
                raise lost
            transport, run_id = self._connect()
        except NodeError as e:  # a worker down as the ring starts, or lost meanwhile: a spare or its neighbours serve
            if not named_worker_lost(self.plan, self.registry, e):
                raise
            transport, run_id, how, started, cause = self._rebuild(e, [])
            self._record(cause, how, started, recovered=True)
        ggml_cuts = bool(self.ggml_nodes())
        if ggml_cuts and self.plan.prefill_chunk < TILED_ROWS:
            log.info("mdi: starter: prompts of %d tokens or more go in passes of at least %d (runtime.prefill_chunk "
                     "%d): ggml computes shorter passes of them with another attention kernel", TILED_ROWS, TILED_ROWS,
                     self.plan.prefill_chunk)
        settings = PipelineSettings.from_plan(self.plan, self.speculating, ggml_cuts, drawable_ids(self.source))
        self.pipeline = Pipeline(self.chunk, transport, run_id, self.params, self.end_ids, settings,
                                 self.on_token, self._check, drafter_factory=self.drafter_factory,
                                 draft_model=draft_model, on_train=self._train_frame)
        self._enable_prefix_cache()
        if self.speculating:
            # Before any sample holds a slot (it times passes in slot 0), and not sooner: timed
            # right after the ring connected, the workers still settling beside the starter,
            # a 4-row pass cost 1.17x [1.06, 1.24] more on loopback (all 4 rounds of a same-run
            # A/B, results/bench_ab_issue60_speculation.json) and the samples drafted less.
            from mdi.starter.speculation.costs import measure_pass_costs  # (imports torch)
            costs = measure_pass_costs(self.chunk, 1 + self.cfg.generation.speculation.max_draft)
            self.pipeline.pass_costs = costs
            log.info("mdi: starter: passes of 1, 2, .. rows cost %s one-row passes", costs.to_json())

    def close(self) -> List[NodeReport]:
        """Send the stop frame round the ring; return each worker's counters."""
        stats = self.ring.finish() if self.ring is not None else []
        self.ring = None
        self.registry.close()
        return stats

    def abort(self) -> None:
        if self.ring is not None:
            self.ring.abort()
            self.ring = None
        self.registry.close()

    def _starter_chunk(self, layers: List[int]) -> Any:
        first, last = layers
        unusable = device_unusable(self.device)  # by either backend; the choice then weighs which can
        if unusable is not None:
            raise ConfigError("starter: %s" % unusable)
        choice = self._choose_backend(first, last)
        self.backend_choice = choice
        log.log(logging.INFO if choice.asked == "auto" else logging.DEBUG,  # said where auto decided; asked: debug
                "mdi: starter: backend %s", choice.describe())
        warn_unread_settings(self.cfg, self.cfg.starter, choice.backend)
        if choice.backend == "ggml":
            chunk = self._ggml_chunk(first, last)
            if self.adapters:
                self.adapters.install(chunk)
            return chunk
        # torch's chunk: its kernels are chosen here (a ggml starter never imports torch)
        from mdi.model.quantization import kernel_choice, qkernels
        compute, note = self._compute_dtype()
        if note:
            log.warning("mdi: starter: %s", note)
        quant = self.plan.nodes[0].quant
        spare = check_fits_here(self.plan.budgets[0], self.device, bool(quant))  # the plan's budget, as --check's
        self._set_prefix_bytes(spare)
        qkernels.set_preference(self.cfg.runtime.quant_kernel)
        # mdi-start set it already; an engine built in Python had not (a benchmark's starter ran
        # 2 threads on 2 cores, its second spinning through a CPU quota)
        use_fixed_threads(self.cfg.runtime.threads)
        kernel_choice.set_memory_allowance(kernel_choice.allowance_for(
            self.cfg.runtime.kernel_memory, None if spare is None else spare - self.prefix_bytes))
        kernel_choice.start_report()  # reports name these layers' kernels only
        # its layers' weights leave the source once in the chunk (a GGUF's are held in memory)
        chunk = self.source.load_chunk(first, last, True, True, self.dtype, self.device, compute, quant, consume=True)
        chunk.fused_decode = self.cfg.runtime.fused_decode  # before allocate_cache scripts the blocks
        chunk.allocate_cache(self.n_slots, self.max_len)
        if self.cfg.runtime.threads == AUTO:  # timed before any sample or adapter uses the chunk
            threads = choose_threads(chunk, self.plan.max_batch)
            log.info("mdi: starter: threads: auto chose %s", threads.describe())
        if self.adapters:
            self.adapters.install(chunk)
        return chunk

    def ggml_nodes(self) -> List[str]:
        """The nodes of the open ring that compute with ggml (which has no backward pass)."""
        return [name for name, backend in node_backends(self).items() if backend == "ggml"]

    def _choose_backend(self, first: int, last: int) -> BackendChoice:
        """The starter's backend (runtime.backend, or its node's own), auto measured here."""
        cfg = self.cfg
        try:
            return select_backend(
                cfg.backend_of(cfg.starter), self.source.config, first, last,
                self.source.gguf_types(first, last, True, True) if self.source.gguf_path else None, self.device,
                cfg.runtime.threads if isinstance(cfg.runtime.threads, int) else None, self.plan.max_batch,
                adapters=bool(self.adapters) or bool(cfg.adapters), dtype=cfg.model.dtype,
                quant=layout_to_json(self.plan.nodes[0].quant), quant_kernel=cfg.runtime.quant_kernel,
                kv_type=cfg.runtime.kv_type, prefill_weights=cfg.prefill_weights_of(cfg.starter),
                prefill_chunk=cfg.runtime.prefill_chunk, repack=cfg.runtime.repack,
                compute_dtype=cfg.model.compute_dtype)
        except (ValueError, RuntimeError) as e:
            raise ConfigError("starter: %s" % e)

    def _ggml_chunk(self, first: int, last: int) -> Any:
        """The starter's chunk on ggml: its GGUF tensors as stored, a ggml KV cache."""
        cfg = self.cfg  # (a kv_type that cannot hold the heads was refused with the backend: select_backend)
        self._set_prefix_bytes(check_fits_here(self.plan.ggml_budget(0, self.source), self.device, True, " on ggml"))
        threads = cfg.runtime.threads if isinstance(cfg.runtime.threads, int) else usable_cpus()
        chunk = self.source.ggml_chunk(first, last, True, True, threads, cfg.runtime.kv_type, cfg.runtime.repack,
                                       self.device)
        chunk.allocate_cache(self.n_slots, self.max_len, self.plan.prefill_chunk)
        if cfg.runtime.threads == AUTO:
            chosen = choose_threads(chunk, self.plan.max_batch)
            log.info("mdi: starter: threads: auto chose %s", chosen.describe())
        chunk.set_prefill_weights(cfg.prefill_weights_of(cfg.starter))  # after the threads: what it measures is theirs
        rows = chunk.dequantized_from  # (prompts on ggml go in passes of TILED_ROWS rows or more anyway)
        if rows is not None and rows > max(cfg.runtime.prefill_chunk, TILED_ROWS):
            log.warning("mdi: starter: prefill weights are dequantized here from %d rows a pass, but runtime.prefill_chunk "
                        "is %d: prompts stay quantized unless prefill_chunk is %d or more", rows,
                        cfg.runtime.prefill_chunk, rows)
        return chunk

    def _set_prefix_bytes(self, spare: Optional[int]) -> None:
        self.starter_spare = spare  # what adapters loaded while serving are counted against
        try:
            self.prefix_bytes = prefix_budget(self.cfg.runtime.prefix_cache, spare)
        except ValueError as e:
            raise ConfigError("starter: runtime.prefix_cache: %s" % e)

    def _draft_model(self) -> Optional[DraftModel]:
        """The run's draft model (generation.speculation's draft), loaded beside the starter's chunk."""
        if self.plan.draft is None:
            return None
        chunk = self.live_chunk
        runtime = self.cfg.runtime
        ggml = GgmlDraft(chunk.threads, runtime.kv_type, runtime.repack, self.device,
                         self.cfg.prefill_weights_of(self.cfg.starter)) \
            if chunk.backend == "ggml" else None
        return DraftModel.load(self.plan.draft, self.n_slots, self.max_len,
                               lambda: (self.dtype, self._compute_dtype()[0]), self.device,
                               self.plan.prefill_chunk, self.cfg.runtime.fused_decode, ggml)

    def _compute_dtype(self) -> Tuple[Any, Optional[str]]:
        """The torch dtype a torch chunk computes in, and a note when the device decided it."""
        asked = self.cfg.model.compute_dtype
        return resolve_compute_dtype(self.device, self.dtype, torch_dtype(asked) if asked else None)

    def _enable_prefix_cache(self) -> None:
        """The pipeline keeps earlier prompts' KV within what every node gives it: as many
        positions as the tightest node's budget holds (each node's bytes per position differ;
        nodes on one memory share an "auto" budget: prefix_store.budget_positions)."""
        chunk = self.live_chunk
        cache = chunk.cache
        here = NodePrefixRoom(self.prefix_bytes, cache.range_bytes(1) if cache is not None and chunk.n_layers else 0,
                              memory_pool())
        rooms = [here] + (self.ring.prefix_rooms() if self.ring is not None else [])
        positions = budget_positions(rooms, self.cfg.runtime.prefix_cache == PREFIX_AUTO)
        self.live_pipeline.enable_prefix_cache(positions, self.prefix_bytes)
        if self.cfg.runtime.prefix_cache:  # --serve's start line says it too
            log.debug("mdi: prefix cache: %d positions on every node%s", positions,
                      "" if positions else " (a node has no room for it)")

    def _connect(self):
        run_id = random.getrandbits(62)
        if len(self.nodes) == 1:
            return LocalLoop(), run_id
        self.ring = RingSession(self.plan, self.source, run_id, self.adapters, self.registry,
                                takes_host_arrays(self.live_chunk))
        return self.ring.start(), run_id

    def _check(self) -> None:
        if self.ring is not None:
            self.ring.check()

    def named_failure(self, e: BaseException) -> BaseException:  # a silent ring's dead node, where found
        return self.ring.named_failure(e) if isinstance(e, RingTimeout) and self.ring is not None else e

    # --- generation ------------------------------------------------------------------
    def admit(self, sample: Sample) -> None:
        self.live_pipeline.admit(sample)

    def step(self, timeout: Optional[float] = None) -> List[Sample]:
        """One frame's worth of progress; a node failure is recovered from when allowed (one the
        watchdog found too, with nothing in flight: an idle server had kept a dead node)."""
        try:
            self._check()
            return self.live_pipeline.step(timeout)
        except (NodeError, RingTimeout) as e:
            self._recover(self.named_failure(e))
            return []

    def run(self, samples: List[Sample]) -> None:
        self.t0 = time.perf_counter()
        self.live_pipeline.run(samples, self.step, t0=self.t0)

    # --- recovery --------------------------------------------------------------------
    def _rebuild(self, cause: BaseException,
                 events: List[RecoveryEvent]) -> Tuple[Any, int, str, float, BaseException]:
        """The ring re-planned without the node `cause` names and connected (`cause` raised once the
        attempts are spent, each failed one in `events`): transport, run id, how, start, last cause."""
        while True:
            if len(self.recoveries) >= self.cfg.recovery_attempts or isinstance(cause, RecoveryImpossible):
                raise cause  # (a ring that cannot be made now: the same check again would say the same)
            started = time.perf_counter()
            log.warning("mdi: %s; recovering (attempt %d of %d)", cause, len(self.recoveries) + 1,
                        self.cfg.recovery_attempts)
            self.abort()
            how = ""  # what the re-plan did, said too where connecting then failed (a second node lost)
            try:
                self.plan, how = replan(self.plan, self.source, self.registry, cause, self.params)
                transport, run_id = self._connect()
                old = self.live_chunk  # the starter's chunk, anew where the plan moved its layers
                if [old.first, old.last] != list(self.ranges[0]):
                    old.free_cache()
                    self.chunk = self._starter_chunk(self.ranges[0])
                return transport, run_id, how, started, cause
            except (NodeError, RecoveryImpossible) as e:
                events.append(self._record(cause, "%sfailed: %s" % (how and how + ", then ", e), started))
                cause = e

    def _recover(self, cause: BaseException) -> List[RecoveryEvent]:
        """Re-plan the ring and go on (or raise once the attempts are spent); the events of
        its attempts, failed ones first."""
        events: List[RecoveryEvent] = []
        transport, run_id, how, started, cause = self._rebuild(cause, events)
        pipeline = self.live_pipeline
        counters = pipeline.prefix.counters if pipeline.prefix is not None else None  # they run on (*_total)
        lost = pipeline.reconnect(transport, run_id, self.live_chunk, n_stages=len(self.nodes),
                                  ggml_cuts=bool(self.ggml_nodes()))
        self._enable_prefix_cache()  # empty: the new ring's nodes hold nothing yet
        if counters is not None and pipeline.prefix is not None:
            pipeline.prefix.counters = counters
        for sample in lost:
            pipeline.admit(sample)
        events.append(self._record(cause, how, started, recovered=True))
        return events

    def _record(self, cause: BaseException, how: str, started: float, recovered: bool = False) -> RecoveryEvent:
        return self.add_recovery(cause, how, started, started - self.t0, self.nodes, self.ranges, recovered)

    # --- the rest of serving's face (mdi.starter.engine_face) --------------------------
    @property
    def in_flight(self) -> int:
        return len(self.pipeline.active) if self.pipeline is not None else 0

    def free_slots(self) -> List[int]:
        return self.live_pipeline.free_slots

    def choose_slot(self, sample: Sample, free: List[int]) -> int:
        return self.live_pipeline.choose_slot(sample, free)

    @property
    def busy_seconds(self) -> float:
        """The starter's own work so far (its layers, head and sampling)."""
        return self.pipeline.compute_seconds if self.pipeline is not None else 0.0

    def speculation_metrics(self) -> Dict[str, Any]:
        return self.pipeline.speculation_metrics() if self.pipeline is not None else {}

    def prefix_metrics(self) -> Dict[str, Any]:
        return self.pipeline.prefix_metrics() if self.pipeline is not None else {}

    @property
    def prefix_budget(self) -> Optional[int]:
        """The prefix cache's positions on every node (None: off)."""
        prefix = self.pipeline.prefix if self.pipeline is not None else None
        return prefix.budget if prefix is not None else None

    def starter_reading(self) -> StarterReading:
        chunk, pipeline = self.chunk, self.pipeline
        transport = pipeline.transport if pipeline is not None else None
        store = pipeline.prefix_store if pipeline is not None else None
        return StarterReading(
            chunk.backend if chunk is not None else None,
            backend_line(self),
            chunk.cache.nbytes if chunk is not None and chunk.cache is not None else 0,
            getattr(transport, "bytes_sent", 0), getattr(transport, "messages_sent", 0),
            store.stats if store is not None else None,
            pipeline.batching.metrics() if pipeline is not None else BatchCounter().metrics(),
            starter_kernels(chunk.backend if chunk is not None else None) or {})

    def free_cache(self) -> None:
        """Give the starter's KV cache back (a failed ring's engine, before the next is built)."""
        if self.chunk is not None:
            self.chunk.free_cache()

    # --- training beside serving (mdi.serving.train_job) --------------------------------
    def set_training_hook(self, on_train: Optional[Callable[[Any], None]]) -> None:
        """Training frames back from the ring go to `on_train` (the stepping thread stays the
        one reader of the ring)."""
        self._on_train = on_train

    def _train_frame(self, frame: Any) -> None:
        if self._on_train is not None:
            self._on_train(frame)

    @property
    def run_id(self) -> Optional[int]:
        """The open ring's run id (a new one after each recovery)."""
        return self.pipeline.run_id if self.pipeline is not None else None

    def send_frame(self, frame: Any) -> None:
        self.live_pipeline.transport.send(frame)

    def ring_trainer(self, options: Any, pairs: Any) -> Any:
        """A RingTrainer (mdi.starter.train.ring_trainer) over this engine's ring: every node trains its layers' pairs."""
        from mdi.starter.train.ring_trainer import RingTrainer  # training runs on torch: imported when asked
        return RingTrainer(self, options, pairs)

    def stop_training(self) -> List[str]:
        """Every worker stops training (best effort: a worker that is gone has nothing to
        drop); what those that could not said."""
        said: List[str] = []
        for client in self.ring.clients if self.ring is not None else []:
            try:
                client.stop_train()
            except RuntimeError as e:  # NodeError: named; "not training" after a refused start
                said.append(str(e))
        return said
