#!/usr/bin/env python
"""What mdi-train's recovery costs and what it gives (issue 38), SmolLM2-135M LoRA on a 3-node
loopback ring (starter + board1 + board2, 10 layers each, float32, 1 torch thread per node).

In one run, alternating so the shared machine's load falls on all alike:
  off    no spare, recovery off: the steps alone (no snapshot is taken);
  spare  a spare configured, recovery on, --recovery-every larger than the run (one snapshot, the
         start's, kept in memory): what recovery costs without snapshots;
  on     a spare configured, recovery on: after every step the starter reads every worker's LoRA
         pairs and AdamW moments back (GET /train: mdi.starter.train.train_recovery's snapshot);
then once `on` with board1 SIGKILLed halfway through step 3 (a timer started when step 2
ends, set to half the median step time): the spare takes board1's layers, step 3 runs again,
and the run must end with the uninterrupted `on` run's losses and adapter.

Recorded (results/bench_train_recovery.json, with the CPU's ISA): each mode's step seconds
(median [min, max] over the steps after the first of every repeat), the snapshot's seconds
and bytes, its seconds over the step seconds of the same `on` run, the same-run ratios
spare/off and on/off of the median step time, the killed run's recovery
seconds and its largest relative difference from the uninterrupted run.

    python scripts/bench_train_recovery.py                      # 6 steps, batch 4, seq-len 64, rank 8
    python scripts/bench_train_recovery.py --repeats 3 --steps 8
"""
import argparse
import dataclasses
import os
import signal
import statistics
import tempfile
import threading
from typing import Any, Dict, List

import benchlib
from benchlib import DEFAULT_MODEL, WorkerProcess, ports_besides, print_table


def parse_args(argv=None) -> argparse.Namespace:
    from mdi.cli.arguments import arg_type
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--steps", type=arg_type(int, lambda v: v >= 3, "an integer >= 3"), default=6,
                   help="training steps per run (at least 3: a board is killed after step 2; default 6)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of off, spare, on (default 2)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--text", default=os.path.join(benchlib.ROOT, "README.md"))
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_train_recovery.json"))
    return p.parse_args(argv)


def config(model: str, n_layer: int, starter_ports: List[int], boards: List[WorkerProcess],
           spares: List[WorkerProcess]):
    from mdi.runconfig import parse_config
    share = n_layer // 3

    def node(w: WorkerProcess) -> Dict[str, Any]:
        return {"name": w.name, "host": "127.0.0.1", "port": w.port, "data_port": w.data_port}
    nodes = [{"name": "starter", "host": "127.0.0.1", "port": starter_ports[0], "data_port": starter_ports[1],
              "layers": n_layer - 2 * share}] + [dict(node(w), layers=share) for w in boards]
    data = {"model": {"path": model, "dtype": "float32", "device": "cpu", "quant": "none"}, "nodes": nodes,
            "generation": {"temperature": 0},
            "runtime": {"threads": 1, "ring_timeout": 600, "heartbeat_interval": 0.5}}
    if spares:
        data["spares"] = [node(w) for w in spares]
    return parse_config(data, "bench_train_recovery")


