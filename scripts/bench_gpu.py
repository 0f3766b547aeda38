#!/usr/bin/env python3
"""GPU benchmark: mdi's CUDA paths against transformers, a 3-process ring on one GPU, int4 vs float16.

Written for one short run (<= ~150 s wall, model building included) on a machine with one
NVIDIA GPU; `--device cpu --quick` runs the same logic on tiny shapes to check it anywhere.
Models are random (std 0.02) Llama-family weights of real shapes, built once into --cache as
prepared mdi directories (float16 on disk: half the bytes to write and read) with a character
tokenizer covering the whole vocabulary, so EOS never ends a sample and every id decodes:

  smollm2-135m     30 layers, 576 wide, 9 / 3 heads, MLP 1536, vocabulary 49152, tied head
  tinyllama-1.1b   22 layers, 2048 wide, 32 / 4 heads, MLP 5632, vocabulary 32000
  (quick mode: tiny-tied / tiny-untied, the same two layouts at toy sizes)

Every timing is bracketed by torch.cuda.synchronize; a warm-up run (allocator, cuBLAS
handles, kernel choice) precedes every timed series and is never timed. Decode rate =
(N-1) / (t_last - t_first) from per-token timestamps (prefill excluded); the prompt is 16
tokens ("Once upon a time"), greedy, EOS off.

1. standalone  Decode tok/s of mdi (Pipeline + LocalLoop on the whole-model chunk, what a
               one-node run executes) and of transformers' LlamaForCausalLM.generate (default
               dynamic cache, sdpa) holding the same weights, same GPU, same dtype (float16,
               then bfloat16 if time allows), 128 new tokens, warm-up + 3 alternating repeats
               (which goes first alternates too). Ratio mdi / transformers per repeat (target
               >= 1.0). The first new token where the greedy ids differ is recorded
               (informational: float16 rounding differs between the implementations).
               Then one 32-token mdi decode under torch's profiler: the CUDA kernels' summed
               time and count per token (`mdi_gpu_work`), against the wall time per token: the
               share of a step the GPU computes (the rest is launching: what CUDA graphs save).
2. hop         Per-hop overhead of a 3-process ring on this one GPU: the starter here plus two
               `mdi-worker` processes on loopback (all model.device: cuda, workers read their
               layers from --cache, no weight push), 1 sample in flight:
               (ring ms/token - one-node ms/token) / 3 hops, per-token time = median gap
               between consecutive tokens; one-node and ring runs (both mdi.starter.batch.run)
               alternate, 64 new tokens each, 3 repeats after one short untimed run of each.
               --pyspy: one more ring run sampled by py-spy in every process (how the 20-40 ms
               per hop of cuDNN attention compiling per key length was found).
3. pipeline    Aggregate decode tok/s with S = N = 3 samples (max_batch 1: every sample in its
               own frame) and S = 4N = 12 (max_batch 4: frames carry 4 samples), ring vs one
               node holding the whole model at the same S and max_batch, same GPU; ratio
               ring / one node per repeat. Aggregate = mdi.lab.report.steady_rate (tokens while
               every sample decodes). 64 new tokens, 2 repeats.
4. int4        Standalone decode tok/s and GPU memory of float16 vs int4 weights (random
               quantized model: int4 in groups of 128, or the largest of 64/32 dividing every
               width: SmolLM2's 576 is no multiple of 128; embedding/head int8 per channel, as
               mdi's uniform int4 layout keeps them), kernel policy `fast`. Memory:
               torch.cuda.memory_allocated / max_memory_allocated relative to before the load,
               the peak reset before the load and again before decoding. The kernel every
               quantized layer got is recorded (int4pack-cuda needs n_in % 1024 == 0 and sm80+,
               so SmolLM2's 576/1536-wide inputs and TinyLlama's 5632-wide mlp.down fall back
               to dequant: expect SmolLM2's int4 slow). The float16
               tok/s is taken from part 1 when it ran (same shape, dtype, tokens), else measured.

5. spec        Speculative decoding verified in the ring of 3 on this GPU (issue 42), S = 1,
               --dtype's first, 96 new tokens: a drafter that agrees with the target with
               probability a (mdi.lab.oracle_drafter; random weights make n-gram drafts
               meaningless) at a = 0.5, 0.7, 0.9, filling the ring and verifying alone, against
               the plain ring and one node alone, alternating per prompt (3 prompts); the
               starter's measured pass costs (what k is chosen by) and the model's expected
               speed-up beside each point. Whether each run's ids equal the plain ring's is
               recorded, not asserted: half-precision rows computed in one pass may round
               otherwise than one at a time.
6. ggml        Standalone decode on ggml (ggml-cuda where the binding was built with CUDA:
               scripts/gpu_check.sh builds it from a carried sdist) of the shape's GGUF in each of
               GGML_TYPES (written once from the float16 model by mdi-prepare's own export,
               ggml's quantizer), against torch's path on the same device and --dtype's first,
               alternating, the same tokens and repeats as part 1: what issue 61 asks of a
               GPU (ggml's int4-class types at least as fast as torch's float16). A binding
               without a GPU device is recorded as the reason the part is skipped.

Order (most wanted first, so a tight --budget-s cuts the extras): standalone float16 of both
shapes, ring (hop, pipeline) of the small shape, int4 of both, ring of the 1.1B shape,
standalone bfloat16. A task whose estimated time no longer fits --budget-s is recorded as
skipped; a repeat series stops early (marked truncated) when the budget runs out; a hard
timer at budget + 10 s aborts whatever runs (workers stopped, JSON written). Every task is
in its own try/except (a failure is recorded with its error and the rest runs), and the JSON
is rewritten after every task, so a run killed from outside still leaves its results.

    python scripts/bench_gpu.py                                   # GPU, ~135 s
    python scripts/bench_gpu.py --parts standalone,int4 --dtype float16
    python scripts/bench_gpu.py --device cpu --quick --out /tmp/bg/bench_gpu.json
"""
import argparse
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

T_START = time.perf_counter()  # the budget counts from here: imports and model building included

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)
from benchlib import fmt_stat, print_table, summarize  # noqa: E402

PARTS = ("standalone", "hop", "pipeline", "int4", "spec", "ggml")
GGML_TYPES = ("F16", "Q8_0", "Q4_K", "Q4_0")  # part 6's GGUF weight types
PROMPT = "Once upon a time"  # 16 characters = 16 tokens with the character tokenizer
STD = 0.02
RING_NODES = 3
GPU_SHAPES = ("smollm2-135m", "tinyllama-1.1b")
# Quick-mode shapes: SmolLM2's layout (tied head, narrow) and TinyLlama's (untied, wider).
TINY_SHAPES = {
    "tiny-tied": dict(family="llama", vocab_size=512, n_layer=6, n_embd=128, n_head=4, n_kv_head=2,
                      intermediate_size=384, block_size=512, rope_theta=100000.0, tied_head=True),
    "tiny-untied": dict(family="llama", vocab_size=1024, n_layer=4, n_embd=256, n_head=8, n_kv_head=2,
                        intermediate_size=512, block_size=512, tied_head=False),
}
# Seconds a task takes on an H100 at the default token counts (guesses from per-token costs:
# ~10-25 ms/token with Python-bound decode), for the budget's skip decisions; unknown shapes: 5.
EST_GPU = {
    ("standalone", "smollm2-135m"): 20, ("standalone", "tinyllama-1.1b"): 30,  # model build included
    ("hop", "smollm2-135m"): 25, ("hop", "tinyllama-1.1b"): 25,  # the first includes the workers' start
    ("pipeline", "smollm2-135m"): 22, ("pipeline", "tinyllama-1.1b"): 26,
    ("int4", "smollm2-135m"): 16, ("int4", "tinyllama-1.1b"): 20,
    ("spec", "smollm2-135m"): 60, ("spec", "tinyllama-1.1b"): 60,
    ("ggml", "smollm2-135m"): 40, ("ggml", "tinyllama-1.1b"): 60,  # the GGUFs' writing included
}
SPEC_AGREES = (0.5, 0.7, 0.9)
SPEC_PROMPTS = ("Once upon a time", "The ring of boards", "A quick brown fox")
SPEC_TOKENS = 96
INT4_GROUPS = (128, 64, 32)


