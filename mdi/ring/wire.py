"""Data-plane wire format: a small msgpack header + one raw tensor buffer (contract).

A message is two zmq frames: [header, payload]. The header says which samples the payload
carries, at which positions, and its dtype and shape; the payload is the tensor's bytes, sent
and received without copies. `decode` validates every field before touching the buffer, so a
malformed or hostile frame raises `FrameError` and never allocates attacker-chosen memory.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import msgpack
import torch

from mdi.model.layout import DTYPES, dtype_name

PROTOCOL_VERSION = 1
# prefill/decode: a generation pass (the last node returns each sample's last position only);
# score: a pass whose every position comes back (perplexity), so its rows always equal sum(count).
KINDS = ("prefill", "decode", "score", "stop", "reset")
CODECS = ("raw",)
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 512 * 1024 * 1024
_HEADER_KEYS = {"v", "kind", "run", "samples", "start", "count", "dtype", "shape", "codec"}


class FrameError(ValueError):
    """A frame that fails validation; the message says why."""


@dataclass
class Frame:
    kind: str
    run: int
    samples: List[int] = field(default_factory=list)
    start: List[int] = field(default_factory=list)  # first position of each sample's tokens
    count: List[int] = field(default_factory=list)  # tokens per sample (rows in the tensor)
    tensor: Optional[torch.Tensor] = None  # [sum(count), hidden]

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


def encode(frame: Frame) -> List[Any]:
    """Header bytes + a zero-copy view of the tensor's memory."""
    t = frame.tensor
    header = {"v": PROTOCOL_VERSION, "kind": frame.kind, "run": frame.run, "samples": frame.samples,
              "start": frame.start, "count": frame.count, "codec": "raw",
              "dtype": dtype_name(t.dtype) if t is not None else None,
              "shape": list(t.shape) if t is not None else None}
    if t is None:
        return [msgpack.packb(header), b""]
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # A byte view works for every dtype, bfloat16 included (numpy has no bfloat16).
    return [msgpack.packb(header), memoryview(t.view(torch.uint8).reshape(-1).numpy())]


def _int_list(header: Dict[str, Any], key: str, n: int, lo: int, hi: int) -> List[int]:
    value = header.get(key)
    if not isinstance(value, list) or len(value) != n:
        raise FrameError("%s must be a list of %d integers" % (key, n))
    for x in value:
        if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
            raise FrameError("%s has a value outside [%d, %d]" % (key, lo, hi))
    return value


def decode(parts: Sequence[Any], run: Optional[int] = None, hidden: Optional[int] = None,
           n_slots: Optional[int] = None, max_len: int = 1 << 20,
           max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """Validate and decode [header, payload]. `run`, `hidden`, `n_slots` and `max_len` are what
    this node expects; frames that disagree are rejected."""
    if len(parts) != 2:
        raise FrameError("expected 2 parts (header, payload), got %d" % len(parts))
    raw_header, payload = parts
    raw_header = bytes(raw_header.buffer if hasattr(raw_header, "buffer") else raw_header)
    if len(raw_header) > MAX_HEADER_BYTES:
        raise FrameError("header of %d bytes exceeds %d" % (len(raw_header), MAX_HEADER_BYTES))
    try:
        header = msgpack.unpackb(raw_header, raw=False, strict_map_key=True,
                                 max_bin_len=0, max_ext_len=0, max_str_len=256,
                                 max_array_len=4096, max_map_len=32)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise FrameError("header is not valid msgpack: %s" % type(e).__name__)
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        raise FrameError("header must be a map with exactly the keys %s" % sorted(_HEADER_KEYS))
    if header["v"] != PROTOCOL_VERSION:
        raise FrameError("protocol version %r, expected %d" % (header["v"], PROTOCOL_VERSION))
    kind = header["kind"]
    if kind not in KINDS:
        raise FrameError("unknown kind %r" % (kind,))
    frame_run = header["run"]
    if not isinstance(frame_run, int) or isinstance(frame_run, bool):
        raise FrameError("run id must be an integer")
    if run is not None and frame_run != run:
        raise FrameError("stale frame from run %d (current run %d)" % (frame_run, run))
    if header["codec"] not in CODECS:
        raise FrameError("unknown codec %r" % (header["codec"],))
    samples = header["samples"]
    if not isinstance(samples, list):
        raise FrameError("samples must be a list")
    n = len(samples)
    slot_hi = (n_slots - 1) if n_slots is not None else (1 << 31)
    samples = _int_list(header, "samples", n, 0, slot_hi)
    if len(set(samples)) != n:
        raise FrameError("sample ids repeat")
    start = _int_list(header, "start", n, 0, max_len)
    count = _int_list(header, "count", n, 1, max_len)
    for s, c in zip(start, count):
        if s + c > max_len:
            raise FrameError("positions [%d, %d) exceed the cache length %d" % (s, s + c, max_len))
    pbytes = len(payload.buffer if hasattr(payload, "buffer") else payload)
    frame = Frame(kind, frame_run, samples, start, count)
    if kind in ("stop", "reset"):
        if header["dtype"] is not None or header["shape"] is not None or pbytes:
            raise FrameError("%s frames carry no tensor" % kind)
        return frame
    if n == 0:
        raise FrameError("%s frame names no sample" % kind)
    if kind == "decode" and any(c != 1 for c in count):
        raise FrameError("decode frames carry one token per sample")
    dtype = DTYPES[header["dtype"]][0] if isinstance(header["dtype"], str) and header["dtype"] in DTYPES else None
    if dtype is None:
        raise FrameError("dtype %r not in %s" % (header["dtype"], sorted(DTYPES)))
    shape = header["shape"]
    if not isinstance(shape, list) or len(shape) != 2:
        raise FrameError("shape must be [rows, hidden]")
    rows, width = _int_list(header, "shape", 2, 1, 1 << 24)
    if hidden is not None and width != hidden:
        raise FrameError("hidden size %d, expected %d" % (width, hidden))
    if rows not in ((sum(count),) if kind == "score" else (sum(count), n)):
        # All positions, or (generation passes only) each sample's last one.
        raise FrameError("shape rows %d do not match the token counts %s" % (rows, count))
    expected = rows * width * torch.tensor([], dtype=dtype).element_size()
    if expected > max_payload:
        raise FrameError("payload of %d bytes exceeds the %d-byte limit" % (expected, max_payload))
    if pbytes != expected:
        raise FrameError("payload has %d bytes, shape x dtype needs %d" % (pbytes, expected))
    buf = payload.buffer if hasattr(payload, "buffer") else payload
    # zmq's buffer is read-only and nothing writes activations in place, so wrapping it without
    # a copy is safe (torch warns about it once; entry points silence that warning).
    frame.tensor = torch.frombuffer(buf, dtype=dtype).view(rows, width)
    return frame
