"""The processes of one ring under test: workers and a warm starter, started inside the
board emulation, configured once and run again and again."""
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from mdi.lab.cgroups import peak_rss_bytes, reset_peak_rss
from mdi.lab.emulation import Emulation
from mdi.lab.processes import NodeProcess, WorkerProcess, free_ports, tool
from mdi.cli.process import EXIT_CONFIG, EXIT_RUN
from mdi.lab.spec import Experiment, RingPlan


# The warm starter's command line; `mdi-bench --cleanup` recognises its leftovers by it.
STARTER_SERVICE_MODULE = "mdi.lab.cli"
STARTER_SERVICE_CMD = [sys.executable, "-m", STARTER_SERVICE_MODULE, "--serve-starter"]


# --------------------------------------------------------------------------- the warm starter

class StarterService:
    """A warm starter: `python -m mdi.lab.cli --serve-starter` runs mdi-start's own main
    once per request, so torch's import and process start are paid once per ring."""

    def __init__(self, proc: NodeProcess) -> None:
        self.proc = proc
        stdin, stdout = proc.proc.stdin, proc.proc.stdout
        assert stdin is not None and stdout is not None  # started with pipes=True (Ring's starter)
        self.stdin, self.stdout = stdin, stdout
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.stdout:
            try:
                self.replies.put(json.loads(line.decode()))
            except ValueError:
                continue
        self.replies.put(None)  # the process ended

    def _reply(self, timeout: float) -> Dict[str, Any]:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("starter did not answer within %g s" % timeout)
        if reply is None:
            raise RuntimeError("starter process exited (%s)" % self.proc.tail())
        return reply

    def wait_ready(self, timeout: float) -> None:
        if not self._reply(timeout).get("ready"):
            raise RuntimeError("starter did not report ready")

    def run(self, argv: List[str], timeout: float) -> Dict[str, Any]:
        try:
            self.stdin.write((json.dumps({"argv": argv}) + "\n").encode())
            self.stdin.flush()
        except OSError:
            raise RuntimeError("starter process is gone (%s)" % self.proc.tail())
        return self._reply(timeout)

    def stop(self) -> None:
        try:
            self.stdin.close()  # the service ends when its input ends
        except OSError:
            pass
        self.proc.stop(grace=5.0)


@dataclass
class RunOutcome:
    code: int
    error: Optional[str]
    metrics: Optional[Dict[str, Any]]
    peak_rss: List[Optional[int]]  # per node, measured by mdi-bench (None: use the metrics' value)
    cgroup_peak: List[Optional[int]]
    load_1min: float
    wall_s: float


