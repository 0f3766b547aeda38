"""The starter: loads its chunk, configures the workers, drives the ring, gathers metrics."""
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from .config import ConfigError, RunConfig, partition
from .loading import ModelSource, build_chunk, torch_dtype
from .pipeline import LocalLoop, Pipeline, Sample, make_samples
from .sampling import SamplingParams
from .wire import Frame


class RunError(RuntimeError):
    """A run that failed; the message names the node and what went wrong."""


@dataclass
class RunResult:
    samples: List[Sample]
    texts: List[str]
    elapsed: float
    nodes: List[Dict[str, Any]]
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def metrics(self) -> Dict[str, Any]:
        record = {
            "samples": [{"prompt": s.prompt, "prompt_ids": s.prompt_ids, "token_ids": s.token_ids,
                         "text": text, "token_times": [round(t, 6) for t in s.token_times],
                         "finish_reason": s.finish_reason}
                        for s, text in zip(self.samples, self.texts)],
            "n_tokens": self.n_tokens, "seconds": self.elapsed,
            "tokens_per_s": self.tokens_per_s, "n_nodes": len(self.nodes), "nodes": self.nodes,
        }
        record.update(self.extra)
        return record


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def layer_ranges(counts: List[int]) -> List[List[int]]:
    """Half-open [first, last) ranges for consecutive layer counts."""
    ranges, first = [], 0
    for c in counts:
        ranges.append([first, first + c])
        first += c
    return ranges


def encode_prompts(source: ModelSource, prompts: List[str], n_tokens: int) -> List[List[int]]:
    tok = source.tokenizer
    if tok is None:
        raise ConfigError("%s: no tokenizer found for this model" % source.path)
    block = source.config.block_size
    out = []
    for p in prompts:
        ids = tok.encode(p)
        if not ids:
            start = tok.bos_id if tok.bos_id is not None else tok.eos_id
            if start is None:
                raise ConfigError("prompt is empty and the tokenizer has no BOS/EOS token to start from")
            ids = [start]
        if len(ids) >= block:
            raise ConfigError("prompt of %d tokens does not fit the model's context of %d tokens"
                              % (len(ids), block))
        out.append(ids)
    return out


def run(cfg: RunConfig, prompts: List[str], log: Callable[[str], None] = print,
        on_token: Optional[Callable[[Sample, int], None]] = None) -> RunResult:
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    source = ModelSource(cfg.model.path)
    config = source.config
    counts = partition(config.n_layer, cfg.nodes, cfg.source)
    ranges = layer_ranges(counts)
    dtype = torch_dtype(cfg.model.dtype)
    device = cfg.starter.device or cfg.model.device
    gen = cfg.generation
    prompt_ids = encode_prompts(source, prompts, gen.n_tokens)
    # A sample stops at the context end even if n_tokens asks for more.
    max_new = min(gen.n_tokens, config.block_size - max(len(ids) for ids in prompt_ids))
    max_len = max(len(ids) for ids in prompt_ids) + max_new
    samples = make_samples(prompts, prompt_ids, max_new, gen.seed)

    first, last = ranges[0]
    chunk = build_chunk(config, source.weights(first, last, True, True, dtype),
                        first, last, True, True, dtype, device)
    chunk.allocate_cache(len(samples), max_len)
    params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)
    eos = source.tokenizer.eos_id if source.tokenizer is not None else config.eos_token_id
    run_id = random.getrandbits(62)

    ring = None
    if cfg.workers:
        from .ring_starter import RingSession
        ring = RingSession(cfg, source, ranges, run_id, len(samples), max_len, dtype, log)
        transport = ring.start()
    else:
        transport = LocalLoop()
    pipeline = Pipeline(chunk, transport, run_id, params, eos, cfg.runtime.ring_timeout, on_token,
                        ring.check if ring is not None else None)
    t0 = time.perf_counter()
    worker_stats = []  # type: List[Dict[str, Any]]
    try:
        pipeline.run(samples, t0)
        elapsed = time.perf_counter() - t0
        if ring is not None:
            worker_stats = ring.finish()
    except (RuntimeError, KeyboardInterrupt) as e:
        # Keep what was generated: the caller still prints it and writes the metrics.
        if ring is not None:
            ring.abort()
        partial = _result(cfg, source, samples, time.perf_counter() - t0, ranges, chunk, transport, [])
        partial.extra["error"] = str(e) or type(e).__name__
        raise RunFailed(partial.extra["error"], partial)
    return _result(cfg, source, samples, elapsed, ranges, chunk, transport, worker_stats)


class RunFailed(RuntimeError):
    """The run stopped early; `result` holds everything generated until then."""

    def __init__(self, message: str, result: RunResult) -> None:
        super().__init__(message)
        self.result = result


def _result(cfg: RunConfig, source: ModelSource, samples: List[Sample], elapsed: float,
            ranges: List[List[int]], chunk, transport, worker_stats: List[Dict[str, Any]]) -> RunResult:
    first, last = ranges[0]
    starter_node = {"name": cfg.starter.name, "layers": [first, last - 1], "peak_memory_bytes": peak_rss_bytes(),
                    "cache_bytes": chunk.cache.nbytes if chunk.cache is not None else 0}
    starter_node.update(transport.traffic() if hasattr(transport, "traffic") else {"bytes_sent": 0, "messages_sent": 0})
    nodes = [starter_node]
    chunk.free_cache()
    for node, (a, b), stats in zip(cfg.workers, ranges[1:], worker_stats):
        entry = {"name": node.name, "layers": [a, b - 1]}
        entry.update(stats)
        nodes.append(entry)
    texts = [decode_generated(source, s) for s in samples]
    return RunResult(samples, texts, elapsed, nodes)


def decode_generated(source: ModelSource, sample: Sample) -> str:
    ids = sample.token_ids
    if sample.finish_reason == "eos":
        ids = ids[:-1]  # the EOS token ends the text; it is not part of it
    return source.tokenizer.decode(ids)
