#!/usr/bin/env python3
"""Quantized weights: kernel speed, standalone decode speed and memory, float32 vs float16 vs int8 vs int4.

One run measures three things, every ratio taken between measurements of this same run:

(a) Kernels. For the linear shapes of SmolLM2-135M and TinyLlama-1.1B with one row of
    activations (decode, T=1): float32 F.linear against every kernel of mdi.model.quantization.qkernels that
    supports int8 per output channel, int8 in groups of 32 and int4 in groups of 32 on that
    shape (random weights, std 0.02). Rounds alternate the implementations (each round times
    enough calls for ~--round-ms); ms per call and the speed-up over float32 (float32 ms /
    kernel ms, per round) are reported as median [min, max] over --rounds. Each kernel's output
    is checked against the float32 dequantized weight (max error / max output; on the float32
    row: the float weight against its rounded twin, i.e. the quantization error itself), and the
    kernel `mdi.model.quantization.kernel_choice.choose` takes under the `fast` policy is named (`exact` always takes
    `dequant`). Each weight format has its own float32 rounds (its own same-run baseline).

(b) Standalone decode. `mdi-start --model DIR --temperature 0 --threads N --metrics-out` child
    processes: SmolLM2-135M at float32 (the packaged Q4_1 GGUF prepared with --quant none),
    float16 (the same directory, --dtype float16), int8 (--quant int8: per output channel) and
    int4 (--quant auto: the GGUF's Q4_1 blocks taken over, int8 g32 tied embedding), each int
    under --quant-kernel exact and fast; then a TinyLlama-1.1B-shaped random model (llama,
    22 layers, 2048 wide, 32 heads / 4 KV heads, MLP 5632, vocabulary 32000, context 2048, a
    32000-character tokenizer) built once into --cache, prepared from its float32 directory with
    --quant int8 and int4. Decode rate = (N-1) / (t_last - t_first) from the metrics' token
    times (prefill excluded); the ratio to float32 is taken per repeat (configurations of one
    model run in rotating order within each repeat), median [min, max] over --repeats.
    `exact` on the 1.1B shape dequantizes ~1.1 G weights per token: it generates
    --n-tokens-slow tokens.

(c) Memory. Each child's peak RSS (os.wait4's ru_maxrss), the weights it holds at their stored
    size (mdi.model.layout.weight_bytes with the node's quantization layout, what the starter's
    memory planning counts), its KV cache (the metrics' cache_bytes) and the rest:
    RSS - (weights + KV), which is torch itself (~220 MB), the tokenizer, packed kernel copies,
    load-time temporaries and allocator slack.

Example (about 45 minutes on 2 cores; the 1.1B model is built once, ~7 GB in --cache):
  python scripts/bench_quant.py --out results/bench_quant.json --markdown results/bench_quant.md
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)

MB = 1e6

# --------------------------------------------------------------------------- what is measured

SHAPES = {  # name -> [(layer, n_out, n_in)]
    "smollm2-135m": [("qkv", 960, 576), ("proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                     ("head", 49152, 576)],
    "tinyllama-1.1b": [("qkv", 2560, 2048), ("proj", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632),
                       ("head", 32000, 2048)],
}
SPECS = [("int8/channel", "int8", None), ("int8/g32", "int8", 32), ("int4/g32", "int4", 32)]

TINYLLAMA = dict(name="tinyllama-1.1b-shape-random", family="llama", vocab_size=32000, n_layer=22, n_embd=2048,
                 n_head=32, n_kv_head=4, intermediate_size=5632, block_size=2048, norm_eps=1e-5,
                 rope_theta=10000.0, bias=False, tied_head=False)

# (label, dtype, model variant, --quant, --quant-kernel); the variant names a directory in the cache
CONFIGS = [("float32", "float32", "f32", "none", None), ("float16", "float16", "f32", "none", None),
           ("int8 exact", "float32", "int8", "auto", "exact"), ("int8 fast", "float32", "int8", "auto", "fast"),
           ("int4 exact", "float32", "int4", "auto", "exact"), ("int4 fast", "float32", "int4", "auto", "fast")]

TARGETS = {("tinyllama-1.1b", "int4 fast"): 1.8, ("smollm2-135m", "int4 fast"): 1.2,
           ("tinyllama-1.1b", "int8 fast"): 1.0, ("smollm2-135m", "int8 fast"): 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints tables and writes every raw number to --out.",
        epilog="Ratios are same-run: kernel rounds alternate implementations; decode repeats rotate the "
               "configurations of a model. Reported as median [min, max].",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cache", default=os.path.join(benchlib.ROOT, "models", "bench-quant-cache"),
                   help="prepared model directories (git-ignored); built when missing")
    p.add_argument("--models", default="smollm2-135m,tinyllama-1.1b", help="comma-separated: which models")
    p.add_argument("--prompt", default=benchlib.DEFAULT_PROMPT, help="prompt of every decode run")
    p.add_argument("--n-tokens", type=int, default=128, help="new tokens per decode run")
    p.add_argument("--n-tokens-slow", type=int, default=16,
                   help="new tokens for `exact` int runs of the 1.1B shape (dequantize per call: slow)")
    p.add_argument("--repeats", type=int, default=3, help="decode runs per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads (kernels and decode runs)")
    p.add_argument("--rounds", type=int, default=7, help="kernel timing rounds")
    p.add_argument("--round-ms", type=float, default=60.0, help="time per kernel per round")
    p.add_argument("--skip-kernels", action="store_true", help="skip (a)")
    p.add_argument("--skip-decode", action="store_true", help="skip (b) and (c)")
    p.add_argument("--configs", default="", help="comma-separated decode configuration labels to run "
                                                 "(default all: %s)" % ", ".join(c[0] for c in CONFIGS))
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_quant.json"),
                   help="JSON record with all raw numbers")
    p.add_argument("--markdown", help="also write the tables as markdown to this file")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        p.error("unknown model(s) %s (expected %s)" % (", ".join(unknown), ", ".join(SHAPES)))
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()] or [c[0] for c in CONFIGS]
    bad = [c for c in args.configs if c not in [x[0] for x in CONFIGS]]
    if bad:
        p.error("unknown configuration(s) %s" % ", ".join(bad))
    if args.n_tokens < 3 or args.n_tokens_slow < 3 or args.repeats < 1 or args.threads < 1 or args.rounds < 1:
        p.error("need --n-tokens/--n-tokens-slow >= 3, --repeats, --threads, --rounds >= 1")
    return args


# --------------------------------------------------------------------------- (a) kernels

def _calls_for(fn, budget_s: float) -> int:
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    return max(1, int(budget_s / one))


def kernel_bench(model: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from mdi.model.layout import QuantSpec
    from mdi.model.quantization import kernel_choice, qkernels
    from mdi.model.quantization.quant import dequantize, quantize
    cpu = torch.device("cpu")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for layer, n_out, n_in in SHAPES[model]:
        w = torch.randn(n_out, n_in, generator=gen) * 0.02
        x = torch.randn(1, n_in, generator=gen)
        for spec_label, kind, group in SPECS:
            spec = QuantSpec(kind, group or n_in)
            parts = quantize(w, spec)
            reference = F.linear(x, dequantize(parts, spec, n_in))
            scale = float(reference.abs().max()) or 1.0
            impls = {"float32": (lambda: F.linear(x, w))}
            errors = {"float32": float((F.linear(x, w) - reference).abs().max()) / scale}
            for kernel in qkernels.KERNELS:
                if not kernel.supports(spec, n_out, n_in, cpu):
                    continue
                try:
                    packed = kernel.pack(parts, spec, n_in)
                    y = kernel.run(x, packed, spec, n_in)
                except (RuntimeError, TypeError, ValueError) as e:
                    errors[kernel.name] = "unusable: %s" % str(e).splitlines()[0][:80]
                    continue
                errors[kernel.name] = float((y.float() - reference).abs().max()) / scale
                impls[kernel.name] = (lambda k=kernel, p=packed: k.run(x, p, spec, n_in))
            calls = {name: _calls_for(fn, args.round_ms / 1e3) for name, fn in impls.items()}
            times = {name: [] for name in impls}  # type: Dict[str, List[float]]
            names = list(impls)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    fn, n = impls[name], calls[name]
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn()
                    times[name].append((time.perf_counter() - t0) / n)
            qkernels.set_preference("fast")
            try:
                picked = kernel_choice.choose(parts, spec, n_in, cpu, "%s %s" % (model, layer))[0].name
            finally:
                qkernels.set_preference(None)
            for name in names:
                rows.append({"model": model, "layer": layer, "n_out": n_out, "n_in": n_in, "spec": spec_label,
                             "impl": name, "ms": benchlib.summarize([1e3 * t for t in times[name]]),
                             "speedup_vs_float32": benchlib.summarize(
                                 [f / t for f, t in zip(times["float32"], times[name])]),
                             "calls_per_round": calls[name], "rel_error": errors[name],
                             "chosen_fast": name == picked})
            for name, err in errors.items():
                if isinstance(err, str):
                    rows.append({"model": model, "layer": layer, "n_out": n_out, "n_in": n_in, "spec": spec_label,
                                 "impl": name, "unusable": err})
            print("  %s %s [%d x %d] %s: %s; fast picks %s" % (
                model, layer, n_out, n_in, spec_label,
                ", ".join("%s %.3f ms" % (n, 1e3 * sorted(times[n])[len(times[n]) // 2]) for n in names), picked),
                flush=True)
            del parts, impls
    return rows


# --------------------------------------------------------------------------- models

def _run(cmd: List[str]) -> None:
    print("  $ %s" % " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def tinyllama_chars() -> List[str]:
    """32000 distinct single characters: printable ASCII and newline first, then code points from
    U+0100 (every id the random model can produce decodes)."""
    from mdi.lab.model_setup import CHARS
    extra = [chr(c) for c in range(0x100, 0x100 + 32000 - len(CHARS))]
    return list(CHARS) + extra


def build_random_llama(path: str, spec: Dict[str, Any], seed: int = 0, std: float = 0.02) -> None:
    """A float32 random mdi directory written tensor by tensor (a 4.4 GB model never held twice:
    save_model_dir's safetensors.save_file would copy every tensor to bytes first)."""
    import torch
    from mdi.model.config import ModelConfig
    from mdi.model.files.store import FORMAT_VERSION, MDI_CONFIG, MODEL_FILE
    from mdi.model.layout import expected_shapes
    from mdi.model.tokenizers import char_tokenizer
    from mdi.system.files import write_json
    config = ModelConfig(**spec)
    shapes = expected_shapes(config, (0, config.n_layer), True, True)
    header, offset = {}, 0  # type: Dict[str, Any], int
    for k, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        header[k] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt", "mdi_config": json.dumps(config.to_dict()),
                              "layers": "0-%d" % config.n_layer, "with_embedding": "1", "with_head": "1"}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tmp = os.path.join(path, MODEL_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for k, shape in shapes.items():
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * std
            f.write(t.numpy().tobytes())
            del t
    os.replace(tmp, os.path.join(path, MODEL_FILE))
    char_tokenizer(tinyllama_chars()).save(path)
    write_json(os.path.join(path, MDI_CONFIG), {"format": "mdi-model", "version": FORMAT_VERSION,
                                                 "model": config.to_dict(),
                                                 "source": "bench_quant random: seed %d, std %g" % (seed, std),
                                                 "quant": []})


def ensure_models(model: str, cache: str) -> Dict[str, str]:
    """variant (f32, int8, int4) -> prepared directory, built or prepared when missing."""
    from mdi.model.files.gguf import packaged_gguf_path
    prep = os.path.join(benchlib.BIN, "mdi-prepare")
    short = "smollm2" if model == "smollm2-135m" else "tinyllama"
    dirs = {v: os.path.join(cache, "%s-%s" % (short, v)) for v in ("f32", "int8", "int4")}
    ready = lambda d: os.path.isfile(os.path.join(d, "mdi_config.json"))  # noqa: E731
    if model == "smollm2-135m":
        gguf = packaged_gguf_path()
        for variant, quant in (("f32", "none"), ("int8", "int8"), ("int4", "auto")):
            if not ready(dirs[variant]):
                _run([prep, gguf, "--out", dirs[variant], "--quant", quant])
    else:
        if not ready(dirs["f32"]):
            print("  building the random %s model in %s ..." % (model, dirs["f32"]), flush=True)
            build_random_llama(dirs["f32"], TINYLLAMA)
        for variant in ("int8", "int4"):
            if not ready(dirs[variant]):
                _run([prep, dirs["f32"], "--out", dirs[variant], "--quant", variant])
    return dirs


# --------------------------------------------------------------------------- (b) decode, (c) memory

def planned_bytes(path: str, dtype: str, quant: str) -> Dict[str, Any]:
    """What memory planning counts for the whole model on one node: weights at their stored
    size (float ones in `dtype`), and the layout it keeps quantized."""
    from mdi.model.layout import quantizable, weight_bytes
    from mdi.model.quantization.quant import describe
    from mdi.model.source import ModelSource
    source = ModelSource(path)
    c = source.config
    layout = source.layout(0, c.n_layer, True, quant)
    return {"weight_bytes": weight_bytes(c, (0, c.n_layer), dtype, True, layout),
            "layout": describe(layout, len(quantizable(c, (0, c.n_layer), True, True)))}


# A small process between this one and mdi-start: Linux carries a process's peak RSS (ru_maxrss)
# over fork and exec, so a child of this benchmark (which holds GBs after the kernel rounds) would
# report at least our own peak. The launcher's fork of itself is small; it writes the child's
# ru_maxrss (KiB) to argv[1] and exits with its status.
_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


def decode_run(path: str, dtype: str, quant: str, kernel: Optional[str], n_tokens: int,
               args: argparse.Namespace) -> Dict[str, Any]:
    """One `mdi-start` child; its decode timing from --metrics-out and its peak RSS."""
    fd, metrics = tempfile.mkstemp(suffix=".json", prefix="bench_quant_")
    os.close(fd)
    cmd = [os.path.join(benchlib.BIN, "mdi-start"), "--model", path, "--prompt", args.prompt,
           "--n-tokens", str(n_tokens), "--temperature", "0", "--threads", str(args.threads),
           "--dtype", dtype, "--quant", quant, "--quiet", "--metrics-out", metrics]
    if kernel:
        cmd += ["--quant-kernel", kernel]
    fd, peak_file = tempfile.mkstemp(suffix=".txt", prefix="bench_quant_")
    os.close(fd)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        rc = subprocess.call([sys.executable, "-c", _LAUNCHER, peak_file] + cmd, stdout=subprocess.DEVNULL, stderr=log)
        wall = time.perf_counter() - t0
        if rc != 0:
            log.seek(0)
            raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), rc, log.read().decode(errors="replace")[-2000:]))
    with open(metrics) as f:
        m = json.load(f)
    with open(peak_file) as f:
        peak_kib = int(f.read())
    os.unlink(metrics)
    os.unlink(peak_file)
    sample = m["samples"][0]
    timing = benchlib.decode_timing(sample["token_times"])
    starter = m["nodes"][0]
    return {"cmd": cmd, "wall_s": wall, "n_tokens": len(sample["token_ids"]), "prompt_ids": sample["prompt_ids"],
            "token_ids": sample["token_ids"], "finish_reason": sample["finish_reason"],
            "decode_tokens_per_s": timing["tokens_per_s"], "ms_per_token_median_gap": 1e3 * timing["median_s"],
            "first_token_s": timing["first_token_s"], "metrics_tokens_per_s": m["tokens_per_s"],
            "peak_rss_bytes": peak_kib * 1024,
            "metrics_peak_memory_bytes": starter.get("peak_memory_bytes"), "kv_bytes": starter.get("cache_bytes")}


