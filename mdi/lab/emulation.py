"""Board emulation on one machine: a CPU quota, a memory limit and a network link per node.

Everything here is optional. It needs root, cgroup v1 (`cpu`, `memory`), `ip netns` and `tc`;
`Emulation.start()` detects what works, uses it, and says what it could not use and why.
Everything created (cgroups, namespaces, the bridge, proxies) is removed by `close()`.

- CPU: one cgroup v1 `cpu` group per node process, `cpu.cfs_quota_us / cpu.cfs_period_us`
  cores (0.5 = a board half as fast as one core of this machine).
- Memory: one cgroup v1 `memory` group per node process with `memory.limit_in_bytes`; groups
  are made under this process's own memory cgroup so whoever accounts for it still does.
- Network: one namespace per node index on a bridge, each with a veth pair shaped with
  `tc ... tbf` in both directions (the node's upload and download). The kernel here lacks
  `netem`, so latency comes from a userspace delay proxy: in the sender's namespace the
  receiver's address is a local alias where a proxy listens, and the proxy forwards from the
  root namespace over the bridge after the delay. Node configs keep the real addresses.
"""
import ctypes
import os
import queue
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_CPU = os.path.join(CGROUP_ROOT, "cpu")
CGROUP_MEMORY = os.path.join(CGROUP_ROOT, "memory")
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000


class EmulationError(RuntimeError):
    """Emulation was required (mode 'on') but a part of it cannot be set up."""


# --------------------------------------------------------------------------- cgroup v1

def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def cgroup_unavailable_reason() -> Optional[str]:
    """None when cgroup v1 CPU quotas can be used, else why not."""
    return _controller_unavailable_reason(CGROUP_CPU, "cpu.cfs_quota_us", "cpu")


def memory_cgroup_unavailable_reason() -> Optional[str]:
    """None when cgroup v1 memory limits can be used, else why not."""
    return _controller_unavailable_reason(CGROUP_MEMORY, "memory.limit_in_bytes", "memory")


def _controller_unavailable_reason(root: str, probe: str, name: str) -> Optional[str]:
    if not _is_root():
        return "not running as root"
    if not os.path.isfile(os.path.join(root, probe)):
        return "no cgroup v1 %s controller at %s" % (name, root)
    if not os.access(root, os.W_OK):
        return "%s is not writable" % root
    return None


def _write(path: str, value: Any) -> None:
    with open(path, "w") as f:
        f.write("%s\n" % value)


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().split()[0])


def _own_cgroup(controller: str, root: str) -> str:
    """The directory of this process's cgroup for one v1 controller."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return os.path.join(root, path.lstrip("/"))
    return root


def _own_cpu_cgroup() -> str:
    return _own_cgroup("cpu", CGROUP_CPU)


class _Cgroups:
    """Groups of one v1 controller made under one parent; cleanup() removes them."""

    root = CGROUP_ROOT
    controller = ""

    def __init__(self, prefix: str, parent: Optional[str] = None) -> None:
        self.home = _own_cgroup(self.controller, self.root)  # where this process came from
        self.base = os.path.join(parent or self.root, "%s_%d" % (prefix, os.getpid()))
        self.groups = []  # type: List[str]
        os.mkdir(self.base)

    def path(self, name: str) -> str:
        return os.path.join(self.base, name)

    def create(self, name: str) -> str:
        p = self.path(name)
        os.mkdir(p)
        self.groups.append(name)
        return p

    def procs_file(self, name: str) -> str:
        return os.path.join(self.path(name), "cgroup.procs")

    def preexec(self, name: str) -> Callable[[], None]:
        """For subprocess.Popen(preexec_fn=...): the child joins the group before exec."""
        procs = self.procs_file(name)
        return lambda: _write(procs, os.getpid())

    def join(self, name: str) -> None:
        """Move this whole process (all its threads) into a group."""
        _write(self.procs_file(name), os.getpid())

    def leave(self) -> None:
        _write(os.path.join(self.home, "cgroup.procs"), os.getpid())

    def cleanup(self) -> List[str]:
        """Remove the groups (they must be empty: stop the processes first). Returns problems."""
        problems = []
        try:
            self.leave()
        except OSError as e:
            problems.append("cannot move back to %s: %s" % (self.home, e))
        for name in reversed(self.groups):
            problems.extend(_rmdir_patiently(self.path(name)))
        self.groups = []
        problems.extend(_rmdir_patiently(self.base))
        return problems


def _rmdir_patiently(path: str, timeout: float = 5.0) -> List[str]:
    """rmdir a cgroup; a process that just exited can keep it busy for a moment."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return []
        except FileNotFoundError:
            return []
        except OSError as e:
            if time.monotonic() > deadline:
                return ["cannot remove %s: %s" % (path, e)]
            time.sleep(0.1)


