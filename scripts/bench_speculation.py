#!/usr/bin/env python3
"""Speculative decoding through the ring (issue 42): one user, several boards.

Every ratio comes from one run of this script, on this machine, on the shipped SmolLM2-135M
(int4, quant: auto; runtime.quant_kernel fast), greedy, S = 1 unless said:

  setups    loopback: a ring of 3 processes x 1 thread (the starter here, 2 mdi-workers);
            emulated: the same 3 processes each held to --board-cores of CPU (cgroup v1 quota
            over --board-period-us periods; skipped, and said so, where cgroups cannot be
            used). "one board" is the starter alone on the same CPU share, plain decoding.
            --layers splits the ring (default even).
  prompts   scripts/speculation_prompts.json: "copy" prompts (rewrite, quote, fix, refactor:
            answers that copy the prompt) and "free" ones, each in the model's chat template,
            each run cold (a new sample and drafter; the ring stays up between prompts).
  modes     plain ring; ngram (prompt lookup, filling the ring); ngram without filling.
  sweep     a drafter that agrees with the target with probability a (mdi.lab.oracle_drafter),
            a = 0.3 .. 0.9, with and without filling, beside a simple model of the speed-up.
  batch     --batch samples at once (default 12), plain vs ngram: speculation must yield.
  draft     with --draft-model PATH: a --draft-target-quant (default none: float32) target with
            that model drafting (quantized --draft-quant, default int4), one node alone and the
            ring of 3, S = 1: plain vs ngram vs draft alternating prompt by prompt on both sets
            (--draft-only runs this part alone; its record goes to --draft-out).

Decode speed is (tokens - 1) / (last token time - first token time) per prompt: prefill,
the same in every mode, is left out. The record (JSON) keeps every prompt's figures and the
machine's CPU (its ISA decides which kernels win); --plot draws tokens/s against a.
"""
import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (DEFAULT_MODEL, ROOT, WorkerProcess, cgroup_unavailable_reason, decode_timing,  # noqa: E402
                      finish_machine_info, fmt_stat, machine_info, node_cgroups, note_load, print_table, save_record,
                      stop_workers, summarize)
from mdi.lab.cgroups import quota_and_period  # noqa: E402
from mdi.model.backend import BACKENDS, default_backend  # noqa: E402

