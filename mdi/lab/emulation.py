"""Board emulation on one machine: a CPU quota, a memory limit and a network link per node.

Everything here is optional. It needs root, cgroup v1 (`cpu`, `memory`), `ip netns` and `tc`;
`Emulation.start()` detects what works, uses it, and says what it could not use and why.
Everything created (cgroups, namespaces, the bridge, proxies) is removed by `close()`.

The parts: cgroups.py (CPU quota and memory limit per node process), netns.py (a namespace
per node on a bridge, shaped with tc tbf) and delay_proxy.py (latency without netem).
"""
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from mdi.lab.cgroups import (CGROUP_ROOT, CpuCgroups, MemoryCgroups, cgroup_unavailable_reason, quota_and_period,
                             memory_cgroup_unavailable_reason, own_cpu_cgroup, rmdir_patiently)
from mdi.lab.commands import EmulationError, try_run
from mdi.lab.netns import NETNS_DIR, NetworkLab, network_unavailable_reason

__all__ = ["EmulationError", "EmulationSettings", "Emulation", "remove_leftovers", "per_node", "per_node_text"]

# A per-node setting: one value for every node, or a list with one value per node index in
# ring order (index 0 = the starter; None = no limit for that node): heterogeneous boards.
PerNode = Union[None, int, float, List[Any]]


def per_node(value: PerNode, k: int) -> Any:
    """The value of a per-node setting for node index k."""
    if not isinstance(value, list):
        return value
    if k >= len(value):  # the experiment's plan checks this before anything runs
        raise EmulationError("a per-node emulation list has %d entries, no value for node %d" % (len(value), k))
    return value[k]


def per_node_text(value: PerNode, fmt: str = "%g") -> str:
    """'0.5', or '1/0.5/0.25' for a list ('-' for a node without a limit)."""
    values = value if isinstance(value, list) else [value]
    return "/".join("-" if v is None else fmt % v for v in values)


def _one_if_equal(values: List[Any]) -> Any:
    return values[0] if len(set(values)) == 1 else values


def _asked(value: PerNode) -> bool:
    return any(v is not None for v in (value if isinstance(value, list) else [value]))


@dataclass
class EmulationSettings:
    mode: str = "auto"  # auto: use what works; on: all asked parts or fail; off: plain loopback
    cpu_quota: PerNode = None  # cores per node process (a list: per node index)
    # The shortest period the kernel allows (a quota under 1 ms lengthens it: 0.5 core runs 1 ms
    # per 2 ms). A board idle between passes runs a pass at full speed while its period's quota
    # lasts: over 100 ms periods a 0.5-core board ran a ring's 3 ms stages unthrottled, a whole
    # core's speed, and a ring at S = 1 looked faster than one such board alone.
    cpu_period_us: int = 1000
    memory_limit_mb: PerNode = None  # per node process (a list: per node index)
    bandwidth_mbit: Optional[float] = None  # per node link, each direction
    latency_ms: float = 0.0  # one-way, added per hop by the delay proxy

    def wants_network(self) -> bool:
        return bool(self.bandwidth_mbit) or self.latency_ms > 0

    def wants_cpu(self) -> bool:
        return _asked(self.cpu_quota)

    def wants_memory(self) -> bool:
        return _asked(self.memory_limit_mb)

    def cpu_quota_of(self, k: int) -> Optional[float]:
        """Cores of node index k (None: no quota)."""
        return per_node(self.cpu_quota, k)

    def memory_limit_of(self, k: int) -> Optional[int]:
        """Bytes of memory of node index k (None: no limit)."""
        mb = per_node(self.memory_limit_mb, k)
        return None if mb is None else mb * 1024 * 1024

    def node_lists(self) -> Dict[str, int]:
        """The settings given as per-node lists: key -> number of entries."""
        return {key: len(v) for key, v in (("cpu_quota", self.cpu_quota), ("memory_limit_mb", self.memory_limit_mb))
                if isinstance(v, list)}