class HardLimit(BaseException):
    """Raised by the timer at --budget-s + HARD_GRACE: a BaseException so that no `except
    Exception` (ours or mdi's) swallows it on the way out."""


HARD_GRACE = 10.0
# The backend every run here computes with but part 6's ggml ones: its ring and standalone runs
# measure torch's CUDA paths; scripts/bench_peer.py measures ggml on the CPU.
TORCH = "torch"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring for what each part measures and how.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: a logic check, with --quick)")
    p.add_argument("--dtype", default="float16,bfloat16",
                   help="comma list: the first is used everywhere; later ones only for standalone, last in order")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of %s" % ", ".join(PARTS))
    p.add_argument("--shapes", default=None,
                   help="comma list of model shapes: names of mdi.model.config.CONFIGS or %s (default: %s; "
                        "--quick: %s)" % (", ".join(TINY_SHAPES), ",".join(GPU_SHAPES), ",".join(TINY_SHAPES)))
    p.add_argument("--tokens", type=int, default=None, help="new tokens per standalone / int4 run (default 128, quick 12)")
    p.add_argument("--ring-tokens", type=int, default=None, help="new tokens per ring run (default 64, quick 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per standalone / int4 series")
    p.add_argument("--ring-repeats", type=int, default=None, help="timed repeats of the hop series (default 3, quick 1)")
    p.add_argument("--pipeline-repeats", type=int, default=None,
                   help="timed repeats per pipeline series, S = 3 and 12 (default 2, quick 1)")
    p.add_argument("--verify-rows", choices=("auto", "row-wise", "one-call"), default="auto",
                   help="how a speculative verification's rows attend in every process (mdi.model.row_batch."
                        "verifies_row_by_row; auto: row by row on a CPU, in one call on a GPU)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and token counts (a logic check)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds from start after which remaining tasks are skipped (default 135; quick 600)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads in every process (default: torch's own on cuda, 1 on cpu)")
    p.add_argument("--pyspy", action="store_true",
                   help="after the hop series, one more ring run sampled by py-spy (if on PATH) in the starter and "
                        "each worker: per-thread hot frames in the JSON, raw stacks beside --out")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "gpu", "bench_gpu.json"))
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "mdi-bench-gpu-cache"),
                   help="where the random model directories are built once (and the node logs go)")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtype.split(",") if d]
    args.parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        p.error("unknown part(s) %s (expected %s)" % (", ".join(bad), ", ".join(PARTS)))
    for d in args.dtypes:
        if d not in ("float16", "bfloat16", "float32"):
            p.error("--dtype: expected float16, bfloat16 or float32, got %r" % d)
    if not args.dtypes:
        p.error("--dtype: give at least one dtype")
    args.shapes = [s for s in (args.shapes or ",".join(TINY_SHAPES if args.quick else GPU_SHAPES)).split(",") if s]
    args.tokens = args.tokens or (12 if args.quick else 128)
    args.ring_tokens = args.ring_tokens or (10 if args.quick else 64)
    args.ring_repeats = args.ring_repeats or (1 if args.quick else 3)
    args.pipeline_repeats = args.pipeline_repeats or (1 if args.quick else 2)
    args.budget_s = args.budget_s or (600.0 if args.quick else 135.0)
    if args.tokens < 3 or args.ring_tokens < 3 or args.repeats < 1:
        p.error("need --tokens >= 3, --ring-tokens >= 3, --repeats >= 1")
    args.cache = os.path.abspath(args.cache)  # workers check weights paths against it (--models-dir)
    if args.threads is None and args.device == "cpu":
        args.threads = 1  # a shared CPU: one thread per process keeps the three ring processes apart
    return args


# --------------------------------------------------------------------------- bookkeeping

def log(msg: str) -> None:
    print("[%6.1fs] %s" % (time.perf_counter() - T_START, msg), flush=True)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - T_START

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, est: float) -> bool:
        return self.left() >= est


class Recorder:
    """The JSON record, rewritten whole after every task (write_json replaces it atomically)."""

    def __init__(self, path: str, record: Dict[str, Any]) -> None:
        self.path, self.record = path, record

    def flush(self) -> None:
        from mdi.system.files import write_json
        self.record["elapsed_s"] = round(time.perf_counter() - T_START, 2)
        try:
            write_json(self.path, self.record)
        except (OSError, TypeError, ValueError) as e:  # a bad value must not end the benchmark
            print("warning: cannot write %s: %s" % (self.path, e), file=sys.stderr, flush=True)


def error_text(e: BaseException) -> Dict[str, str]:
    return {"error": "%s: %s" % (type(e).__name__, str(e)[:2000]),
            "traceback": traceback.format_exc()[-4000:]}


# --------------------------------------------------------------------------- device

def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    import torch
    if is_cuda(device):
        torch.cuda.synchronize(device)


def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


