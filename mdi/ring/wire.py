"""Data-plane wire format: a small msgpack header + one tensor buffer (contract).

A message is two zmq frames: [header, payload]. The header says which samples the payload
carries, at which positions, the activation's dtype and shape, and the codec the payload is
encoded with; the raw payload is the tensor's bytes, sent and received without copies. `decode`
validates every field before touching the buffer, so a malformed or hostile frame raises
`FrameError` and never allocates attacker-chosen memory.

Codecs (header "codec"; header "dtype" is always the activation dtype that `decode` returns):
  raw       the tensor's own bytes (zero-copy both ways).
  float16   the values cast to float16, 2 bytes each; decoded = x.to(float16).to(dtype).
  bfloat16  the same with bfloat16.
  int8      blockwise absmax, like GGUF's Q8_0, plus each row's outliers kept exact-ish: the
            INT8_OUTLIERS = 2 values of largest magnitude of every row are sent apart (int16
            column, float16 value) and zeroed before the blocks are made. The rest of the row
            is cut into blocks of INT8_BLOCK = 32 values (a row's last block is shorter when
            width % 32 != 0); each block has one float16 scale = absmax / 127 and values
            round(x / scale) in [-127, 127]. Payload, one contiguous buffer, each part
            row-major: the int8 values (rows * width bytes), the float16 scales
            (rows * ceil(width / 32) * 2), the outliers' int16 columns (rows * 2 * 2), their
            float16 values (rows * 2 * 2). A 576-wide float32 decode hop shrinks to 0.269 of
            its raw size. Why the outliers: the residual stream has a few "massive" channels
            (SmolLM2: ~100x the median value of a row); a block holding one rounds its 31
            neighbours to a few levels, and plain Q8_0 activations changed a third of
            SmolLM2's greedy tokens (scripts/bench_wire_codec.py), two outliers per row ~1.7%.
"""
from dataclasses import dataclass, field
from typing import Any, Container, Dict, List, Optional, Sequence

import sys

import msgpack

from mdi.model.layout import DTYPE_BYTES, WIRE_CODECS, dtype_name
from mdi.model.prefix_store import OP_KINDS, CacheOp
from mdi.ring import wire_numpy
from mdi.ring.wire_format import INT8_BLOCK, INT8_MAX_WIDTH, INT8_OUTLIERS, FrameError  # noqa: F401  (named from here)
from mdi.ring.wire_format import outliers as _outliers
from mdi.system.str_enum import StrEnum

# v2: frames carry a payload codec and the "score" kind; a v1 peer would misread both.
# v3: each sample's adapter id ("adapter"); a v2 peer would run every sample on the base.
# v4: the "verify" kind and each pass's epoch ("epoch"); a v3 peer would cut a verification's rows.
# v5: prefix cache ops ("cache"); a v4 peer would compute on positions its slot does not hold.
# v6: the training kinds ("train", "grad", "step", "eval", "clip") and their "train" header; a v5
# peer would refuse them as unknown kinds one frame at a time instead of at the first frame.
# v7: the "state" kind and the train header's copy flag; a v6 worker would run a "state" copy
# as work or refuse it, and would not send the copies a v7 starter waits for.
PROTOCOL_VERSION = 7


class FrameKind(StrEnum):
    """What a frame is; the value is the header's "kind" string."""
    PREFILL = "prefill"  # a generation pass: the last node returns each sample's last position only
    DECODE = "decode"  # a generation pass of one token per sample
    # A speculative pass: each sample's last token and the tokens drafted after it, at
    # consecutive positions; every row comes back, so the starter can check every draft.
    VERIFY = "verify"
    SCORE = "score"  # every position comes back (perplexity): its rows always equal sum(count)
    STOP = "stop"  # the end of a run, sent round the ring
    RESET = "reset"  # a probe round the ring before samples enter it
    # Training (mdi.starter.train.training, mdi.worker.training): a micro-batch of whole windows from
    # position 0, every row carried; "grad" the gradient of the loss for the hidden states at a
    # layer boundary, travelling the ring's one direction until the node whose chunk ends there;
    # "step" tells every node that a batch's gradients are complete (no tensor); "eval" a
    # held-out micro-batch's forward, nothing kept for backward; "clip" (--clip) one value in a
    # [1, hidden] tensor's first element: going round with train layer 0 each node adds its
    # gradients' squared norm to it, with layer 1 it is the scale every node multiplies them by.
    TRAIN = "train"
    GRAD = "grad"
    STEP = "step"
    EVAL = "eval"
    CLIP = "clip"
    # A copy of a training forward's hidden states entering layer `train.layer`, sent by the
    # worker whose chunk ends there when the forward asked for copies (the train header's 4th
    # element, 1); every other worker passes it on, so it reaches the starter (the states between
    # two workers, which the starter's RemoteBlocks returns as node boundaries).
    STATE = "state"


