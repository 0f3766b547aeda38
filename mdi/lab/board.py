"""One command run as one emulated board: the cgroup v1 CPU quota and memory limit that
mdi-bench gives each node, then how the command ended (its exit status; whether the kernel's
OOM killer ended it) and its memory peak.

    python -m mdi.lab.board --memory-mb 2560 [--cpu-quota 0.5] -- mdi-start --model DIR --check

A refusal (mdi-start's own error, exit code 1 or 2) and an out-of-memory kill (signal 9, the
group's oom_kill count) are told apart. Needs root.
"""
import argparse
import os
import signal
import subprocess
import sys
from typing import Any, Dict, List, Optional

from mdi.lab.commands import EmulationError
from mdi.lab.emulation import Emulation, EmulationSettings

MB = 1024 * 1024
KEY = "board"


def _oom_kills(emu: Emulation) -> Optional[int]:
    """The group's `oom_kill` count (memory.oom_control), None where the kernel has none."""
    if emu.memory is None:
        return None
    try:
        with open(os.path.join(emu.memory.path(KEY), "memory.oom_control")) as f:
            fields = dict(line.split() for line in f if len(line.split()) == 2)
        return int(fields["oom_kill"]) if "oom_kill" in fields else None
    except (OSError, ValueError):
        return None


def run_board(cmd: List[str], memory_mb: int, cpu_quota: Optional[float] = None,
              cpu_period_us: int = 10000) -> Dict[str, Any]:
    """Run `cmd` in one board's cgroups; {"code", "oom_kills", "peak_bytes", "limit_bytes"}."""
    emu = Emulation(EmulationSettings(mode="on", cpu_quota=cpu_quota, cpu_period_us=cpu_period_us,
                                      memory_limit_mb=memory_mb), 1, log=lambda m: None)
    emu.start()
    try:
        emu.prepare_process(KEY)
        emu.limit_cpu(KEY, True)
        proc = subprocess.Popen(emu.command(cmd, KEY, 0))
        # SIGTERM or SIGHUP to the board goes to its command, which ends, then the cgroup goes:
        # the command had run on, orphaned in its limits, and the cgroup stayed behind
        forwarded = {s: signal.signal(s, lambda signum, _: proc.send_signal(signum))
                     for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C to the board alone, say: its command ends before the cgroup goes
            proc.kill()
            proc.wait()
            raise
        finally:
            for s, handler in forwarded.items():
                signal.signal(s, handler)
        return {"code": code, "oom_kills": _oom_kills(emu), "peak_bytes": emu.memory_peak(KEY),
                "limit_bytes": memory_mb * MB}
    finally:
        emu.release_process(KEY)
        emu.close()


def describe(result: Dict[str, Any]) -> str:
    code = result["code"]
    how = "exit code %d" % code if code >= 0 else "killed by signal %d" % -code
    if result["oom_kills"]:
        how += " (the kernel's OOM killer: %d kill(s) in the board's cgroup)" % result["oom_kills"]
    peak = result["peak_bytes"]
    return "board: %s; peak memory %s of the board's %.0f MB (cgroup, page cache included)" % (
        how, "%.0f MB" % (peak / MB) if peak is not None else "unknown", result["limit_bytes"] / MB)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mdi.lab.board", description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-mb", type=int, required=True, help="the board's memory (cgroup v1 limit)")
    p.add_argument("--cpu-quota", type=float, help="cores (cgroup v1 CPU quota); default: no limit")
    p.add_argument("--cpu-period-us", type=int, default=10000)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the command after --")
    try:
        result = run_board(cmd, args.memory_mb, args.cpu_quota, args.cpu_period_us)
    except EmulationError as e:
        print("board: error: %s" % e, file=sys.stderr)
        return 2
    print(describe(result), file=sys.stderr)
    code = int(result["code"])
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
