"""POST /profile (contract): the starter asks an idle worker how fast it runs a model's blocks,
before any weight is sent; the planner (mdi.starter.planning.planner) splits the layers by the answers.

One definition for both ends, as for /init: `ProfileRequest.to_json` / `validate_profile` on
the way in (every field checked before use: a `RequestError`, HTTP 400), `ProfileReply.to_json` /
`ProfileReply.from_json` on the way back (a wrong or hostile reply is one `ValueError` naming
the field, never a KeyError in the planner). Measuring is mdi.timing.node's (`profile_here`:
the worker for /profile, the starter for itself).
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mdi.model.config import ModelConfig
from mdi.model.ggml.tensors import MATRIX_TYPES, VECTOR_TYPES, block_tensors, end_tensors
from mdi.model.layout import QuantSpec, layout_to_json
from mdi.model.timing_loop import PROFILE_LAYERS
from mdi.model.torch_settings import fused_decode_default
from mdi.ring.init_request import (MAX_THREADS, RequestError, bool_field, check_device, dtype_fields,
                                   fused_decode_field, int_field, kv_type_field, model_field, object_fields,
                                   quant_field, quant_kernel_field, str_field, threads_field)

MAX_BATCH_SIZES = 8  # distinct decode batch sizes one profile times
MAX_PROFILE_ROWS = 256  # rows of one timed pass (a decode batch or the prefill pass)
MAX_PROFILE_BLOCKS = 4096  # more than any model's layers
MAX_PROBE_BYTES = 1 << 20  # POST /probe: the body the starter times a link with


@dataclass
class ProfileRequest:
    model: ModelConfig
    dtype: str
    device: str
    batch_sizes: List[int]  # decode passes of this many samples (one row each) are timed
    context: int  # the position those rows decode at (attention reads this many keys)
    prefill_tokens: int  # one prefill pass of this many tokens is timed
    threads: Any = None  # the run's torch threads (an integer or "auto": what it has now); --threads wins
    compute_dtype: Optional[str] = None
    quant: Dict[str, QuantSpec] = field(default_factory=dict)  # for blocks [0, PROFILE_LAYERS)
    quant_kernel: Optional[str] = None
    # runtime.fused_decode: the blocks are timed on the path the run will take. Always sent, so
    # it is in the profile cache key (mdi.starter.planning.node_speeds keys a profile by this JSON).
    fused_decode: bool = field(default_factory=fused_decode_default)
    # The backend the run will compute with there (mdi.model.backend): a plan times what runs.
    # ggml: the GGUF types of a block's tensors by suffix ("attn_q.weight": "Q4_1"), and (a
    # starter's own profile) of its embedding and head by name.
    backend: str = "torch"
    layer_types: Dict[str, str] = field(default_factory=dict)
    end_types: Dict[str, str] = field(default_factory=dict)
    kv_type: str = "f16"
    repack: bool = True  # ggml: runtime.repack, as the run will compute

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"model": self.model.to_dict(), "dtype": self.dtype, "device": self.device,
                               "batch_sizes": list(self.batch_sizes), "context": self.context,
                               "prefill_tokens": self.prefill_tokens, "fused_decode": self.fused_decode,
                               "backend": self.backend, "kv_type": self.kv_type}
        if self.backend == "ggml":
            out.update(layer_types=dict(self.layer_types), end_types=dict(self.end_types))
            if not self.repack:  # (the default's body and cache key as before the setting)
                out["repack"] = False
        for key in ("threads", "compute_dtype", "quant_kernel"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.quant:
            out["quant"] = layout_to_json(self.quant)
        return out


def validate_profile(body: Any) -> ProfileRequest:
    """The /profile JSON body as a `ProfileRequest`, or a `RequestError` naming the first bad field."""
    spec = object_fields("profile", body, ("model", "dtype", "device", "batch_sizes", "context", "prefill_tokens"),
                         ("threads", "compute_dtype", "quant", "quant_kernel", "fused_decode", "backend",
                          "layer_types", "end_types", "kv_type", "repack"))
    config = model_field(spec["model"])
    dtype_fields(spec)
    device = check_device(str_field("device", spec["device"], 32))
    sizes = spec["batch_sizes"]
    if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_BATCH_SIZES:
        raise RequestError("batch_sizes must be a list of 1 to %d integers" % MAX_BATCH_SIZES)
    for i, b in enumerate(sizes):
        int_field("batch_sizes[%d]" % i, b, 1, MAX_PROFILE_ROWS)
    int_field("context", spec["context"], 0, config.block_size - 1)
    int_field("prefill_tokens", spec["prefill_tokens"], 1, min(MAX_PROFILE_ROWS, config.block_size))
    threads_field(spec.get("threads"))
    kernel = quant_kernel_field(spec)
    quant = quant_field(spec.get("quant"), config, [0, min(PROFILE_LAYERS, config.n_layer)])
    fused = fused_decode_field(spec)
    backend = spec.get("backend", "torch")
    if backend not in ("ggml", "torch"):
        raise RequestError("backend must be ggml or torch (a plan times what the run computes with)")
    kv_type = kv_type_field(spec)
    layer_types = _types_field("layer_types", spec.get("layer_types"), block_tensors(config, 0), "blk.0.")
    end_types = _types_field("end_types", spec.get("end_types"), end_tensors(config, True, True), "")
    if backend == "ggml" and not layer_types:
        raise RequestError("backend ggml needs layer_types (the GGUF types of a block's tensors)")
    return ProfileRequest(config, spec["dtype"], device, sorted(set(sizes)), spec["context"], spec["prefill_tokens"],
                          spec.get("threads"), spec.get("compute_dtype"), quant, kernel, fused, backend, layer_types,
                          end_types, kv_type, bool_field("repack", spec["repack"]) if "repack" in spec else True)


def _types_field(key: str, data: Any, tensors: Dict[str, Any], prefix: str) -> Dict[str, str]:
    """GGUF types of tensors named as in `tensors` less `prefix`: only names it holds, each of a
    type such a tensor may have."""
    if data is None:
        return {}
    if not isinstance(data, dict) or len(data) > 64:
        raise RequestError("%s must be a mapping of tensor names to ggml types" % key)
    for name, kind in data.items():
        dims = tensors.get(prefix + name) if isinstance(name, str) else None
        if dims is None:
            raise RequestError("%s: %r is not a tensor of this model" % (key, name))
        if kind not in (MATRIX_TYPES if len(dims) == 2 else VECTOR_TYPES):
            raise RequestError("%s: %s is %r, not a type it may have" % (key, name, kind))
    return {str(k): str(v) for k, v in data.items()}


@dataclass
class ProfileReply:
    """Seconds on the worker (keys of the dicts: rows per decode pass)."""
    layer_s: Dict[int, float]  # one block, one decode pass
    prefill_token_s: float  # one block, per prompt token
    frame_s: Dict[int, float]  # receiving and sending one frame of that many rows (decode + encode)
    threads: int
    device: str
    seconds: float  # how long profiling took
    ends_s: Dict[int, float] = field(default_factory=dict)  # the starter's own: embedding, head, sampling
    # The node's whole pass over the `blocks` timed blocks in its real loop, frames looping back
    # to itself (mdi.timing.relay; the starter's: mdi.starter.planning.loop_timing). Absent: not timed.
    loop_s: Dict[int, float] = field(default_factory=dict)
    blocks: int = PROFILE_LAYERS  # random blocks timed (mdi.model.block_timing.profile_blocks)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"layer_s": {str(k): v for k, v in self.layer_s.items()}, "prefill_token_s": self.prefill_token_s,
                               "frame_s": {str(k): v for k, v in self.frame_s.items()}, "threads": self.threads,
                               "device": self.device, "seconds": self.seconds, "blocks": self.blocks}
        for key in ("ends_s", "loop_s"):
            if getattr(self, key):
                out[key] = {str(k): v for k, v in getattr(self, key).items()}
        return out

    @classmethod
    def from_json(cls, data: Any) -> "ProfileReply":
        if not isinstance(data, dict):
            raise ValueError("profile reply: expected an object")

        def seconds(where: str, v: Any) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 3600:
                raise ValueError("profile reply: %s must be seconds in [0, 3600), got %r" % (where, v))
            return float(v)

        def table(key: str) -> Dict[int, float]:
            raw = data.get(key)
            if not isinstance(raw, dict) or not raw or len(raw) > MAX_BATCH_SIZES:
                raise ValueError("profile reply: %s must map 1 to %d batch sizes to seconds" % (key, MAX_BATCH_SIZES))
            out = {}
            for k, v in raw.items():
                if not (isinstance(k, str) and k.isdigit() and 1 <= int(k) <= MAX_PROFILE_ROWS):
                    raise ValueError("profile reply: %s has a bad batch size %r" % (key, k))
                out[int(k)] = seconds("%s[%s]" % (key, k), v)
            return out
        threads, device = data.get("threads"), data.get("device")
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise ValueError("profile reply: threads must be an integer in [1, %d]" % MAX_THREADS)
        if not isinstance(device, str) or not device or len(device) > 32:
            raise ValueError("profile reply: device must be a short string")
        blocks = data.get("blocks", PROFILE_LAYERS)
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= MAX_PROFILE_BLOCKS:
            raise ValueError("profile reply: blocks must be an integer in [1, %d]" % MAX_PROFILE_BLOCKS)
        return cls(table("layer_s"), seconds("prefill_token_s", data.get("prefill_token_s")), table("frame_s"),
                   threads, device, seconds("seconds", data.get("seconds")),
                   table("ends_s") if "ends_s" in data else {}, table("loop_s") if "loop_s" in data else {}, blocks)