class Ring:
    """The processes of one ring: a starter (persistent or per run) and its workers."""

    def __init__(self, plan: RingPlan, exp: Experiment, emu: Emulation, token: Optional[str], work: str,
                 log: Callable[[str], None]) -> None:
        self.plan, self.exp, self.emu, self.token, self.work, self.log = plan, exp, emu, token, work, log
        self.keys = ["g%dk%d" % (plan.index, k) for k in range(plan.n_nodes)]
        self.workers: List[WorkerProcess] = []
        self.service: Optional[StarterService] = None
        self.hosts, self.ports, self.data_ports = self._addresses()
        self.env = dict(os.environ)
        for key in ("MDI_TOKEN", "MDI_TOKEN_FILE"):
            self.env.pop(key, None)
        if token:
            self.env["MDI_TOKEN"] = token
        self.profile_cache: Optional[str] = None
        if plan.kind == "auto":
            # The planner's node profiles, one cache per ring: never another ring's (or the
            # user's ~/.cache/mdi) measurements of other boards.
            self.profile_cache = os.path.join(work, "profiles-ring%d" % plan.index)
            self.env["MDI_PROFILE_CACHE"] = self.profile_cache

    def _addresses(self) -> Tuple[List[str], List[int], List[int]]:
        n = self.plan.n_nodes
        hosts = [self.emu.host(k) for k in range(n)]
        if self.emu.net is not None:
            # One namespace per node index: the ring's index keeps its ports apart from other rings'.
            port = 8100 + self.plan.index
            return hosts, [port] * n, [port + 1000] * n
        ports = free_ports(2 * n)
        return hosts, ports[:n], ports[n:]

    def config_path(self, max_batch: Any) -> str:
        """The run configuration for runs at this max_batch (one file per value: the persistent
        starter reads --config again on every run)."""
        return os.path.join(self.work, "ring%d-b%s.yaml" % (self.plan.index, max_batch))

    def run_config(self, max_batch: Any = "auto") -> Dict[str, Any]:
        p = self.plan
        runtime = {"threads": 1, "connect_timeout": 10, "init_timeout": self.exp.start_timeout, "ring_timeout": 120,
                   "heartbeat_timeout": 60, "quant_kernel": p.model.quant_kernel, "max_batch": max_batch,
                   "wire_codec": p.model.wire_codec}
        if p.model.backend is not None:  # (else the starter's default: $MDI_BACKEND, else auto)
            runtime["backend"] = p.model.backend
        if p.model.prefill_chunk is not None:
            runtime["prefill_chunk"] = p.model.prefill_chunk
        nodes = []
        for k in range(p.n_nodes):
            node = {"name": "starter" if k == 0 else "node%d" % k, "host": self.hosts[k],
                    "port": self.ports[k], "data_port": self.data_ports[k]}
            if p.kind == "explicit":
                node["layers"] = p.counts[k]
            elif p.kind == "auto":
                node["layers"] = "auto"  # mdi-start profiles the nodes and picks (p.counts is only an estimate)
            if k > 0 and p.local_weights and p.model.weights == "local":
                node["weights"] = p.path  # as a board with the model on its own disk
            nodes.append(node)
        return {"model": {"path": p.path, "dtype": p.model.dtype, "device": "cpu", "quant": p.model.quant},
                "nodes": nodes,
                "generation": dict({"n_tokens": p.model.tokens, "temperature": self.exp.temperature, "seed": 1,
                                    "prompts": [p.model.prompt]},
                                   **({"speculation": self.exp.speculation} if self.exp.speculation is not None else {})),
                # heartbeat_timeout: a throttled, shared machine must not end runs by mistake
                "runtime": runtime}

    # --- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        for max_batch in self.plan.max_batch:
            with open(self.config_path(max_batch), "w") as f:
                yaml.safe_dump(self.run_config(max_batch), f, sort_keys=False)
        for k, key in enumerate(self.keys):
            self.emu.prepare_process(key, k)
        for k in range(1, self.plan.n_nodes):
            # --insecure: no token on a private namespace network that this tool made
            extra = ["--insecure"] if not self.token and self.hosts[k] != "127.0.0.1" else []
            if self.plan.local_weights and self.plan.model.weights == "local":
                # The worker reads only under its --models-dir: the model's own folder's parent.
                extra += ["--models-dir", os.path.dirname(os.path.abspath(self.plan.path))]
            self.workers.append(WorkerProcess(
                self.ports[k], self._log_path("node%d" % k), self._name("node%d" % k), self.hosts[k], extra=extra,
                env=self.env, token=self.token,
                # ignore: mypy cannot match a lambda's default arguments to Callable[[List[str]], List[str]]
                wrap=lambda cmd, k=k: self.emu.command(cmd, self.keys[k], k)))  # type: ignore[misc]
        if self.exp.starter == "persistent":
            self.service = self._start_service()
        self._add_delays()

    def _name(self, node: str) -> str:
        return "ring %d %s" % (self.plan.index, node)

    def _log_path(self, node: str) -> str:
        return os.path.join(self.work, "ring%d-%s.log" % (self.plan.index, node))

    def _start_service(self) -> "StarterService":
        cmd = self.emu.command(STARTER_SERVICE_CMD, self.keys[0], 0)
        return StarterService(NodeProcess(self._name("starter"), cmd, self._log_path("starter"), self.env,
                                          pipes=True))

    def _add_delays(self) -> None:
        """Delay proxies for every connection a node opens: starter -> each worker's control
        port, and each node -> the next node's data port."""
        n = self.plan.n_nodes
        for k in range(1, n):
            self.emu.add_delay(0, k, self.ports[k])
        for k in range(n):
            if n > 1:
                nxt = (k + 1) % n
                self.emu.add_delay(k, nxt, self.data_ports[nxt])

    def wait_ready(self, timeout: float) -> None:
        for w in self.workers:
            w.wait_ready(timeout)
        if self.service is not None:
            self.service.wait_ready(timeout)

    def limit(self) -> None:
        for k, key in enumerate(self.keys):
            self.emu.limit_cpu(key, True, k)

    def processes(self) -> List[Optional[NodeProcess]]:
        """Per node index; the starter is None when it is a fresh mdi-start per run."""
        return [self.service.proc if self.service else None] + self.workers

    def stop(self) -> None:
        for w in self.workers:
            w.shutdown()  # all at once; then the starter, then wait for each
        if self.service is not None:
            self.service.stop()
        for w in self.workers:
            w.stop()
        for key in self.keys:
            self.emu.release_process(key)

    # --- one run ---------------------------------------------------------------------
    def starter_argv(self, samples: int, tokens: int, metrics_path: str, max_batch: Any = "auto") -> List[str]:
        return ["--config", self.config_path(max_batch), "--prompt", self.plan.model.prompt,
                "--n-samples", str(samples),
                "--n-tokens", str(tokens), "--temperature", repr(self.exp.temperature), "--seed", "1",
                "--metrics-out", metrics_path, "--quiet"]

    def run(self, samples: int, tokens: int, metrics_path: str, max_batch: Any = "auto") -> RunOutcome:
        try:
            self._restart_starter()
        except RuntimeError as e:
            return RunOutcome(EXIT_RUN, str(e), None, [], [], os.getloadavg()[0], 0.0)
        procs = self.processes()
        for k, p in enumerate(procs):
            if p is not None:
                reset_peak_rss(p.pid)
            self.emu.reset_memory_peak(self.keys[k])
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        code, error = self._start_run(self.starter_argv(samples, tokens, metrics_path, max_batch))
        wall = time.monotonic() - t0
        peaks = [peak_rss_bytes(p.pid) if p is not None else None for p in procs]
        cg = [self.emu.memory_peak(key) for key in self.keys]
        metrics = read_json(metrics_path) if code == 0 else None
        return RunOutcome(code, error, metrics, peaks, cg, load, wall)

    def _restart_starter(self) -> None:
        """A starter that died (killed at its memory limit, say) fails its run; the next run
        gets a new one."""
        if self.service is None or self.service.proc.alive():
            return
        self.log("mdi-bench: ring %d: starter exited (%s); starting a new one"
                 % (self.plan.index, self.service.proc.tail(1)))
        self.service.stop()
        self.service = self._start_service()
        self.service.wait_ready(self.exp.start_timeout)

    def _start_run(self, argv: List[str]) -> Tuple[int, Optional[str]]:
        timeout = self.exp.run_timeout
        if self.service is not None:
            try:
                reply = self.service.run(argv, timeout)
            except RuntimeError as e:
                # ended: its late reply would answer the next run (a run that completed was then
                # recorded as failed, and runs overlapped); the next run starts a new starter
                self.service.stop()
                return EXIT_RUN, str(e)
            return int(reply.get("code", EXIT_RUN)), reply.get("error")
        cmd = self.emu.command([tool("mdi-start")] + argv, self.keys[0], 0)
        try:
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return EXIT_RUN, "mdi-start did not finish within %g s" % timeout
        return r.returncode, _error_line(r.stderr.decode(errors="replace")) if r.returncode else None


def read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _error_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("mdi: error:")]
    return (errors or lines or ["no message"])[-1]


# --------------------------------------------------------------------------- the warm starter

def serve_starter() -> int:
    """Answer JSON lines {"argv": [...]} on stdin by running mdi-start's main with those
    arguments; reply {"code", "error"} on stdout. Everything else goes to stderr (the log)."""
    import contextlib
    import io
    from mdi.cli.start import start_main
    import torch  # noqa: F401  (the import is the slow part; do it before saying ready)
    replies = sys.stdout
    sys.stdout = sys.stderr

    def reply(obj: Dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        try:
            argv = json.loads(line)["argv"]
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a list of strings")
        except (ValueError, KeyError, TypeError) as e:
            reply({"code": EXIT_CONFIG, "error": "bad request: %s" % e})
            continue
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            code = start_main(argv)
        sys.stderr.write(captured.getvalue())
        sys.stderr.flush()
        _release_memory()  # so the next run starts from what a fresh mdi-start would hold
        reply({"code": code, "error": _error_line(captured.getvalue()) if code else None})
    return 0


def _release_memory() -> None:
    """Free the finished run's tensors and hand the freed heap back to the OS (glibc)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