def worst_relative(got, want) -> float:
    return max(((g - w).norm() / max(w.norm(), 1e-12)).item()
               for key in want for g, w in zip(got[key], want[key]))


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdi.model.source import ModelSource
    from mdi.ring.train_request import TrainSetup
    from mdi.model.adapters.lora_train import TARGETS
    from mdi.starter.train import training
    n_layer = ModelSource(args.model).config.n_layer
    info = benchlib.machine_info(1)
    tmp = tempfile.mkdtemp(prefix="bench-train-recovery-")
    setup = TrainSetup(targets=TARGETS, rank=args.rank, alpha=2.0 * args.rank, lr=1e-3)
    options = training.TrainOptions(args.text, setup, steps=args.steps, batch_size=args.batch_size,
                                    micro_batches=min(3, args.batch_size), seq_len=args.seq_len)
    model = os.path.abspath(args.model)
    workers = []
    try:
        workers = [WorkerProcess(name, 1, tmp) for name in ("board1", "board2", "spare1")]
        for w in workers:
            w.wait_healthy(120)
        ports = ports_besides(workers, 2)
        boards, spare = workers[:2], workers[2:]
        seconds: Dict[str, List[float]] = {"off": [], "spare": [], "on": []}
        snapshot_s: List[float] = []
        snapshot_share: List[float] = []  # per `on` run: its snapshots' seconds / its steps' seconds
        last_on = None
        for _ in range(args.repeats):
            for mode in seconds:
                every = 1 if mode == "on" else args.steps + 1
                result = training.run(config(model, n_layer, ports, boards, spare if mode != "off" else []),
                                      dataclasses.replace(options, recovery_every=every))
                seconds[mode] += [s.seconds for s in result.steps[1:]]
                if mode == "on":
                    snaps = result.extra["snapshots"]
                    snapshot_s.append(snaps["seconds"] / max(snaps["count"], 1))
                    snapshot_share.append(snaps["seconds"] / sum(s.seconds for s in result.steps))
                    snapshot_bytes, last_on = snaps["bytes"], result
                print("%s: step seconds %s" % (mode, " ".join("%.2f" % s.seconds for s in result.steps)), flush=True)
        assert last_on is not None
        delay = statistics.median(seconds["on"]) / 2

        def on_step(record, total):
            if record.step == 1:  # step 2 done: board1 dies halfway through step 3
                threading.Timer(delay, os.kill, (boards[0].proc.pid, signal.SIGKILL)).start()
        killed = training.run(config(model, n_layer, ports, boards, spare), options, on_step=on_step)
    finally:
        benchlib.stop_workers(workers)
    benchlib.finish_machine_info(info)
    (rec,) = killed.extra["recoveries"]
    loss_diff = max(abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(killed.steps, last_on.steps))
    out = {"model": args.model, "nodes": 3, "layers": [n_layer - 2 * (n_layer // 3)] + [n_layer // 3] * 2,
           "steps": args.steps, "repeats": args.repeats, "batch_size": args.batch_size, "seq_len": args.seq_len,
           "rank": args.rank, "targets": list(TARGETS),
           "step_seconds": {m: benchlib.summarize(v) for m, v in seconds.items()},
           "snapshot_seconds": benchlib.summarize(snapshot_s), "snapshot_bytes": snapshot_bytes,
           "snapshot_over_step_seconds": benchlib.summarize(snapshot_share),
           "on_over_off_median": statistics.median(seconds["on"]) / statistics.median(seconds["off"]),
           "spare_over_off_median": statistics.median(seconds["spare"]) / statistics.median(seconds["off"]),
           "killed": {"recovery": rec, "step_seconds": [s.seconds for s in killed.steps],
                      "worst_relative_adapter_diff": worst_relative(killed.pairs, last_on.pairs),
                      "worst_relative_loss_diff": loss_diff},
           "isa": info["cpu"]["isa"], "machine": info}
    print_table("mdi-train recovery: SmolLM2-135M LoRA rank %d, 3 nodes" % args.rank, ["", "value"], [
        ["step s, recovery off", benchlib.fmt_stat(out["step_seconds"]["off"], "%.2f")],
        ["step s, recovery on, no snapshots", benchlib.fmt_stat(out["step_seconds"]["spare"], "%.2f")],
        ["step s, recovery on (snapshot every step)", benchlib.fmt_stat(out["step_seconds"]["on"], "%.2f")],
        ["same-run ratios spare/off, on/off (medians)", "%.3f, %.3f" % (out["spare_over_off_median"],
                                                                     out["on_over_off_median"])],
        ["snapshot s (per step)", benchlib.fmt_stat(out["snapshot_seconds"], "%.3f")],
        ["snapshot s / step s (same run)", benchlib.fmt_stat(out["snapshot_over_step_seconds"], "%.3f")],
        ["snapshot MB (pairs + 2 moments)", "%.1f" % (snapshot_bytes / 2 ** 20)],
        ["killed run: recovery s, action", "%.2f, %s" % (rec["seconds"], rec["action"])],
        ["killed vs uninterrupted: adapter, loss (relative)", "%.1e, %.1e" % (
            out["killed"]["worst_relative_adapter_diff"], loss_diff)]])
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, out)
    return 0 if out["killed"]["worst_relative_adapter_diff"] <= 1e-5 and loss_diff <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
