"""Node processes that the lab, the benchmark scripts and the tests start: a process with its
output in a log file, stopped by its own PID only, and an `mdi-worker` on top of it (ready
when /health answers, stopped with POST /shutdown first)."""
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

from mdi.runconfig.nodes import DATA_PORT_OFFSET

BIN = os.path.dirname(os.path.abspath(sys.executable))
LOOPBACK = "127.0.0.1"


def tool(name: str) -> str:
    """The path of one of mdi's commands: next to this Python first, else on PATH."""
    here = os.path.join(BIN, name)
    return here if os.path.exists(here) else (shutil.which(name) or name)


_LOWEST = 10000
_reserved: Set[int] = set()  # ports this process has handed out (and their data ports), never given twice
_cursor = [0]


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out as a client's source port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind((LOOPBACK, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


PORT_PART_ENV = "MDI_PORT_PART"  # "i/n": free_ports walks the i-th of n parts of the range


def spread_ports(index: int, count: int) -> None:
    """This process and those it starts walk the index-th of `count` equal parts of the port
    range (processes of one test session side by side: each hands out ports the others never
    probe; mdi-bench started by one walks its part too)."""
    os.environ[PORT_PART_ENV] = "%d/%d" % (index, count)
    _cursor[0] = 0


def _first_cursor(span: int) -> int:
    """Where this process's walk starts: a place drawn from the PID (and the time), within its
    part of the range where $MDI_PORT_PART gives one."""
    drawn = os.getpid() * 7919 + int(time.time())
    try:
        index, count = (int(x) for x in os.environ.get(PORT_PART_ENV, "").split("/"))
    except ValueError:
        return drawn % span
    part = span // max(1, count)
    if not 0 <= index < count or part < 100:
        return drawn % span
    return index * part + drawn % (part // 2)  # (the rest of the part: room to walk on)


def free_ports(n: int) -> List[int]:
    """n distinct TCP ports free on loopback now, each with its data port (port + 1000) free too.

    Why not let the OS pick (bind to port 0): it picks from the ephemeral range, the same range
    every outgoing connection takes its source port from, so between the pick and a worker's
    bind at /init some HTTP client could own the port ("Address already in use" in CI). Ports
    below that range are only ever taken by an explicit bind. The walk starts at a place drawn
    from the PID, so two runs on one machine rarely probe the same ports."""
    top = _ephemeral_floor() - 1 - DATA_PORT_OFFSET
    span = top - _LOWEST
    if span < 100:  # an unusual ip_local_port_range: fall back to the OS's choice
        return _os_picked(n)
    if not _cursor[0]:
        _cursor[0] = _first_cursor(span) or 1
    ports: List[int] = []
    for _ in range(span):
        port = _LOWEST + _cursor[0] % span
        _cursor[0] += 1
        if port in _reserved or port + DATA_PORT_OFFSET in _reserved:
            continue
        if _bindable(port) and _bindable(port + DATA_PORT_OFFSET):
            _reserved.update((port, port + DATA_PORT_OFFSET))
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError("no %d free loopback ports between %d and %d" % (n, _LOWEST, top + DATA_PORT_OFFSET))


def _os_picked(n: int) -> List[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((LOOPBACK, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class NodeProcess:
    """One process this tool started, stdout and stderr in `log_path`; only its own PID is
    ever signalled.

    pipes: stdin and stdout are pipes (stderr still goes to the log). append: add to an
    existing log (a restarted process keeps its predecessor's output) instead of starting it
    afresh. new_session: a session of its own, so that Ctrl-C reaches only the parent, which
    then stops its nodes in order.
    """

    tail_lines = 3  # how much of the log an error message quotes

    def __init__(self, name: str, cmd: List[str], log_path: str, env: Optional[Dict[str, str]] = None,
                 pipes: bool = False, preexec: Optional[Callable[[], None]] = None, append: bool = True,
                 new_session: bool = True) -> None:
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "ab" if append else "wb")
        extra: Dict[str, Any] = ({"stdin": subprocess.PIPE, "stdout": subprocess.PIPE} if pipes
                                 else {"stdout": self.log})
        self.proc: "subprocess.Popen[bytes]" = subprocess.Popen(  # bytes: no text mode
            cmd, stderr=self.log, env=env, start_new_session=new_session, preexec_fn=preexec, **extra)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """Wait `grace` s for it to exit, then SIGTERM, then SIGKILL (this PID only)."""
        for action, wait in ((None, grace), (self.proc.terminate, 5.0), (self.proc.kill, 5.0)):
            if self.proc.poll() is not None:
                break
            if action is not None:
                action()
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        self.log.close()

    def output(self) -> str:
        """Everything in the log so far."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, n: Optional[int] = None) -> str:
        """The log's last n lines (default: tail_lines), joined with ' | '."""
        lines = self.output().strip().splitlines()
        return " | ".join(lines[-(n or self.tail_lines):])


def control_auth(token: Optional[str]):
    """What signs a request to a worker with the shared secret (None without one)."""
    from mdi.starter.control import HmacAuth
    return HmacAuth(token) if token else None


def wait_healthy(url: str, token: Optional[str], proc: NodeProcess, timeout: float) -> None:
    """Until GET url/health answers; RuntimeError (with the log's tail) if the process exits
    or `timeout` s pass first."""
    import requests
    session = requests.Session()
    session.trust_env = False  # never through an HTTP proxy from the environment
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError("%s exited with code %s: %s" % (proc.name, proc.proc.returncode, proc.tail()))
        try:
            if session.get(url + "/health", auth=control_auth(token), timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError("%s did not answer %s/health within %.0f s" % (proc.name, url, timeout))


def post_shutdown(url: str, token: Optional[str]) -> None:
    import requests
    with requests.Session() as session:
        session.trust_env = False  # never through an HTTP proxy from the environment
        try:
            session.post(url + "/shutdown", auth=control_auth(token), timeout=3)
        except requests.RequestException:
            pass


class WorkerProcess(NodeProcess):
    """`mdi-worker --port PORT --threads N [--host HOST] EXTRA...`.

    host: None listens on loopback (the worker's default). data_port: the port the run config
    gives it for the ring (bound only at /init). wrap: turns the command into the one to run
    (board emulation: a namespace, cgroups). token: signs /health and /shutdown; the worker
    itself reads it from `env` (MDI_TOKEN or MDI_TOKEN_FILE).
    """

    def __init__(self, port: int, log_path: str, name: Optional[str] = None, host: Optional[str] = None,
                 threads: Optional[int] = 1, extra: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                 token: Optional[str] = None, data_port: Optional[int] = None,
                 wrap: Optional[Callable[[List[str]], List[str]]] = None, **kw) -> None:
        self.port, self.data_port, self.host, self.token = port, data_port, host or LOOPBACK, token
        self.url = "http://%s:%d" % (self.host, port)
        self.auth = control_auth(token)  # signs requests to it: requests.get(w.url, auth=w.auth)
        self._shutdown_sent = False
        cmd = [tool("mdi-worker"), "--port", str(port)] + (["--host", host] if host else [])
        cmd += (["--threads", str(threads)] if threads else []) + list(extra)  # None: no --threads
        super().__init__(name or "worker on port %d" % port, wrap(cmd) if wrap else cmd, log_path, env, **kw)

    def wait_ready(self, timeout: float = 90.0) -> "WorkerProcess":
        wait_healthy(self.url, self.token, self, timeout)
        return self

    def node(self, weights: Optional[str] = None) -> Dict[str, object]:
        """Its entry in a run config's `nodes`."""
        entry: Dict[str, object] = {"name": self.name, "host": self.host, "port": self.port,
                                    "data_port": self.data_port}
        if weights:
            entry["weights"] = weights
        return entry

    def shutdown(self) -> None:
        """POST /shutdown once, if it still runs (the worker then exits by itself)."""
        if self.alive() and not self._shutdown_sent:
            self._shutdown_sent = True
            post_shutdown(self.url, self.token)

    def stop(self, grace: float = 10.0) -> None:
        """POST /shutdown, then wait `grace` s, SIGTERM, SIGKILL (this PID only)."""
        self.shutdown()
        super().stop(grace)
