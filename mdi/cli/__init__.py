"""Command-line entry points, one module per program: start (mdi-start), worker (mdi-worker),
prepare (mdi-prepare), plan (mdi-plan) and train (mdi-train); mdi-bench is mdi.lab.cli. What
they share: process (logging, threads, exit codes, the one-line error), arguments (argument
types, the quantization and kernel flags), progress (the terminal's progress line) and output
(what a finished run prints).

User errors (bad YAML, missing files, wrong partitions, unreachable nodes) print one line
starting with "mdi: error:" and exit non-zero (2 for configuration errors); no tracebacks.
"""
# The console scripts name these (setup.py: `mdi-start=mdi.cli:start_main`, ...), and so do the
# scripts pip already wrote into installed environments (`from mdi.cli import start_main`):
# keeping the four mains here keeps both working without reinstalling anything.
from mdi.cli.plan import plan_main
from mdi.cli.prepare import prepare_main
from mdi.cli.start import start_main
from mdi.cli.train import train_main
from mdi.cli.worker import worker_main

__all__ = ["plan_main", "prepare_main", "start_main", "train_main", "worker_main"]