class CpuCgroups(_Cgroups):
    """cgroup v1 `cpu` groups made by a benchmark under one parent; cleanup() removes them.

    A group's quota is given in cores (0.5 = 50 ms of CPU per 100 ms period); None = no limit.
    """

    root = CGROUP_CPU
    controller = "cpu"

    def set_quota(self, name: str, cores: Optional[float], period_us: Optional[int] = None) -> None:
        p = self.path(name)
        if period_us is not None:
            _write(os.path.join(p, "cpu.cfs_period_us"), int(period_us))
        period = _read_int(os.path.join(p, "cpu.cfs_period_us"))
        _write(os.path.join(p, "cpu.cfs_quota_us"), -1 if cores is None else max(1000, int(cores * period)))


class MemoryCgroups(_Cgroups):
    """cgroup v1 `memory` groups, made under this process's own memory cgroup."""

    root = CGROUP_MEMORY
    controller = "memory"

    def __init__(self, prefix: str, parent: Optional[str] = None) -> None:
        super().__init__(prefix, parent or _own_cgroup("memory", CGROUP_MEMORY))

    def set_limit(self, name: str, nbytes: Optional[int]) -> None:
        _write(os.path.join(self.path(name), "memory.limit_in_bytes"), -1 if nbytes is None else int(nbytes))

    def reset_peak(self, name: str) -> None:
        _write(os.path.join(self.path(name), "memory.max_usage_in_bytes"), 0)

    def peak_bytes(self, name: str) -> int:
        """Peak usage since the last reset: resident memory plus page cache charged here."""
        return _read_int(os.path.join(self.path(name), "memory.max_usage_in_bytes"))


# --------------------------------------------------------------------------- peak RSS of a process

def reset_peak_rss(pid: int) -> bool:
    """Reset a process's VmHWM (Linux: "5" > /proc/PID/clear_refs) so the next read is a per-run peak."""
    try:
        _write("/proc/%d/clear_refs" % pid, 5)
        return True
    except OSError:
        return False


