#!/usr/bin/env python3
"""Prefill-aware kernel choice: time to first token of a long prompt and decode speed, one run.

A quantized layer's kernel was chosen by timing one row (decode). `choose_kernels`
(mdi.model.quantization.kernel_choice) also times each candidate at a prefill pass's rows and may keep a
second kernel for passes of many rows, within what the node's memory spares. This compares, on
standalone SmolLM2 (the prepared Q4_1 GGUF: int4 blocks, int8 head):

  decode-only    kernels by one-row timing only (the choice before; PREFILL_GAIN set to infinity)
  prefill-aware  the default now
  float32        runtime quant none (the GGUF dequantized at load)

each in its own fresh process, the variants' order rotating per repeat, `--runs` generations
per process (model loaded and kernels measured anew each time; the median taken). The prompt is
README.md's prose (as scripts/bench_prefix_cache.py builds it), `prefix_cache: 0`; greedy,
`--n-tokens` new tokens. TTFT = the first token's time since the pipeline started (load
excluded); decode tok/s = (n - 1) / (last - first token time). Ratios per repeat against
decode-only, median [min, max]. Greedy ids of each variant are compared with the `exact`
kernels' (one run), and `--perplexity` scores each quantized variant as
scripts/bench_quant_quality.py does (Areopagitica, 8 windows, 2 threads).

`--ring3 --base REV`: the same long prompt on a ring of the starter and 2 mdi-workers (1 thread
each), the tree at REV (the choice before, in every process) against this one, alternating
fresh processes; record ..._ring3.json.

`--paired`: one process holds the three models at once (the two quantized ones share the same
kernel measurements, so they differ only in the second kernels) and takes them through the
prompt in turns, pass by pass (64 tokens each, the order rotating), then through `--n-tokens`
decode steps in turns; `--repeats` rounds; TTFT = a model's summed pass times. Finer
alternation than fresh processes, where other tenants' bursts last seconds; record
..._paired.json.

`--shapes`: each candidate kernel's time per call at 1..64 rows on SmolLM2's weight shapes
(random weights of the same formats), 1 and 2 threads, repeats interleaved: min of each call
set, median over repeats.

    python scripts/bench_prefill_kernels.py --shapes --repeats 3 --perplexity
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402  (adds the repo root to sys.path)
from benchlib import ROOT  # noqa: E402

VARIANTS = ("decode-only", "prefill-aware", "float32")
SHAPES = [("qkv", 960, 576, "int4"), ("proj", 576, 576, "int4"), ("gate_up", 3072, 576, "int4"),
          ("down", 576, 1536, "int4"), ("head", 49152, 576, "int8")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    p.add_argument("--words", type=int, default=1000, help="README words in the prompt (~1.3 tokens each)")
    p.add_argument("--n-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant")
    p.add_argument("--runs", type=int, default=2, help="generations per process (median taken)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-exact", action="store_true", help="skip the exact kernels' greedy ids")
    p.add_argument("--perplexity", action="store_true", help="also score perplexity per quantized variant")
    p.add_argument("--shapes", action="store_true", help="also time each kernel per shape and row count")
    p.add_argument("--shapes-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_prefill_kernels.json"))
    p.add_argument("--paired", action="store_true", help="the variants alternated pass by pass in one process")
    p.add_argument("--forced", action="store_true", help="--paired: also fbgemm for every block layer's prefill passes")
    p.add_argument("--ring3", action="store_true", help="ring of 3 processes: --base's tree against this one")
    p.add_argument("--base", default="52b2752~1", help="git revision with the decode-only choice (--ring3)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def set_variant(variant: str) -> None:
    """In a child: the kernel choice `variant` asks for."""
    if variant == "decode-only":
        from mdi.model.quantization import kernel_choice
        kernel_choice.PREFILL_GAIN = float("inf")  # no kernel earns a second copy: one-row timing decides


# --------------------------------------------------------------------------- one process

def generate(args: argparse.Namespace, variant: str) -> Dict[str, Any]:
    import torch
    from bench_prefix_cache import document
    from mdi.runconfig import parse_config
    from mdi.starter import batch
    torch.set_num_threads(args.threads)
    set_variant(variant)
    runs = []
    for _ in range(args.runs):
        d = benchlib.run_config_dict(args.model, [{"name": "starter", "data_port": benchlib.free_ports(1)[0]}],
                                     args.n_tokens, args.threads)
        d["model"]["quant"] = "none" if variant == "float32" else "auto"
        d["runtime"].update({"quant_kernel": "exact" if variant == "exact" else "fast", "prefix_cache": 0})
        t0 = time.perf_counter()
        result = batch.run(parse_config(d, "bench_prefill_kernels"), [document(args.words)])
        s = result.samples[0]
        runs.append({"ttft_s": s.token_times[0],
                     "decode_tok_s": (len(s.token_times) - 1) / (s.token_times[-1] - s.token_times[0]),
                     "prompt_tokens": len(s.prompt_ids), "token_ids": s.token_ids,
                     "wall_s": time.perf_counter() - t0, "kernels": result.nodes[0].kernels})
    return {"runs": runs, "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}


def perplexity(args: argparse.Namespace, variant: str) -> Dict[str, Any]:
    """scripts/bench_quant_quality.py's scoring, in this process (the variant's choice set)."""
    import bench_quant_quality as q
    from mdi.cli import start_main
    set_variant(variant)
    with tempfile.TemporaryDirectory() as tmp:
        text = q.text_file(q.TEXTS["smollm2"], tmp)
        metrics = os.path.join(tmp, "m.json")
        sys.argv = ["mdi-start", "--model", args.model, "--perplexity", text, "--ppl-max-windows", "8",
                    "--threads", "2", "--metrics-out", metrics] + (["--quant", "none"] if variant == "float32" else [])
        with open(os.devnull, "w") as null:
            saved, sys.stdout = sys.stdout, null
            try:
                start_main()
            finally:
                sys.stdout = saved
        with open(metrics) as f:
            m = json.load(f)
    return {"perplexity": m["perplexity"], "tokens_per_s": m.get("tokens_per_s"),
            "kernels": m["nodes"][0].get("kernels")}


def ring3(args: argparse.Namespace) -> Dict[str, Any]:
    """The long prompt on the starter and 2 workers, all running `mdi` from args.tree."""
    import shutil
    import torch
    from bench_prefix_cache import document
    from mdi.runconfig import parse_config
    from mdi.starter import batch
    torch.set_num_threads(1)
    log_dir = tempfile.mkdtemp(prefix="mdi-pfk-")
    workers = [benchlib.WorkerProcess("worker%d" % i, 1, log_dir) for i in (1, 2)]
    runs = []
    try:
        for w in workers:
            w.wait_healthy(60)
        for _ in range(args.runs):
            nodes = [{"name": "starter", "data_port": benchlib.ports_besides(workers)[0]}] + [w.node() for w in workers]
            d = benchlib.run_config_dict(args.model, nodes, args.n_tokens, 1)
            d["model"]["quant"] = "auto"
            d["runtime"].update({"quant_kernel": "fast", "prefix_cache": 0})
            result = batch.run(parse_config(d, "bench_prefill_kernels"), [document(args.words)])
            s = result.samples[0]
            runs.append({"ttft_s": s.token_times[0],
                         "decode_tok_s": (len(s.token_times) - 1) / (s.token_times[-1] - s.token_times[0]),
                         "prompt_tokens": len(s.prompt_ids), "token_ids": s.token_ids,
                         "kernels": {n.name: n.kernels for n in result.nodes}})
    finally:
        benchlib.stop_workers(workers)
        shutil.rmtree(log_dir, ignore_errors=True)
    return {"runs": runs, "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}


def child(args: argparse.Namespace) -> Dict[str, Any]:
    import mdi
    tree = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # ROOT stays behind it: benchlib adds nothing
    assert os.path.dirname(os.path.abspath(mdi.__file__)) == os.path.join(os.path.abspath(tree), "mdi"), mdi.__file__
    kind, variant = args.child.split(":")
    if kind == "ring3":
        return ring3(args)
    return generate(args, variant) if kind == "generate" else perplexity(args, variant)


def in_child(args: argparse.Namespace, kind: str, variant: str, tree: str = ROOT) -> Dict[str, Any]:
    """`mdi` from `tree` in the child (and in the workers it starts), the scripts from here."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "%s:%s" % (kind, variant), "--model", args.model,
           "--words", str(args.words), "--n-tokens", str(args.n_tokens), "--threads", str(args.threads),
           "--runs", str(args.runs if variant != "exact" else 1)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join((tree, ROOT, HERE))), timeout=1800)
    if done.returncode != 0:
        raise RuntimeError("%s %s failed:\n%s" % (kind, variant, done.stderr[-3000:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- kernels per shape

def time_shapes(repeats: int) -> List[Dict[str, Any]]:
    """Each candidate's call time per shape, row count and thread count (kernel_choice._time:
    caches filled with other data before each call, min of the calls), repeats interleaved."""
    import torch
    from mdi.model.layout import QuantSpec
    from mdi.model.quantization import kernel_choice, qkernels
    from mdi.model.quantization.quant import quantize
    rows_list = (1, 4, 8, 16, 32, 64)
    g = torch.Generator().manual_seed(0)
    out = []
    for name, n_out, n_in, kind in SHAPES:
        spec = QuantSpec(kind, 32)
        tensors = quantize(torch.randn(n_out, n_in, generator=g) * 0.05, spec)
        cpu = torch.device("cpu")
        kernels = qkernels.candidates(spec, n_out, n_in, cpu)
        packed = {k.name: dict(tensors) if k is qkernels.DEQUANT else k.pack(tensors, spec, n_in) for k in kernels}
        xs = {r: torch.randn(r, n_in, generator=g) for r in rows_list}
        times = {}  # type: Dict[str, List[float]]
        for _ in range(repeats):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for k in kernels:
                    for r in rows_list:
                        if name == "head" and r > 1 and k is not qkernels.INT8_FBGEMM and r != 64:
                            continue  # the slow head kernels: 1 and 64 rows only
                        fn = kernel_choice._timed(k, packed[k.name], spec, n_in, xs[r])
                        t = kernel_choice._time(fn, cpu, spec.nbytes(n_out, n_in))
                        times.setdefault("%s|%d|%d" % (k.name, threads, r), []).append(t * 1e3)
        for key, values in times.items():
            kernel, threads, r = key.split("|")
            out.append({"shape": name, "n_out": n_out, "n_in": n_in, "spec": spec.label(), "kernel": kernel,
                        "threads": int(threads), "rows": int(r), "ms": statistics.median(values),
                        "ms_per_row": statistics.median(values) / int(r), "repeats_ms": [round(v, 4) for v in values]})
        del packed
        print("timed %s" % name, flush=True)
    return out


def shape_table(rows: List[Dict[str, Any]]) -> None:
    for threads in (1, 2):
        table = []
        for name, *_ in SHAPES:
            for kernel in sorted({r["kernel"] for r in rows if r["shape"] == name}):
                cells = {r["rows"]: r["ms"] for r in rows if r["shape"] == name and r["kernel"] == kernel
                         and r["threads"] == threads}
                table.append([name, kernel] + ["%.3f" % cells[n] if n in cells else "-" for n in (1, 4, 8, 16, 32, 64)])
        benchlib.print_table("ms per call, %d thread(s), median of repeats" % threads,
                             ["shape", "kernel", "1", "4", "8", "16", "32", "64 rows"], table)


# --------------------------------------------------------------------------- driver

def main_ring3(args: argparse.Namespace, info: Dict[str, Any]) -> int:
    import shutil
    base_dir = tempfile.mkdtemp(prefix="mdi-pfk-base-")
    subprocess.run("git archive %s mdi | tar -x -C %s" % (args.base, base_dir), shell=True, cwd=ROOT, check=True)
    trees = {"decode-only": base_dir, "prefill-aware": ROOT}
    runs = {v: [] for v in trees}  # type: Dict[str, List[Dict[str, Any]]]
    try:
        for r in range(args.repeats):
            for v in (["decode-only", "prefill-aware"] if r % 2 == 0 else ["prefill-aware", "decode-only"]):
                m = in_child(args, "ring3", v, trees[v])
                runs[v].append(m)
                print("repeat %d ring3 %-14s TTFT %6.2f s  decode %5.1f tok/s  (%d prompt tokens)" % (
                    r + 1, v, m["ttft_s"], m["decode_tok_s"], m["runs"][0]["prompt_tokens"]), flush=True)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    summary = {v: {"ttft_s": benchlib.summarize([m["ttft_s"] for m in runs[v]]),
                   "decode_tok_s": benchlib.summarize([m["decode_tok_s"] for m in runs[v]])} for v in runs}
    for key in ("ttft_s", "decode_tok_s"):
        summary["prefill-aware"][key.split("_")[0] + "_ratio_vs_decode_only"] = benchlib.summarize(
            [n[key] / b[key] for n, b in zip(runs["prefill-aware"], runs["decode-only"])])
    benchlib.finish_machine_info(info)
    out = args.out.replace(".json", "_ring3.json")
    benchlib.save_record(out, {"benchmark": "bench_prefill_kernels_ring3", "machine": info, "base": args.base,
                               "args": {k: v for k, v in vars(args).items() if k != "child"},
                               "runs": runs, "summary": summary})
    print(json.dumps({v: {k: x["median"] for k, x in s.items()} for v, s in summary.items()}))
    return 0


def paired(args: argparse.Namespace, info: Dict[str, Any]) -> int:
    import torch
    from bench_prefix_cache import document
    from mdi.model.quantization import kernel_choice, qkernels
    from mdi.model.source import ModelSource
    from mdi.model.tokenizers import load_tokenizer
    torch.set_num_threads(args.threads)
    source = ModelSource(args.model)
    n = source.config.n_layer
    chunks = {}
    chosen = kernel_choice.choose_kernels
    fbgemm = qkernels.INT8_FBGEMM

    def fbgemm_for_prefill(tensors, spec, n_in, device, where="", resident=(), many_rows=True, keeps_canonical=False):
        """The choice, then fbgemm for passes of 16 rows or more on every block layer: what this
        kernel gives where the measurement does not pick it."""
        c = chosen(tensors, spec, n_in, device, where, resident, many_rows, keeps_canonical)
        if many_rows and c.prefill_kernel is None and c.kernel is not fbgemm:
            c.prefill_kernel, c.prefill_packed, c.prefill_from = fbgemm, fbgemm.pack(tensors, spec, n_in), 16
        return c
    gain = kernel_choice.PREFILL_GAIN
    # prefill-aware first: it measures, the others reuse its measurements
    for v in [v for v in ("prefill-aware", "decode-only", "fbgemm-prefill", "float32") if args.forced or v[0] != "f"
              or v == "float32"]:
        kernel_choice.set_memory_allowance(1 << 30)  # as a node with 1 GB to spare beside its plan
        kernel_choice.PREFILL_GAIN = float("inf") if v == "decode-only" else gain
        kernel_choice.choose_kernels = fbgemm_for_prefill if v == "fbgemm-prefill" else chosen
        quant = source.layout(0, n, True, "none" if v == "float32" else "auto")
        chunks[v] = source.load_chunk(0, n, True, True, torch.float32, "cpu", None, quant)
    kernel_choice.PREFILL_GAIN, kernel_choice.choose_kernels = gain, chosen
    ids = load_tokenizer(args.model).encode_prompt(document(args.words))
    chunk_rows = kernel_choice.PREFILL_ROWS

    variants = list(chunks)

    def one_round(r: int) -> Dict[str, Dict[str, Any]]:
        """Every model through the same prompt, pass by pass in turns (the order rotating per
        pass), then the same decode steps in turns: each model's summed time."""
        t = torch.tensor(ids)
        spent = {v: [0.0, 0.0] for v in variants}
        out = {v: [] for v in variants}  # type: Dict[str, List[int]]
        for c in chunks.values():
            c.allocate_cache(1, len(ids) + args.n_tokens + 1)
        with torch.inference_mode():
            for i, a in enumerate(range(0, len(ids), chunk_rows)):
                for v in variants[(r + i) % len(variants):] + variants[:(r + i) % len(variants)]:
                    c = chunks[v]
                    t0 = time.perf_counter()
                    x = c.forward_blocks(c.embed(t[a:a + chunk_rows], a), 0, a)
                    if a + chunk_rows >= len(ids):
                        out[v].append(int(c.head(x[-1:]).argmax(-1)))
                    spent[v][0] += time.perf_counter() - t0
            for i in range(args.n_tokens - 1):
                pos = len(ids) + i
                for v in variants[(r + i) % len(variants):] + variants[:(r + i) % len(variants)]:
                    c = chunks[v]
                    t0 = time.perf_counter()
                    x = c.forward_blocks(c.embed(torch.tensor([out[v][-1]]), pos), 0, pos)
                    out[v].append(int(c.head(x).argmax(-1)))
                    spent[v][1] += time.perf_counter() - t0
        for c in chunks.values():
            c.free_cache()
        return {v: {"ttft_s": spent[v][0], "decode_tok_s": (args.n_tokens - 1) / spent[v][1], "token_ids": out[v]}
                for v in variants}
    runs = {v: [] for v in variants}  # type: Dict[str, List[Dict[str, Any]]]
    for r in range(args.repeats):
        got = one_round(r)
        for v in variants:
            runs[v].append(got[v])
            print("round %d %-14s TTFT %6.2f s  decode %5.1f tok/s" % (r + 1, v, got[v]["ttft_s"], got[v]["decode_tok_s"]),
                  flush=True)
    summary = {}  # type: Dict[str, Any]
    for v in variants:
        summary[v] = {k: benchlib.summarize([m[k] for m in runs[v]]) for k in ("ttft_s", "decode_tok_s")}
        if v != "decode-only":
            for k in ("ttft_s", "decode_tok_s"):
                summary[v][k.split("_")[0] + "_ratio_vs_decode_only"] = benchlib.summarize(
                    [a[k] / b[k] for a, b in zip(runs[v], runs["decode-only"])])
        ref = runs["decode-only"][0]["token_ids"]
        summary[v]["greedy_same_prefix_as_decode_only"] = next(
            (i for i, (a, b) in enumerate(zip(runs[v][0]["token_ids"], ref)) if a != b), len(ref))
    kernels = {}
    for v in [v for v in chunks if v != "float32"]:
        layers = [m for name, m in chunks[v].named_modules() if hasattr(m, "prefill_kernel")]
        kernels[v] = sorted({"%s [%dx%d]: %s%s" % (m.spec.label(), m.n_out, m.n_in, m.kernel.name,
                                                    ", prefill %s from %d rows" % (m.prefill_kernel.name, m.prefill_from)
                                                    if m.prefill_kernel is not None else "") for m in layers})
        print(v, kernels[v])
    benchlib.finish_machine_info(info)
    benchlib.save_record(args.out.replace(".json", "_paired.json"), {
        "benchmark": "bench_prefill_kernels_paired", "machine": info, "prompt_tokens": len(ids),
        "args": {k: v for k, v in vars(args).items() if k != "child"}, "kernels": kernels,
        "why": kernel_choice.chosen_by_weight(), "runs": runs, "summary": summary})
    print(json.dumps({v: {k: x["median"] if isinstance(x, dict) else x for k, x in s.items()}
                      for v, s in summary.items()}, indent=1))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    import torch
    info = benchlib.machine_info(args.threads)
    info["isa"] = torch.backends.cpu.get_cpu_capability()
    if args.ring3:
        return main_ring3(args, info)
    if args.paired:
        return paired(args, info)
    record = {"benchmark": "bench_prefill_kernels", "machine": info,
              "args": {k: v for k, v in vars(args).items() if k != "child"}}  # type: Dict[str, Any]
    t0 = time.time()
    if args.shapes or args.shapes_only:
        record["shapes"] = time_shapes(args.repeats)
        shape_table(record["shapes"])
        if args.shapes_only:
            benchlib.finish_machine_info(info)
            benchlib.save_record(args.out, record)
            return 0
    variants = [v for v in args.variants.split(",") if v]
    runs = {v: [] for v in variants}  # type: Dict[str, List[Dict[str, Any]]]
    for r in range(args.repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            m = in_child(args, "generate", v)
            runs[v].append(m)
            print("repeat %d %-14s TTFT %6.2f s  decode %5.1f tok/s  (%d prompt tokens; runs %s)" % (
                r + 1, v, m["ttft_s"], m["decode_tok_s"], m["runs"][0]["prompt_tokens"],
                ", ".join("%.2f s" % x["ttft_s"] for x in m["runs"])), flush=True)
    record["runs"] = runs
    exact = None if args.no_exact else in_child(args, "generate", "exact")
    if exact is not None:
        record["exact"] = exact
        print("exact kernels: TTFT %.2f s, decode %.1f tok/s" % (exact["ttft_s"], exact["decode_tok_s"]), flush=True)
    summary = {}  # type: Dict[str, Any]
    base = "decode-only"
    for v in variants:
        s = {"ttft_s": benchlib.summarize([m["ttft_s"] for m in runs[v]]),
             "decode_tok_s": benchlib.summarize([m["decode_tok_s"] for m in runs[v]]),
             "kernels": runs[v][-1]["runs"][-1]["kernels"]}
        if base in runs and v != base:
            s["ttft_ratio_vs_decode_only"] = benchlib.summarize(
                [m["ttft_s"] / b["ttft_s"] for m, b in zip(runs[v], runs[base])])
            s["decode_ratio_vs_decode_only"] = benchlib.summarize(
                [m["decode_tok_s"] / b["decode_tok_s"] for m, b in zip(runs[v], runs[base])])
        if exact is not None:
            ids, ref = runs[v][-1]["runs"][-1]["token_ids"], exact["runs"][0]["token_ids"]
            s["greedy_vs_exact"] = {"tokens": len(ref), "same_prefix": next(
                (i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref))),
                "differing_ids": sum(a != b for a, b in zip(ids, ref))}
        summary[v] = s
    if args.perplexity:
        for v in variants:
            summary[v]["perplexity"] = in_child(args, "perplexity", v)
            print("%-14s perplexity %.4f" % (v, summary[v]["perplexity"]["perplexity"]), flush=True)
    record["summary"] = summary
    rows = []
    for v in variants:
        s = summary[v]
        rows.append([v, benchlib.fmt_stat(s["ttft_s"], "%.2f"), benchlib.fmt_stat(s["decode_tok_s"]),
                     benchlib.fmt_stat(s["ttft_ratio_vs_decode_only"], "%.3f") if "ttft_ratio_vs_decode_only" in s else "",
                     benchlib.fmt_stat(s["decode_ratio_vs_decode_only"], "%.3f") if "decode_ratio_vs_decode_only" in s else "",
                     "%d/%d" % (s["greedy_vs_exact"]["same_prefix"], s["greedy_vs_exact"]["tokens"])
                     if "greedy_vs_exact" in s else "",
                     "%.4f" % s["perplexity"]["perplexity"] if "perplexity" in s else ""])
    benchlib.print_table("standalone, %d thread(s), %d prompt tokens, ISA %s" % (
        args.threads, runs[variants[0]][0]["runs"][0]["prompt_tokens"], info["isa"]),
        ["variant", "TTFT s", "decode tok/s", "TTFT ratio", "decode ratio", "greedy = exact", "perplexity"], rows)
    benchlib.finish_machine_info(info)
    record["seconds"] = round(time.time() - t0, 1)
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