def gpu_info(device: str) -> Dict[str, Any]:
    """The GPU every figure of this run belongs to."""
    import torch
    info = {"device": device, "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}  # type: Dict[str, Any]
    if is_cuda(device) and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(name=torch.cuda.get_device_name(torch.device(device)),
                    capability=list(torch.cuda.get_device_capability(torch.device(device))),
                    total_memory_bytes=int(props.total_memory), multiprocessors=int(props.multi_processor_count),
                    l2_cache_bytes=int(getattr(props, "L2_cache_size", 0) or 0),
                    cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    else:
        info["name"] = "none (%s)" % device
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,"
                                  "compute_mode", "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            info["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
            fields = [f.strip() for f in out.stdout.strip().splitlines()[0].split(",")] if out.stdout.strip() else []
            if len(fields) > 1:
                info["driver"] = fields[1]
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            info["nvidia_smi"] = "failed: %s" % e
    else:
        info["nvidia_smi"] = None
    return info


class GpuMemory:
    """Bytes torch's allocator hands out on `device`, relative to a baseline taken at start();
    None everywhere on the CPU (RSS would mix in the whole process)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = is_cuda(device)
        self.base = 0

    def start(self) -> None:
        import torch
        if self.cuda:
            sync(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def reset_peak(self) -> None:
        import torch
        if self.cuda:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def now(self) -> Optional[int]:
        import torch
        if not self.cuda:
            return None
        sync(self.device)
        return int(torch.cuda.memory_allocated(self.device) - self.base)

    def peak(self) -> Optional[int]:
        import torch
        if not self.cuda:
            return None
        sync(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self.base)


def free_device_memory(device: str) -> None:
    import torch
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- models

def shape_spec(shape: str) -> Dict[str, Any]:
    """ModelConfig keywords of a shape; EOS/BOS dropped (random weights: nothing ends a sample)."""
    from mdi.model.config import CONFIGS
    if shape in TINY_SHAPES:
        spec = dict(TINY_SHAPES[shape])
    elif shape in CONFIGS:
        spec = dict(CONFIGS[shape])
    else:
        raise ValueError("unknown shape %r (expected a name of mdi.model.config.CONFIGS or %s)"
                         % (shape, ", ".join(TINY_SHAPES)))
    if spec.get("family") != "llama" or spec.get("bias") or spec.get("qkv_bias") or spec.get("qk_norm"):
        raise ValueError("%s: only plain Llama shapes map onto transformers' LlamaForCausalLM" % shape)
    spec.update(bos_token_id=None, eos_token_id=None)
    return spec


def shape_config(shape: str):
    from mdi.lab.model_setup import random_model_config
    return random_model_config(shape, shape_spec(shape))


def vocabulary(n: int) -> List[str]:
    """n distinct single characters: mdi.lab.model_setup's (printable ASCII, newline, then CJK
    and on) continued past the UTF-16 surrogates. Why not random_vocabulary: it stops at the
    surrogates, 35424 ids, short of SmolLM2's 49152."""
    from mdi.lab.model_setup import CHARS, PAD_CHARS_FROM
    out = list(CHARS)
    code = PAD_CHARS_FROM
    while len(out) < n:
        if 0xD800 <= code <= 0xDFFF:
            code = 0xE000
        out.append(chr(code))
        code += 1
    return out[:n]


def int4_group(config) -> int:
    """The largest of 128 / 64 / 32 that divides every quantized width (the blocks' inputs)."""
    widths = (config.n_embd, config.intermediate_size, config.n_head * config.head_dim)
    for g in INT4_GROUPS:
        if all(w % g == 0 for w in widths):
            return g
    raise ValueError("no int4 group size of %s divides the widths %s" % (INT4_GROUPS, widths))


def _same_model(path: str, config, labels: Dict[str, str]) -> bool:
    from mdi.model.files.store import file_layout, read_mdi_config
    try:
        return read_mdi_config(path).to_dict() == config.to_dict() and \
            {k: v.label() for k, v in file_layout(path).items()} == labels
    except Exception:  # noqa: BLE001 - unreadable: rebuild it
        return False


def ensure_model(cache: str, shape: str, group: Optional[int], gen_device: str) -> Tuple[str, Dict[str, Any]]:
    """A prepared mdi directory of random weights for `shape` (float16, or int4 in groups of
    `group` with the embedding/head int8 per channel), built once into `cache`; returns its
    path and how it was made. Built next to its final place and renamed into it, so a run
    killed mid-build never leaves a half directory that a later run would take."""
    from mdi.model.quantization.quant import uniform_layout
    config = shape_config(shape)
    n = config.n_layer
    layout = uniform_layout(config, (0, n), True, True, "int4", group) if group else {}
    labels = {k: v.label() for k, v in layout.items()}
    path = os.path.join(cache, "%s-%s" % (shape, "int4-g%d" % group if group else "f16"))
    info = {"path": path, "config": config.to_dict(), "quant": "int4/g%d (embedding/head int8 per channel)" % group
            if group else "none (float16 on disk)"}  # type: Dict[str, Any]
    if os.path.isdir(path) and _same_model(path, config, labels):
        info["built_now"] = False
        return path, info
    t0 = time.perf_counter()
    tmp = path + ".building-%d" % os.getpid()
    shutil.rmtree(tmp, ignore_errors=True)
    _build(tmp, config, layout, gen_device)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    info.update(built_now=True, build_s=round(time.perf_counter() - t0, 2))
    return path, info


def _build(path: str, config, layout: Dict[str, Any], gen_device: str) -> None:
    """Random N(0, STD) matrices drawn (and quantized) one at a time on `gen_device` (a GPU
    draws 1.1 G values in well under a second; mdi.lab.model_setup.build_random_model builds
    the float32 model on the CPU first, ~10 s and 4.4 GB for the 1.1B shape), norms 1."""
    import torch
    from mdi.model.files.store import save_model_dir
    from mdi.model.layout import expected_shapes
    from mdi.model.quantization.quant import QParts, quantize
    from mdi.model.tokenizers import char_tokenizer
    gen = torch.Generator(device=gen_device).manual_seed(0)
    out = {}  # type: Dict[str, Any]
    with torch.no_grad():
        for key, shape in expected_shapes(config, (0, config.n_layer), True, True).items():
            if len(shape) != 2:
                fill = 0.0 if key.endswith(".bias") else 1.0
                out[key] = torch.full(shape, fill, dtype=torch.float16)
                continue
            w = torch.empty(shape, device=gen_device).normal_(0, STD, generator=gen)
            spec = layout.get(key[:-len(".weight")]) if key.endswith(".weight") else None
            if spec is None:
                out[key] = w.to(torch.float16).cpu()
            else:
                out[key] = QParts(spec, {k: t.cpu() for k, t in quantize(w, spec).items()}, shape[1])
            del w
    save_model_dir(path, config, out, "bench_gpu random: std %g, %s" % (STD, "quantized" if layout else "float16"))
    char_tokenizer(vocabulary(config.vocab_size)).save(path)


def load_mdi(path: str, dtype: str, device: str, policy: str = "fast"):
    """(source, whole-model chunk on `device`), quantized weights kept as stored, kernels
    chosen under `policy` with no memory limit."""
    from mdi.model.quantization import kernel_choice, qkernels
    from mdi.model.source import ModelSource
    qkernels.set_preference(policy)
    kernel_choice.set_memory_allowance(None)
    source = ModelSource(path)
    n = source.config.n_layer
    quant = source.layout(0, n, True, "auto")
    chunk = source.load_chunk(0, n, True, True, torch_dtype(dtype), device, None, quant)
    return source, chunk


def chunk_kernels(chunk) -> Dict[str, Any]:
    """Which kernel every quantized layer of `chunk` runs: per layer, per weight shape, counts."""
    from mdi.model.layers import QuantLinear
    from mdi.model.quantization import kernel_choice
    per_layer, per_shape = {}, {}  # type: Dict[str, str], Dict[str, str]
    for name, m in chunk.named_modules():
        if isinstance(m, QuantLinear):
            # an untied embedding is only looked up (rows dequantized): it has no matmul kernel
            kernel = m.kernel.name if m.kernel is not None else "lookup-only"
            per_layer[name] = kernel
            per_shape["%s %dx%d" % (m.spec.label(), m.n_out, m.n_in)] = kernel
    counts = {}  # type: Dict[str, int]
    for k in per_layer.values():
        counts[k] = counts.get(k, 0) + 1
    why = [e for e in kernel_choice.chosen() if e["weight"] in per_shape]
    return {"per_layer": per_layer, "per_shape": per_shape, "counts": counts,
            "summary": ", ".join("%s x%d" % kv for kv in sorted(counts.items())), "why": why}


# --------------------------------------------------------------------------- transformers

def load_hf(chunk, config, dtype: str, device: str):
    """transformers LlamaForCausalLM holding exactly the mdi chunk's weights (its canonical
    state dict mapped back by bench_standalone.hf_state_dict), built on `device` (random
    initialisation on the GPU is fast; the 1.1B shape on the CPU takes ~10 s)."""
    import torch
    import transformers
    from bench_standalone import hf_state_dict
    c = config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tied_head, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config)
    model = model.to(torch_dtype(dtype)).eval()
    sd = hf_state_dict(c, {k: v for k, v in chunk.state_dict().items()})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (c.tied_head and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError("weight mapping failed: missing %s, unexpected %s" % (missing[:3], unexpected[:3]))
    if c.tied_head:
        model.tie_weights()
    return model


def _token_clock(device: str):
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """generate() calls put() once with the prompt, then once per new token (with the
        token already copied to the CPU: synced; synchronize again to be sure)."""

        def __init__(self) -> None:
            self.times = []  # type: List[float]
            self._prompt_seen = False

        def put(self, value) -> None:
            if self._prompt_seen:
                sync(device)
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return TokenClock()


def hf_generate(model, prompt_ids: List[int], n_tokens: int, device: str) -> Tuple[List[int], List[float]]:
    """generate(): greedy, EOS off (eos_token_id None), default (dynamic) KV cache."""
    import torch
    from transformers import GenerationConfig
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=n_tokens, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=0, bos_token_id=None)
    clock = _token_clock(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=clock)
    sync(device)
    new = out[0, len(prompt_ids):].tolist()
    return new, [t - t0 for t in clock.times]


def mdi_generate(chunk, prompt_ids: List[int], n_tokens: int, device: str) -> Tuple[List[int], List[float]]:
    """bench_standalone.mdi_generate (Pipeline + LocalLoop, greedy, EOS off), synchronized
    around; each token's time is taken after sample_next copied its logits to the CPU."""
    from bench_standalone import mdi_generate as generate
    sync(device)
    ids, times = generate(chunk, prompt_ids, n_tokens)
    sync(device)
    return ids, times


def gpu_kernel_ms_per_token(chunk, prompt_ids: List[int], n_tokens: int, device: str) -> Optional[Dict[str, Any]]:
    """The GPU's own work per decoded token: every CUDA kernel's duration over one mdi decode of
    `n_tokens`, summed by torch.profiler (CUPTI), divided by the tokens, prefill included. Set
    against the unprofiled wall time per token, it says what share of a step the GPU computes
    and so what at most launching the step as one CUDA graph could save. None without CUDA."""
    if not is_cuda(device):
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mdi_generate(chunk, prompt_ids, n_tokens, device)
    events = prof.key_averages()
    total_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    launches = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return {"gpu_kernel_ms_per_token": round(total_us / 1e3 / n_tokens, 4),
            "kernels_per_token": round(launches / float(n_tokens), 1)}


