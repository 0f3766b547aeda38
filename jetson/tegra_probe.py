#!/usr/bin/env python3
"""Memory and power probe for Jetson boards: runs `tegrastats` and prints one JSON object per
line (RAM/SWAP in MB, per-rail power in mW, GPU load, temperatures), parsed by mdi.system.tegra.

NVML does not work on Jetson, so this is where power and GPU figures come from. tegrastats'
RAM figure is system-wide and already includes GPU allocations (unified memory).

    python3 jetson/tegra_probe.py --interval 500 --out run-power.jsonl   # until Ctrl-C
    python3 jetson/tegra_probe.py --once                                # one sample
    python3 jetson/tegra_probe.py --file captured.log --summary         # replay a capture
"""
import argparse
import itertools
import json
import os
import sys
import time

try:
    from mdi.system import tegra
except ImportError:  # run from a checkout without mdi installed: mdi.system.tegra needs only the stdlib
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mdi.system import tegra


class Summary:
    """Peak RAM/SWAP and mean/peak input power over the lines seen."""

    def __init__(self) -> None:
        self.n, self.ram, self.swap, self.power = 0, 0, 0, []

    def add(self, rec: dict) -> None:
        self.n += 1
        self.ram = max(self.ram, rec["ram_used_mb"])
        self.swap = max(self.swap, rec.get("swap_used_mb", 0))
        if "input_power_mw" in rec:
            self.power.append(rec["input_power_mw"])

    def record(self) -> dict:
        out = {"samples": self.n, "ram_used_mb_max": self.ram, "swap_used_mb_max": self.swap}
        if self.power:
            out["input_power_mw_mean"] = round(sum(self.power) / len(self.power), 1)
            out["input_power_mw_max"] = max(self.power)
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--interval", type=int, default=1000, metavar="MS",
                   help="tegrastats sampling interval in milliseconds (default 1000)")
    p.add_argument("--once", action="store_true", help="print the first sample and stop")
    p.add_argument("--file", metavar="LOG", help="parse a captured tegrastats log instead of running tegrastats")
    p.add_argument("--out", metavar="FILE.jsonl", help="also append the JSON lines to this file")
    p.add_argument("--summary", action="store_true",
                   help="print only a final summary (peak RAM/SWAP, mean and peak input power)")
    p.add_argument("--tegrastats", default="tegrastats", help="the tegrastats command (default: on PATH)")
    args = p.parse_args(argv)

    stream = None  # the running tegrastats, stopped in `finally`
    if args.file:
        try:
            lines = open(args.file, encoding="utf-8", errors="replace")
        except OSError as e:
            print("tegra_probe: error: cannot read %s: %s" % (args.file, e.strerror), file=sys.stderr)
            return 2
    else:
        if not tegra.is_jetson():
            print("tegra_probe: warning: this does not look like a Jetson", file=sys.stderr)
        stream = tegra.run_tegrastats(args.interval, args.tegrastats)
        try:
            first = next(stream, None)  # a missing tegrastats fails here, not mid-stream
        except OSError as e:
            print("tegra_probe: error: cannot run %s: %s (off the board, replay a capture with --file LOG)"
                  % (args.tegrastats, e.strerror or e), file=sys.stderr)
            return 2
        lines = itertools.chain([first] if first is not None else [], stream)

    out = open(args.out, "a", encoding="utf-8") if args.out else None
    summary = Summary()
    try:
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = tegra.parse_tegrastats(line)
            except ValueError as e:
                print("tegra_probe: skipped: %s" % e, file=sys.stderr)
                continue
            if not args.file:
                rec["t"] = round(time.time(), 3)
            summary.add(rec)
            text = json.dumps(rec, sort_keys=True)
            if not args.summary:
                print(text, flush=True)
            if out:
                out.write(text + "\n")
                out.flush()
            if args.once:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if stream is not None:
            stream.close()  # terminates tegrastats
        else:
            lines.close()
        if out:
            out.close()
    if summary.n == 0:
        print("tegra_probe: error: no tegrastats line parsed", file=sys.stderr)
        return 1
    if args.summary:
        print(json.dumps(summary.record(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
