"""The /init request: one definition for both ends. The starter builds an `InitRequest` and
sends `to_json()`; the worker turns the JSON body back into one with `validate_init`, which
checks every field before anything is used (a bad field is a `RequestError`, HTTP 400)."""
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mdi.model.backend import BACKENDS, KV_TYPES, PREFILL_WEIGHTS
from mdi.model.config import ModelConfig
from mdi.model.ggml.tensors import typed_bytes
from mdi.model.layout import DTYPE_NAMES, QuantSpec, layout_from_json, layout_to_json, quantizable, weight_bytes
from mdi.model.torch_settings import POLICY_NAMES, fused_decode_default
from mdi.ring.wire import CODECS

HEX64 = re.compile(r"^[0-9a-f]{64}$")
# A host the data plane can connect to (zmq's tcp://HOST:PORT): a DNS name or an IPv4 address
HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
MAX_WEIGHTS_BYTES = 64 * 1024 ** 3


SAFETENSORS_SLACK = 1 << 20  # room for the safetensors header on top of the tensor bytes


class RequestError(ValueError):
    """A control-plane request that cannot be honoured; the message says why. `status` is the
    HTTP status the worker answers with."""
    status = 400


class NodeBusy(RequestError):
    """Another run holds this worker (HTTP 409): the message names the holder."""
    status = 409


class TooLarge(RequestError):
    """What was announced does not fit this worker (HTTP 413): the message names both sizes."""
    status = 413


MAX_THREADS = 1024
MAX_ROWS = 1 << 16  # token rows in one forward: a prefill chunk plus decode rows


@dataclass
class DataPlane:
    """Where this node listens for frames and where it sends its output (the next node)."""
    bind_port: int
    next_host: str
    next_port: int
    is_last: bool  # the last worker sends only each sample's last position back to the starter

    def to_json(self) -> Dict[str, Any]:
        return {"bind_port": self.bind_port, "next_host": self.next_host, "next_port": self.next_port,
                "is_last": self.is_last}


@dataclass
class PushedWeights:
    """Weights the starter will POST to /weights after /init: announced by size and hash."""
    nbytes: int
    sha256: str


@dataclass
class Weights:
    """Exactly one of: a safetensors file on the worker (`path`), or bytes pushed later (`push`)."""
    path: Optional[str] = None
    push: Optional[PushedWeights] = None

    def to_json(self) -> Dict[str, Any]:
        if self.path is not None:
            return {"path": self.path}
        assert self.push is not None, "weights need a path or a push"
        return {"push": {"nbytes": self.push.nbytes, "sha256": self.push.sha256}}