PROMPTS_FILE = os.path.join(ROOT, "scripts", "speculation_prompts.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    p.add_argument("--prompts", default=PROMPTS_FILE, help="JSON {copy: [...], free: [...]}")
    p.add_argument("--n-prompts", type=int, default=10, help="prompts of each set (default 10)")
    p.add_argument("--setups", default="loopback,emulated", help="loopback, emulated or both")
    p.add_argument("--board-cores", type=float, default=0.5, help="CPU share of an emulated board (default 0.5)")
    p.add_argument("--board-period-us", type=int, default=2000,
                   help="the quota's period (default 2000: the shortest a 0.5 core quota allows). A board "
                        "idle between passes runs a pass at full speed while its period's quota lasts: over "
                        "20 ms periods a ring at S = 1 ran each 3 ms stage unthrottled, like boards of a "
                        "whole core, and beat one board of the same share 1.6x with no speculation")
    p.add_argument("--layers", default="even",
                   help="the ring's split: even (default), auto (the planner's, from measured stage times) or "
                        "counts per node, starter first (e.g. 7,12,11: the starter's embedding and head cost "
                        "about 4 of SmolLM2's layers, and a filled ring runs at its slowest stage)")
    p.add_argument("--sweep", default="0.3,0.5,0.7,0.9", help="oracle acceptances (empty: no sweep)")
    p.add_argument("--sweep-prompts", type=int, default=3, help="prompts per sweep point (default 3)")
    p.add_argument("--batch", type=int, default=12, help="samples of the batch comparison (0: skip)")
    p.add_argument("--kernel", default="fast", help="runtime.quant_kernel (default fast)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="runtime.backend of every node (default: $MDI_BACKEND, else auto); the record names what "
                        "each node chose")
    p.add_argument("--draft-model", default="", help="a draft model's path: the draft comparison (empty: skip)")
    p.add_argument("--draft-quant", default="int4", help="the draft model's quantization (default int4)")
    p.add_argument("--draft-target-quant", default="none", help="the target's quantization there (default none)")
    p.add_argument("--draft-prompts", type=int, default=3, help="prompts of each set there (default 3)")
    p.add_argument("--draft-only", action="store_true", help="run the draft comparison alone")
    p.add_argument("--draft-out", default=os.path.join(ROOT, "results", "bench_speculation_draft.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_speculation.json"))
    p.add_argument("--plot", default=None, help="the sweep's plot (default: --out with .png, beside the record)")
    return p.parse_args(argv)


class Ring:
    """A starter engine in this process and its workers, opened once: prompts run one after
    another, each a fresh sample with its own speculation setting and drafter."""

    def __init__(self, model: str, workers: List[Any], kernel: str, n_slots: int, max_len: int,
                 quant: str = "auto", speculation: Any = "ngram", layers: Optional[str] = None,
                 device: str = "cpu", dtype: Optional[str] = None, threads: Optional[int] = 1,
                 worker_weights: Optional[str] = None, backend: Optional[str] = None) -> None:
        """`worker_weights`: the model's path as the workers read it themselves (their
        --models-dir), so no weights are sent; `threads` None: torch's default per node;
        `backend` None: runtime.backend's default ($MDI_BACKEND, else auto)."""
        from mdi.model.sampling import SamplingParams
        from mdi.model.source import ModelSource
        from mdi.runconfig import parse_config
        from mdi.starter.engine import Engine
        from mdi.starter.planning.run_plan import plan_run
        from mdi.starter.planning.run_shape import RunShape
        nodes = [{"name": "starter", "port": 1}] + [w.node(weights=worker_weights) for w in workers]
        if layers and layers != "even" and workers:
            counts = [layers] * len(nodes) if layers == "auto" else [int(c) for c in layers.split(",")]
            nodes = [dict(n, layers=c) for n, c in zip(nodes, counts)]
        runtime = {"quant_kernel": kernel, "prefix_cache": 0}  # type: Dict[str, Any]
        if threads is not None:
            runtime["threads"] = threads
        if backend is not None:
            runtime["backend"] = backend
        spec_model = {"path": model, "quant": quant, "device": device}  # type: Dict[str, Any]
        if dtype is not None:
            spec_model["dtype"] = dtype
        cfg = parse_config({"model": spec_model, "nodes": nodes,
                            "generation": {"temperature": 0, "speculation": speculation},
                            # prefix_cache 0: each prompt runs cold in every mode (a cached prefix would
                            # give the later mode's prompt other prefill passes, and so other bits)
                            "runtime": runtime}, "bench_speculation")
        self.source = ModelSource(model)
        params = SamplingParams(0.0)
        plan = plan_run(cfg, self.source, RunShape(n_slots, max_len), params)
        self.engine = Engine(plan, self.source, params)
        self.engine.open()

    def generate(self, prompts: List[List[int]], n_tokens: int, spec: Any,
                 factory: Optional[Callable] = None) -> List[Any]:
        from mdi.model.sampling import sample_generator
        from mdi.starter.sample import Sample
        from mdi.starter.speculation import SpecCounters
        self.engine.pipeline.drafter_factory = factory
        self.engine.pipeline.spec_counters = SpecCounters()  # this call's counters only
        samples = [Sample(i, "", list(ids), n_tokens, sample_generator(1, i), speculation=spec)
                   for i, ids in enumerate(prompts)]
        self.engine.run(samples)
        return samples

    def node_backends(self) -> Dict[str, Optional[str]]:
        from mdi.starter.node_report import node_backends
        return node_backends(self.engine)

    def close(self) -> None:
        self.engine.close()


def decode_speed(samples: List[Any]) -> float:
    """Aggregate decode tokens/s of samples that ran together (prefill left out)."""
    t0 = min(s.token_times[0] for s in samples)
    t1 = max(s.token_times[-1] for s in samples)
    return sum(len(s.token_ids) - 1 for s in samples) / (t1 - t0)


def modes() -> Dict[str, Any]:
    from mdi.runconfig import SpeculationSpec
    return {"plain": SpeculationSpec("off"), "ngram": SpeculationSpec("ngram"),
            "ngram_nofill": SpeculationSpec("ngram", fill=False)}


def draft_modes() -> Dict[str, Any]:
    from mdi.runconfig import SpeculationSpec
    return {"plain": SpeculationSpec("off"), "ngram": SpeculationSpec("ngram"),
            "draft": SpeculationSpec("draft")}  # the ring's loaded draft model


def run_prompts(ring: Ring, sets: Dict[str, List[List[int]]], n_tokens: int,
                which: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Each prompt of each set in every mode, alternating modes prompt by prompt."""
    out: Dict[str, Any] = {}
    which = which or modes()
    for name, prompts in sets.items():
        per: Dict[str, List[float]] = {m: [] for m in which}
        spec_stats: Dict[str, List[Dict[str, Any]]] = {m: [] for m in which}
        for ids in prompts:
            reference = None
            for mode, spec in which.items():
                (sample,) = ring.generate([ids], n_tokens, spec)
                if reference is None:
                    reference = sample.token_ids
                elif sample.token_ids != reference:
                    raise SystemExit("speculation changed the tokens (%s, %s set)" % (mode, name))
                per[mode].append(decode_timing(sample.token_times)["tokens_per_s"])
                spec_stats[mode].append(ring.engine.pipeline.spec_counters.metrics())
        out[name] = {m: {"tokens_per_s": summarize(v),
                         "vs_plain": summarize([a / b for a, b in zip(v, per["plain"])]),
                         "acceptance": [s["acceptance_rate"] for s in spec_stats[m]],
                         "accepted_per_pass": [s["accepted_per_pass"] for s in spec_stats[m]]}
                     for m, v in per.items()}
        print_table("%s prompts (decode tokens/s, median [min, max] of %d)" % (name, len(prompts)),
                    ["mode", "tokens/s", "x plain ring"],
                    [[m, fmt_stat(r["tokens_per_s"]), fmt_stat(r["vs_plain"], "%.2f")] for m, r in out[name].items()])
    return out


def sweep(ring: Ring, prompts: List[List[int]], n_tokens: int, agrees: List[float]) -> Dict[str, Any]:
    from mdi.lab.oracle_drafter import OracleDrafter
    from mdi.runconfig import SpeculationSpec
    out: Dict[str, Any] = {}
    for a in agrees:
        row: Dict[str, List[float]] = {"plain": [], "fill": [], "nofill": []}
        for ids in prompts:
            (plain,) = ring.generate([ids], n_tokens, SpeculationSpec("off"))
            row["plain"].append(decode_timing(plain.token_times)["tokens_per_s"])
            for mode, fill in (("fill", True), ("nofill", False)):
                def factory(s, ref=plain.token_ids):
                    return OracleDrafter(s.prompt_ids + s.token_ids, len(s.prompt_ids), ref, a, seed=7)
                (sample,) = ring.generate([ids], n_tokens, SpeculationSpec("ngram", fill=fill), factory)
                assert sample.token_ids == plain.token_ids
                row[mode].append(decode_timing(sample.token_times)["tokens_per_s"])
        out[str(a)] = {m: summarize(v) for m, v in row.items()}
        out[str(a)].update({"%s_vs_plain" % m: summarize([x / p for x, p in zip(row[m], row["plain"])])
                            for m in ("fill", "nofill")})
        print("a=%.1f: plain %s, verify only %s (x%.2f), filling %s (x%.2f)" % (
            a, fmt_stat(out[str(a)]["plain"]), fmt_stat(out[str(a)]["nofill"]), out[str(a)]["nofill_vs_plain"]["median"],
            fmt_stat(out[str(a)]["fill"]), out[str(a)]["fill_vs_plain"]["median"]))
    return out


def theory(a: float, max_draft: int, costs: Any, stages: int) -> Dict[str, float]:
    """Speed-up over the plain ring by the models the policy runs on (mdi.starter.speculation:
    each draft accepted with probability a independently, a pass of 1 + k rows costing what the
    starter measured, `costs`: a PassCosts), at the best k: verification alone, and the ring filled
    (at its best depth)."""
    from mdi.starter.speculation import best_fill, best_verify
    return {"verify": best_verify(a, costs, max_draft)[1], "fill": best_fill(a, costs, max_draft, stages)[2]}


def setup_run(args, setup: str, sets: Dict[str, List[List[int]]], log_dir: str) -> Dict[str, Any]:
    n_slots = max(args.batch, 1)
    longest = max(len(ids) for p in sets.values() for ids in p)
    max_len = longest + args.tokens + 8
    cgroups = None
    if setup == "emulated":  # main() skipped it where cgroups cannot be used
        cgroups = node_cgroups("mdi_bench_spec", args.board_cores, 3, args.board_period_us)
        if cgroups is not None:  # None: --board-cores 0
            cgroups.join("starter")
    workers: List[Any] = []
    record: Dict[str, Any] = {"board_cores": args.board_cores if cgroups else None,
                              "board_period_us": quota_and_period(args.board_cores, args.board_period_us)[1] if cgroups else None}
    try:
        alone = Ring(args.model, [], args.kernel, n_slots, max_len, backend=args.backend)
        record["one_board_backends"] = alone.node_backends()
        record["one_board"] = {name: summarize([decode_timing(alone.generate([ids], args.tokens,
                                                                              modes()["plain"])[0].token_times)
                                                ["tokens_per_s"] for ids in prompts])
                               for name, prompts in sets.items()}
        alone.close()
        for i in range(2):
            workers.append(WorkerProcess("board%d" % (i + 1), 1, log_dir,
                                         cgroups.preexec("board%d" % (i + 1)) if cgroups else None))
        for w in workers:
            w.wait_healthy(90)
        ring = Ring(args.model, workers, args.kernel, n_slots, max_len, layers=args.layers, backend=args.backend)
        record["node_backends"] = ring.node_backends()
        costs = ring.engine.pipeline.pass_costs
        record["pass_costs"] = costs.to_json()
        record["ranges"] = ring.engine.ranges
        print("\n== %s: 3 nodes%s; passes of 1, 2, .. rows cost %s one-row passes on the starter"
              % (setup, ", %.2f core each" % args.board_cores if cgroups else " x 1 thread", record["pass_costs"]))
        record["prompts"] = run_prompts(ring, sets, args.tokens)
        for name in sets:
            ring_ngram = record["prompts"][name]["ngram"]["tokens_per_s"]["median"]
            record["prompts"][name]["ngram_vs_one_board"] = ring_ngram / record["one_board"][name]["median"]
            print("%s: ngram ring / one board alone (plain): %.2f" % (name, record["prompts"][name]["ngram_vs_one_board"]))
        agrees = [float(a) for a in args.sweep.split(",") if a]
        if agrees:
            record["sweep"] = sweep(ring, sets["free"][:args.sweep_prompts], args.tokens, agrees)
            record["theory"] = {str(a): theory(a, 8, costs, 3) for a in agrees}
        if args.batch:
            both = {}
            prompts = [sets["copy"][i % len(sets["copy"])] for i in range(args.batch)]
            for mode in ("plain", "ngram", "plain", "ngram"):
                both.setdefault(mode, []).append(decode_speed(ring.generate(prompts, args.tokens, modes()[mode])))
            record["batch"] = {"samples": args.batch, **{m: summarize(v) for m, v in both.items()},
                               "ngram_vs_plain": summarize([n / p for n, p in zip(both["ngram"], both["plain"])])}
            print("S=%d: plain %s, ngram %s tokens/s (x%.2f)" % (args.batch, fmt_stat(record["batch"]["plain"]),
                  fmt_stat(record["batch"]["ngram"]), record["batch"]["ngram_vs_plain"]["median"]))
        ring.close()
    finally:
        stop_workers(workers, cgroups)
    return record


def draft_run(args, sets: Dict[str, List[List[int]]], log_dir: str) -> Dict[str, Any]:
    """The draft model's comparison: one node alone, then the ring of 3 (loopback, 1 thread
    each), S = 1, plain vs ngram vs draft alternating prompt by prompt."""
    import torch
    spec = {"draft": args.draft_model, "quant": args.draft_quant}
    longest = max(len(ids) for p in sets.values() for ids in p)
    max_len = longest + args.tokens + 8
    record: Dict[str, Any] = {"target_quant": args.draft_target_quant, "draft": args.draft_model,
                              "draft_quant": args.draft_quant, "isa": torch.backends.cpu.get_cpu_capability()}
    workers: List[Any] = []
    try:
        for setup, n_workers in (("one_node", 0), ("ring3", 2)):
            while len(workers) < n_workers:
                workers.append(WorkerProcess("board%d" % (len(workers) + 1), 1, log_dir, None))
                workers[-1].wait_healthy(90)
            ring = Ring(args.model, workers, args.kernel, 1, max_len, args.draft_target_quant, spec,
                        backend=args.backend)
            costs = ring.engine.pipeline.pass_costs.to_json()
            print("\n== draft model, %s: target %s, draft %s %s; passes of 1, 2, .. rows cost %s one-row passes"
                  % (setup, args.draft_target_quant, args.draft_model, args.draft_quant, costs))
            record[setup] = {"pass_costs": costs, "node_backends": ring.node_backends(),
                             "prompts": run_prompts(ring, sets, args.tokens, draft_modes())}
            ring.close()
    finally:
        stop_workers(workers, None)
    return record


def encode_sets(model: str, path: str, n: int) -> Dict[str, List[List[int]]]:
    from mdi.model.source import ModelSource
    from mdi.serving.prompts import ChatTemplate
    with open(path) as f:
        raw = json.load(f)
    tok = ModelSource(model).tokenizer
    template = ChatTemplate(tok)
    return {name: [tok.encode(template.render([{"role": "user", "content": p}])) for p in raw[name][:n]]
            for name in ("copy", "free")}


def plot(record: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for setup, rec in record["setups"].items():
        if "sweep" not in rec:
            continue
        agrees = sorted(float(a) for a in rec["sweep"])
        for mode, style in (("fill", "-o"), ("nofill", "-s")):
            ax.plot(agrees, [rec["sweep"][str(a)]["%s_vs_plain" % mode]["median"] for a in agrees], style,
                    label="%s, %s" % (setup, "filling" if mode == "fill" else "verify only"))
        for mode, style in (("fill", "--"), ("verify", ":")):
            ax.plot(agrees, [rec["theory"][str(a)][mode] for a in agrees], style,
                    label="%s, model: %s" % (setup, "filling" if mode == "fill" else "verify only"))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("drafter agreement a")
    ax.set_ylabel("decode tokens/s vs plain ring (S = 1)")
    ax.set_title("SmolLM2-135M int4, ring of 3, speculative decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("plot written to %s" % path)


def main(argv=None) -> int:
    args = parse_args(argv)
    import tempfile
    info = machine_info(1)
    sets = encode_sets(args.model, args.prompts, args.n_prompts)
    backend = args.backend or default_backend()  # what the runs asked for; node_backends: what each chose
    record: Dict[str, Any] = {"machine": info, "model": args.model, "tokens": args.tokens, "kernel": args.kernel,
                              "backend": backend,
                              "prompts": {k: len(v) for k, v in sets.items()}, "setups": {}}
    log_dir = tempfile.mkdtemp(prefix="mdi-bench-spec-")
    if args.draft_model:
        small = {k: v[:args.draft_prompts] for k, v in sets.items()}
        draft_record = {"machine": info, "model": args.model, "tokens": args.tokens, "kernel": args.kernel,
                        "backend": backend,
                        "prompts": {k: len(v) for k, v in small.items()}, **draft_run(args, small, log_dir)}
        finish_machine_info(info)
        print(note_load(info))
        save_record(args.draft_out, draft_record)
        if args.draft_only:
            return 0
    for setup in args.setups.split(","):
        why = cgroup_unavailable_reason() if setup == "emulated" else None
        if why:
            print("emulated boards skipped: %s" % why)
            record["setups"][setup] = {"skipped": why}
            continue
        started = time.time()
        record["setups"][setup] = setup_run(args, setup, sets, log_dir)
        record["setups"][setup]["seconds"] = round(time.time() - started, 1)
    finish_machine_info(info)
    print(note_load(info))
    save_record(args.out, record)
    if any("sweep" in r for r in record["setups"].values()):  # beside its own record, never over another's plot
        plot(record, args.plot or os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
