"""What a worker measures when asked between runs: POST /profile (its blocks' timing, within
the memory it spares) and POST /backend (which backend it would compute given layers with)."""
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from mdi.model.backend import BackendChoice, WouldMeasure
from mdi.model.backend_select import select_backend
from mdi.model.layout import layout_to_json
from mdi.ring.backend_request import BackendReply, BackendRequest
from mdi.ring.init_request import NodeBusy, RequestError, TooLarge
from mdi.ring.profile_request import ProfileReply, ProfileRequest
from mdi.system.memory import collect_freed_memory
from mdi.worker.memory_budget import chunk_nbytes

log = logging.getLogger(__name__)


class Measuring:
    """Worker's /profile and /backend (mixed into mdi.worker.node.Worker, whose lock, run,
    weights and memory limit they read)."""

    # What this reads of the Worker it is mixed into (mdi.worker.node.Worker sets and defines them)
    lock: threading.Lock
    run: Any
    pending: Any
    chunk: Any
    chosen: Any
    device_override: Optional[str]
    threads_override: Optional[int]
    token: Optional[str]
    if TYPE_CHECKING:
        def touch(self) -> None: ...
        def _check_device(self, asked: str) -> None: ...
        def check_holder(self, run_id: int, peer: str, taking_over: bool = True) -> None: ...
        def _drop_chunk_locked(self) -> None: ...
        def _memory_limit(self, device: str) -> Tuple[Optional[int], str]: ...
        def _set_threads(self, request: Any, chunk: Optional[Any] = None) -> Optional[int]: ...

    def profile(self, request: ProfileRequest) -> ProfileReply:
        """Time the asked model's blocks here (POST /profile). Refused (409) while a run or a
        load holds this worker: it would slow that run, and the run would skew the numbers."""
        self._check_device(request.device)
        if not self.lock.acquire(timeout=1.0):
            raise NodeBusy("busy loading weights; profile it between runs")
        try:
            run = self.run
            if run is not None and run.holds_worker():
                raise NodeBusy("busy with run %d of the starter at %s; profile it between runs" % (run.id, run.peer))
            if self.pending is not None:
                raise NodeBusy("run %d is waiting for its weights; profile it between runs"
                               % self.pending.request.run_id)
            self.touch()
            if request.backend == "ggml":  # the run's blocks, on ggml: no torch loaded for it
                from mdi.timing.ggml_profile import probe_blocks, probe_bytes
                from mdi.timing.ggml_profile import profile_ggml as profile_here
                n_blocks = self._fitting(request, lambda free: (probe_blocks(request), probe_bytes(request)))
                if self.threads_override:  # this worker's --threads, as its runs compute with
                    request = dataclasses.replace(request, threads=self.threads_override)
            else:
                from mdi.timing.node import profile_here  # torch's blocks
                n_blocks = self._profile_blocks(request)
                self._set_threads(request)
            try:
                return profile_here(request, self.device_override or request.device, token=self.token,
                                    n_blocks=n_blocks)
            except (RuntimeError, ValueError) as e:  # e.g. no CUDA here, or out of memory
                raise RequestError("cannot profile on %s: %s" % (self.device_override or request.device, e))
            finally:
                collect_freed_memory()  # the random blocks' memory goes back before the weights come
        finally:
            self.lock.release()

    def choose_backend(self, request: BackendRequest) -> BackendReply:
        """POST /backend: which backend this worker would compute the asked layers with
        (mdi.model.backend_select; auto is measured here once per machine and shape)."""
        self._check_device(request.device)
        if request.run_id is not None:
            self.check_holder(request.run_id, "?", taking_over=False)
        run = self.run
        # auto's first measurement takes every core for seconds: not beside a run (a remembered
        # answer is given at any time)
        busy = ("busy with run %d of the starter at %s" % (run.id, run.peer)
                if run is not None and run.holds_worker() else None)
        try:
            choice = self._select_backend(request.asked, request.model, request.layers, request.gguf_types,
                                          self.device_override or request.device, request.threads, request.rows,
                                          request.adapters, request.dtype, layout_to_json(request.quant),
                                          request.quant_kernel, request.kv_type, busy, request.prefill_weights,
                                          request.prefill_chunk, request.repack, request.compute_dtype)
        except WouldMeasure as e:
            raise NodeBusy("%s: measuring its backends now would slow that run; ask between runs, or name "
                           "runtime.backend" % e)
        # the /init that follows names the backend chosen: its reports keep why
        self.chosen = (list(request.layers), choice.backend, choice.describe())
        kernels = []
        if choice.backend == "torch":  # it will load torch for the run anyway
            from mdi.model.quantization import qkernels
            kernels = qkernels.offered_on(self.device_override or request.device)
        return BackendReply(choice.backend, choice.describe(), round(choice.seconds, 3), kernels)

    def _select_backend(self, asked: str, config: Any, layers: List[int], gguf_types: Dict[str, str], device: str,
                        threads: Any, rows: int, adapters: bool, dtype: str, quant: Dict[str, Any],
                        quant_kernel: Optional[str], kv_type: str, busy: Optional[str] = None,
                        prefill_weights: str = "quantized", prefill_chunk: Optional[int] = None,
                        repack: bool = True, compute_dtype: Optional[str] = None) -> BackendChoice:
        threads = self.threads_override or threads
        try:
            return select_backend(asked, config, layers[0], layers[1], gguf_types, device,
                                  threads if isinstance(threads, int) else None, rows, adapters, dtype, quant,
                                  quant_kernel, kv_type, busy=busy, prefill_weights=prefill_weights,
                                  prefill_chunk=prefill_chunk, repack=repack, compute_dtype=compute_dtype)
        except WouldMeasure:
            raise
        except (ValueError, RuntimeError) as e:
            raise RequestError(str(e))

    def _profile_blocks(self, request: ProfileRequest) -> int:
        """How many of torch's random blocks to time (profile_blocks): as many as fit (`_fitting`)."""
        from mdi.model.profile_size import profile_blocks, profile_bytes
        from mdi.timing.node import profile_positions
        config, rows = request.model, max(request.batch_sizes)
        positions = profile_positions(request)
        device = self.device_override or request.device

        def size(free: Optional[int]) -> Tuple[int, int]:
            n = profile_blocks(config, request.dtype, request.quant, device, free, rows, positions)
            return n, profile_bytes(config, n, request.dtype, request.quant, rows, positions)
        return self._fitting(request, size)

    def _fitting(self, request: ProfileRequest, size: Callable[[Optional[int]], Tuple[int, int]]) -> int:
        """The blocks `size` (free bytes -> blocks, bytes they need) says to time, within what is
        free beside the weights held now; refused (413) when not even PROFILE_LAYERS fit: a board
        at its limit is killed by the kernel, not told (ggml's probe ignored it: 2.3 GB on a
        worker given 0.3). When they do not fit beside the last run's weights (idle: the caller
        checked), those go first, as the next /init would drop them, and the room is measured
        again, not assumed: a 230 MB board holding its warmup run's layers refused the profile
        and the plan left it out, and one sized on the room the weights would leave, before they
        had gone, was OOM-killed."""
        device = self.device_override or request.device

        def fit() -> Tuple[int, int, Optional[int], str]:
            limit, what = self._memory_limit(device)
            free = limit - chunk_nbytes(self.chunk) if limit is not None else None
            return size(free) + (free, what)

        n, need, free, what = fit()
        if free is not None and need > free and self.chunk is not None:
            log.info("worker: letting go of the last run's weights to profile (%d bytes needed, %d free beside them)",
                     need, free)
            self._drop_chunk_locked()
            n, need, free, what = fit()
        if free is not None and need > free:
            raise TooLarge("profiling needs %d bytes (%d random blocks and their cache) but %d are free here (%s)"
                           % (need, n, free, what))
        return n