_KIND_OF = {k.value: k for k in FrameKind}  # a dict lookup, where FrameKind(value) runs enum's Python code
GENERATION_KINDS = (FrameKind.PREFILL, FrameKind.DECODE, FrameKind.VERIFY)
TRAINING_KINDS = (FrameKind.TRAIN, FrameKind.GRAD, FrameKind.STEP, FrameKind.EVAL, FrameKind.CLIP, FrameKind.STATE)
# the last node returns every row, not each sample's last
ALL_ROWS_KINDS = (FrameKind.SCORE, FrameKind.VERIFY, FrameKind.TRAIN, FrameKind.GRAD, FrameKind.EVAL, FrameKind.CLIP,
                  FrameKind.STATE)
CODECS = WIRE_CODECS
_CAST = ("float16", "bfloat16")  # codecs that are a plain cast
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 512 * 1024 * 1024
_HEADER_KEYS = {"v", "kind", "run", "samples", "start", "count", "dtype", "shape", "codec"}
# "adapter" (each sample's adapter id) is there only when a sample runs with one: the base
# alone costs no header bytes. "epoch" likewise only in runs that speculate.
MAX_ADAPTER_ID = 1 << 16  # adapter ids 1..this (mdi.ring.adapter_request); 0 is the base
MAX_EPOCH = (1 << 62) - 1
MAX_ENTRY = (1 << 62) - 1  # prefix cache entry ids (mdi.starter.prefix_cache)
# "cache": the prefix cache ops every node carries out before computing the frame, in order
# (mdi.model.prefix_store), as [kind, entry, slot, length] lists; only in frames that bring some.
# "train": [step, micro-batch, layer] on training frames only, and always there: the batch
# step, the micro-batch within it (a step frame: how many the batch had) and the layer boundary
# the tensor is at (a train frame: the first layer of the node it goes to; a grad frame: the
# last layer + 1 of the node that computes with it; a step frame: 0; a clip frame: its phase),
# then, on a train or eval frame only, an optional 1: every worker sends a "state" copy of its output.
_OPTIONAL_KEYS = {"adapter", "epoch", "cache", "train"}
_ALL_KEYS = _HEADER_KEYS | _OPTIONAL_KEYS
MAX_STEP = (1 << 62) - 1
MAX_MICRO = 1 << 16
MAX_TRAIN_SAMPLES = 1 << 16  # windows of one micro-batch (they name no cache slot)


@dataclass(frozen=True)
class TrainTag:
    """Where a training frame belongs (the header's "train"; see _OPTIONAL_KEYS)."""
    step: int
    micro: int  # a step frame: the micro-batches of the batch
    layer: int
    copy: bool = False  # a train or eval forward whose every worker sends back a "state" copy of its output


@dataclass
class Frame:
    kind: str  # a FrameKind (its string, as frames are built with either)
    run: int
    samples: List[int] = field(default_factory=list)
    start: List[int] = field(default_factory=list)  # first position of each sample's tokens
    count: List[int] = field(default_factory=list)  # tokens per sample (rows in the tensor)
    # [sum(count), hidden]: a torch tensor where the process has torch loaded, else a numpy
    # array (a node computing with ggml: mdi.ring.wire_numpy decodes its frames)
    tensor: Optional[Any] = None
    adapters: List[int] = field(default_factory=list)  # each sample's adapter id (0: the base); [] = all 0
    # Each sample's pass epoch (speculation): the starter starts a new epoch for a sample when a
    # verification rejects, so any node that sees a later epoch for a slot may drop the earlier
    # passes still queued (mdi.worker.run). [] = all 0 (runs that do not speculate).
    epochs: List[int] = field(default_factory=list)
    cache_ops: List[CacheOp] = field(default_factory=list)  # prefix cache ops, applied before the frame's compute
    train: Optional["TrainTag"] = None  # training frames only

    def adapter_ids(self) -> List[int]:
        return list(self.adapters) if self.adapters else [0] * len(self.samples)

    def epoch_ids(self) -> List[int]:
        return list(self.epochs) if self.epochs else [0] * len(self.samples)

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else int(self.tensor.nbytes)