def decode_bench(model: str, dirs: Dict[str, str], args: argparse.Namespace) -> Dict[str, Any]:
    configs = [c for c in CONFIGS if c[0] in args.configs]
    if "float32" not in [c[0] for c in configs]:
        configs.insert(0, CONFIGS[0])  # the reference of every ratio
    runs = {c[0]: [] for c in configs}  # type: Dict[str, List[Dict[str, Any]]]
    slow = lambda c: model == "tinyllama-1.1b" and c[4] == "exact"  # noqa: E731
    for r in range(args.repeats):
        k = r % len(configs)
        for label, dtype, variant, quant, kernel in configs[k:] + configs[:k]:
            n = args.n_tokens_slow if slow((label, dtype, variant, quant, kernel)) else args.n_tokens
            run = decode_run(dirs[variant], dtype, quant, kernel, n, args)
            run["repeat"] = r
            runs[label].append(run)
            print("  repeat %d/%d %s %s: %.2f tok/s decode (%d tokens), peak RSS %.0f MB" % (
                r + 1, args.repeats, model, label, run["decode_tokens_per_s"], run["n_tokens"],
                (run["peak_rss_bytes"] or 0) / MB), flush=True)
    out = {}  # type: Dict[str, Any]
    for label, dtype, variant, quant, kernel in configs:
        rs = runs[label]
        plan = planned_bytes(dirs[variant], dtype, quant)
        kv = max(x["kv_bytes"] or 0 for x in rs)
        rss = [x["peak_rss_bytes"] for x in rs if x["peak_rss_bytes"]]
        out[label] = {
            "dir": dirs[variant], "dtype": dtype, "quant": quant, "quant_kernel": kernel, "layout": plan["layout"],
            "n_tokens": [x["n_tokens"] for x in rs],
            "decode_tokens_per_s": benchlib.summarize([x["decode_tokens_per_s"] for x in rs]),
            "ms_per_token_median_gap": benchlib.summarize([x["ms_per_token_median_gap"] for x in rs]),
            "ratio_to_float32": benchlib.summarize([x["decode_tokens_per_s"] / f["decode_tokens_per_s"]
                                                    for x, f in zip(rs, runs["float32"])]),
            "peak_rss_bytes": benchlib.summarize(rss), "weight_bytes": plan["weight_bytes"], "kv_bytes": kv,
            "rss_minus_weights_kv_bytes": benchlib.summarize([v - plan["weight_bytes"] - kv for v in rss]),
            "same_ids_as_float32": [x["token_ids"] == f["token_ids"][:len(x["token_ids"])]
                                    for x, f in zip(rs, runs["float32"])][0],
            "runs": rs}
    return out