class Emulation:
    """Detects, creates and tears down the per-node limits; wraps node commands to use them."""

    def __init__(self, settings: EmulationSettings, max_nodes: int, log: Callable[[str], None] = print) -> None:
        self.settings, self.max_nodes, self.log = settings, max_nodes, log
        self.tag = "mdib%d" % (os.getpid() % 100000)
        self.cpu: Optional[CpuCgroups] = None
        self.memory: Optional[MemoryCgroups] = None
        self.net: Optional[NetworkLab] = None
        self.status: Dict[str, str] = {}  # part -> "on: ..." or "off: why"

    # --- set up ----------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.mode == "off":
            for part in ("cpu", "memory", "network"):
                self.status[part] = "off: emulation disabled"
            return
        self._try_part("cpu", s.wants_cpu(), cgroup_unavailable_reason, self._start_cpu)
        self._try_part("memory", s.wants_memory(), memory_cgroup_unavailable_reason,
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
        self.cpu = CpuCgroups(self.tag, own_cpu_cgroup())
        s = self.settings
        quotas = s.cpu_quota if isinstance(s.cpu_quota, list) else [s.cpu_quota]
        written = [None if q is None else quota_and_period(q, s.cpu_period_us) for q in quotas]
        return "%s core per node%s (cgroup v1 cpu.cfs_quota_us %s / cpu.cfs_period_us %s)" % (
            per_node_text(s.cpu_quota, "%.2f"), " index" if isinstance(s.cpu_quota, list) else "",
            per_node_text([None if w is None else w[0] for w in written], "%d"),
            per_node_text(_one_if_equal([s.cpu_period_us if w is None else w[1] for w in written]), "%d"))

    def _start_memory(self) -> str:
        self.memory = MemoryCgroups(self.tag)
        mb = self.settings.memory_limit_mb
        return "%s MB per node%s (cgroup v1 memory.limit_in_bytes)" % (
            per_node_text(mb, "%d"), " index" if isinstance(mb, list) else "")

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
    def _cgroups(self) -> List[Any]:
        """The cgroup sets in use (CpuCgroups, MemoryCgroups)."""
        return [g for g in (self.cpu, self.memory) if g is not None]

    def host(self, k: int) -> str:
        """The address node index k listens on."""
        return self.net.address(k) if self.net is not None else "127.0.0.1"

    def prepare_process(self, key: str, k: int = 0) -> None:
        """Cgroups for the process of node index k (`key` names it), with no CPU limit yet:
        process start and weight loading are not measured, and a quota would only make them slow."""
        if self.cpu is not None:
            self.cpu.create(key)
            self.cpu.set_quota(key, None, self.settings.cpu_period_us)
        if self.memory is not None:
            self.memory.create(key)
            self.memory.set_limit(key, self.settings.memory_limit_of(k))

    def command(self, cmd: List[str], key: str, k: int) -> List[str]:
        """`cmd` wrapped to run in node k's namespace and in `key`'s cgroups. A shell joins the
        cgroups and execs, so the PID is the node's own (no preexec_fn in a threaded parent)."""
        if self.net is not None:
            cmd = self.net.exec_prefix(k) + cmd
        procs = [g.procs_file(key) for g in self._cgroups()]
        if not procs:
            return cmd
        join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 97; shift; done; shift; exec "$@"'
        return ["sh", "-c", join, "mdi-node"] + procs + ["--"] + cmd

    def limit_cpu(self, key: str, on: bool, k: int = 0) -> None:
        """Node index k's quota on (or off) for the process `key` names."""
        if self.cpu is not None:
            self.cpu.set_quota(key, self.settings.cpu_quota_of(k) if on else None, self.settings.cpu_period_us)

    def memory_limit_bytes(self, k: int = 0) -> Optional[int]:
        """Node index k's memory limit while the memory emulation is on, else None."""
        return self.settings.memory_limit_of(k) if self.memory is not None else None

    def reset_memory_peak(self, key: str) -> None:
        if self.memory is not None:
            self.memory.reset_peak(key)

    def memory_peak(self, key: str) -> Optional[int]:
        return self.memory.peak_bytes(key) if self.memory is not None else None

    def release_process(self, key: str) -> None:
        """Remove a stopped process's cgroups."""
        for groups in self._cgroups():
            if key in groups.groups and not rmdir_patiently(groups.path(key)):
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
            bits.append("cpu=%score" % per_node_text(s.cpu_quota))
        if self.active("memory"):
            bits.append("mem=%sMB" % per_node_text(s.memory_limit_mb, "%d"))
        if self.active("network"):
            if s.bandwidth_mbit:
                bits.append("bw=%gMbit" % s.bandwidth_mbit)
            if s.latency_ms > 0:
                bits.append("lat=%gms" % s.latency_ms)
        return ";".join(bits) or "off"

    def record(self) -> Dict[str, Any]:
        s = self.settings
        # cpu_quota_cores and memory_limit_mb: a number, or a list per node index
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
                "cgroups": [g.base for g in self._cgroups()]}

    def close(self) -> List[str]:
        """Tear everything down (stop the node processes first). Returns problems, if any."""
        problems: List[str] = []
        if self.net is not None:
            problems.extend(self.net.close())
            self.net = None
        for groups in self._cgroups():
            problems.extend(groups.cleanup())
        self.cpu = self.memory = None
        return problems


def remove_leftovers(resources: Dict[str, Any]) -> List[str]:
    """Remove what a crashed run listed in its state file (namespaces, bridge, cgroup dirs)."""
    problems: List[str] = []
    for ns in resources.get("netns") or []:
        if os.path.exists(os.path.join(NETNS_DIR, ns)):
            problems.extend(try_run(["ip", "netns", "del", ns]))
    bridge = resources.get("bridge")
    if bridge and os.path.exists("/sys/class/net/" + bridge):
        problems.extend(try_run(["ip", "link", "del", bridge]))
    for base in resources.get("cgroups") or []:
        if not base.startswith(CGROUP_ROOT + "/") or not os.path.isdir(base):
            continue
        for child in sorted(os.listdir(base)):
            if os.path.isdir(os.path.join(base, child)):
                problems.extend(rmdir_patiently(os.path.join(base, child), 1.0))
        problems.extend(rmdir_patiently(base, 1.0))
    return problems
