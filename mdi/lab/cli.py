"""mdi-bench: which partition of which model over how many boards gives what throughput and memory.

An experiment YAML lists models, node counts, partitions, samples in flight, tokens, dtype,
repeats and the board emulation (see configs/experiments/ and results/README.md). For every
combination mdi-bench starts the node processes itself, runs the starter, keeps each run's
metrics JSON, and writes one CSV row per run, a summary with the pipeline efficiency, a short
report, the machine and emulation record, and PNG plots, all in one output folder.

The parts live in mdi/lab/: spec (the YAML), model_setup, processes and nodes (a ring's processes),
emulation (with cgroups, netns, delay_proxy), sweep (running it all), report (CSV, summary,
report.md) and plots.
"""
import argparse
import os
import sys
from typing import Callable, List, Optional

from mdi.lab.emulation import EmulationError
from mdi.model.backend import BACKENDS, default_backend
from mdi.lab.nodes import read_json, serve_starter
from mdi.cli.arguments import ArgumentParser
from mdi.cli.process import EXIT_CONFIG, interrupt_on_sigterm  # mdi-bench exits like mdi-start
from mdi.lab.spec import Experiment, ExperimentError, load_experiment
from mdi.lab.sweep import cleanup_stale, dry_run, finish_outputs, run_experiment
from mdi.system.files import output_problem


# --------------------------------------------------------------------------- CLI

def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mdi-bench",
        description="Run an experiment sweep (models x node counts x partitions x samples in flight x repeats): "
                    "start the node processes, run the starter, and write results.csv (one row per run), "
                    "summary.csv, report.md, machine.json and PNG plots into the output folder. Board "
                    "emulation (CPU quota, memory limit, network namespaces with shaping and delay) is used "
                    "when available (root) and reported; otherwise plain loopback, and it says so.",
        epilog="Example: mdi-bench --experiment configs/experiments/boards.yaml   (see results/README.md)")
    p.add_argument("--experiment", metavar="FILE.yaml", action="append", default=[],
                   help="the experiment to run (see configs/experiments/); give several to run them in turn")
    p.add_argument("--out", metavar="DIR", help="output folder (default: the file's 'output', else results/NAME); "
                                                "only with a single --experiment")
    p.add_argument("--emulation", choices=["auto", "on", "off"],
                   help="override emulation.enabled (default: the file's, else auto): auto uses what works, on "
                        "fails if a part cannot be set up, off runs plain loopback")
    p.add_argument("--repeats", type=int, help="override the number of repeats (default: the file's, else 3)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="override every model's backend (runtime.backend; default: the file's, else $MDI_BACKEND, "
                        "else auto, which measures both where both can serve); the `backends` column says what each "
                        "node used")
    p.add_argument("--dry-run", action="store_true",
                   help="check the file and list the runs; writes nothing (random models are built by the real run)")
    p.add_argument("--plot-only", action="store_true",
                   help="no runs: rebuild summary.csv, report.md and the PNGs from the results.csv in the "
                        "experiment's output folder (--out DIR overrides it; --experiment is still needed)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove processes, namespaces and cgroups left by a killed mdi-bench, then exit")
    p.add_argument("--serve-starter", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.serve_starter:
        return serve_starter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.cleanup:
        return cleanup_stale(log)
    if not args.experiment:
        return _fail("give --experiment FILE.yaml (see mdi-bench --help)", EXIT_CONFIG)
    try:
        if args.out and len(args.experiment) > 1:
            raise ExperimentError("--out: give it with a single --experiment (each file names its 'output')")
        experiments = [_with_overrides(load_experiment(path), args) for path in args.experiment]
        for exp in experiments if not (args.plot_only or args.dry_run) else []:
            problem = output_problem(args.out or exp.output, folder=True)
            if problem is not None:  # before any run: a traceback after the first one had lost it
                raise ExperimentError("%s %s: %s" % ("--out" if args.out else "%s: output" % exp.source,
                                                     args.out or exp.output, problem))
        interrupt_on_sigterm(lambda signum: KeyboardInterrupt(), also_sighup=True)  # torn down as on Ctrl-C
        code = 0
        for exp in experiments:  # all files are checked before the first one runs
            code = max(code, _one_experiment(exp, args.out or exp.output, args, log))
            if code == 130:
                break
        return code
    except ExperimentError as e:
        return _fail(str(e), EXIT_CONFIG)
    except EmulationError as e:
        return _fail(str(e), EXIT_CONFIG)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _with_overrides(exp: Experiment, args: argparse.Namespace) -> Experiment:
    if args.repeats is not None:
        if args.repeats < 1:
            raise ExperimentError("--repeats: expected a positive integer")
        exp.repeats = args.repeats
    if args.emulation:
        exp.emulation.mode = args.emulation
    if args.backend:
        for model in exp.models:
            model.backend = args.backend
    try:
        default_backend()  # the runs' default where a model names none: a typo in $MDI_BACKEND said now
    except ValueError as e:
        raise ExperimentError(str(e))
    return exp


def _one_experiment(exp: Experiment, out: str, args: argparse.Namespace, log: Callable[[str], None]) -> int:
    if args.plot_only:
        if not os.path.isfile(os.path.join(out, "results.csv")):
            raise ExperimentError("%s: no results.csv to plot" % out)
        finish_outputs(out, read_json(os.path.join(out, "machine.json")) or {}, log)
        return 0
    if args.dry_run:
        return dry_run(exp, log)
    log("mdi-bench: experiment %s -> %s" % (exp.source, out))
    return run_experiment(exp, out, log)


def _fail(message: str, code: int) -> int:
    print("mdi-bench: error: %s" % message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