# --------------------------------------------------------------------------- report

def kernel_table(rows: List[Dict[str, Any]]) -> Tuple[List[str], List[List[str]]]:
    headers = ["model", "layer [out x in]", "weights", "kernel", "ms/call", "speed-up vs float32",
               "error vs dequantized", "fast picks"]
    out = []
    for r in rows:
        if "unusable" in r:
            continue
        err = r["rel_error"]
        out.append([r["model"], "%s [%d x %d]" % (r["layer"], r["n_out"], r["n_in"]),
                    r["spec"], "float32 F.linear" if r["impl"] == "float32" else r["impl"],
                    benchlib.fmt_stat(r["ms"], "%.3f"),
                    benchlib.fmt_stat(r["speedup_vs_float32"], "%.2f") if r["impl"] != "float32" else "1",
                    "%.1e" % err if isinstance(err, float) else str(err), "<-" if r["chosen_fast"] else ""])
    return headers, out


def decode_table(results: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    headers = ["model", "weights", "kernels", "layout", "tokens", "decode tok/s", "ratio to float32",
               "peak RSS MB", "weights MB", "KV MB", "RSS - (weights + KV) MB"]
    out = []
    for model, configs in results.items():
        for label, s in configs.items():
            out.append([model, label.split()[0], s["quant_kernel"] or "-", s["layout"],
                        "/".join(sorted({str(n) for n in s["n_tokens"]})),
                        benchlib.fmt_stat(s["decode_tokens_per_s"], "%.2f"),
                        benchlib.fmt_stat(s["ratio_to_float32"], "%.2f"),
                        benchlib.fmt_stat(s["peak_rss_bytes"], "%.0f", 1 / MB), "%.0f" % (s["weight_bytes"] / MB),
                        "%.1f" % (s["kv_bytes"] / MB),
                        benchlib.fmt_stat(s["rss_minus_weights_kv_bytes"], "%.0f", 1 / MB)])
    return headers, out


def markdown(headers: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def target_lines(decode: Dict[str, Any], kernels: List[Dict[str, Any]]) -> List[str]:
    lines = []
    for (model, label), want in TARGETS.items():
        s = decode.get(model, {}).get(label)
        if s is None:
            continue
        got = s["ratio_to_float32"]["median"]
        lines.append("%s %s decode: %.2fx float32 (target >= %.1fx): %s"
                     % (model, label, got, want, "met" if got >= want else "NOT met"))
    for model in sorted({r["model"] for r in kernels}):
        for spec in ("int8/channel", "int8/g32"):
            picked = [r for r in kernels if r["model"] == model and r["spec"] == spec and r.get("chosen_fast")]
            slower = [r for r in picked if r["speedup_vs_float32"]["median"] < 1.0]
            if picked:
                lines.append("%s %s kernels picked by `fast` slower than float32: %s" % (
                    model, spec, ", ".join("%s (%s %.2fx)" % (r["layer"], r["impl"], r["speedup_vs_float32"]["median"])
                                           for r in slower) or "none"))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    info = benchlib.machine_info(args.threads)
    record = {"benchmark": "quant", "args": vars(args), "machine": info}  # type: Dict[str, Any]
    kernels = []  # type: List[Dict[str, Any]]
    if not args.skip_kernels:
        print("(a) kernels, %d round(s) of ~%.0f ms each, %d thread(s)" % (args.rounds, args.round_ms, args.threads),
              flush=True)
        for model in args.models:
            kernels += kernel_bench(model, args)
    decode = {}  # type: Dict[str, Any]
    if not args.skip_decode:
        print("(b, c) standalone decode and memory, %d repeat(s)" % args.repeats, flush=True)
        for model in args.models:
            dirs = ensure_models(model, args.cache)
            decode[model] = decode_bench(model, dirs, args)
    benchlib.finish_machine_info(info)
    md = []
    if kernels:
        h, rows = kernel_table(kernels)
        benchlib.print_table("Kernels, one row of activations (T=1), %d thread(s); ms per call and speed-up over "
                             "float32 F.linear, median [min, max] of %d rounds; `<-` what kernel_choice.choose takes "
                             "under `fast`" % (args.threads, args.rounds), h, rows)
        md += ["#### Kernels (T=1, %d thread)" % args.threads, "", markdown(h, rows), ""]
    if decode:
        h, rows = decode_table(decode)
        benchlib.print_table("Standalone decode (mdi-start, %d thread(s), greedy), median [min, max] of %d repeats; "
                             "ratio per repeat; memory per run (peak RSS of the process)"
                             % (args.threads, args.repeats), h, rows)
        md += ["#### Standalone decode and memory (%d thread, greedy)" % args.threads, "", markdown(h, rows), ""]
    lines = target_lines(decode, kernels)
    for line in lines:
        print(line)
    print(benchlib.note_load(info))
    md += ["- " + line for line in lines] + ["- " + benchlib.note_load(info)]
    record.update({"kernels": kernels, "decode": decode, "targets": lines,
                   "method": {"kernels": "random weights (std 0.02), x [1, n_in]; rounds alternate implementations; "
                                         "speed-up = float32 ms / kernel ms per round",
                              "decode": "mdi-start child per run; decode rate (N-1)/(t_last - t_first) from the "
                                        "metrics' token_times; ratio to the float32 run of the same repeat",
                              "memory": "peak RSS = os.wait4 ru_maxrss of the child; weights = layout.weight_bytes "
                                        "with the node's quantization layout; KV = metrics cache_bytes"}})
    benchlib.save_record(args.out, record)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(md) + "\n")
        print("markdown tables written to %s" % args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
