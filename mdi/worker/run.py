"""One run on a worker: its data-plane endpoint and the compute loop that pops a frame,
selects each sample's KV cache slot, runs this node's blocks and pushes the result on."""
import logging
import threading
import time
from typing import Optional

import torch

from mdi.model.transformer import ModelChunk
from mdi.ring.init_request import InitRequest
from mdi.ring.transport import RingEndpoint, RingTimeout
from mdi.ring.wire import Frame

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT = 8.0  # seconds without any sign of the starter before a run ends


class Run:
    """One run's state on this worker: its id, data-plane endpoint and compute thread."""

    def __init__(self, request: InitRequest, chunk: ModelChunk, endpoint: RingEndpoint, peer: str = "?",
                 threads: Optional[int] = None) -> None:
        self.request = request
        self.id = request.run_id
        self.chunk = chunk
        self.endpoint = endpoint
        self.peer = peer
        self.threads = threads
        self.is_last = request.data.is_last
        hb = request.heartbeat_timeout
        self.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT if hb is None else hb
        self.stopped = threading.Event()
        # Set before the stop frame is passed on: from then on the run no longer holds the
        # worker (its starter may send the next /init before this thread has finished).
        self.ending = threading.Event()
        self.frames_done = 0
        self.compute_seconds = 0.0  # time spent in _forward: per-node step time for /metrics
        self.error = None  # type: Optional[str]
        self.thread = threading.Thread(target=self._compute_loop, name="mdi-compute", daemon=True)

    def holds_worker(self) -> bool:
        """Whether this run still holds the worker: not stopped, no stop frame seen."""
        return not (self.stopped.is_set() or self.ending.is_set())

    def _compute_loop(self) -> None:
        try:
            if self.threads:
                # torch reads its thread count per thread on first use: set it in this thread too.
                torch.set_num_threads(self.threads)
            with torch.inference_mode():
                while not self.stopped.is_set():
                    try:
                        frame = self.endpoint.recv(timeout=0.1)
                    except RingTimeout:
                        continue
                    if frame.kind in ("stop", "reset"):
                        if frame.kind == "stop":
                            self.ending.set()
                        self.endpoint.send(frame)
                        if frame.kind == "stop":
                            self.endpoint.flush(timeout=5)
                            self.stopped.set()
                        continue
                    t0 = time.perf_counter()
                    out = self._forward(frame)
                    self.compute_seconds += time.perf_counter() - t0
                    self.endpoint.send(out)
                    self.frames_done += 1
        except Exception as e:  # report, never die silently
            if self.stopped.is_set():  # the run was ended under a long computation: not its failure
                log.info("compute loop ended after its run was stopped: %s", e)
            else:
                self.error = "%s: %s" % (type(e).__name__, e)
                log.exception("compute loop failed")
        finally:
            self.stopped.set()
            self.chunk.free_cache()  # a finished or failed run gives its cache memory back
            # Unbind the data port now, not at the next /init: a neighbour configured for the
            # next run must find nothing there (and retry) rather than this run's socket.
            self.endpoint.close()

    def _forward(self, frame: Frame) -> Frame:
        p = next(self.chunk.parameters())
        x = frame.tensor.to(device=p.device, dtype=self.chunk.compute_dtype or p.dtype)
        # For generation the starter needs only each sample's last position to pick the next
        # token; a score pass (perplexity) needs every position's.
        last_only = self.is_last and frame.kind != "score"
        outs, row = [], 0
        for slot, start, count in zip(frame.samples, frame.start, frame.count):
            y = self.chunk.forward_blocks(x[row:row + count], slot, start)
            row += count
            outs.append(y[-1:] if last_only else y)
        return Frame(frame.kind, frame.run, frame.samples, frame.start, frame.count, torch.cat(outs))

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.endpoint.close()
        self.chunk.free_cache()