def peak_rss_bytes(pid: int) -> Optional[int]:
    """VmHWM of a running process (its peak resident set since start or the last reset)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- delay proxy

class DelayProxy:
    """A TCP forwarder that delivers every byte `delay_s` after it arrived, in both directions.

    It stands in for `netem delay`: the listening socket may have been made in another network
    namespace (see listen_in_netns), the outgoing connections are made from this process's.
    """

    def __init__(self, listener: socket.socket, target: Tuple[str, int], delay_s: float,
                 name: str = "proxy") -> None:
        self.listener, self.target, self.delay_s, self.name = listener, target, delay_s, name
        self._stop = threading.Event()
        self._socks = []  # type: List[socket.socket]
        self._lock = threading.Lock()
        self.listener.settimeout(0.5)  # so the accept loop notices close()
        self._thread = threading.Thread(target=self._accept_loop, name="mdi-%s" % name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the target is down: the client sees a reset, as it would directly
                continue
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.extend([client, upstream])
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        q = queue.Queue()  # type: queue.Queue
        threading.Thread(target=self._read, args=(src, q), daemon=True).start()
        threading.Thread(target=self._deliver, args=(dst, q), daemon=True).start()

    def _read(self, src: socket.socket, q: "queue.Queue") -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            q.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _deliver(self, dst: socket.socket, q: "queue.Queue") -> None:
        while not self._stop.is_set():
            try:
                due, data = q.get(timeout=0.5)
            except queue.Empty:
                continue
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)  # pass the end of stream on, after the delay too
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        socks = [self.listener]
        with self._lock:
            socks.extend(self._socks)
            self._socks = []
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        self._thread.join(timeout=2)


def listen_in_netns(netns: Optional[str], host: str, port: int) -> socket.socket:
    """A listening TCP socket bound inside a named network namespace (None: this one).

    setns() changes the namespace of the calling thread only, so a short-lived thread
    switches, creates the socket (which keeps its namespace) and ends.
    """
    if netns is None:
        return _listener(host, port)
    out = {}  # type: Dict[str, Any]

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        target = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, "setns(%s): %s" % (netns, os.strerror(err)))
            out["sock"] = _listener(host, port)
        except BaseException as e:
            out["error"] = e
        finally:
            os.close(target)  # the thread ends here, still in `netns`: nothing else runs on it

    t = threading.Thread(target=work, name="mdi-setns", daemon=True)
    t.start()
    t.join(timeout=10)
    if "sock" not in out:
        raise out.get("error") or OSError("creating a socket in namespace %s timed out" % netns)
    return out["sock"]


def _listener(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(16)
    return s


# --------------------------------------------------------------------------- network namespaces

def _run(cmd: List[str], timeout: float = 10.0) -> None:
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EmulationError("%s: %s" % (" ".join(cmd), e))
    if r.returncode != 0:
        raise EmulationError("%s: %s" % (" ".join(cmd), r.stderr.decode(errors="replace").strip()))


def _output(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def network_unavailable_reason() -> Optional[str]:
    if not _is_root():
        return "not running as root"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]):
            return "the %r command is missing" % tool
    return None


def tbf_command(dev: str, mbit: float, netns: Optional[str] = None) -> List[str]:
    """`tc qdisc add ... tbf`: the bucket holds 4 ms of traffic (at least 16 KB) so the
    shaping works whatever the kernel's timer frequency; 50 ms of queue at most."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(16384, int(rate_bytes * 0.004))
    where = ["-n", netns] if netns else []
    return ["tc"] + where + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", "%dkbit" % int(mbit * 1000),
                             "burst", str(burst), "latency", "50ms"]


