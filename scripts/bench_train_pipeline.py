#!/usr/bin/env python
"""Training throughput through the ring on emulated boards: pipeline efficiency (issue 38).

SmolLM2-135M (float32, `quant: none`), a LoRA of --rank on every q/k/v/o/gate/up/down, trained
with mdi-train over N emulated boards: every node process (the mdi-train starter and N - 1
`mdi-worker`s, 1 torch thread each) in its own cgroup v1 CPU quota of --board-cores (mdi-bench's
emulation, mdi.lab.emulation; the same quota for every board). The layers are split so each
board has about the same work (the starter's LM head counts as bench_ring's head-aware
partition says). Measured, in rounds so a slow phase of this shared machine hits every setting:

    one board  mdi-train on a 1-node ring: one board of the same quota holding the whole model
    M = 1, N, 2N, ...   the N-board ring, the batch of B windows as M micro-batches

Each run is one mdi-train process of --steps steps; its rate is the median tokens/s of its
steps after the first (the first pays for allocation). Pipeline efficiency of a round =
tokens/s(M) / (N x tokens/s(one board)); reported as median [min, max] over rounds.

Memory: each node's peak RSS (VmHWM, reset before every run) against an estimate of its parts:
the frozen weights it holds (float32), its adapter (LoRA parameters + their gradients), AdamW's
two moments, and the activations backward keeps: the bytes autograd saves for one block over
one window (measured here with saved-tensor hooks on one SmolLM2 block, through the same
StageTrainer the nodes run), x its layers x the B windows in flight (GPipe keeps every
micro-batch's until its gradient comes); the starter adds the LM head's logits of one
micro-batch (forward, softmax and gradient). The rest of RSS is the runtime (torch, Python).

    python scripts/bench_train_pipeline.py                        # N = 3, 0.5 core per board
    python scripts/bench_train_pipeline.py --rounds 3 --micro 1,3,6,12 --batch-size 12
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
from benchlib import BIN, DEFAULT_MODEL, fmt_stat, ports_besides, print_table, summarize
from bench_ring import head_aware_partition, head_cost_in_layers

from mdi.lab.cgroups import peak_rss_bytes, reset_peak_rss
from mdi.lab.emulation import Emulation, EmulationSettings
from mdi.lab.processes import WorkerProcess, free_ports

MB = 2.0 ** 20
# The node processes run this tree's mdi (the venv's own install may be another checkout's).
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([benchlib.ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--nodes", type=int, default=3, help="boards N of the ring (default 3)")
    p.add_argument("--board-cores", type=float, default=0.5, help="CPU quota of every board (default 0.5)")
    p.add_argument("--micro", default="", help="micro-batch counts M, comma-separated (default 1,N,2N,B)")
    p.add_argument("--batch-size", type=int, default=0, help="windows per step B (default 4N)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per run, the first not timed (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every setting (default 2)")
    p.add_argument("--partition", default="", help="layers per node, e.g. 5,13,12 (default head-aware)")
    p.add_argument("--compare-partition", default="",
                   help="also run M = 2N with this split in every round (e.g. the decode head-aware 5,13,12)")
    p.add_argument("--compare-tree", default="",
                   help="also run M = 2N with the starter (mdi-train) from this checkout of mdi in every round: "
                        "a same-run A/B of a schedule change (the workers stay this tree's)")
    p.add_argument("--text", default=os.path.join(benchlib.ROOT, "README.md"))
    p.add_argument("--no-quota", action="store_true", help="plain loopback, no CPU quota")
    p.add_argument("--cpu-period-us", type=int, default=100000,
                   help="the quota's CFS period (default 100000: mdi-bench's; a board at its quota stalls until "
                        "the next period, which delays a frame it would relay)")
    p.add_argument("--profile", action="store_true",
                   help="then one profiled run per M with the starter in this process: where a step's time goes")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_train_pipeline.json"))
    args = p.parse_args(argv)
    n = args.nodes
    args.batch_size = args.batch_size or 4 * n
    args.micro = [int(m) for m in args.micro.split(",")] if args.micro else sorted({1, n, 2 * n, args.batch_size})
    if any(not 1 <= m <= args.batch_size for m in args.micro):
        p.error("every --micro must be 1 to --batch-size")
    return args


def write_config(path: str, model: str, nodes: List[Dict[str, Any]]) -> None:
    lines = ["  - {%s}" % ", ".join("%s: %s" % kv for kv in node.items()) for node in nodes]
    with open(path, "w") as f:
        f.write("model: {path: %s, dtype: float32, device: cpu, quant: none}\nnodes:\n%s\n"
                "generation: {temperature: 0}\nruntime: {threads: 1, ring_timeout: 120}\n" % (model, "\n".join(lines)))


def train_once(emu: Emulation, cfg_path: str, args, micro: int, data: str, tmp: str,
               workers: List[WorkerProcess], tree: str = "") -> Dict[str, Any]:
    """One mdi-train run in the starter's cgroup: its steps' tokens/s and every node's peak RSS."""
    metrics = os.path.join(tmp, "metrics.json")
    cmd = [os.path.join(BIN, "mdi-train"), "--config", cfg_path, "--data", data, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--micro-batches", str(micro), "--seq-len", str(args.seq_len),
           "--rank", str(args.rank), "--alpha", str(2 * args.rank), "--lr", "1e-3", "--metrics-out", metrics]
    for w in workers:
        reset_peak_rss(w.pid)
    log = open(os.path.join(tmp, "starter.log"), "ab")
    env = dict(ENV, PYTHONPATH=tree) if tree else ENV
    proc = subprocess.Popen(emu.command(cmd, "starter", 0), stdout=log, stderr=log, env=env)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # VmHWM goes with the process: read it until it exits
        while not stop.is_set():
            peak[0] = max(peak[0], peak_rss_bytes(proc.pid) or 0)
            time.sleep(0.2)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rc = proc.wait(timeout=3600)
    finally:
        stop.set()
        watcher.join()
        log.close()
    if rc != 0:
        raise RuntimeError("mdi-train (M = %d) exited with %d: see %s" % (micro, rc, os.path.join(tmp, "starter.log")))
    with open(metrics) as f:
        steps = json.load(f)["steps"]
    rates = [s["tokens_per_s"] for s in steps[1:]] or [steps[0]["tokens_per_s"]]
    peaks = {"starter": peak[0]}
    peaks.update({w.name: peak_rss_bytes(w.pid) or 0 for w in workers})
    return {"tokens_per_s": summarize(rates)["median"], "step_tokens_per_s": [s["tokens_per_s"] for s in steps],
            "peak_rss_bytes": peaks}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (/proc/PID/stat), in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


