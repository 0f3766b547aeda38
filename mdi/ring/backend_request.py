"""POST /backend (contract): which backend a worker computes a run's layers with, decided there
before /init (mdi.model.backend_select: what can serve, then for auto the measured faster,
remembered per machine), so the starter pushes weights in the format that backend reads (a
GGUF of the node's tensors for ggml, safetensors for torch).

One definition for both ends, as for /init: `BackendRequest.to_json` / `validate_backend` in,
`BackendReply.to_json` / `BackendReply.from_json` back (a bad field is one line naming it).
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mdi.model.backend import BACKENDS
from mdi.model.backend_select import PROBE_PREFILL_TOKENS, probe_prefill_tokens
from mdi.model.config import ModelConfig
from mdi.model.layout import QuantSpec, layout_to_json
from mdi.ring.init_request import (MAX_ROWS, RequestError, bool_field, check_device, dtype_fields, gguf_types_field,
                                   int_field, kv_type_field, layers_field, model_field, object_fields,
                                   prefill_weights_field, quant_field, quant_kernel_field, str_field, threads_field)


@dataclass
class BackendRequest:
    model: ModelConfig
    layers: List[int]  # [first, last)
    asked: str  # one of BACKENDS
    device: str
    dtype: str
    threads: Any = None  # the run's threads (an integer, "auto" or None); the worker's --threads wins
    rows: int = 1  # samples per frame the run batches (max_batch): the decode passes timed
    gguf_types: Dict[str, str] = field(default_factory=dict)  # the node's GGUF tensors -> ggml type; {}: no GGUF
    quant: Dict[str, QuantSpec] = field(default_factory=dict)  # torch: the weights kept quantized
    quant_kernel: Optional[str] = None
    kv_type: str = "f16"
    adapters: bool = False  # the run serves adapters or soft prompts
    prefill_weights: str = "quantized"  # ggml: runtime.prefill_weights, as the run will compute
    prefill_chunk: Optional[int] = None  # runtime.prefill_chunk: the prefill pass auto times (None: 128 tokens)
    run_id: Optional[int] = None  # the run whose /init follows: 409 at once where another run holds the worker
    repack: bool = True  # ggml: runtime.repack, as the run will compute
    compute_dtype: Optional[str] = None  # torch: model.compute_dtype, as the run will compute (None: from dtype)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"model": self.model.to_dict(), "layers": list(self.layers), "asked": self.asked,
                               "device": self.device, "dtype": self.dtype, "rows": self.rows,
                               "gguf_types": dict(self.gguf_types), "kv_type": self.kv_type, "adapters": self.adapters}
        if self.prefill_weights != "quantized":  # (a worker from before the setting takes the default's body)
            out["prefill_weights"] = self.prefill_weights
        if not self.repack:  # (likewise)
            out["repack"] = False
        chunk = self.prefill_chunk
        if chunk is not None and probe_prefill_tokens(chunk, self.prefill_weights) != PROBE_PREFILL_TOKENS:
            # (likewise: only where it changes what is timed); no pass of the run is longer than MAX_ROWS
            out["prefill_chunk"] = min(chunk, MAX_ROWS)
        for key in ("threads", "quant_kernel", "run_id", "compute_dtype"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.quant:
            out["quant"] = layout_to_json(self.quant)
        return out


def validate_backend(body: Any) -> BackendRequest:
    spec = object_fields("backend", body, ("model", "layers", "asked", "device", "dtype"),
                         ("threads", "rows", "gguf_types", "quant", "quant_kernel", "kv_type", "adapters",
                          "prefill_weights", "prefill_chunk", "run_id", "repack", "compute_dtype"))
    config = model_field(spec["model"])
    layers = layers_field(spec["layers"], config)
    if spec["asked"] not in BACKENDS:
        raise RequestError("asked must be one of %s" % ", ".join(BACKENDS))
    device = check_device(str_field("device", spec["device"], 32))
    dtype_fields(spec)
    threads_field(spec.get("threads"))
    rows = int_field("rows", spec.get("rows", 1), 1, 4096)
    kernel = quant_kernel_field(spec)
    kv_type = kv_type_field(spec)
    chunk = spec.get("prefill_chunk")
    if chunk is not None:
        int_field("prefill_chunk", chunk, 1, MAX_ROWS)
    adapters = spec.get("adapters", False)
    if not isinstance(adapters, bool):
        raise RequestError("adapters must be true or false")
    return BackendRequest(config, layers, spec["asked"], device, spec["dtype"], spec.get("threads"),
                          rows, gguf_types_field(spec.get("gguf_types"), config, layers),
                          quant_field(spec.get("quant"), config, layers), kernel, kv_type, adapters,
                          prefill_weights_field(spec), chunk,
                          None if spec.get("run_id") is None else int_field("run_id", spec["run_id"], 0, 2 ** 63 - 1),
                          bool_field("repack", spec["repack"]) if "repack" in spec else True, spec.get("compute_dtype"))


@dataclass
class BackendReply:
    backend: str  # "ggml" or "torch"
    line: str  # what was chosen and why, in one line (the starter logs it)
    seconds: float = 0.0  # spent measuring on the worker (0: recalled or asked)
    # torch: the quantized kernels runtime.quant_kernel fast may try there (--check lists them)
    kernels_here: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {"backend": self.backend, "line": self.line, "seconds": self.seconds,
                "kernels_here": list(self.kernels_here)}

    @classmethod
    def from_json(cls, data: Any) -> "BackendReply":
        if not isinstance(data, dict):
            raise ValueError("not an object")
        backend, line, seconds = data.get("backend"), data.get("line"), data.get("seconds", 0.0)
        if backend not in ("ggml", "torch"):
            raise ValueError("backend must be ggml or torch, got %r" % (backend,))
        if not isinstance(line, str) or len(line) > 2000:
            raise ValueError("line must be a string")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValueError("seconds must be a number >= 0")
        kernels = data.get("kernels_here", [])
        if not isinstance(kernels, list) or len(kernels) > 64 or not all(isinstance(k, str) and len(k) < 64
                                                                          for k in kernels):
            raise ValueError("kernels_here must be a list of kernel names")
        return cls(backend, line, float(seconds), kernels)
