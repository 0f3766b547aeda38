"""Which backend a node computes with, decided where the node is (the starter for its own
chunk, a worker at /init): what can serve the run, then `mdi.model.backend.choose` (auto
measures both in a child process, mdi.model.backend_probe, remembered per machine)."""
import collections
import logging
from typing import Any, Dict, Optional

from mdi.model.backend import AUTO, WORKLOAD_PROMPT, BackendChoice, BackendTiming, choose
from mdi.model.backend_probe import PROBE_BLOCKS, ProbeRequest, run_probe
from mdi.model.config import ModelConfig
from mdi.model.ggml.kv_cache import head_dim_unfit
from mdi.model.ggml.tensors import GGUF_DIRECT, GGUF_FLOAT
from mdi.model.threads import usable_cpus
from mdi.system.devices import unusable_reason
from mdi.system.machine_cache import machine_key

log = logging.getLogger(__name__)

PROBE_PREFILL_TOKENS = 128


def probe_prefill_tokens(prefill_chunk: Optional[int], prefill_weights: str = "quantized") -> int:
    """How long a prefill pass auto times for a run that prefills `prefill_chunk` tokens a pass
    (None: not said, a starter from before it): the run's own pass, up to the prompt auto weighs.
    Multiplied as stored, a token costs about the same in any pass of 32 to 256 rows (ggml's
    8-bit dot products and torch's kernels alike), so a shorter pass is timed at 128 tokens, as
    before, and default runs keep their remembered choices. Dequantized, the pass's rows decide
    which product runs (mdi.model.ggml.dequant_rows) and a token's cost falls 2.5x from 32 rows
    to 256: the run's own pass is timed."""
    if prefill_chunk is None:
        return PROBE_PREFILL_TOKENS
    tokens = max(1, min(int(prefill_chunk), WORKLOAD_PROMPT))
    return tokens if prefill_weights != "quantized" else max(tokens, PROBE_PREFILL_TOKENS)


def ggml_cannot(gguf_types: Optional[Dict[str, str]], device: str, adapters: bool) -> Optional[str]:
    """Why ggml cannot compute this node's part of the run (None: it can). Adapters and soft
    prompts run on either backend (mdi.model.ggml.adapters); `adapters` stays for callers."""
    from mdi.model.ggml.lib import gpu_unusable_reason, unavailable_reason
    if not gguf_types:
        return ("its weights hold no GGUF (ggml reads a model directory's model.gguf, which mdi-prepare writes, or a "
                ".gguf file; a chunk cut into safetensors is torch's only)")
    if device.startswith("cuda"):  # ggml-cuda, where the binding was built with it
        return gpu_unusable_reason(device)
    return unavailable_reason()


def torch_cannot(device: str = "cpu") -> Optional[str]:
    """Why torch cannot compute on `device` here (None: it can)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:  # found, not imported: a ggml node stays without it
        return "torch is not installed here"
    return unusable_reason(device)  # (imports torch for a GPU only)


def device_unusable(device: str) -> Optional[str]:
    """None when a backend can compute on `device` ("cpu", "cuda", "cuda:N") in this process,
    else why neither can, in one line; asked before anything touches the device. A GPU that
    ggml can reach is checked without loading torch (a ggml node never loads it)."""
    from mdi.model.ggml.lib import gpu_unusable_reason
    if not device.startswith("cuda"):
        return None
    ggml_why = gpu_unusable_reason(device)
    if ggml_why is None:
        return None
    torch_why = torch_cannot(device)
    return None if torch_why is None else "%s; ggml: %s" % (torch_why, ggml_why)


def layer_types(gguf_types: Dict[str, str], first: int, last: int) -> Dict[str, str]:
    """Each block tensor's most common GGUF type over layers [first, last), by suffix: what the
    probe's random blocks are made of."""
    counts: Dict[str, collections.Counter] = {}
    for name, kind in gguf_types.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and first <= int(parts[1]) < last:
            counts.setdefault(parts[2], collections.Counter())[kind] += 1
    return {suffix: c.most_common(1)[0][0] for suffix, c in counts.items()}