# --------------------------------------------------------------------------- timing series

def alternate(impls: Dict[str, Callable[[], Tuple[List[int], List[float]]]], repeats: int, n_tokens: int,
              budget: Budget, per_repeat_s: float) -> Dict[str, Any]:
    """A warm-up of each, then `repeats` rounds in alternating order; stops early (truncated)
    when the budget has no room for another round (at least one timed round always runs)."""
    names = list(impls)
    warm = {}  # type: Dict[str, float]
    for name in names:
        t0 = time.perf_counter()
        impls[name]()
        warm[name] = time.perf_counter() - t0
    runs = {name: [] for name in names}  # type: Dict[str, List[Dict[str, Any]]]
    ids = {}  # type: Dict[str, List[int]]
    truncated = False
    for r in range(repeats):
        round_s = sum(warm.values()) if r == 0 else per_repeat_s
        if r > 0 and not budget.allows(round_s + 2):
            truncated = True
            break
        order = names if r % 2 == 0 else names[::-1]
        t_round = time.perf_counter()
        for name in order:
            tokens, times = impls[name]()
            if len(tokens) != n_tokens:
                raise RuntimeError("%s generated %d tokens, expected %d" % (name, len(tokens), n_tokens))
            ids.setdefault(name, tokens)
            runs[name].append(dict(benchlib.decode_timing(times), order=order.index(name)))
        per_repeat_s = time.perf_counter() - t_round
        log("    repeat %d/%d: %s" % (r + 1, repeats, ", ".join("%s %.1f tok/s" % (n, runs[n][-1]["tokens_per_s"])
                                                             for n in names)))
    return {"runs": runs, "ids": ids, "warmup_s": {k: round(v, 3) for k, v in warm.items()}, "truncated": truncated}


def rate_summary(rs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"tokens_per_s": summarize([r["tokens_per_s"] for r in rs]),
            "ms_per_token_mean": summarize([1000 * r["mean_s"] for r in rs]),
            "ms_per_token_median_gap": summarize([1000 * r["median_s"] for r in rs]),
            "prefill_first_token_ms": summarize([1000 * r["first_token_s"] for r in rs])}


# --------------------------------------------------------------------------- part 1: standalone

