"""POST / GET / DELETE /v1/mdi/train: start, report and stop the training job beside serving
(mdi.serving.train_job), one at a time. The body's checks are `train_body`'s; the job starts,
stops and runs on the scheduler's thread (Scheduler.between_steps), never on an HTTP thread.

  POST    starts a job: 200 with its report; 400 naming a bad field; 409 while one runs; 502
          when a worker refuses it (the message names the node)
  GET     the current or last job: state (running | stopping | stopped | done | failed), step,
          steps, loss and tokens/s per step, ETA, error; 404 before any job
  DELETE  stops the running job cleanly (the workers drop their training state, requests go on);
          its report once stopped; 404 when none runs
"""
import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Dict

from mdi.runconfig import ConfigError
from mdi.serving.admission import SchedulerError
from mdi.serving.scheduler import Scheduler
from mdi.serving.served_files import ServedFiles
from mdi.serving.validation import ApiError, bad_field

if TYPE_CHECKING:  # a job trains on torch: imported when one starts, not by a server that never trains
    from mdi.serving.train_job import TrainJob

log = logging.getLogger(__name__)

CALL_WAIT_S = 60.0  # for the scheduler to take the start or stop between two steps
STOP_POLL_S = 0.05


class TrainControl:
    def __init__(self, sched: Scheduler, files: ServedFiles, model_id: str,
                 on_adapter: Callable[[], None]) -> None:
        self.sched, self.files, self.model_id, self.on_adapter = sched, files, model_id, on_adapter

    def _running(self) -> bool:
        job = self.sched.job
        return job is not None and job.active

    def reserves(self, name: str) -> bool:
        """Whether the running job's adapter is to be served as `name`: no other may take it."""
        return self._running() and self.sched.job.spec.name == name

    def writes(self, real: str) -> bool:
        """Whether the running job's `out` is `real`, lies in it or holds it: an adapter loaded
        from there would be overwritten, while served, when the job ends."""
        if not self._running():
            return False
        out = self.sched.job.spec.out
        return os.path.commonpath([out, real]) in (out, real)

    def _conflict(self) -> ApiError:
        job = self.sched.job
        return ApiError(409, "a training job is running (step %d of %d); DELETE /v1/mdi/train stops it"
                        % (len(job.steps), job.spec.steps), code="training_running")

    def start(self, body: Dict[str, Any]) -> Dict[str, Any]:
        sched = self.sched
        if self._running():
            raise self._conflict()
        engine = sched.engine
        if engine is None:
            raise ApiError(503, "the ring is %s" % sched.state, kind="server_error")
        cfg = engine.cfg
        # (a spare asked for ggml takes part once it replaces a lost node: training there would fail mid-job)
        on_ggml = engine.ggml_nodes() + [s.name for s in engine.plan.spares if cfg.backend_of(s) == "ggml"]
        fast_quantized = cfg.runtime.quant_kernel != "exact" and any(n.quant for n in engine.plan.nodes)
        if on_ggml:  # ggml has no backward pass; a torch copy beside it would double a board's weights
            raise ApiError(400, "%s compute%s with ggml, which cannot train: serve with runtime.backend: torch (and "
                           "no node's own backend: ggml)%s to train beside serving, or train with mdi-train "
                           "(runtime.backend: auto or torch) while the ring is not serving"
                           % (", ".join(on_ggml), "s" if len(on_ggml) == 1 else "",
                              " and runtime.quant_kernel: exact" if fast_quantized else ""))
        if fast_quantized:  # torch's kernels
            raise ApiError(400, "this server keeps its base quantized with runtime.quant_kernel %s, whose kernels "
                           "have no backward: serve with runtime.quant_kernel: exact to train beside it"
                           % cfg.runtime.quant_kernel)
        # training's modules import torch: here, once a ring that can train is asked to
        from mdi.serving.train_body import NAME_TAKEN, out_problem, parse_train_body
        from mdi.serving.train_job import TrainJob
        from mdi.starter.train.train_data import load_windows
        taken = [self.model_id] + [n for _, n in engine.loaded_adapters()]
        spec = parse_train_body(body, self.files, len(engine.nodes),
                                min(sched.max_len, sched.source.config.block_size), taken)
        try:  # tokenized here, on this request's thread: the ring keeps serving meanwhile
            windows = load_windows(sched.tokenizer, spec.data, spec.seq_len)
        except ConfigError as e:
            raise ApiError(400, "'data': %s" % str(e).replace("--data ", ""), "data")
        job = TrainJob(spec, engine, windows, self._register, functools.partial(out_problem, files=self.files))

        def begin() -> None:
            if self._running():
                raise self._conflict()
            if sched.engine is not engine:
                raise ApiError(503, "the ring was rebuilt meanwhile; try again", kind="server_error")
            # again: a job started and ended while this one's data was read may have taken both
            problem = job.out_problem(spec.out)
            if problem is not None:
                raise bad_field("out", problem)
            if spec.name is not None and spec.name in [n for _, n in engine.loaded_adapters()]:
                raise bad_field("name", NAME_TAKEN % spec.name)
            sched.job = job
            try:
                job.start()
            except Exception as e:
                job.fail(str(e))
                raise
        try:
            sched.between_steps(begin, CALL_WAIT_S)
        except ApiError:
            raise
        except SchedulerError as e:
            raise ApiError(e.status, str(e), kind="server_error")
        except (RuntimeError, ValueError) as e:  # a worker refused it (NodeError): named in the message
            raise ApiError(502, str(e), kind="server_error")
        log.info("mdi: serve: training job started: %d steps of %d windows of %d tokens from %s",
                 spec.steps, spec.batch_size, spec.seq_len, self.files.shown(spec.data))
        return dict(self.shown(job), ok=True)

    def _register(self, name: str, path: str) -> int:
        """Serve the trained adapter (the scheduler's thread, between two steps)."""
        engine = self.sched.engine_up()
        adapter = engine.add_adapter(name, path)
        self.files.add(name, path)
        self.on_adapter()
        return adapter

    def shown(self, job: "TrainJob") -> Dict[str, Any]:
        """`job`'s report as a client sees it: its files relative to the models folder."""
        report = job.report()
        for key in ("out", "data"):
            if isinstance(report.get(key), str):
                report[key] = self.files.shown(report[key])
        if report.get("error"):
            report["error"] = self.files.scrub(report["error"])
        return report

    def report(self) -> Dict[str, Any]:
        job = self.sched.job
        if job is None:
            raise ApiError(404, "no training job has run on this server")
        return self.shown(job)

    def stop(self) -> Dict[str, Any]:
        job = self.sched.job
        if job is None or not job.active:
            raise ApiError(404, "no training job is running")
        try:
            self.sched.between_steps(job.stop, CALL_WAIT_S)
        except SchedulerError as e:
            raise ApiError(e.status, str(e), kind="server_error")
        from mdi.serving.train_job import STOP_WAIT_S  # (a job ran: torch is loaded)
        deadline = time.monotonic() + STOP_WAIT_S + CALL_WAIT_S
        while job.active and self.sched.alive:
            if time.monotonic() > deadline:
                raise ApiError(503, "the training job did not stop within %.0f s" % (STOP_WAIT_S + CALL_WAIT_S),
                               kind="server_error")
            time.sleep(STOP_POLL_S)
        return self.shown(job)
