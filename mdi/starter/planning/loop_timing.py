"""The starter's whole pass, timed: what the planner's profile of blocks, head and sampling
leaves out.

Per pass the starter also runs the pipeline's own Python (grouping samples, building the
batch, bookkeeping each token), hands the frame to zmq, wakes on the frame coming back, and
shares its CPU with its send and receive threads. On a small model whose stages take a few ms
that was a quarter of the starter's stage (GPT-2 12L/384 on a 1-core emulated board: 14 ms per
pass in the ring against 10 ms profiled), and the plan predicted 1.3-2x the tokens/s the ring
made. So the starter runs its real loop, a `Pipeline` over random blocks with the embedding and
head, its frames going out and straight back through a data-plane endpoint connected to itself
on loopback (mdi.timing.relay, which times a worker's pass the same way), and times a pass
at each batch size.
"""
import time
from typing import Any, Dict, Optional, Sequence

from mdi.model.timing_loop import MIN_WINDOW_S, ROUNDS
from mdi.model.sampling import SamplingParams, sample_generator
from mdi.timing.relay import RUN_ID, WAIT_S, looped_endpoint
from mdi.ring.transport import RingEndpoint
from mdi.starter.pass_compute import inference_mode
from mdi.starter.pipeline import Pipeline
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.sample import Sample

MAX_STEPS = 256  # decode passes per timed round (positions 1..MAX_STEPS: a short context)


def time_starter_loop(chunk: Any, batch_sizes: Sequence[int], params: SamplingParams,
                      codec: str = "raw", token: Optional[str] = None) -> Dict[int, float]:
    """Seconds per decode pass of the starter's loop over `chunk` (embedding, its blocks and
    head) for each number of samples in `batch_sizes`, the frames looping back to itself."""
    config = chunk.config
    rows_max = max(batch_sizes)
    max_len = min(config.block_size, MAX_STEPS + 4)
    chunk.allocate_cache(rows_max, max_len)
    endpoint = looped_endpoint(config.n_embd, rows_max, max_len, codec, token)
    try:
        out = {}
        for rows in sorted(set(batch_sizes)):
            rounds = sorted(_one_round(chunk, endpoint, RUN_ID, rows, params, max_len) for _ in range(ROUNDS))
            out[rows] = rounds[len(rounds) // 2]
        return out
    finally:
        endpoint.close()
        chunk.free_cache()


def _one_round(chunk: Any, endpoint: RingEndpoint, run_id: int, rows: int, params: SamplingParams,
               max_len: int) -> float:
    pipe = Pipeline(chunk, endpoint, run_id, params, None, PipelineSettings(max_batch=rows, recv_timeout=WAIT_S))
    for i in range(rows):
        pipe.admit(Sample(i, "", [i % chunk.config.vocab_size], max_len, sample_generator(1, i)))
    steps = max_len - 3
    for _ in range(2):  # the one-token prefill, then a first decode pass: not timed
        _step(pipe)
        steps -= 1
    n, t0 = 0, time.perf_counter()
    while n < 2 or (time.perf_counter() - t0 < MIN_WINDOW_S and n < steps):
        _step(pipe)
        n += 1
    elapsed = (time.perf_counter() - t0) / n
    for sample in pipe.active.values():  # nothing is left travelling for the next round
        sample.cancelled = True
    while pipe.active:
        _step(pipe)
    return elapsed


def _step(pipe: Pipeline) -> None:
    with inference_mode(pipe.chunk):
        if not pipe.step(WAIT_S):
            raise RuntimeError("the starter's timing loop got no frame back within %.0f s" % WAIT_S)
