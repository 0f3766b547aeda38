"""The starter: loads its chunk, configures the workers, drives the ring, gathers metrics."""
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from mdi.runconfig import RunConfig
from mdi.system.interrupt import Interrupted  # (batch.Interrupted: the name the CLI catches)
from mdi.starter.engine import Engine
from mdi.starter.node_report import NodeReport, ring_reports, starter_report
from mdi.model.source import ModelSource
from mdi.starter.sample import FinishReason, Sample
from mdi.starter.planning.run_plan import plan_run
from mdi.starter.planning.run_shape import batch_samples, batch_shape
from mdi.model.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    samples: List[Sample]
    texts: List[str]
    elapsed: float
    nodes: List[NodeReport]  # the ring's, starter first
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def metrics(self) -> Dict[str, Any]:
        record = {
            "samples": [{"prompt": s.prompt, "prompt_ids": s.prompt_ids[s.virtual:], "token_ids": s.token_ids,
                         "text": text, "token_times": [round(t, 6) for t in s.token_times],
                         "finish_reason": s.finish_reason, **({"error": s.error} if s.error else {}),
                         **({"adapter": s.adapter} if s.adapter else {}),
                         **({"virtual_tokens": s.virtual} if s.virtual else {})}
                        for s, text in zip(self.samples, self.texts)],
            "n_tokens": self.n_tokens, "seconds": self.elapsed,
            "tokens_per_s": self.tokens_per_s, "n_nodes": len(self.nodes), "nodes": [n.to_json() for n in self.nodes],
        }
        record.update(self.extra)
        return record


def run(cfg: RunConfig, prompts: List[str],
        on_token: Optional[Callable[[Sample, int], None]] = None,
        on_engine: Optional[Callable[[Engine], None]] = None,
        adapters: Sequence[str] = ()) -> RunResult:
    """Generate every prompt's sample; `on_token` is called after each token, `on_engine` with
    the engine before it opens the ring (a dashboard watches the run through it). `adapters`:
    the adapter name of each prompt in turn (the rest run on the base)."""
    begun = time.perf_counter()
    source = ModelSource(cfg.model.path)
    gen = cfg.generation
    samples, adapter_set = batch_samples(cfg, source, prompts, adapters)
    shape = batch_shape(source.config, samples, gen.n_tokens)
    params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)

    plan = plan_run(cfg, source, shape, params)  # layers: auto measures the nodes here
    engine = Engine(plan, source, params, on_token, adapters=adapter_set)
    plan_record = plan.metrics()
    if on_engine is not None:
        on_engine(engine)
    try:
        engine.open()
    except (KeyboardInterrupt, Interrupted):
        engine.abort()  # workers configured so far drop the run now
        raise
    plan_record["startup_seconds"] = round(time.perf_counter() - begun, 3)  # reading, planning, loading, the ring
    try:
        engine.run(samples)
        elapsed = time.perf_counter() - engine.t0
        ended: Optional[str] = None
        try:
            workers = engine.close()
        except RuntimeError as e:  # every sample is complete: a node lost now costs only its counters
            log.warning("mdi: every sample is complete, but ending the ring failed (the workers' counters are "
                        "missing): %s", e)
            engine.abort()
            workers, ended = [], str(e)
    except (RuntimeError, KeyboardInterrupt, Interrupted) as e:
        # Keep what was generated: the caller still prints it and writes the metrics. Ending
        # the ring tells every worker at once, instead of after its heartbeat timeout.
        engine.abort()
        partial = _result(engine, samples, time.perf_counter() - engine.t0, [])
        partial.extra.update(plan_record)
        signum = e.signum if isinstance(e, Interrupted) else (signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
        partial.extra["error"] = ("interrupted by %s" % signal.Signals(signum).name if signum is not None
                                  else str(e) or type(e).__name__)
        raise RunFailed(partial.extra["error"], partial, signum)
    result = _result(engine, samples, elapsed, workers)
    result.extra.update(plan_record)
    if ended is not None:
        result.extra["ring_end_error"] = ended
    return result


class RunFailed(RuntimeError):
    """The run stopped early; `result` holds everything done until then (a RunResult here,
    a PerplexityResult for mdi.starter.perplexity), `signum` the signal that stopped it (None
    for a failure)."""

    def __init__(self, message: str, result: Any, signum: Optional[int] = None) -> None:
        super().__init__(message)
        self.result = result
        self.signum = signum


def _result(engine: Engine, samples: List[Sample], elapsed: float, workers: List[NodeReport]) -> RunResult:
    pipeline = engine.live_pipeline
    starter = starter_report(engine, pipeline.compute_seconds)
    engine.live_chunk.free_cache()
    # Every node of the ring is listed; a run that failed has no counters from the workers.
    nodes = ring_reports(engine, starter, workers)
    texts = [decode_generated(engine.source, s) for s in samples]
    extra: Dict[str, Any] = {"recoveries": [r.to_json() for r in engine.recoveries]} if engine.recoveries else {}
    extra["context"] = engine.source.config.block_size
    if pipeline.context_shifts:
        extra["context_shifts"] = pipeline.context_shifts
    return RunResult(samples, texts, elapsed, nodes, extra)


def decode_generated(source: ModelSource, sample: Sample) -> str:
    ids = sample.token_ids
    if sample.finish_reason == FinishReason.EOS:
        ids = ids[:-1]  # the EOS token ends the text; it is not part of it
    if source.tokenizer is None:  # a batch run's prompts were encoded with it
        raise ValueError("%s: no tokenizer to decode the generated text with" % source.path)
    return source.tokenizer.decode(ids)
