"""A node's whole pass, timed on a data plane looped back to itself.

Besides its blocks a node pays, per pass, for the frame: zmq taking it in and handing it out,
the receive thread validating it, the send thread, the Python around the forward. On a board
under a CPU quota those threads eat into the same quota as the blocks: a 0.5-core board ran 4
layers of a small GPT-2 in 9-13 ms and passed a frame on every ~17 ms in the ring, where blocks
and codec alone were profiled at ~12.5 ms. So /profile also times the real thing: an endpoint
connected to itself, each frame that comes back run through random blocks and sent again.
"""
import contextlib
import socket
import sys
import time
from typing import Any, Dict, Optional, Sequence

import numpy as np

from mdi.model.pass_rows import PassRows
from mdi.model.timing_loop import MIN_WINDOW_S, ROUNDS, seconds_per_call
from mdi.ring.auth import ring_password
from mdi.ring.transport import RingEndpoint
from mdi.ring.wire import Frame, FrameKind, decode, encode

WAIT_S = 10.0  # for a frame to come back round the loop
RUN_ID = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def looped_endpoint(hidden: int, n_slots: int, max_len: int, codec: str = "raw",
                    token: Optional[str] = None) -> RingEndpoint:
    """A data-plane endpoint on a free loopback port whose next node is itself, validating as a
    run's would (CURVE-encrypted when the node has a token, as its runs are)."""
    port = _free_port()
    endpoint = RingEndpoint("profile", "127.0.0.1", port,
                            lambda parts: decode(parts, run=RUN_ID, hidden=hidden, n_slots=n_slots, max_len=max_len),
                            ring_password(token, RUN_ID) if token else None, codec=codec)
    endpoint.connect("127.0.0.1", port)
    return endpoint


def frame_seconds(rows: int, width: int, dtype: Any = None) -> float:
    """Encoding one frame of `rows` activations and decoding (validating) it again: what a node
    spends on every hop besides its blocks and the socket (torch's codecs where torch is loaded,
    numpy's in a node without it; `dtype`: a torch dtype, float32 when None)."""
    torch = sys.modules.get("torch")
    zeros = np.zeros((rows, width), np.float32) if torch is None else \
        torch.zeros(rows, width, dtype=dtype if dtype is not None else torch.float32)
    frame = Frame(FrameKind.DECODE, 1, list(range(rows)), [0] * rows, [1] * rows, zeros)

    def hop() -> Frame:
        return decode([bytes(p) for p in encode(frame)], run=1, hidden=width, n_slots=rows, max_len=2)
    return seconds_per_call(hop, min_window=0.05)


def time_relay(chunk: Any, batch_sizes: Sequence[int], context: int, codec: str = "raw",
               token: Optional[str] = None) -> Dict[int, float]:
    """Seconds per pass of a worker's loop over `chunk` (a torch or a ggml one): a frame of
    `rows` one-row samples at position `context` received, run through the blocks and sent on,
    for each size."""
    config = chunk.config
    rows_max = max(batch_sizes)
    max_len = min(config.block_size, context + 1)
    context = max_len - 1
    chunk.allocate_cache(rows_max, max_len)
    endpoint = looped_endpoint(config.n_embd, rows_max, max_len, codec, token)
    forward, zeros = _forward(chunk)
    out = {}
    torch = sys.modules.get("torch")
    try:
        with torch.inference_mode() if torch is not None else contextlib.nullcontext():
            for rows in sorted(set(batch_sizes)):
                slots = list(range(rows))
                endpoint.send(Frame(FrameKind.DECODE, RUN_ID, slots, [context] * rows, [1] * rows,
                                    zeros(rows, config.n_embd)))

                def relay() -> None:
                    frame = endpoint.recv(WAIT_S)
                    y = forward(frame)
                    endpoint.send(Frame(FrameKind.DECODE, RUN_ID, frame.samples, frame.start, frame.count, y))
                relay()  # warm
                rounds = []
                for _ in range(ROUNDS):
                    n, t0 = 0, time.perf_counter()
                    while n < 2 or time.perf_counter() - t0 < MIN_WINDOW_S:
                        relay()
                        n += 1
                    rounds.append((time.perf_counter() - t0) / n)
                out[rows] = sorted(rounds)[len(rounds) // 2]
                endpoint.recv(WAIT_S)  # the frame still travelling
        return out
    finally:
        endpoint.close()
        chunk.free_cache()


def _forward(chunk: Any) -> Any:
    """(a frame -> the chunk's output rows, rows x width zeros) in the chunk's own terms."""
    if chunk.backend == "ggml":
        return ((lambda frame: chunk.forward_rows(frame.tensor, PassRows(frame.samples, frame.start, frame.count))),
                (lambda rows, width: np.zeros((rows, width), np.float32)))
    import torch
    from mdi.model.row_batch import RowBatch
    from mdi.system.transfers import to_device, to_host
    cache = chunk.cache
    dtype, device = cache.k.dtype, cache.k.device  # the activations' dtype and device

    def forward(frame: Frame) -> Any:
        assert frame.tensor is not None  # the decode frames looped here always carry their rows
        batch = RowBatch.of(frame.samples, frame.start, frame.count, device)
        return to_host(chunk.forward_rows(to_device(frame.tensor, device, dtype), batch))
    return forward, (lambda rows, width: torch.zeros(rows, width, dtype=dtype))