def profile(emu: Emulation, cfg_path: str, args, data: str, workers: List[WorkerProcess]) -> Dict[str, Any]:
    """Per M, one step timed from inside the starter (this process, in the starter's cgroup):
    its own compute (forward, loss + head backward, backward), the frames it only relays, the
    time to the first loss (pipeline fill) and from the last loss to its last backward (the
    gradients' way back: the GPipe drain, relay hops included), and every worker's CPU seconds."""
    import torch
    from mdi.runconfig import load_config
    from mdi.ring.train_request import TrainSetup
    from mdi.model.adapters.lora_train import TARGETS
    from mdi.starter.train import ring_trainer, training
    torch.set_num_threads(1)
    assert emu.cpu is not None or args.no_quota
    if emu.cpu is not None:
        emu.cpu.join("starter")
    out: Dict[str, Any] = {}
    originals = {"_loss": ring_trainer.RingTrainer._loss}
    stage_methods = {name: getattr(ring_trainer.StageTrainer, name) for name in ("forward", "backward")}
    events: List[Any] = []

    def timed(kind, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                events.append((kind, t, time.perf_counter()))
        return wrapper
    try:
        ring_trainer.RingTrainer._loss = timed("loss", originals["_loss"])
        ring_trainer.StageTrainer.forward = timed("forward", stage_methods["forward"])
        ring_trainer.StageTrainer.backward = timed("backward", stage_methods["backward"])
        for m in args.micro:
            cfg = load_config(cfg_path)
            setup = TrainSetup(targets=TARGETS, rank=args.rank, alpha=2.0 * args.rank, lr=1e-3)
            options = training.TrainOptions(data, setup, steps=2, batch_size=args.batch_size, micro_batches=m,
                                            seq_len=args.seq_len)
            marks: Dict[str, Any] = {}

            def on_step(record, total, marks=marks):
                marks[record.step] = (time.perf_counter(), [cpu_seconds(w.pid) for w in workers])
            events.clear()
            result = training.run(cfg, options, on_step=on_step)
            t_end, cpu_end = marks[1]
            t_start, cpu_start = marks[0]
            step = result.steps[1]
            mine = [e for e in events if e[1] >= t_start]
            busy = {k: sum(e[2] - e[1] for e in mine if e[0] == k) for k in ("forward", "loss", "backward")}
            losses = [e for e in mine if e[0] == "loss"]
            backs = [e for e in mine if e[0] == "backward"]
            out["M=%d" % m] = {
                "step_seconds": step.seconds, "tokens_per_s": step.tokens_per_s,
                "starter_seconds": busy, "starter_busy_share": sum(busy.values()) / step.seconds,
                "fill_seconds": losses[0][1] - t_start if losses else None,
                "drain_seconds": backs[-1][2] - losses[-1][2] if losses and backs else None,
                "worker_cpu_seconds": [b - a for a, b in zip(cpu_start, cpu_end)]}
            print("profile M = %d: %s" % (m, json.dumps(out["M=%d" % m])), flush=True)
    finally:
        ring_trainer.RingTrainer._loss = originals["_loss"]
        for name, fn in stage_methods.items():
            setattr(ring_trainer.StageTrainer, name, fn)
        if emu.cpu is not None:
            emu.cpu.leave()
    return out


def training_head_layers(config, spec, seq_len: int, windows: int, repeats: int = 3) -> float:
    """The starter's loss (LM head forward, cross-entropy, the head's backward to its input) over
    `windows` windows, in transformer blocks' forward + backward (with the LoRA, as StageTrainer
    runs them) over the same windows: timed here, 1 thread, medians of `repeats`. Decode's
    head-aware partition (bench_ring: parameter bytes) undercounts it: training's head works on
    every position and the cross-entropy reads the whole vocabulary per position."""
    import statistics
    import torch
    import torch.nn.functional as F
    from mdi.model.adapters.lora_train import init_pairs
    from mdi.model.adapters.stage_train import StageTrainer
    from mdi.model.source import random_chunk
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = random_chunk(config, 0, 1, False, False, torch.float32, "cpu")
        stage = StageTrainer(block, spec, {k: v for k, v in init_pairs(config, spec, 0).items()
                                           if k.startswith("0.")}, 1e-3)
        ends = random_chunk(config, 0, 0, True, True, torch.float32, "cpu")
        x = torch.randn(windows, seq_len, config.n_embd) * 0.5
        ids = torch.randint(0, config.vocab_size, (windows * seq_len,))
        block_s, head_s = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            y = stage.forward(0, i, x)
            stage.backward(0, i, torch.randn_like(y))
            t1 = time.perf_counter()
            with torch.inference_mode(False), torch.enable_grad():
                h = y.clone().requires_grad_(True)
                F.cross_entropy(ends.head(h).float().reshape(-1, config.vocab_size), ids).backward()
            block_s.append(t1 - t0)
            head_s.append(time.perf_counter() - t1)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(head_s) / statistics.median(block_s)


def saved_bytes_per_layer_window(config, spec, seq_len: int) -> int:
    """Bytes autograd keeps for backward of one block over one window: a random block of the
    model's shapes through StageTrainer (what every node runs), saved tensors counted once."""
    import torch
    from mdi.model.adapters.lora_train import init_pairs
    from mdi.model.adapters.stage_train import StageTrainer
    from mdi.model.source import random_chunk
    chunk = random_chunk(config, 0, 1, False, False, torch.float32, "cpu")
    pairs = {k: v for k, v in init_pairs(config, spec, 0).items() if k.startswith("0.")}
    stage = StageTrainer(chunk, spec, pairs, 1e-3)
    seen: Dict[Any, int] = {}

    def pack(t):
        if t.device.type == "cpu" and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.forward(0, 0, torch.randn(1, seq_len, config.n_embd))
    weights = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    weights |= {p.untyped_storage().data_ptr() for p in stage.lora.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights)  # frozen weights are held anyway


def memory_estimate(config, spec, counts: List[int], args) -> Dict[str, Dict[str, int]]:
    """Per node (starter first): weights, adapter (+ gradients), AdamW, activations, in bytes."""
    from mdi.model.adapters.lora_train import init_pairs, key_layer
    from mdi.model.layout import expected_shapes
    import math
    pairs = init_pairs(config, spec, 0)
    per_window = saved_bytes_per_layer_window(config, spec, args.seq_len)
    out, first = [], 0
    for k, count in enumerate(counts):
        ends = k == 0
        shapes = expected_shapes(config, (first, first + count), ends, ends)
        weights = 4 * sum(math.prod(s) for s in shapes.values())
        lora = 4 * sum(t.numel() for key, ab in pairs.items() if first <= key_layer(key) < first + count for t in ab)
        acts = per_window * count * args.batch_size
        if ends:  # logits, their softmax and gradient for one micro-batch of windows
            rows = args.seq_len * -(-args.batch_size // min(args.micro))
            acts += 3 * 4 * rows * config.vocab_size
        out.append({"weights": weights, "adapter_and_grads": 2 * lora, "adamw": 2 * lora, "activations": acts,
                    "activations_per_layer_window": per_window})
        first += count
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.model.adapters.lora_train import LoraSpec, TARGETS
    from mdi.model.source import ModelSource
    config = ModelSource(args.model).config
    n = args.nodes
    spec = LoraSpec(TARGETS, args.rank, 2.0 * args.rank)
    head = training_head_layers(config, spec, args.seq_len, max(1, args.batch_size // max(args.micro)))
    print("the starter's loss costs %.1f blocks' forward + backward (decode's head-aware split: %.1f)"
          % (head, head_cost_in_layers(args.model)), flush=True)
    counts = [int(c) for c in args.partition.split(",")] if args.partition else \
        head_aware_partition(config.n_layer, n, head)
    other = [int(c) for c in args.compare_partition.split(",")] if args.compare_partition else None
    for split in [counts] + ([other] if other else []):
        if len(split) != n or sum(split) != config.n_layer:
            raise SystemExit("a partition must give %d counts adding up to %d layers" % (n, config.n_layer))
    info = benchlib.machine_info(1)
    emu = Emulation(EmulationSettings(mode="off" if args.no_quota else "auto", cpu_quota=args.board_cores,
                                      cpu_period_us=args.cpu_period_us), n)
    emu.start()
    print(emu.describe(), flush=True)
    tmp = tempfile.mkdtemp(prefix="bench-train-pipeline-")
    data = os.path.join(tmp, "train.txt")
    with open(args.text, encoding="utf-8") as f, open(data, "w", encoding="utf-8") as g:
        g.write(f.read())
    model = os.path.abspath(args.model)
    workers: List[WorkerProcess] = []
    rounds: List[Dict[str, Any]] = []
    profiles: Dict[str, Any] = {}
    t0 = time.time()
    try:
        emu.prepare_process("starter", 0)
        emu.limit_cpu("starter", True, 0)
        for k in range(1, n):
            key = "board%d" % k
            emu.prepare_process(key, k)
            emu.limit_cpu(key, True, k)
            port, data_port = free_ports(2)
            workers.append(WorkerProcess(port, os.path.join(tmp, key + ".log"), key, threads=1,
                                         env=ENV, data_port=data_port,
                                         wrap=lambda cmd, key=key, k=k: emu.command(cmd, key, k)))
        for w in workers:
            w.wait_ready(180)
        one_cfg, ring_cfg = os.path.join(tmp, "one.yaml"), os.path.join(tmp, "ring.yaml")

        def configs(split: List[int] = counts) -> None:  # the starter on fresh ports every run: the last run's may linger
            port, data_port = ports_besides(workers, 2)
            starter = {"name": "starter", "host": "127.0.0.1", "port": port, "data_port": data_port}
            write_config(one_cfg, model, [starter])
            write_config(ring_cfg, model, [dict(starter, layers=split[0])] +
                         [dict(w.node(), layers=c) for w, c in zip(workers, split[1:])])
        for r in range(args.rounds):
            configs()
            record: Dict[str, Any] = {"one_board": train_once(emu, one_cfg, args, 1, data, tmp, [])}
            print("round %d: one board %.2f tokens/s" % (r + 1, record["one_board"]["tokens_per_s"]), flush=True)
            for m in args.micro:
                configs()
                record["M=%d" % m] = train_once(emu, ring_cfg, args, m, data, tmp, workers)
                print("round %d: M = %d %.2f tokens/s" % (r + 1, m, record["M=%d" % m]["tokens_per_s"]), flush=True)
            if args.compare_tree:
                configs()
                key = "M=%d starter from %s" % (2 * n, args.compare_tree)
                record[key] = train_once(emu, ring_cfg, args, 2 * n, data, tmp, workers, args.compare_tree)
                print("round %d: %s %.2f tokens/s" % (r + 1, key, record[key]["tokens_per_s"]), flush=True)
            if other:
                configs(other)
                key = "M=%d split %s" % (2 * n, "+".join(map(str, other)))
                record[key] = train_once(emu, ring_cfg, args, 2 * n, data, tmp, workers)
                print("round %d: %s %.2f tokens/s" % (r + 1, key, record[key]["tokens_per_s"]), flush=True)
            rounds.append(record)
        if args.profile:
            configs()
            profiles = profile(emu, ring_cfg, args, data, workers)
    finally:
        for w in workers:
            w.stop()
        for problem in emu.close():
            print("warning: %s" % problem, file=sys.stderr)
    benchlib.finish_machine_info(info)
    estimate = memory_estimate(config, spec, counts, args)
    one = summarize([r["one_board"]["tokens_per_s"] for r in rounds])
    by_m: Dict[str, Any] = {}
    for m in args.micro:
        key = "M=%d" % m
        by_m[key] = {"micro_batches": m, "windows_per_micro": args.batch_size / m,
                     "tokens_per_s": summarize([r[key]["tokens_per_s"] for r in rounds]),
                     "efficiency": summarize([r[key]["tokens_per_s"] / (n * r["one_board"]["tokens_per_s"])
                                              for r in rounds])}
    compared = {}
    for key in rounds[0]:
        if "split" in key or "starter from" in key:
            compared[key] = {"tokens_per_s": summarize([r[key]["tokens_per_s"] for r in rounds]),
                             "efficiency": summarize([r[key]["tokens_per_s"] / (n * r["one_board"]["tokens_per_s"])
                                                      for r in rounds])}
    names = ["starter"] + [w.name for w in workers]
    memory = []
    for k, name in enumerate(names):
        peaks = [r[key]["peak_rss_bytes"][name] for r in rounds for key in by_m]  # the main split's runs
        parts = estimate[k]
        parts_sum = sum(v for p, v in parts.items() if p != "activations_per_layer_window")
        memory.append(dict(parts, node=name, layers=counts[k], peak_rss_bytes=max(peaks),
                           estimated_bytes=parts_sum, runtime_and_rest_bytes=max(peaks) - parts_sum))
    one_peak = max(r["one_board"]["peak_rss_bytes"]["starter"] for r in rounds)
    print_table("mdi-train on %d emulated boards (%s), B = %d windows of %d tokens, rank %d: median [min, max] "
                "of %d rounds" % (n, emu.tag_for_csv(), args.batch_size, args.seq_len, args.rank, args.rounds),
                ["setting", "tokens/s", "pipeline efficiency"],
                [["one board (whole model)", fmt_stat(one, "%.2f"), ""]] +
                [["%d boards, M = %d" % (n, v["micro_batches"]), fmt_stat(v["tokens_per_s"], "%.2f"),
                  fmt_stat(v["efficiency"], "%.2f")] for v in by_m.values()] +
                [["%d boards, %s" % (n, k), fmt_stat(v["tokens_per_s"], "%.2f"), fmt_stat(v["efficiency"], "%.2f")]
                 for k, v in compared.items()])
    print_table("peak memory per node (MB) against its parts (estimated)",
                ["node", "layers", "peak RSS", "weights", "adapter+grads", "AdamW", "activations", "rest (runtime)"],
                [[m["node"], m["layers"]] + ["%.0f" % (m[p] / MB) for p in (
                    "peak_rss_bytes", "weights", "adapter_and_grads", "adamw", "activations",
                    "runtime_and_rest_bytes")] for m in memory])
    print("one board holding the whole model: peak RSS %.0f MB" % (one_peak / MB))
    print(benchlib.note_load(info))
    print("took %.0f s" % (time.time() - t0))
    benchlib.save_record(args.out, {
        "benchmark": "bench_train_pipeline", "model": args.model, "nodes": n, "partition": counts,
        "training_head_cost_layers": head, "decode_head_cost_layers": head_cost_in_layers(args.model),
        "threads_per_node": 1,
        "board_cores": None if args.no_quota else args.board_cores, "emulation": emu.record(),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "rank": args.rank, "alpha": 2 * args.rank,
        "targets": list(TARGETS), "steps_per_run": args.steps, "rounds": args.rounds,
        "one_board_tokens_per_s": one, "one_board_peak_rss_bytes": one_peak, "by_micro_batches": by_m,
        "other_partition": compared,
        "memory": memory, "raw_rounds": rounds, "profile": profiles, "isa": info["cpu"]["isa"], "machine": info})
    return 0


if __name__ == "__main__":
    sys.exit(main())