def probe_layout(quant: Optional[Dict[str, Any]], first: int) -> Dict[str, Any]:
    """A node's torch quantization layout (JSON form) for the probe's blocks 0.. (its first ones)."""
    out = {}
    for name, spec in (quant or {}).items():
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 2 and parts[1].isdigit():
            j = int(parts[1]) - first
            if 0 <= j < PROBE_BLOCKS:
                out[".".join(["blocks", str(j)] + parts[2:])] = spec
    return out


def select_backend(asked: str, config: ModelConfig, first: int, last: int, gguf_types: Optional[Dict[str, str]],
                   device: str, threads: Optional[int], rows: int, adapters: bool = False, dtype: str = "float32",
                   quant: Optional[Dict[str, Any]] = None, quant_kernel: Optional[str] = None, kv_type: str = "f16",
                   refresh: bool = False, busy: Optional[str] = None,
                   prefill_weights: str = "quantized", prefill_chunk: Optional[int] = None,
                   repack: bool = True, compute_dtype: Optional[str] = None) -> BackendChoice:
    """The backend of a node holding layers [first, last): `asked` (ValueError when it cannot
    serve), or for auto the measured faster of those that can (`busy`: see backend.choose).
    `prefill_chunk`: the run's tokens per prefill pass (probe_prefill_tokens); `repack`:
    runtime.repack, as ggml will compute (its weights had been timed repacked whatever it said);
    `compute_dtype`: model.compute_dtype, as torch will compute."""
    # (a q8_0 cache that cannot hold the heads is said here, not found by a failing measurement)
    cannot = {"ggml": ggml_cannot(gguf_types, device, adapters) or head_dim_unfit(kv_type, config.head_dim),
              "torch": torch_cannot(device)}
    rounded = sorted({k for k in (gguf_types or {}).values() if k not in GGUF_DIRECT and k not in GGUF_FLOAT})
    if asked == AUTO and cannot["ggml"] is None and cannot["torch"] is None and rounded:
        # auto never trades the GGUF's own numbers for speed
        cannot["torch"] = "it would re-round the GGUF's %s (ggml computes them as stored)" % ", ".join(rounded)
    elif asked == "torch" and rounded and cannot["torch"] is None:  # asked for: said, as a GGUF path's load says it
        log.warning("mdi: layers [%d, %d) on torch compute the GGUF's %s re-rounded to mdi's int4 / int8, not the "
                    "file's values (the ggml backend computes them as stored)", first, last, ", ".join(rounded))
    threads = int(threads) if isinstance(threads, int) and threads > 0 else usable_cpus()  # as the run will
    ltypes = layer_types(gguf_types or {}, first, last)
    tquant = probe_layout(quant, first)
    prefill_tokens = probe_prefill_tokens(prefill_chunk, prefill_weights)

    def measure(backend: str) -> BackendTiming:
        req = ProbeRequest(backend=backend, model=config.to_dict(), threads=threads, rows=max(1, rows),
                           prefill_tokens=prefill_tokens, layer_types=ltypes, kv_type=kv_type, dtype=dtype,
                           device=device, quant=tquant, quant_kernel=quant_kernel, prefill_weights=prefill_weights,
                           repack=repack, compute_dtype=compute_dtype)
        return run_probe(req)

    key: Optional[Dict[str, object]] = None
    if asked == AUTO:
        shape = {k: v for k, v in config.to_dict().items() if k not in ("name", "bos_token_id", "eos_token_id")}
        key = {"machine": machine_key(), "model": shape, "types": ltypes, "quant": tquant, "kernel": quant_kernel,
               "dtype": dtype, "device": device, "threads": threads, "rows": max(1, rows), "kv_type": kv_type}
        # (the defaults leave the keys remembered before them as they were)
        if prefill_weights != "quantized":
            key["prefill_weights"] = prefill_weights
        if not repack:
            key["repack"] = False
        if compute_dtype is not None:
            key["compute_dtype"] = compute_dtype
        if prefill_tokens != PROBE_PREFILL_TOKENS:
            key["prefill_tokens"] = prefill_tokens
    return choose(asked, cannot, measure, key, refresh, busy)
