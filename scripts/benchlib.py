"""Helpers shared by the benchmark scripts (bench_standalone.py, bench_ring.py, the serving ones).

Statistics (median + spread of repeats), per-token timing from `token_times`, plain-text
tables, the JSON record, machine context, cgroup v1 CPU quotas and worker processes.
Python 3.8 compatible; imports only the standard library at module level.
"""
import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "smollm2-135m")
DEFAULT_PROMPT = "Once upon a time"  # SmolLM2-135M writes > 100 tokens without EOS (greedy)
BIN = os.path.dirname(sys.executable)

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# --------------------------------------------------------------------------- arguments

def positive_ints(text: str) -> List[int]:
    """An argparse type: "1,2,6" -> [1, 2, 6]; anything else one line from argparse."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers separated by commas (e.g. 1,2), got %r" % text)
    return values


# --------------------------------------------------------------------------- statistics

def summarize(values: Sequence[float]) -> Dict[str, Any]:
    """Median, min and max of repeats, plus the raw values."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals), "values": vals}


def fmt_stat(s: Dict[str, Any], fmt: str = "%.1f", scale: float = 1.0) -> str:
    """'median [min, max]' of a summarize() record."""
    if s["median"] is None:
        return "n/a"
    return "%s [%s, %s]" % (fmt % (s["median"] * scale), fmt % (s["min"] * scale), fmt % (s["max"] * scale))


def decode_timing(token_times: Sequence[float]) -> Dict[str, float]:
    """Decode-only timing of one sample: prefill (the first token) is excluded.

    mean_s: (t_last - t_first) / (n - 1), the plain decode rate's inverse.
    median_s: median gap between consecutive tokens (robust to a neighbour's CPU burst).
    """
    t = list(token_times)
    if len(t) < 2:
        raise ValueError("need at least 2 tokens to time decoding, got %d" % len(t))
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = (t[-1] - t[0]) / (len(t) - 1)
    return {"first_token_s": t[0], "mean_s": mean, "median_s": statistics.median(gaps),
            "tokens_per_s": 1.0 / mean, "n_gaps": len(gaps)}


def node_backends(result: Any) -> Dict[str, Optional[str]]:
    """What each node of a finished run (mdi.starter.batch's RunResult) computed with, by name."""
    return {n.name: n.backend for n in result.nodes}


# --------------------------------------------------------------------------- output

def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    print("\n" + title)
    print(line)
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print(line)
    print(line, flush=True)


def save_record(path: str, record: Dict[str, Any]) -> None:
    from mdi.system.files import write_json
    write_json(path, record)
    print("\nraw numbers written to %s" % path)


def machine_info(threads: int) -> Dict[str, Any]:
    import torch
    from mdi.system.cpu import cpu_info
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "threads_per_process": threads,
            "loadavg_start": list(os.getloadavg()), "machine": platform.machine(),
            "cpu": cpu_info(),  # the ISA decides which kernels win: a figure holds for this CPU
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import mdi
        from mdi.lab.report import code_revision
        info["mdi"] = mdi.__version__
        info.update(code_revision())  # the commit that measured: a figure holds for this code
    except (ImportError, AttributeError):
        pass
    return info


def finish_machine_info(info: Dict[str, Any]) -> None:
    info["loadavg_end"] = list(os.getloadavg())


def note_load(info: Dict[str, Any]) -> str:
    return ("machine: %s CPUs, load average %.2f at start, %.2f at end (other tenants' work counts "
            "too: this box is shared)" % (info["cpu_count"], info["loadavg_start"][0],
                                           info.get("loadavg_end", os.getloadavg())[0]))


# --------------------------------------------------------------------------- mdi models and configs

def load_mdi(path: str):
    """The whole model as one chunk (embedding + all blocks + head), and the tokenizer."""
    import torch
    from mdi.model.source import ModelSource, build_chunk
    source = ModelSource(path)
    n = source.config.n_layer
    weights = source.weights(0, n, True, True, torch.float32)
    chunk = build_chunk(source.config, weights, 0, n, True, True, torch.float32, "cpu")
    return source, chunk


# Processes are started, health-checked and stopped as mdi-bench does (mdi/lab/processes.py).
from mdi.lab.processes import NodeProcess, free_ports, post_shutdown, wait_healthy  # noqa: E402,F401
from mdi.lab.processes import WorkerProcess as _Worker  # noqa: E402