@dataclass
class InitRequest:
    run_id: int
    model: ModelConfig
    layers: List[int]  # [first, last): half-open, inside the model
    dtype: str  # weight dtype, one of DTYPE_NAMES
    device: str  # cpu, cuda or cuda:N (the worker's --device overrides it)
    n_slots: int
    max_len: int
    data: DataPlane
    weights: Weights
    cache_budget_bytes: Optional[int] = None
    heartbeat_timeout: Optional[float] = None  # None: the worker's default
    compute_dtype: Optional[str] = None  # None: the worker picks from dtype and device
    threads: Any = None  # torch threads (runtime.threads: an integer or "auto"); the worker's own --threads wins
    quant: Dict[str, QuantSpec] = field(default_factory=dict)  # weights kept quantized (layout.QuantLayout)
    quant_kernel: Optional[str] = None  # runtime.quant_kernel; None: the default policy
    max_batch: int = 1  # samples one forward may take: queued frames are merged up to this many
    max_rows: int = MAX_ROWS  # token rows one forward may take (merged frames stay under it)
    wire_codec: str = "raw"  # how this node encodes the activations it sends (mdi.ring.wire.CODECS)
    # runtime.fused_decode: decode frames through the scripted blocks (mdi.model.fused_decode)
    fused_decode: bool = field(default_factory=fused_decode_default)
    # runtime.prefix_cache: the bytes this node may keep of earlier prompts' KV (an integer),
    # "auto" (half of what its memory spares beside weights and KV cache), or None/0: none.
    prefix_cache: Any = None
    # runtime.kernel_memory: the bytes its kernels may hold beyond the stored weights (an
    # integer, within what its memory spares), "auto" (what it spares), or None/0: none.
    kernel_memory: Any = None
    # What this node computes with (mdi.model.backend): ggml or torch, as POST /backend decided;
    # "auto" decides here. Absent (a starter from before the ggml backend): torch.
    backend: str = "torch"
    kv_type: str = "f16"  # ggml's KV cache type
    gguf_types: Dict[str, str] = field(default_factory=dict)  # ggml: the node's GGUF tensors and their types
    repack: bool = True  # ggml: runtime.repack (matrices re-laid for ggml's faster kernels)
    prefill_weights: str = "quantized"  # ggml: runtime.prefill_weights (mdi.model.ggml.dequant_rows)

    @property
    def prefill_chunk(self) -> int:
        """The run's prompt tokens a pass (runtime.prefill_chunk): max_rows is a batch of decode
        rows plus one such chunk."""
        return max(1, self.max_rows - self.max_batch)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"run_id": self.run_id, "model": self.model.to_dict(), "layers": list(self.layers),
                               "dtype": self.dtype, "device": self.device, "n_slots": self.n_slots, "max_len": self.max_len,
                               "data": self.data.to_json(), "weights": self.weights.to_json(),
                               "max_batch": self.max_batch, "max_rows": self.max_rows, "wire_codec": self.wire_codec,
                               "fused_decode": self.fused_decode, "backend": self.backend, "kv_type": self.kv_type,
                               "repack": self.repack}
        if self.prefill_weights != "quantized":  # (a worker from before the setting takes the default's body)
            out["prefill_weights"] = self.prefill_weights
        # Optional fields are left out rather than sent as null: the validator accepts both.
        for key in ("cache_budget_bytes", "heartbeat_timeout", "compute_dtype", "threads", "quant_kernel",
                    "prefix_cache", "kernel_memory"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.quant:
            out["quant"] = layout_to_json(self.quant)
        if self.gguf_types:
            out["gguf_types"] = dict(self.gguf_types)
        return out


def gguf_types_field(data: Any, config: ModelConfig, layers: List[int]) -> Dict[str, str]:
    """A node's GGUF tensor types: only the names its layers hold, each of a type it may have."""
    from mdi.model.ggml.tensors import MATRIX_TYPES, VECTOR_TYPES, node_tensors
    if data is None:
        return {}
    if not isinstance(data, dict) or len(data) > 100000:
        raise RequestError("gguf_types must be a mapping of GGUF tensor names to ggml types")
    want = node_tensors(config, layers[0], layers[1], False, False, rope_freqs=True)
    for name, kind in data.items():
        if name not in want:
            raise RequestError("gguf_types: %r is not a tensor of layers [%d, %d)" % (name, layers[0], layers[1]))
        allowed = MATRIX_TYPES if len(want[name]) == 2 else VECTOR_TYPES
        if kind not in allowed:
            raise RequestError("gguf_types: %s is %r, not one of %s" % (name, kind, ", ".join(allowed)))
    return {str(k): str(v) for k, v in data.items()}


def int_field(where: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise RequestError("%s must be an integer in [%d, %d]" % (where, lo, hi))
    return value


def threads_field(value: Any) -> Any:
    """runtime.threads as sent: absent, an integer, or "auto" (the node times its own chunk)."""
    if value is not None and value != "auto":
        try:
            int_field("threads", value, 1, MAX_THREADS)
        except RequestError:
            raise RequestError("threads must be an integer in [1, %d] or \"auto\"" % MAX_THREADS)
    return value


def prefix_cache_field(value: Any, name: str = "prefix_cache") -> Any:
    """runtime.prefix_cache (or kernel_memory) as sent: absent, a byte count, or "auto"."""
    if value is not None and value != "auto":
        try:
            int_field(name, value, 0, 2 ** 62)
        except RequestError:
            raise RequestError("%s must be a number of bytes >= 0 or \"auto\"" % name)
    return value


def bool_field(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError("%s must be true or false" % where)
    return value


def fused_decode_field(spec: Dict[str, Any]) -> bool:
    """`fused_decode` as sent; absent (a starter from before it was sent): the worker's default."""
    return bool_field("fused_decode", spec["fused_decode"]) if "fused_decode" in spec else fused_decode_default()


def str_field(where: str, value: Any, max_len: int = 4096) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise RequestError("%s must be a non-empty string" % where)
    if "\0" in value:  # no path holds one, and os functions raise on it
        raise RequestError("%s must not hold a NUL character" % where)
    return value


def object_fields(where: str, data: Any, required, optional=()) -> Dict[str, Any]:
    if not isinstance(data, dict):
        raise RequestError("%s must be an object" % where)
    missing = [k for k in required if k not in data]
    if missing:
        raise RequestError("%s: missing key %r" % (where, missing[0]))
    unknown = sorted(set(data) - set(required) - set(optional))
    if unknown:
        raise RequestError("%s: unknown key %r" % (where, unknown[0]))
    return data


def model_field(value: Any) -> ModelConfig:
    """A request's `model` (ModelConfig.to_dict()): ModelConfig bounds every value."""
    try:
        if not isinstance(value, dict):
            raise ValueError("must be an object")
        return ModelConfig.from_dict(value)
    except (TypeError, ValueError) as e:
        raise RequestError("model: %s" % e)


def dtype_fields(spec: Dict[str, Any]) -> None:
    """`dtype` (required) and `compute_dtype` (optional): names of DTYPE_NAMES."""
    for key in ("dtype", "compute_dtype"):
        if (key == "dtype" or spec.get(key) is not None) and spec.get(key) not in DTYPE_NAMES:
            raise RequestError("%s must be one of %s" % (key, ", ".join(DTYPE_NAMES)))


def check_device(device: str) -> str:
    if not (device in ("cpu", "cuda") or re.match(r"^cuda:\d+$", device)):
        raise RequestError("device must be cpu, cuda or cuda:N")
    return device


def quant_kernel_field(spec: Dict[str, Any]) -> Optional[str]:
    """runtime.quant_kernel as a request carries it (None: the node's default)."""
    kernel = spec.get("quant_kernel")
    if kernel is not None and kernel not in POLICY_NAMES:
        raise RequestError("quant_kernel must be one of %s" % ", ".join(POLICY_NAMES))
    return kernel


def prefill_weights_field(spec: Dict[str, Any]) -> str:
    """runtime.prefill_weights as a request carries it (default quantized)."""
    value = spec.get("prefill_weights", "quantized")
    if value not in PREFILL_WEIGHTS:
        raise RequestError("prefill_weights must be one of %s" % ", ".join(PREFILL_WEIGHTS))
    return value


def kv_type_field(spec: Dict[str, Any]) -> str:
    """runtime.kv_type as a request carries it (default f16)."""
    kv_type = spec.get("kv_type", "f16")
    if kv_type not in KV_TYPES:
        raise RequestError("kv_type must be one of %s" % ", ".join(KV_TYPES))
    return kv_type


def layers_field(layers: Any, config: ModelConfig) -> List[int]:
    """A node's blocks [first, last) of `config`'s, as two integers."""
    if not isinstance(layers, list) or len(layers) != 2:
        raise RequestError("layers must be [first, last) as two integers")
    int_field("layers[0]", layers[0], 0, config.n_layer - 1)
    int_field("layers[1]", layers[1], layers[0] + 1, config.n_layer)
    return [layers[0], layers[1]]


def validate_init(body: Any) -> InitRequest:
    """The /init JSON body as an `InitRequest`, or a `RequestError` naming the first bad field."""
    spec = object_fields("init", body, ("run_id", "model", "layers", "dtype", "device", "n_slots", "max_len",
                                        "data", "weights"),
                         ("cache_budget_bytes", "heartbeat_timeout", "compute_dtype", "threads", "quant",
                          "quant_kernel", "max_batch", "max_rows", "wire_codec", "fused_decode", "prefix_cache",
                          "backend", "kv_type", "gguf_types", "repack", "kernel_memory", "prefill_weights"))
    int_field("run_id", spec["run_id"], 0, 2 ** 63 - 1)
    config = model_field(spec["model"])
    layers = layers_field(spec["layers"], config)
    dtype_fields(spec)
    device = check_device(str_field("device", spec["device"], 32))
    int_field("n_slots", spec["n_slots"], 1, 4096)
    int_field("max_len", spec["max_len"], 1, config.block_size)
    if spec.get("cache_budget_bytes") is not None:
        int_field("cache_budget_bytes", spec["cache_budget_bytes"], 0, 2 ** 62)
    hb = spec.get("heartbeat_timeout")
    if hb is not None and (isinstance(hb, bool) or not isinstance(hb, (int, float)) or not 0.5 <= hb <= 3600):
        raise RequestError("heartbeat_timeout must be a number of seconds in [0.5, 3600]")
    threads_field(spec.get("threads"))
    prefix_cache_field(spec.get("prefix_cache"))
    prefix_cache_field(spec.get("kernel_memory"), "kernel_memory")
    quant = quant_field(spec.get("quant"), config, layers)
    kernel = quant_kernel_field(spec)
    max_batch = int_field("max_batch", spec.get("max_batch", 1), 1, spec["n_slots"])
    max_rows = int_field("max_rows", spec.get("max_rows", MAX_ROWS), 1, MAX_ROWS)
    codec = spec.get("wire_codec", "raw")
    if codec not in CODECS:
        raise RequestError("wire_codec must be one of %s" % ", ".join(CODECS))
    fused = fused_decode_field(spec)
    data = object_fields("data", spec["data"], ("bind_port", "next_host", "next_port", "is_last"))
    int_field("data.bind_port", data["bind_port"], 1, 65535)
    int_field("data.next_port", data["next_port"], 1, 65535)
    if not HOST_NAME.match(str_field("data.next_host", data["next_host"], 255)):
        raise RequestError("data.next_host must be a host name or IPv4 address, got %r" % data["next_host"][:64])
    bool_field("data.is_last", data["is_last"])
    backend = spec.get("backend", "torch")
    if backend not in BACKENDS:
        raise RequestError("backend must be one of %s" % ", ".join(BACKENDS))
    kv_type = kv_type_field(spec)
    gguf_types = gguf_types_field(spec.get("gguf_types"), config, layers)
    repack = bool_field("repack", spec["repack"]) if "repack" in spec else True
    prefill_weights = prefill_weights_field(spec)
    if backend == "ggml" and not gguf_types:
        raise RequestError("backend ggml needs gguf_types (the node's GGUF tensors and their types)")
    weights = spec["weights"]
    if isinstance(weights, dict) and "path" in weights:
        object_fields("weights", weights, ("path",))
        source = Weights(path=str_field("weights.path", weights["path"]))
    else:
        object_fields("weights", weights, ("push",))
        push = object_fields("weights.push", weights["push"], ("nbytes", "sha256"))
        stored = typed_bytes(config, gguf_types, layers[0], layers[1]) if backend == "ggml" else \
            weight_bytes(config, layers, spec["dtype"], quant=quant)
        limit = min(MAX_WEIGHTS_BYTES, stored + SAFETENSORS_SLACK)
        int_field("weights.push.nbytes", push["nbytes"], 1, limit)
        if not isinstance(push["sha256"], str) or not HEX64.match(push["sha256"]):
            raise RequestError("weights.push.sha256 must be 64 lowercase hex digits")
        source = Weights(push=PushedWeights(push["nbytes"], push["sha256"]))
    return InitRequest(
        run_id=spec["run_id"], model=config, layers=[layers[0], layers[1]], dtype=spec["dtype"], device=device,
        n_slots=spec["n_slots"], max_len=spec["max_len"],
        data=DataPlane(data["bind_port"], data["next_host"], data["next_port"], data["is_last"]),
        weights=source, cache_budget_bytes=spec.get("cache_budget_bytes"),
        heartbeat_timeout=float(hb) if hb is not None else None, compute_dtype=spec.get("compute_dtype"),
        threads=spec.get("threads"), quant=quant, quant_kernel=kernel, max_batch=max_batch, max_rows=max_rows,
        wire_codec=codec, fused_decode=fused, prefix_cache=spec.get("prefix_cache"), backend=backend, kv_type=kv_type,
        kernel_memory=spec.get("kernel_memory"),
        gguf_types=gguf_types, repack=repack, prefill_weights=prefill_weights)


def quant_field(data: Any, config: ModelConfig, layers: List[int]) -> Dict[str, QuantSpec]:
    """`quant` names only this node's weight matrices, each with a spec its width allows."""
    if data is None:
        return {}
    if not isinstance(data, dict) or len(data) > 100000:
        raise RequestError("quant must be a mapping of weight names to [kind, group size]")
    try:
        quant = layout_from_json(data)
    except ValueError as e:
        raise RequestError("quant: %s" % e)
    shapes = quantizable(config, (layers[0], layers[1]), False, False)
    for base, qspec in quant.items():
        if base not in shapes:
            raise RequestError("quant: %r is not a weight matrix of layers [%d, %d)" % (base[:80], layers[0], layers[1]))
        try:
            qspec.check(base, shapes[base][1])
        except ValueError as e:
            raise RequestError("quant: %s" % e)
    return quant
