"""Time one backend on a model's shapes, in a process of its own: `python -m mdi.model.backend_probe`
reads a ProbeRequest as JSON on stdin and writes a BackendTiming as JSON on stdout.

Its own process because what a measurement loads stays resident after it: timing torch would
leave torch's libraries (250 MB of RSS) in a node that then computes with ggml. The blocks are
random, of the real dims and weight types (mdi.model.ggml.random_weights, mdi.model.source.random_chunk).
"""
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from mdi.model.backend import BackendTiming
from mdi.model.config import ModelConfig
from mdi.model.timing_loop import PROFILE_LAYERS

PROBE_BLOCKS = PROFILE_LAYERS
PROBE_TIMEOUT_S = 120.0  # a probe takes seconds; two of them and the lock's wait fit in /backend's 600 s


@dataclass
class ProbeRequest:
    backend: str
    model: Dict[str, Any]  # ModelConfig.to_dict()
    threads: int = 1
    rows: int = 1  # decode rows per pass (samples in a frame)
    prefill_tokens: int = 64
    n_blocks: int = PROBE_BLOCKS
    # ggml: the GGUF types of a block's tensors by suffix ("attn_q.weight": "Q4_1")
    layer_types: Dict[str, str] = field(default_factory=dict)
    kv_type: str = "f16"
    # torch: weights' dtype, device and quantization (mdi.model.layout's JSON form, blocks 0 and 1)
    dtype: str = "float32"
    compute_dtype: Optional[str] = None  # model.compute_dtype (None: the weights' dtype, as resolve_compute_dtype says)
    device: str = "cpu"
    quant: Dict[str, Any] = field(default_factory=dict)
    quant_kernel: Optional[str] = None
    prefill_weights: str = "quantized"  # ggml: runtime.prefill_weights (its prefill pass is timed that way)
    repack: bool = True  # ggml: runtime.repack (Q4_0's decode 1.6x slower without it, on AVX-512)


def run_probe(request: ProbeRequest, timeout: float = PROBE_TIMEOUT_S) -> BackendTiming:
    """Time `request.backend` in a child process; RuntimeError with its last line when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(request.threads))
    try:
        proc = subprocess.run([sys.executable, "-m", "mdi.model.backend_probe"], input=json.dumps(asdict(request)),
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError("timing the %s backend took over %.0f s" % (request.backend, timeout))
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]
        raise RuntimeError("timing the %s backend failed: %s" % (request.backend, last))
    try:
        return BackendTiming(**json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        raise RuntimeError("timing the %s backend printed no timing" % request.backend)


def _time_ggml(req: ProbeRequest, config: ModelConfig) -> BackendTiming:
    import numpy as np
    from mdi.model.files.gguf_write import remove_quietly
    from mdi.model.ggml import lib
    from mdi.model.ggml.chunk import GgmlChunk
    from mdi.model.ggml.random_weights import write_probe_gguf
    from mdi.model.ggml.weights import GgufWeights
    from mdi.model.timing_loop import seconds_per_call

    n = min(req.n_blocks, config.n_layer)
    path = write_probe_gguf(config, req.layer_types, n, False, {})
    try:
        probe = ModelConfig.from_dict(dict(config.to_dict(), n_layer=n))
        chunk = GgmlChunk(probe, 0, n, False, False, GgufWeights(path), lib.ROPE_NEOX, req.threads, req.kv_type,
                          req.repack, device=req.device)
        chunk.set_prefill_weights(req.prefill_weights)
        return _time(chunk, req, probe, np.float32, seconds_per_call)
    finally:
        remove_quietly(path)


def _time_torch(req: ProbeRequest, config: ModelConfig) -> BackendTiming:
    import torch
    from mdi.model.block_timing import profile_chunk
    from mdi.model.layout import layout_from_json, torch_dtype
    from mdi.model.quantization import qkernels
    from mdi.model.timing_loop import seconds_per_call
    from mdi.system.devices import resolve_compute_dtype

    torch.set_num_threads(req.threads)
    if req.quant_kernel:
        qkernels.set_preference(req.quant_kernel)
    n = min(req.n_blocks, config.n_layer)
    quant = layout_from_json(req.quant) if req.quant else None
    dtype = torch_dtype(req.dtype)
    asked = torch_dtype(req.compute_dtype) if req.compute_dtype else None
    compute, _ = resolve_compute_dtype(req.device, dtype, asked)  # as the run will compute
    chunk = profile_chunk(config, dtype, req.device, quant, compute, n_blocks=n)
    with torch.inference_mode():
        return _time(chunk, req, config, None, seconds_per_call)


def _time(chunk: Any, req: ProbeRequest, config: ModelConfig, np_dtype: Any, seconds_per_call: Any) -> BackendTiming:
    from mdi.model.pass_rows import PassRows
    rows, tokens = req.rows, min(req.prefill_tokens, config.block_size)
    max_len = min(config.block_size, max(tokens, 64) + 1)
    chunk.allocate_cache(max(rows, 1), max_len)
    context = min(32, max_len - 1)
    x: Any
    xp: Any
    decode_batch: Any
    prefill_batch: Any
    if np_dtype is not None:
        import numpy as np
        x = np.random.default_rng(0).standard_normal((rows, config.n_embd)).astype(np_dtype)
        xp = np.random.default_rng(1).standard_normal((tokens, config.n_embd)).astype(np_dtype)
        decode_batch, prefill_batch = PassRows(list(range(rows)), [context] * rows, [1] * rows), PassRows([0], [0], [tokens])
    else:
        import torch
        from mdi.model.row_batch import RowBatch
        dtype = chunk.activation_dtype
        x = torch.randn(rows, config.n_embd, dtype=dtype)
        xp = torch.randn(tokens, config.n_embd, dtype=dtype)
        decode_batch, prefill_batch = RowBatch.of(list(range(rows)), [context] * rows, [1] * rows), RowBatch.of([0], [0], [tokens])
    decode = seconds_per_call(lambda: chunk.forward_rows(x, decode_batch))
    prefill = seconds_per_call(lambda: chunk.forward_rows(xp, prefill_batch), rounds=1)
    n = chunk.n_layers
    return BackendTiming(decode / n, prefill / (n * tokens), rows, tokens)


def main() -> int:
    req = ProbeRequest(**json.loads(sys.stdin.read()))
    config = ModelConfig.from_dict(req.model)
    timing = _time_ggml(req, config) if req.backend == "ggml" else _time_torch(req, config)
    print(json.dumps(asdict(timing)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