def standalone(ctx: "Context", shape: str, dtype: str) -> Dict[str, Any]:
    from bench_standalone import first_difference
    args, device = ctx.args, ctx.args.device
    path, made = ctx.model(shape, None)
    mem = GpuMemory(device)
    mem.start()
    source, chunk = load_mdi(path, dtype, device)
    out = {"model": made["path"], "mdi_weights_bytes": mem.now(), "mdi_load_peak_bytes": mem.peak()}
    model = None
    try:
        model = load_hf(chunk, source.config, dtype, device)
        out["transformers_attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        prompt_ids = source.tokenizer.encode(PROMPT)
        n = args.tokens
        m = alternate({"mdi": lambda: mdi_generate(chunk, prompt_ids, n, device),
                       "transformers": lambda: hf_generate(model, prompt_ids, n, device)},
                      args.repeats, n, ctx.budget, 0.0)
        try:
            out["mdi_gpu_work"] = gpu_kernel_ms_per_token(chunk, prompt_ids, min(n, 32), device)
        except Exception as e:  # noqa: BLE001 - informational: the timed series stands
            out["mdi_gpu_work"] = {"error": "%s: %s" % (type(e).__name__, e)}
    finally:
        del model, chunk
        free_device_memory(device)
    runs = m["runs"]
    out.update({name: rate_summary(rs) for name, rs in runs.items()})
    work = out.get("mdi_gpu_work") or {}
    if "gpu_kernel_ms_per_token" in work:
        work["share_of_wall"] = round(work["gpu_kernel_ms_per_token"]
                                      / out["mdi"]["ms_per_token_median_gap"]["median"], 3)
    pairs = list(zip(runs["mdi"], runs["transformers"]))
    out["ratio_mdi_over_transformers"] = summarize([a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs])
    out["ratio_median_gap"] = summarize([b["median_s"] / a["median_s"] for a, b in pairs])
    out["first_different_token"] = first_difference(m["ids"]["mdi"], m["ids"]["transformers"])
    out.update(prompt_tokens=len(prompt_ids), new_tokens=n, repeats_done=len(pairs), truncated=m["truncated"],
               warmup_s=m["warmup_s"], runs=runs, token_ids=m["ids"])
    ctx.standalone_mdi[(shape, dtype, n)] = out["mdi"]["tokens_per_s"]
    return out


# --------------------------------------------------------------------------- parts 2 and 3: the ring

class Ring:
    """Two mdi-worker processes on loopback, started once for every ring task and stopped in
    the caller's finally (this process's own PIDs only). They read their layers from --cache
    (--models-dir), so a run sends no weights; a worker keeps its chunk between runs of the
    same model and split."""

    def __init__(self, ctx: "Context") -> None:
        self.ctx = ctx
        self.workers = []  # type: List[Any]
        self.warm = set()  # type: set  # shapes whose ring and one-node runs have been warmed

    def start(self) -> List[Any]:
        if self.workers and all(w.alive() for w in self.workers):
            return self.workers
        self.stop()
        self.warm.clear()  # fresh workers hold no layers and no CUDA context yet
        from mdi.lab.processes import WorkerProcess, free_ports
        args = self.ctx.args
        log_dir = os.path.join(args.cache, "logs")
        os.makedirs(log_dir, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for i in range(RING_NODES - 1):
            port, data_port = free_ports(2)
            name = "gpu%d" % (i + 1)
            self.workers.append(WorkerProcess(port, os.path.join(log_dir, "%s.log" % name), name,
                                              threads=args.threads, extra=["--models-dir", args.cache], env=env,
                                              data_port=data_port, append=False))  # this run's log only
        self.ctx.record["ring_workers"] = [{"name": w.name, "pid": w.pid, "port": w.port, "data_port": w.data_port,
                                            "log": w.log_path} for w in self.workers]
        t0 = time.perf_counter()
        for w in self.workers:
            w.wait_ready(120)
        self.ctx.record["ring_workers_ready_s"] = round(time.perf_counter() - t0, 2)
        return self.workers

    def stop(self) -> None:
        # /shutdown to every worker first, so they exit side by side, then wait for each
        # (SIGTERM, then SIGKILL, to that PID alone) - an aborted run has seconds, not tens.
        for w in self.workers:
            try:
                w.shutdown()
            except Exception:  # noqa: BLE001 - stop() below still ends it
                pass
        for w in self.workers:
            try:
                w.stop(grace=3.0)
            except Exception as e:  # noqa: BLE001 - the next one must still be stopped
                print("warning: stopping %s: %s" % (w.name, e), file=sys.stderr, flush=True)
        self.workers = []

    def tails(self, n: int = 5) -> Dict[str, str]:
        return {w.name: w.tail(n) for w in self.workers}


def run_config(ctx: "Context", model: str, nodes: List[Dict[str, Any]], n_tokens: int, max_batch: int):
    from mdi.runconfig import parse_config
    args = ctx.args
    d = benchlib.run_config_dict(model, nodes, n_tokens, args.threads or 1)
    d["model"].update(dtype=args.dtypes[0], device=args.device, quant="auto")
    if args.threads is None:
        del d["runtime"]["threads"]  # torch's default in every node
    # A stuck ring fails within the budget instead of after the default 30 s.
    d["runtime"].update(max_batch=max_batch, quant_kernel="fast", ring_timeout=20.0, init_timeout=120.0)
    d["runtime"]["backend"] = TORCH
    return parse_config(d, "bench_gpu")


def one_run(ctx: "Context", model: str, workers: List[Any], n_samples: int, max_batch: int,
            n_tokens: int) -> Dict[str, Any]:
    """One mdi.starter.batch.run: the starter here, plus `workers` (none: one node with the
    whole model). Prefill is excluded from every rate."""
    from mdi.lab.report import steady_rate
    from mdi.starter import batch
    data_port = benchlib.ports_besides(workers)[0]
    nodes = [{"name": "starter", "data_port": data_port}] + [w.node(weights=model) for w in workers]
    cfg = run_config(ctx, model, nodes, n_tokens, max_batch)
    sync(ctx.args.device)
    res = batch.run(cfg, [PROMPT] * n_samples)
    sync(ctx.args.device)
    times = [s.token_times for s in res.samples]
    short = [len(t) for t in times if len(t) < n_tokens]
    if short:
        raise RuntimeError("samples stopped early (%s tokens of %d; finish %s)"
                           % (short, n_tokens, sorted(set(s.finish_reason for s in res.samples))))
    rate = steady_rate(times)
    if rate is None:
        raise RuntimeError("the samples never decoded at the same time")
    firsts, lasts = [t[0] for t in times], [t[-1] for t in times]
    out = {"n_samples": n_samples, "max_batch": max_batch, "nodes": len(nodes), "aggregate_tokens_per_s": rate,
           "decode_tokens_per_s": sum(len(t) - 1 for t in times) / (max(lasts) - min(firsts)),
           "first_token_ms": [round(1000 * f, 2) for f in firsts],
           "node_metrics": [{k: v for k, v in n.to_json().items() if k != "kernels"} for n in res.nodes]}
    if n_samples == 1:
        t = benchlib.decode_timing(times[0])
        out.update(per_token_s=t["median_s"], per_token_mean_s=t["mean_s"])
    return out


def warm_ring(ctx: "Context", shape: str, model: str, workers: List[Any]) -> None:
    """One short run of each kind: the workers load their layers, every process its CUDA
    context, cuBLAS handles and kernels. Never timed."""
    if shape in ctx.ring.warm:
        return
    one_run(ctx, model, [], 1, 1, 4)
    one_run(ctx, model, workers, 1, 1, 4)
    ctx.ring.warm.add(shape)


def alternate_ring(ctx: "Context", model: str, workers: List[Any], n_samples: int, max_batch: int, repeats: int,
                   describe: Callable[[Dict[str, Any], Dict[str, Any]], str]) -> Tuple[list, list, bool, float]:
    """One-node and ring runs in alternating order, `repeats` pairs or fewer when the budget
    runs short: (one-node runs, ring runs, truncated, seconds of the last pair)."""
    alone, ring = [], []  # type: List[Dict[str, Any]], List[Dict[str, Any]]
    truncated, round_s = False, 0.0
    for r in range(repeats):
        if r > 0 and not ctx.budget.allows(round_s + 2):
            truncated = True
            break
        t0 = time.perf_counter()
        pair = [("alone", []), ("ring", workers)] if r % 2 == 0 else [("ring", workers), ("alone", [])]
        for name, ws in pair:
            (alone if name == "alone" else ring).append(one_run(ctx, model, ws, n_samples, max_batch,
                                                                ctx.args.ring_tokens))
        round_s = time.perf_counter() - t0
        log("    repeat %d/%d: %s" % (r + 1, repeats, describe(alone[-1], ring[-1])))
    return alone, ring, truncated, round_s


def hop(ctx: "Context", shape: str) -> Dict[str, Any]:
    args = ctx.args
    model, made = ctx.model(shape, None)
    workers = ctx.ring.start()
    warm_ring(ctx, shape, model, workers)
    alone, ring, truncated, _ = alternate_ring(
        ctx, model, workers, 1, 1, args.ring_repeats,
        lambda a, b: "one node %.2f ms/token, ring %.2f ms/token" % (1e3 * a["per_token_s"], 1e3 * b["per_token_s"]))
    hops = RING_NODES  # a token's activations cross every link of the ring once per step
    per_hop = [(b["per_token_s"] - a["per_token_s"]) / hops for a, b in zip(alone, ring)]
    sampled = sampled_ring_run(ctx, model, workers) if args.pyspy else None
    return {"sampled_ring_run": sampled, "model": model, "nodes": RING_NODES, "hops_per_token": hops, "samples": 1, "new_tokens": args.ring_tokens,
            "standalone_ms_per_token": summarize([1e3 * a["per_token_s"] for a in alone]),
            "ring_ms_per_token": summarize([1e3 * b["per_token_s"] for b in ring]),
            "per_hop_overhead_ms": summarize([1e3 * h for h in per_hop]),
            "standalone_tokens_per_s": summarize([1.0 / a["per_token_s"] for a in alone]),
            "ring_tokens_per_s": summarize([1.0 / b["per_token_s"] for b in ring]),
            "repeats_done": len(per_hop), "truncated": truncated,
            "runs": {"standalone": alone, "ring": ring}}


def sampled_ring_run(ctx: "Context", model: str, workers: List[Any]) -> Dict[str, Any]:
    """One ring run (1 sample) while py-spy samples this process (the starter) and every
    worker, Python and native frames, idle ones too: where a token's time goes in each process.
    py-spy is stopped with SIGINT when the run ends and writes its raw stacks then."""
    exe = shutil.which("py-spy")
    if exe is None:
        return {"status": "skipped", "reason": "py-spy not on PATH"}
    out_dir = os.path.dirname(os.path.abspath(ctx.args.out))
    targets = [("starter", os.getpid())] + [(w.name, w.pid) for w in workers]
    spies = []
    for name, pid in targets:
        path = os.path.join(out_dir, "pyspy_%s.txt" % name)
        cmd = [exe, "record", "--pid", str(pid), "--rate", "200", "--threads", "--idle", "--native",
               "--format", "raw", "--output", path]
        spies.append((name, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    time.sleep(2.0)  # py-spy attaches
    try:
        run = one_run(ctx, model, workers, 1, 1, ctx.args.ring_tokens)
    finally:
        for _, _, proc in spies:
            proc.send_signal(signal.SIGINT)
    out = {"status": "ok", "per_token_ms": round(1e3 * run["per_token_s"], 3),
           "node_metrics": run["node_metrics"], "processes": {}}  # type: Dict[str, Any]
    for name, path, proc in spies:
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = b"py-spy did not stop in 30 s"
        out["processes"][name] = hot_frames(path) if os.path.exists(path) else {
            "error": err.decode(errors="replace")[-500:]}
    return out


def hot_frames(path: str, top: int = 15) -> Dict[str, Any]:
    """py-spy raw stacks ("thread (tid): name;frame;...;leaf count" per line) summed per thread:
    samples, the leaf frames that hold them (self time) and the Python frames they pass through
    (inclusive time), the `top` largest of each, as shares of the thread's samples."""
    threads = {}  # type: Dict[str, Dict[str, Any]]
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            thread = frames[0]  # "thread (tid): name" (py-spy --threads)
            t = threads.setdefault(thread, {"samples": 0, "leaf": {}, "through": {}})
            n = int(count)
            t["samples"] += n
            leaf = frames[-1]
            t["leaf"][leaf] = t["leaf"].get(leaf, 0) + n
            for frame in set(fr for fr in frames[1:] if ".py:" in fr):
                t["through"][frame] = t["through"].get(frame, 0) + n

    def shares(counts: Dict[str, int], total: int) -> List[List[Any]]:
        best = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [[frame, round(n / float(total), 3)] for frame, n in best]
    # waitress's request threads only wait for HTTP requests: left out (they are in the raw file)
    busiest = sorted(((n, t) for n, t in threads.items() if "waitress-" not in n), key=lambda kv: -kv[1]["samples"])
    return {"raw": os.path.basename(path),
            "threads": {name: {"samples": t["samples"], "leaf": shares(t["leaf"], t["samples"]),
                               "through": shares(t["through"], t["samples"])} for name, t in busiest}}


def pipeline(ctx: "Context", shape: str) -> Dict[str, Any]:
    args = ctx.args
    model, made = ctx.model(shape, None)
    workers = ctx.ring.start()
    warm_ring(ctx, shape, model, workers)
    out = {"model": model, "nodes": RING_NODES, "new_tokens": args.ring_tokens, "by_samples": {}}  # type: Dict[str, Any]
    round_s = 0.0
    for s in (RING_NODES, 4 * RING_NODES):
        max_batch = max(1, -(-s // RING_NODES))  # mdi's `auto`: about one group per node (1, then 4)
        if out["by_samples"] and not ctx.budget.allows(round_s * 1.5 + 2):
            out["by_samples"][str(s)] = {"status": "skipped", "reason": "budget"}
            continue
        alone, ring, truncated, round_s = alternate_ring(
            ctx, model, workers, s, max_batch, args.pipeline_repeats,
            lambda a, b: "S=%d max_batch=%d: one node %.1f tok/s, ring %.1f tok/s"
            % (s, max_batch, a["aggregate_tokens_per_s"], b["aggregate_tokens_per_s"]))
        out["by_samples"][str(s)] = {
            "status": "ok", "samples": s, "max_batch": max_batch,
            "standalone_aggregate_tokens_per_s": summarize([a["aggregate_tokens_per_s"] for a in alone]),
            "ring_aggregate_tokens_per_s": summarize([b["aggregate_tokens_per_s"] for b in ring]),
            "ratio_ring_over_standalone": summarize([b["aggregate_tokens_per_s"] / a["aggregate_tokens_per_s"]
                                                     for a, b in zip(alone, ring)]),
            "repeats_done": len(ring), "truncated": truncated, "runs": {"standalone": alone, "ring": ring}}
    return out


# --------------------------------------------------------------------------- part 5: speculation

def spec(ctx: "Context", shape: str) -> Dict[str, Any]:
    """S = 1 on the ring of 3 and on one node, plain vs an oracle drafter (see the docstring)."""
    import torch
    from bench_speculation import Ring as SpecRing, theory
    from mdi.lab.oracle_drafter import OracleDrafter
    from mdi.model.row_batch import verifies_row_by_row
    from mdi.runconfig import SpeculationSpec
    args = ctx.args
    model, _ = ctx.model(shape, None)
    workers = ctx.ring.start()
    common = dict(kernel="fast", n_slots=1, max_len=512, device=args.device, dtype=args.dtypes[0], threads=args.threads,
                  backend=TORCH)
    alone = SpecRing(model, [], **common)
    ring = SpecRing(model, workers, worker_weights=model, **common)
    try:
        costs = ring.engine.pipeline.pass_costs
        max_draft = ring.engine.pipeline.speculation.max_draft
        ids = [ring.source.tokenizer.encode(p) for p in SPEC_PROMPTS]
        n_tokens = SPEC_TOKENS if not args.quick else 12
        for engine in (alone, ring):  # warm: CUDA contexts, kernels, the workers' layers
            engine.generate([ids[0]], 4, SpeculationSpec("off"))
        rates = {}  # type: Dict[str, List[float]]
        same = {}  # type: Dict[str, List[bool]]
        stats = {}  # type: Dict[str, List[Dict[str, Any]]]

        def timed(name: str, engine: Any, prompt: List[int], mode: Any, factory: Any = None) -> List[int]:
            (sample,) = engine.generate([prompt], n_tokens, mode, factory)
            rates.setdefault(name, []).append(benchlib.decode_timing(sample.token_times)["tokens_per_s"])
            if mode.method != "off":
                stats.setdefault(name, []).append(engine.engine.pipeline.spec_counters.metrics())
            return sample.token_ids

        for i, prompt in enumerate(ids):
            if i > 0 and not ctx.budget.allows(12):
                break
            plain = timed("plain ring", ring, prompt, SpeculationSpec("off"))
            timed("one node", alone, prompt, SpeculationSpec("off"))
            for a in SPEC_AGREES:
                for fill in ((True, False) if i % 2 == 0 else (False, True)):
                    name = "a=%.1f %s" % (a, "filling" if fill else "verify only")
                    got = timed(name, ring, prompt, SpeculationSpec("ngram", fill=fill),
                                lambda s, ref=plain, a=a: OracleDrafter(s.prompt_ids + s.token_ids, len(s.prompt_ids),
                                                                       ref, a, seed=7))
                    same.setdefault(name, []).append(got == plain)
        plain_rates = rates["plain ring"]
        out = {"model": model, "nodes": RING_NODES, "samples": 1, "new_tokens": n_tokens, "max_draft": max_draft,
               "verify_rows": "row-wise" if verifies_row_by_row(torch.device(args.device)) else "one-call",
               "pass_costs": costs.to_json(), "prompts_done": len(plain_rates), "modes": {}}  # type: Dict[str, Any]
        for name, v in rates.items():
            entry = {"tokens_per_s": summarize(v),
                     "vs_plain_ring": summarize([x / p for x, p in zip(v, plain_rates)])}  # type: Dict[str, Any]
            if name in same:
                entry["ids_equal_plain"] = same[name]
                entry["acceptance"] = [st["acceptance_rate"] for st in stats[name]]
                entry["accepted_per_pass"] = [st["accepted_per_pass"] for st in stats[name]]
                a = float(name.split()[0][2:])
                entry["model_speedup"] = theory(a, max_draft, costs, RING_NODES)["fill" if "filling" in name else "verify"]
            out["modes"][name] = entry
            log("    %s: %s tok/s, x%s the plain ring%s" % (
                name, fmt_stat(entry["tokens_per_s"]), fmt_stat(entry["vs_plain_ring"], "%.2f"),
                "" if name not in same else ", model x%.2f, ids equal %s" % (entry["model_speedup"], same[name])))
        return out
    finally:
        ring.close()
        alone.close()


# --------------------------------------------------------------------------- part 4: int4

def int4(ctx: "Context", shape: str) -> Dict[str, Any]:
    args, device = ctx.args, ctx.args.device
    dtype = args.dtypes[0]
    config = shape_config(shape)
    group = int4_group(config)
    out = {"dtype": dtype, "group_size": group, "policy": "fast", "new_tokens": args.tokens,
           "variants": {}}  # type: Dict[str, Any]
    for variant, g in ((dtype, None), ("int4", group)):
        path, made = ctx.model(shape, g)
        reuse = ctx.standalone_mdi.get((shape, dtype, args.tokens)) if g is None else None
        mem = GpuMemory(device)
        mem.start()
        t0 = time.perf_counter()
        source, chunk = load_mdi(path, dtype, device, "fast")
        rec = {"model": path, "quant": made["quant"], "load_s": round(time.perf_counter() - t0, 2),
               "weights_bytes": mem.now(), "load_peak_bytes": mem.peak(),
               "tensor_bytes": int(sum(t.numel() * t.element_size() for t in list(chunk.parameters())
                                       + list(chunk.buffers())))}  # type: Dict[str, Any]
        try:
            if g is not None:
                rec["kernels"] = chunk_kernels(chunk)
            prompt_ids = source.tokenizer.encode(PROMPT)
            mem.reset_peak()
            # The warm-up run doubles as the memory probe: its peak holds weights, cache and
            # every temporary of a decode step.
            ids, times = mdi_generate(chunk, prompt_ids, args.tokens, device)
            rec["decode_peak_bytes"] = mem.peak()
            rec["token_ids"] = ids
            if reuse is not None:
                rec.update(tokens_per_s=reuse, tokens_per_s_from="part standalone (same shape, dtype, tokens)")
            else:
                m = alternate({"mdi": lambda: mdi_generate(chunk, prompt_ids, args.tokens, device)},
                              args.repeats, args.tokens, ctx.budget, 0.0)
                rec.update(rate_summary(m["runs"]["mdi"]))
                rec.update(repeats_done=len(m["runs"]["mdi"]), truncated=m["truncated"], runs=m["runs"]["mdi"])
        finally:
            del chunk
            free_device_memory(device)
        out["variants"][variant] = rec
        log("    %s: %s tok/s, weights %s MB, decode peak %s MB%s"
            % (variant, fmt_stat(rec["tokens_per_s"], "%.1f"), _mb(rec["weights_bytes"]), _mb(rec["decode_peak_bytes"]),
               (", kernels " + rec["kernels"]["summary"]) if "kernels" in rec else ""))
    a, b = out["variants"][dtype], out["variants"]["int4"]
    out["speed_int4_over_float"] = b["tokens_per_s"]["median"] / a["tokens_per_s"]["median"]
    if a["weights_bytes"]:
        out["weights_int4_over_float"] = b["weights_bytes"] / float(a["weights_bytes"])
    return out


def ggml_part(ctx: "Context", shape: str) -> Dict[str, Any]:
    """Part 6: decode on ggml, one GGUF per GGML_TYPES, against torch's path, alternating."""
    from mdi.model.backend_select import ggml_cannot
    from mdi.model.files.prepare import prepare
    from mdi.model.source import ModelSource
    args, device = ctx.args, ctx.args.device
    dtype = args.dtypes[0]
    path, _ = ctx.model(shape, None)
    source, torch_chunk = load_mdi(path, dtype, device, "fast")
    why = ggml_cannot({"token_embd.weight": "F16"}, device, False)
    if why is not None:
        del torch_chunk
        free_device_memory(device)
        return {"skipped": why}
    n = source.config.n_layer
    prompt_ids = source.tokenizer.encode(PROMPT)
    out = {"dtype": dtype, "types": list(GGML_TYPES), "new_tokens": args.tokens, "gguf": {}}  # type: Dict[str, Any]
    impls = {"torch-" + dtype: lambda: mdi_generate(torch_chunk, prompt_ids, args.tokens, device)}
    chunks = {}
    for kind in GGML_TYPES:
        typed = "%s-%s" % (path, kind.lower())
        if not os.path.isfile(os.path.join(typed, "model.gguf")):
            t0 = time.perf_counter()
            prepare(path, typed, [], quant=kind.lower())
            log("    wrote %s in %.1f s" % (typed, time.perf_counter() - t0))
        gguf = os.path.join(typed, "model.gguf")
        out["gguf"][kind] = {"path": gguf, "bytes": os.path.getsize(gguf)}
        chunks[kind] = ModelSource(typed).ggml_chunk(0, n, True, True, args.threads or 1, "f16", True, device)
        impls["ggml-" + kind] = lambda c=chunks[kind]: mdi_generate(c, prompt_ids, args.tokens, device)
    try:
        m = alternate(impls, args.repeats, args.tokens, ctx.budget, 0.0)
    finally:
        for c in chunks.values():
            c.close()
        del torch_chunk
        free_device_memory(device)
    out["runs"] = {name: rate_summary(runs) for name, runs in m["runs"].items()}
    base = [r["tokens_per_s"] for r in m["runs"]["torch-" + dtype]]
    out["ratio_over_torch"] = {kind: summarize([r["tokens_per_s"] / b for r, b in zip(m["runs"]["ggml-" + kind], base)])
                               for kind in GGML_TYPES}
    first = m["ids"]["ggml-" + GGML_TYPES[0]]
    out["ids_equal_first_type"] = {kind: m["ids"]["ggml-" + kind] == first for kind in GGML_TYPES}
    out.update(repeats_done=len(base), truncated=m["truncated"], warmup_s=m["warmup_s"])
    return out


def _mb(n: Optional[float]) -> str:
    return "n/a" if n is None else "%.0f" % (n / 2 ** 20)


# --------------------------------------------------------------------------- driver

class Context:
    def __init__(self, args: argparse.Namespace, budget: Budget, recorder: Recorder) -> None:
        self.args, self.budget, self.recorder = args, budget, recorder
        self.record = recorder.record
        self.standalone_mdi = {}  # type: Dict[Tuple[str, str, int], Dict[str, Any]]
        self.ring = Ring(self)
        self.gpu_name = recorder.record["gpu"].get("name")

    def model(self, shape: str, group: Optional[int]) -> Tuple[str, Dict[str, Any]]:
        import torch
        gen = self.args.device if is_cuda(self.args.device) and torch.cuda.is_available() else "cpu"
        key = "%s/%s" % (shape, "int4-g%d" % group if group else "f16")
        models = self.record.setdefault("models", {})
        if key in models and models[key].get("path"):
            return models[key]["path"], models[key]
        log("  model %s: building or reusing in %s ..." % (key, self.args.cache))
        path, info = ensure_model(self.args.cache, shape, group, gen)
        models[key] = info
        log("  model %s: %s" % (key, "built in %.1f s" % info["build_s"] if info["built_now"] else "reused"))
        return path, info


def tasks(args: argparse.Namespace) -> List[Tuple[str, str, str, Callable[["Context"], Dict[str, Any]]]]:
    """(part, shape, dtype, function) in the order they run: most wanted first."""
    first, later = args.dtypes[0], args.dtypes[1:]
    small, big = args.shapes[:1], args.shapes[1:]
    out = []  # type: List[Tuple[str, str, str, Callable[[Context], Dict[str, Any]]]]

    def add(part: str, shapes: List[str], dtype: str, fn: Callable[..., Dict[str, Any]], *extra: Any) -> None:
        for shape in shapes:
            out.append((part, shape, dtype, lambda ctx, s=shape, f=fn, e=extra: f(ctx, s, *e)))
    add("standalone", args.shapes, first, standalone, first)
    add("hop", small, first, hop)
    add("pipeline", small, first, pipeline)
    add("int4", list(reversed(args.shapes)), first, int4)  # the 1.1B shape first: int4pack-cuda applies there
    add("spec", args.shapes, first, spec)
    add("ggml", args.shapes, first, ggml_part)
    add("hop", big, first, hop)
    add("pipeline", big, first, pipeline)
    for d in later:
        add("standalone", args.shapes, d, standalone, d)
    return [t for t in out if t[0] in args.parts]


def estimate(args: argparse.Namespace, part: str, shape: str) -> float:
    base = EST_GPU.get((part, shape), 5.0)
    # EST_GPU holds the defaults' cost (128 / 64 tokens, 3 / 3 / 2 repeats); about a third is
    # fixed (building, loading, starting), the rest grows with tokens x (warm-up + repeats).
    tokens, default_tokens = (args.ring_tokens, 64) if part in ("hop", "pipeline") else (args.tokens, 128)
    repeats, default_repeats = {"hop": (args.ring_repeats, 3), "pipeline": (args.pipeline_repeats, 2)}.get(
        part, (args.repeats, 3))
    base *= 0.3 + 0.7 * (tokens / float(default_tokens)) * (1 + repeats) / float(1 + default_repeats)
    if not is_cuda(args.device) and shape not in TINY_SHAPES:
        base *= 20  # a full-size shape on the CPU: much slower per token
    return base


def run_task(ctx: Context, part: str, shape: str, dtype: str, fn: Callable[[Context], Dict[str, Any]]) -> None:
    args = ctx.args
    item = {"part": part, "shape": shape, "dtype": dtype, "gpu": ctx.gpu_name, "device": args.device}  # type: Dict[str, Any]
    items = ctx.record["parts"].setdefault(part, [])
    est = estimate(args, part, shape)
    if not ctx.budget.allows(est):
        item.update(status="skipped", reason="budget: %.0f s left of %.0f, the task needs ~%.0f s"
                    % (ctx.budget.left(), ctx.budget.seconds, est))
        log("%s %s %s: skipped (%s)" % (part, shape, dtype, item["reason"]))
        items.append(item)
        ctx.recorder.flush()
        return
    log("%s %s %s ..." % (part, shape, dtype))
    t0 = time.perf_counter()
    items.append(item)
    try:
        item.update(fn(ctx))
        item["status"] = "ok"
    except (HardLimit, KeyboardInterrupt):
        item["status"] = "aborted"
        item["reason"] = "hard time limit (--budget-s + %.0f s) reached inside this task" % HARD_GRACE
        raise
    except Exception as e:  # noqa: BLE001 - recorded; the other tasks still run
        item.update(status="error", **error_text(e))
        if part in ("hop", "pipeline") and ctx.ring.workers:
            item["worker_log_tails"] = ctx.ring.tails()
        log("%s %s %s: FAILED: %s" % (part, shape, dtype, item["error"].splitlines()[0][:300]))
    finally:
        item["elapsed_s"] = round(time.perf_counter() - t0, 2)
        ctx.recorder.flush()
    log("%s %s %s: %s in %.1f s" % (part, shape, dtype, item["status"], item["elapsed_s"]))


# --------------------------------------------------------------------------- report

def report(record: Dict[str, Any]) -> None:
    parts = record["parts"]
    gpu = record["gpu"].get("name")

    def ok(part: str) -> List[Dict[str, Any]]:
        return [i for i in parts.get(part, []) if i.get("status") == "ok"]

    rows = [[i["shape"], i["dtype"], fmt_stat(i["mdi"]["tokens_per_s"], "%.1f"),
             fmt_stat(i["transformers"]["tokens_per_s"], "%.1f"), fmt_stat(i["ratio_mdi_over_transformers"], "%.3f"),
             i["first_different_token"], "%d%s" % (i["repeats_done"], " (truncated)" if i["truncated"] else "")]
            for i in ok("standalone")]
    if rows:
        print_table("1. standalone decode on %s, median [min, max]" % gpu,
                    ["shape", "dtype", "mdi tok/s", "transformers tok/s", "mdi/transformers", "1st diff", "repeats"], rows)
    rows = [[i["shape"], fmt_stat(i["standalone_ms_per_token"], "%.2f"), fmt_stat(i["ring_ms_per_token"], "%.2f"),
             fmt_stat(i["per_hop_overhead_ms"], "%.3f"), i["repeats_done"]] for i in ok("hop")]
    if rows:
        print_table("2. per-hop overhead, %d processes sharing %s, 1 sample, median [min, max]" % (RING_NODES, gpu),
                    ["shape", "one node ms/token", "ring ms/token", "overhead ms/hop", "repeats"], rows)
    rows = []
    for i in ok("pipeline"):
        for s, e in sorted(i["by_samples"].items(), key=lambda kv: int(kv[0])):
            if e.get("status") != "ok":
                rows.append([i["shape"], s, "", "skipped", "", ""])
                continue
            rows.append([i["shape"], s, e["max_batch"], fmt_stat(e["standalone_aggregate_tokens_per_s"], "%.1f"),
                         fmt_stat(e["ring_aggregate_tokens_per_s"], "%.1f"),
                         fmt_stat(e["ratio_ring_over_standalone"], "%.3f")])
    if rows:
        print_table("3. pipeline: aggregate decode tok/s, ring of %d vs one node, same S and max_batch" % RING_NODES,
                    ["shape", "S", "max_batch", "one node", "ring", "ring/one node"], rows)
    rows = []
    for i in ok("int4"):
        for name, v in i["variants"].items():
            # no allocator figures on the CPU: the chunk's own tensor bytes instead (marked *)
            weights = _mb(v["weights_bytes"]) if v["weights_bytes"] is not None else _mb(v["tensor_bytes"]) + "*"
            rows.append([i["shape"], name, fmt_stat(v["tokens_per_s"], "%.1f"), weights,
                         _mb(v["decode_peak_bytes"]), v.get("kernels", {}).get("summary", "")])
    if rows:
        print_table("4. int4 vs float: standalone decode and GPU memory (MB allocated, relative to before the load)",
                    ["shape", "weights", "tok/s", "weights MB", "decode peak MB", "kernels"], rows)
    rows = [[i["shape"], name, fmt_stat(m["tokens_per_s"], "%.1f"), fmt_stat(m["vs_plain_ring"], "%.2f"),
             "%.2f" % m["model_speedup"] if "model_speedup" in m else "", "" if "ids_equal_plain" not in m
             else "%d/%d" % (sum(m["ids_equal_plain"]), len(m["ids_equal_plain"]))]
            for i in ok("spec") for name, m in i["modes"].items()]
    if rows:
        print_table("5. speculation at S = 1 on the ring of %d sharing %s (oracle drafter; verification rows "
                    "attend %s), median [min, max]" % (RING_NODES, gpu, ok("spec")[0]["verify_rows"]),
                    ["shape", "mode", "tok/s", "x plain ring", "model x", "ids = plain"], rows)
    rows = [[i["shape"], name, fmt_stat(r["tokens_per_s"], "%.1f"),
             fmt_stat(i["ratio_over_torch"][name[5:]], "%.2f") if name.startswith("ggml-") else ""]
            for i in ok("ggml") if "runs" in i for name, r in i["runs"].items()]
    if rows:
        print_table("6. ggml (%s) vs torch, standalone decode, median [min, max]" % gpu,
                    ["shape", "backend-weights", "tok/s", "x torch"], rows)
    for i in ok("ggml"):
        if "skipped" in i:
            print("ggml %s: skipped: %s" % (i["shape"], i["skipped"]))
    other = [i for p in parts.values() for i in p if i.get("status") != "ok"]
    for i in other:
        print("%s %s %s: %s%s" % (i["part"], i["shape"], i["dtype"], i["status"],
                                  ": " + (i.get("reason") or i.get("error", "").splitlines()[0][:200])
                                  if i["status"] != "ok" else ""))
    print("status: %s, %.1f s" % (record.get("status"), record.get("elapsed_s", 0.0)), flush=True)


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if is_cuda(args.device) and not torch.cuda.is_available():
        print("bench_gpu: --device %s but torch %s sees no CUDA device (use --device cpu --quick for a logic check)"
              % (args.device, torch.__version__), file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.verify_rows != "auto":  # this process and the workers it starts (they inherit the environment)
        from mdi.model.row_batch import ROW_WISE_ENV
        os.environ[ROW_WISE_ENV] = "1" if args.verify_rows == "row-wise" else "0"
    os.makedirs(args.cache, exist_ok=True)
    budget = Budget(args.budget_s)
    info = benchlib.machine_info(torch.get_num_threads())
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError as e:
        info["transformers"] = "not importable: %s" % e
    record = {"benchmark": "bench_gpu", "status": "running", "args": {k: v for k, v in vars(args).items()},
              "gpu": gpu_info(args.device), "machine": info, "prompt": PROMPT,
              "method": {"decode_rate": "(N-1)/(t_last - t_first) per run, prefill excluded, cuda synchronized",
                         "ratio": "per repeat, alternating order, after one untimed warm-up of each",
                         "per_hop": "(ring median-gap ms/token - one-node median-gap ms/token) / %d hops" % RING_NODES,
                         "pipeline": "mdi.lab.report.steady_rate aggregate, ring vs one node, same S and max_batch",
                         "memory": "torch.cuda memory_allocated / max_memory_allocated minus the allocation before "
                                   "the load; peak reset before the load and before the decode"},
              "parts": {}}  # type: Dict[str, Any]
    recorder = Recorder(args.out, record)
    recorder.flush()
    ctx = Context(args, budget, recorder)
    log("bench_gpu on %s (%s), torch %s, CUDA %s; parts %s; shapes %s; dtypes %s; budget %.0f s; out %s"
        % (record["gpu"].get("name"), args.device, torch.__version__, torch.version.cuda, ",".join(args.parts),
           ",".join(args.shapes), ",".join(args.dtypes), args.budget_s, args.out))

    def hard_stop(signum, frame):
        raise HardLimit("hard time limit: %.0f s (--budget-s + %.0f)" % (args.budget_s + HARD_GRACE, HARD_GRACE))

    old = signal.signal(signal.SIGALRM, hard_stop)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, args.budget_s + HARD_GRACE - budget.elapsed()))
    todo = tasks(args)
    try:
        while todo:
            part, shape, dtype, fn = todo[0]
            run_task(ctx, part, shape, dtype, fn)
            todo.pop(0)
        record["status"] = "complete"
    except (HardLimit, KeyboardInterrupt) as e:
        record["status"] = "aborted: %s" % (e if isinstance(e, HardLimit) else "interrupted")
        log(record["status"])
        for part, shape, dtype, _ in todo[1:]:  # todo[0] was running: recorded as aborted
            record["parts"].setdefault(part, []).append(
                {"part": part, "shape": shape, "dtype": dtype, "gpu": ctx.gpu_name, "device": args.device,
                 "status": "skipped", "reason": "the run was aborted before this task"})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        try:
            if ctx.ring.workers:  # their last words (CUDA warnings, a failed compute loop), for the record
                record["ring_worker_log_tails"] = ctx.ring.tails(12)
            ctx.ring.stop()
        finally:
            benchlib.finish_machine_info(info)
            recorder.flush()
    report(record)
    print("raw numbers written to %s" % args.out, flush=True)
    return 0 if record["status"] == "complete" else 1


if __name__ == "__main__":
    sys.exit(main())