def ports_besides(workers: Sequence["WorkerProcess"], n: int = 1) -> List[int]:
    """n free loopback ports that no worker was given: a worker's data port is chosen when it
    starts but bound only at /init, so the OS may still offer it."""
    taken = {p for w in workers for p in (w.port, w.data_port)}
    return [p for p in free_ports(len(taken) + n) if p not in taken][:n]


def run_config_dict(model: str, nodes: List[Dict[str, Any]], n_tokens: int, threads: int,
                    temperature: float = 0.0) -> Dict[str, Any]:
    """A RunConfig as a YAML-like dict (for mdi.runconfig.parse_config)."""
    return {"model": {"path": model, "dtype": "float32", "device": "cpu"},
            "nodes": nodes,
            "generation": {"n_tokens": n_tokens, "temperature": temperature, "seed": 1},
            "runtime": {"threads": threads}}


# --------------------------------------------------------------------------- cgroup v1

# CPU quota groups live in mdi/lab/cgroups.py (used by mdi-bench too); the scripts import them from here.
from mdi.lab.cgroups import CpuCgroups, cgroup_unavailable_reason  # noqa: E402,F401


# --------------------------------------------------------------------------- workers

def stop_workers(workers: Sequence["WorkerProcess"], cgroups: Optional["CpuCgroups"] = None) -> None:
    """Stop a benchmark's workers, then remove its CPU groups (they must be empty first),
    warning about any group that stays."""
    for w in workers:
        w.stop()
    if cgroups is not None:
        for problem in cgroups.cleanup():
            print("warning: %s" % problem, file=sys.stderr)


def node_cgroups(name: str, quota: float, nodes: int, period_us: int = 10000) -> Optional["CpuCgroups"]:
    """CPU groups "starter", "board1".. of `quota` cores each (CFS period `period_us`, lengthened
    where the kernel needs: mdi.lab.cgroups.quota_and_period), or None with --quota 0 or where
    cgroup v1 is missing (said on stderr, with the quota that holds)."""
    why = cgroup_unavailable_reason() if quota > 0 else "--quota 0"
    cgroups = None
    if why is None:
        cgroups = CpuCgroups(name)
        for node in ["starter"] + ["board%d" % i for i in range(1, nodes)]:
            cgroups.create(node)
            cgroups.set_quota(node, quota, period_us)
    print("CPU quota: %s" % ("%.2f core per node" % quota if cgroups else "none (%s)" % why), file=sys.stderr)
    return cgroups


def stop_serving(server: Any, workers: Sequence["WorkerProcess"], cgroups: Optional["CpuCgroups"] = None) -> None:
    """Stop a benchmark's `mdi-start --serve` (a NodeProcess, or None: it never started; SIGTERM
    first, so it ends its run cleanly), then its workers and CPU groups."""
    if server is not None and server.alive():
        server.proc.terminate()
        server.stop(grace=60.0)
    stop_workers(workers, cgroups)


def stream_completion(url: str, prompt: str, tokens: int) -> Tuple[str, float]:
    """(text, seconds per token after the first) of one streamed greedy /v1/completions request
    to a serving starter at `url` (a streamed error event raises)."""
    import json
    import requests
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    parts, times = [], []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=(10, 600)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError("the measured request failed: %s" % event["error"]["message"])
                text = event["choices"][0]["text"]
                if text:
                    parts.append(text)
                    times.append(time.monotonic())
    if len(times) < 2:
        raise RuntimeError("too few tokens streamed")
    return "".join(parts), (times[-1] - times[0]) / (len(times) - 1)


class WorkerProcess(_Worker):
    """One `mdi-worker --threads N` subprocess on free loopback ports (its data port chosen
    too), its log in log_dir/NAME.log, optionally in a cgroup (`preexec` joins it)."""

    def __init__(self, name: str, threads: int, log_dir: str,
                 preexec: Optional[Callable[[], None]] = None) -> None:
        port, data_port = free_ports(2)
        super().__init__(port, os.path.join(log_dir, "%s.log" % name), name, threads=threads,
                         env=dict(os.environ), data_port=data_port, preexec=preexec)

    def wait_healthy(self, timeout: float) -> None:
        self.wait_ready(timeout)