class NetworkLab:
    """A bridge and one namespace per node index, veth-linked, shaped, with delay proxies."""

    def __init__(self, tag: str, n_nodes: int, bandwidth_mbit: Optional[float], latency_ms: float) -> None:
        self.tag, self.n_nodes = tag, n_nodes
        self.bandwidth_mbit, self.latency_ms = bandwidth_mbit, latency_ms
        self.bridge = tag + "br"
        self.subnet = None  # type: Optional[str]
        self.namespaces = []  # type: List[str]
        self.proxies = []  # type: List[DelayProxy]
        self._bridge_made = False

    def netns(self, k: int) -> str:
        return "%sn%d" % (self.tag, k)

    def address(self, k: int) -> str:
        return "%s.%d" % (self.subnet, 10 + k)

    def gateway(self) -> str:
        return "%s.1" % self.subnet

    def create(self) -> None:
        self.subnet = _free_subnet()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._bridge_made = True
        _run(["ip", "addr", "add", self.gateway() + "/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for k in range(self.n_nodes):
            self._add_node(k)
        if self.latency_ms > 0:
            self._add_aliases()

    def _add_node(self, k: int) -> None:
        ns, outer, inner = self.netns(k), "%sv%d" % (self.tag, k), "%sp%d" % (self.tag, k)
        _run(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        _run(["ip", "link", "set", inner, "netns", ns])
        _run(["ip", "link", "set", outer, "master", self.bridge])
        _run(["ip", "link", "set", outer, "up"])
        _run(["ip", "-n", ns, "addr", "add", self.address(k) + "/24", "dev", inner])
        _run(["ip", "-n", ns, "link", "set", inner, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Answer ARP only for addresses on the asking interface: the peer aliases on lo must
        # not capture the bridge's traffic (the proxy would then connect to itself, forever).
        _run(["ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/conf/all/arp_ignore"])
        if self.bandwidth_mbit:
            _run(tbf_command(outer, self.bandwidth_mbit))  # the node's download
            _run(tbf_command(inner, self.bandwidth_mbit, ns))  # the node's upload

    def _add_aliases(self) -> None:
        """The addresses each node sends to, made local in its namespace for the delay proxies:
        the starter (0) talks to every worker; worker k to k+1 and (when last) to the starter."""
        for k in range(self.n_nodes):
            peers = range(1, self.n_nodes) if k == 0 else sorted({0, k + 1} - {self.n_nodes})
            for peer in peers:
                _run(["ip", "-n", self.netns(k), "addr", "add", self.address(peer) + "/32", "dev", "lo"])

    def add_proxy(self, sender: int, receiver: int, port: int) -> None:
        """Delay what `sender` sends to `receiver`:port (and the replies) by latency_ms."""
        host = self.address(receiver)
        listener = listen_in_netns(self.netns(sender), host, port)
        self.proxies.append(DelayProxy(listener, (host, port), self.latency_ms / 1000.0,
                                       "delay-%d-%d-%d" % (sender, receiver, port)))

    def close_proxies(self) -> None:
        for p in self.proxies:
            p.close()
        self.proxies = []

    def exec_prefix(self, k: int) -> List[str]:
        return ["ip", "netns", "exec", self.netns(k)]

    def close(self) -> List[str]:
        self.close_proxies()
        problems = []
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its veth pair
            problems.extend(_try(["ip", "netns", "del", ns]))
        self.namespaces = []
        if self._bridge_made:
            problems.extend(_try(["ip", "link", "del", self.bridge]))
            self._bridge_made = False
        return problems

    def record(self) -> Dict[str, Any]:
        return {"bridge": self.bridge, "subnet": "%s.0/24" % self.subnet,
                "namespaces": [self.netns(k) for k in range(self.n_nodes)],
                "addresses": [self.address(k) for k in range(self.n_nodes)]}


def _try(cmd: List[str]) -> List[str]:
    try:
        _run(cmd)
        return []
    except EmulationError as e:
        return [str(e)]


def _free_subnet() -> str:
    """A 10.213.X.0/24 that no interface or route of this machine uses."""
    used = _output(["ip", "-4", "-o", "addr", "show"]) + _output(["ip", "-4", "route", "show", "table", "all"])
    for x in range(200, 255):
        prefix = "10.213.%d" % x
        if not re.search(re.escape(prefix + "."), used):
            return prefix
    raise EmulationError("no free 10.213.X.0/24 subnet for the emulated network")


# --------------------------------------------------------------------------- the whole emulation

@dataclass
class EmulationSettings:
    mode: str = "auto"  # auto: use what works; on: all asked parts or fail; off: plain loopback
    cpu_quota: Optional[float] = None  # cores per node process
    cpu_period_us: int = 100000
    memory_limit_mb: Optional[int] = None  # per node process
    bandwidth_mbit: Optional[float] = None  # per node link, each direction
    latency_ms: float = 0.0  # one-way, added per hop by the delay proxy

    def wants_network(self) -> bool:
        return bool(self.bandwidth_mbit) or self.latency_ms > 0


class Emulation:
    """Detects, creates and tears down the per-node limits; wraps node commands to use them."""

    def __init__(self, settings: EmulationSettings, max_nodes: int, log: Callable[[str], None] = print) -> None:
        self.settings, self.max_nodes, self.log = settings, max_nodes, log
        self.tag = "mdib%d" % (os.getpid() % 100000)
        self.cpu = None  # type: Optional[CpuCgroups]
        self.memory = None  # type: Optional[MemoryCgroups]
        self.net = None  # type: Optional[NetworkLab]
        self.status = {}  # type: Dict[str, str]  # part -> "on: ..." or "off: why"

    # --- set up ----------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.mode == "off":
            for part in ("cpu", "memory", "network"):
                self.status[part] = "off: emulation disabled"
            return
        self._try_part("cpu", s.cpu_quota is not None, cgroup_unavailable_reason, self._start_cpu)
        self._try_part("memory", s.memory_limit_mb is not None, memory_cgroup_unavailable_reason,
                       self._start_memory)
        self._try_part("network", s.wants_network(), network_unavailable_reason, self._start_network)

    def _try_part(self, part: str, wanted: bool, reason: Callable[[], Optional[str]],
                  create: Callable[[], str]) -> None:
        if not wanted:
            self.status[part] = "off: not asked for"
            return
        why = reason()
        if why is None:
            try:
                self.status[part] = "on: " + create()
                return
            except (OSError, EmulationError) as e:
                why = str(e)
        if self.settings.mode == "on":
            raise EmulationError("%s emulation is unavailable: %s" % (part, why))
        self.status[part] = "off: " + why

    def _start_cpu(self) -> str:
        self.cpu = CpuCgroups(self.tag, _own_cpu_cgroup())
        s = self.settings
        return "%.2f core per node (cgroup v1 cpu.cfs_quota_us %d / cpu.cfs_period_us %d)" % (
            s.cpu_quota, int(s.cpu_quota * s.cpu_period_us), s.cpu_period_us)

    def _start_memory(self) -> str:
        self.memory = MemoryCgroups(self.tag)
        return "%d MB per node (cgroup v1 memory.limit_in_bytes)" % self.settings.memory_limit_mb

    def _start_network(self) -> str:
        s = self.settings
        self.net = NetworkLab(self.tag, self.max_nodes, s.bandwidth_mbit, s.latency_ms)
        try:
            self.net.create()
        except BaseException:
            self.net.close()
            self.net = None
            raise
        parts = ["a network namespace per node on bridge %s (%s.0/24)" % (self.net.bridge, self.net.subnet)]
        if s.bandwidth_mbit:
            parts.append("tc tbf %g Mbit/s each way per node" % s.bandwidth_mbit)
        if s.latency_ms > 0:
            parts.append("+%g ms one-way per hop by a userspace delay proxy (no netem in this kernel)" % s.latency_ms)
        return ", ".join(parts)

    # --- per node process ------------------------------------------------------------
    def host(self, k: int) -> str:
        """The address node index k listens on."""
        return self.net.address(k) if self.net is not None else "127.0.0.1"

    def prepare_process(self, key: str) -> None:
        """Cgroups for one node process (`key` names it), with no CPU limit yet: process start
        and weight loading are not measured, and a quota would only make them slow."""
        if self.cpu is not None:
            self.cpu.create(key)
            self.cpu.set_quota(key, None, self.settings.cpu_period_us)
        if self.memory is not None:
            self.memory.create(key)
            self.memory.set_limit(key, self.settings.memory_limit_mb * 1024 * 1024)

    def command(self, cmd: List[str], key: str, k: int) -> List[str]:
        """`cmd` wrapped to run in node k's namespace and in `key`'s cgroups. A shell joins the
        cgroups and execs, so the PID is the node's own (no preexec_fn in a threaded parent)."""
        if self.net is not None:
            cmd = self.net.exec_prefix(k) + cmd
        procs = [g.procs_file(key) for g in (self.cpu, self.memory) if g is not None]
        if not procs:
            return cmd
        join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 97; shift; done; shift; exec "$@"'
        return ["sh", "-c", join, "mdi-node"] + procs + ["--"] + cmd

    def limit_cpu(self, key: str, on: bool) -> None:
        if self.cpu is not None:
            self.cpu.set_quota(key, self.settings.cpu_quota if on else None)

    def reset_memory_peak(self, key: str) -> None:
        if self.memory is not None:
            self.memory.reset_peak(key)

    def memory_peak(self, key: str) -> Optional[int]:
        return self.memory.peak_bytes(key) if self.memory is not None else None

    def release_process(self, key: str) -> None:
        """Remove a stopped process's cgroups."""
        for groups in (self.cpu, self.memory):
            if groups is not None and key in groups.groups:
                problems = _rmdir_patiently(groups.path(key))
                if not problems:
                    groups.groups.remove(key)

    def add_delay(self, sender: int, receiver: int, port: int) -> None:
        if self.net is not None and self.settings.latency_ms > 0:
            self.net.add_proxy(sender, receiver, port)

    def clear_delays(self) -> None:
        if self.net is not None:
            self.net.close_proxies()

    # --- reporting and teardown ------------------------------------------------------
    def active(self, part: str) -> bool:
        return self.status.get(part, "").startswith("on")

    def describe(self) -> str:
        if not any(self.active(p) for p in self.status):
            reasons = sorted({v[5:] for v in self.status.values()})
            return "emulation: off (%s): plain loopback, no CPU quota, no memory limit" % "; ".join(reasons)
        return "emulation: " + "; ".join("%s %s" % (p, v) for p, v in sorted(self.status.items()))

    def tag_for_csv(self) -> str:
        """A compact description for the CSV's `emulation` column."""
        s, bits = self.settings, []
        if self.active("cpu"):
            bits.append("cpu=%gcore" % s.cpu_quota)
        if self.active("memory"):
            bits.append("mem=%dMB" % s.memory_limit_mb)
        if self.active("network"):
            if s.bandwidth_mbit:
                bits.append("bw=%gMbit" % s.bandwidth_mbit)
            if s.latency_ms > 0:
                bits.append("lat=%gms" % s.latency_ms)
        return ";".join(bits) or "off"

    def record(self) -> Dict[str, Any]:
        s = self.settings
        out = {"mode": s.mode, "settings": {"cpu_quota_cores": s.cpu_quota, "cpu_period_us": s.cpu_period_us,
                                            "memory_limit_mb": s.memory_limit_mb,
                                            "bandwidth_mbit": s.bandwidth_mbit, "latency_ms": s.latency_ms},
               "status": dict(self.status), "summary": self.describe()}
        if self.net is not None:
            out["network"] = self.net.record()
        if self.cpu is not None:
            out["cpu_cgroup_base"] = self.cpu.base
        if self.memory is not None:
            out["memory_cgroup_base"] = self.memory.base
        return out

    def resources(self) -> Dict[str, Any]:
        """What exists now, for the crash-recovery state file (see experiments --cleanup)."""
        return {"netns": list(self.net.namespaces) if self.net else [],
                "bridge": self.net.bridge if self.net and self.net._bridge_made else None,
                "cgroups": [g.base for g in (self.cpu, self.memory) if g is not None]}

    def close(self) -> List[str]:
        """Tear everything down (stop the node processes first). Returns problems, if any."""
        problems = []  # type: List[str]
        if self.net is not None:
            problems.extend(self.net.close())
            self.net = None
        for groups in (self.cpu, self.memory):
            if groups is not None:
                problems.extend(groups.cleanup())
        self.cpu = self.memory = None
        return problems


def remove_leftovers(resources: Dict[str, Any]) -> List[str]:
    """Remove what a crashed run listed in its state file (namespaces, bridge, cgroup dirs)."""
    problems = []  # type: List[str]
    for ns in resources.get("netns") or []:
        if os.path.exists(os.path.join(NETNS_DIR, ns)):
            problems.extend(_try(["ip", "netns", "del", ns]))
    bridge = resources.get("bridge")
    if bridge and os.path.exists("/sys/class/net/" + bridge):
        problems.extend(_try(["ip", "link", "del", bridge]))
    for base in resources.get("cgroups") or []:
        if not base.startswith(CGROUP_ROOT + "/") or not os.path.isdir(base):
            continue
        for child in sorted(os.listdir(base)):
            if os.path.isdir(os.path.join(base, child)):
                problems.extend(_rmdir_patiently(os.path.join(base, child), 1.0))
        problems.extend(_rmdir_patiently(base, 1.0))
    return problems