def payload_nbytes(rows: int, width: int, dtype: Any, codec: str) -> int:
    """Bytes of a [rows, width] activation of `dtype` (a name, or a torch / numpy dtype)
    encoded with `codec` (the one home of the size arithmetic: encode's output and decode's
    check agree through it). Activations are floats: DTYPE_BYTES names the ones accepted."""
    if codec not in CODECS:
        raise FrameError("unknown codec %r (known: %s)" % (codec, ", ".join(CODECS)))
    try:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    except KeyError:
        name = None
    if name not in DTYPE_BYTES:
        what = "codec %s needs a float dtype" % codec if codec != "raw" else "dtype must be one of %s" % sorted(DTYPE_BYTES)
        raise FrameError("%s, not %s" % (what, dtype))
    if codec == "raw":
        return rows * width * DTYPE_BYTES[name]
    if codec in _CAST:
        return rows * width * 2
    if width > INT8_MAX_WIDTH:
        raise FrameError("codec int8 carries rows of at most %d values, not %d" % (INT8_MAX_WIDTH, width))
    # int8 values + float16 block scales + (int16 column, float16 value) per outlier
    return rows * width + rows * -(-width // INT8_BLOCK) * 2 + rows * _outliers(width) * 4


def encode(frame: Frame, codec: str = "raw") -> List[Any]:
    """Header bytes + the payload: a zero-copy view of the tensor's memory for raw, one
    converted copy for the other codecs."""
    if codec not in CODECS:
        raise ValueError("unknown codec %r (known: %s)" % (codec, ", ".join(CODECS)))
    t = frame.tensor
    header = {"v": PROTOCOL_VERSION, "kind": frame.kind, "run": frame.run, "samples": frame.samples,
              "start": frame.start, "count": frame.count, "codec": codec,
              "dtype": dtype_name(t.dtype) if t is not None else None,
              "shape": list(t.shape) if t is not None else None}
    if any(frame.adapters):
        header["adapter"] = frame.adapter_ids()
    if any(frame.epochs):
        header["epoch"] = frame.epoch_ids()
    if frame.cache_ops:
        header["cache"] = [[op.kind, op.entry, op.slot, op.length] for op in frame.cache_ops]
    if frame.train is not None:
        header["train"] = [frame.train.step, frame.train.micro, frame.train.layer] + ([1] if frame.train.copy else [])
    if t is None:
        return [msgpack.packb(header), b""]
    return [msgpack.packb(header), _codecs(t).encode_payload(t, codec)]


def _codecs(t: Any = None) -> Any:
    """The codec arithmetic for `t` (a numpy array, or a torch tensor), or for decoding here:
    torch's where this process has torch loaded, numpy's in a node that computes without it."""
    if t is not None and not hasattr(t, "detach"):
        return wire_numpy
    if t is not None or "torch" in sys.modules:
        # looked up, not imported, once loaded: an import statement runs importlib's Python
        # code, and a hop's Python runs cold after each graph
        codecs = sys.modules.get("mdi.ring.wire_torch")
        if codecs is None:
            from mdi.ring import wire_torch as codecs
        return codecs
    return wire_numpy


# The torch codec's parts, named from here as they always were (tests, benchmarks): imported when asked for.
_TORCH_NAMES = ("quantize_int8_blocks", "dequantize_int8_blocks", "quantize_int8", "dequantize_int8", "Int8Rows")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from mdi.ring import wire_torch
        return getattr(wire_torch, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _int_list(header: Dict[str, Any], key: str, n: int, lo: int, hi: int) -> List[int]:
    value = header.get(key)
    if not isinstance(value, list) or len(value) != n:
        raise FrameError("%s must be a list of %d integers" % (key, n))
    for x in value:
        if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
            raise FrameError("%s has a value outside [%d, %d]" % (key, lo, hi))
    return value


def _cache_ops(value: Any, n_slots: Optional[int], max_len: int) -> List[CacheOp]:
    """The "cache" header: a non-empty list of [kind, entry, slot, length], each in range."""
    if not isinstance(value, list) or not value:
        raise FrameError("cache must be a non-empty list of [kind, entry, slot, length]")
    slot_hi = (n_slots - 1) if n_slots is not None else (1 << 31)
    ops = []
    for raw in value:
        if not isinstance(raw, list) or len(raw) != 4 or raw[0] not in OP_KINDS:
            raise FrameError("cache ops are [kind, entry, slot, length] with kind one of %s" % ", ".join(OP_KINDS))
        kind = raw[0]
        entry, slot, length = _int_list({"cache op": raw[1:]}, "cache op", 3, 0, MAX_ENTRY)
        if entry < 1 or slot > slot_hi or (kind == "drop" and (slot or length)) \
                or (kind != "drop" and not 1 <= length <= max_len):
            raise FrameError("cache op %s has an entry, slot or length outside its range" % kind)
        ops.append(CacheOp(kind, entry, slot, length))
    return ops


def decode(parts: Sequence[Any], run: Optional[int] = None, hidden: Optional[int] = None,
           n_slots: Optional[int] = None, max_len: int = 1 << 20,
           max_payload: int = DEFAULT_MAX_PAYLOAD, adapters: Optional[Container[int]] = None,
           host_kinds: Container[str] = ()) -> Frame:
    """Validate and decode [header, payload]. `run`, `hidden`, `n_slots`, `max_len` and
    `adapters` (the adapter ids loaded here, read at each call) are what this node expects;
    frames that disagree are rejected. `max_payload` bounds both the bytes received and the
    decoded tensor's. Activations decode to torch tensors where torch is loaded, numpy arrays
    otherwise, and numpy for frames of `host_kinds` (a ggml starter's passes: its head takes them
    as they are, where a torch tensor would cost torch calls per token)."""
    if len(parts) != 2:
        raise FrameError("expected 2 parts (header, payload), got %d" % len(parts))
    raw_header, payload = parts
    # zmq frames' buffers as they are: msgpack reads any bytes-like object (a copy costs a
    # hop's cold Python several microseconds)
    raw_header = raw_header.buffer if hasattr(raw_header, "buffer") else raw_header
    if len(raw_header) > MAX_HEADER_BYTES:
        raise FrameError("header of %d bytes exceeds %d" % (len(raw_header), MAX_HEADER_BYTES))
    try:
        header = msgpack.unpackb(raw_header, raw=False, strict_map_key=True,
                                 max_bin_len=0, max_ext_len=0, max_str_len=256,
                                 max_array_len=4096, max_map_len=32)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise FrameError("header is not valid msgpack: %s" % type(e).__name__)
    if not isinstance(header, dict) or not _HEADER_KEYS <= header.keys() <= _ALL_KEYS:
        raise FrameError("header must be a map with exactly the keys %s (and %s)"
                         % (sorted(_HEADER_KEYS), " and ".join(sorted(_OPTIONAL_KEYS))))
    if header["v"] != PROTOCOL_VERSION:
        raise FrameError("protocol version %r, expected %d" % (header["v"], PROTOCOL_VERSION))
    kind = _KIND_OF.get(header["kind"]) if isinstance(header["kind"], str) else None
    if kind is None:
        raise FrameError("unknown kind %r" % (header["kind"],))
    frame_run = header["run"]
    if not isinstance(frame_run, int) or isinstance(frame_run, bool):
        raise FrameError("run id must be an integer")
    if run is not None and frame_run != run:
        raise FrameError("stale frame from run %d (current run %d)" % (frame_run, run))
    codec = header["codec"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise FrameError("unknown codec %r (known: %s)" % (codec, ", ".join(CODECS)))
    samples = header["samples"]
    if not isinstance(samples, list):
        raise FrameError("samples must be a list")
    n = len(samples)
    training = kind in TRAINING_KINDS
    if training != ("train" in header):
        raise FrameError("%s frames %s a train header" % (kind, "need" if training else "carry no"))
    slot_hi = (n_slots - 1) if n_slots is not None else (1 << 31)
    # a training frame's samples are windows of its micro-batch, not cache slots
    samples = _int_list(header, "samples", n, 0, MAX_TRAIN_SAMPLES - 1 if training else slot_hi)
    if n > 1 and len(set(samples)) != n:
        raise FrameError("sample ids repeat")
    start = _int_list(header, "start", n, 0, max_len)
    count = _int_list(header, "count", n, 1, max_len)
    for s, c in zip(start, count):
        if s + c > max_len:
            raise FrameError("positions [%d, %d) exceed the cache length %d" % (s, s + c, max_len))
    adapter = _int_list(header, "adapter", n, 0, MAX_ADAPTER_ID) if "adapter" in header else []
    unknown = [a for a in adapter if a and adapters is not None and a not in adapters]
    if unknown:
        raise FrameError("adapter %d is not loaded here" % unknown[0])
    epoch = _int_list(header, "epoch", n, 0, MAX_EPOCH) if "epoch" in header else []
    buf = payload.buffer if hasattr(payload, "buffer") else payload
    pbytes = len(buf)
    frame = Frame(kind, frame_run, samples, start, count, adapters=adapter if any(adapter) else [],
                  epochs=epoch if any(epoch) else [])
    if "cache" in header:
        if kind not in GENERATION_KINDS:
            raise FrameError("%s frames carry no cache ops" % kind)
        frame.cache_ops = _cache_ops(header["cache"], n_slots, max_len)
    if training:
        given = header["train"]
        step, micro, layer, *copy = _int_list(header, "train", 4 if isinstance(given, list) and len(given) == 4 else 3,
                                              0, MAX_STEP)
        if micro > MAX_MICRO or layer > (1 << 16):
            raise FrameError("train header has a micro-batch or layer outside its range")
        if copy and (copy[0] != 1 or kind not in (FrameKind.TRAIN, FrameKind.EVAL)):
            raise FrameError("only train and eval frames ask for state copies, with a 4th train value of 1")
        frame.train = TrainTag(step, micro, layer, bool(copy))
        if any(adapter) or any(epoch):
            raise FrameError("%s frames name no adapter and no epoch" % kind)
        if kind != FrameKind.STEP and (any(start) or len(set(count)) > 1):
            raise FrameError("%s frames carry whole windows from position 0, all of one length" % kind)
    if frame.train is not None and kind == FrameKind.STEP:
        if n or frame.train.micro < 1:
            raise FrameError("step frames name no sample and at least one micro-batch")
    if kind == FrameKind.CLIP and (count != [1] or frame.train is None or frame.train.layer > 1):
        raise FrameError("clip frames carry one row and a phase of 0 or 1")
    if kind in (FrameKind.STOP, FrameKind.RESET, FrameKind.STEP):
        if header["dtype"] is not None or header["shape"] is not None or pbytes:
            raise FrameError("%s frames carry no tensor" % kind)
        return frame
    if n == 0:
        raise FrameError("%s frame names no sample" % kind)
    if kind == FrameKind.DECODE and any(c != 1 for c in count):
        raise FrameError("decode frames carry one token per sample")
    dtype = header["dtype"] if isinstance(header["dtype"], str) and header["dtype"] in DTYPE_BYTES else None
    if dtype is None:
        raise FrameError("dtype %r not in %s" % (header["dtype"], sorted(DTYPE_BYTES)))
    shape = header["shape"]
    if not isinstance(shape, list) or len(shape) != 2:
        raise FrameError("shape must be [rows, hidden]")
    rows, width = _int_list(header, "shape", 2, 1, 1 << 24)
    if hidden is not None and width != hidden:
        raise FrameError("hidden size %d, expected %d" % (width, hidden))
    if rows not in ((sum(count),) if kind in ALL_ROWS_KINDS else (sum(count), n)):
        # All positions, or (prefill and decode passes only) each sample's last one.
        raise FrameError("shape rows %d do not match the token counts %s" % (rows, count))
    expected = payload_nbytes(rows, width, dtype, codec)
    # The decoded tensor can be ~4x the payload (int8 -> float32): bound both.
    decoded = expected if codec == "raw" else payload_nbytes(rows, width, dtype, "raw")
    for what, size in (("payload", expected), ("decoded tensor", decoded)):
        if size > max_payload:
            raise FrameError("%s of %d bytes exceeds the %d-byte limit" % (what, size, max_payload))
    if pbytes != expected:
        raise FrameError("payload has %d bytes, shape x dtype x codec %s needs %d" % (pbytes, codec, expected))
    frame.tensor = (wire_numpy if kind in host_kinds else _codecs()).decode_payload(buf, rows, width, dtype, codec)
    return frame
