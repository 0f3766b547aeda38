"""CPU and memory limits of node processes (cgroup v1), and their memory peaks.

- CPU: one cgroup v1 `cpu` group per node process, `cpu.cfs_quota_us / cpu.cfs_period_us`
  cores (0.5 = a board half as fast as one core of this machine).
- Memory: one cgroup v1 `memory` group per node process with `memory.limit_in_bytes`; groups
  are made under this process's own memory cgroup so whoever accounts for it still does.
Both need root; the *_unavailable_reason() functions say why they cannot be used.
"""
import math
import os
import time
from typing import Any, Callable, List, Optional, Tuple

from mdi.lab.commands import is_root

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_CPU = os.path.join(CGROUP_ROOT, "cpu")
CGROUP_MEMORY = os.path.join(CGROUP_ROOT, "memory")


def cgroup_unavailable_reason() -> Optional[str]:
    """None when cgroup v1 CPU quotas can be used, else why not."""
    return _controller_unavailable_reason(CGROUP_CPU, "cpu.cfs_quota_us", "cpu")


def memory_cgroup_unavailable_reason() -> Optional[str]:
    """None when cgroup v1 memory limits can be used, else why not."""
    return _controller_unavailable_reason(CGROUP_MEMORY, "memory.limit_in_bytes", "memory")


def _controller_unavailable_reason(root: str, probe: str, name: str) -> Optional[str]:
    if not is_root():
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


def own_cpu_cgroup() -> str:
    return _own_cgroup("cpu", CGROUP_CPU)


class _Cgroups:
    """Groups of one v1 controller made under one parent; cleanup() removes them."""

    root = CGROUP_ROOT
    controller = ""

    def __init__(self, prefix: str, parent: Optional[str] = None) -> None:
        self.home = _own_cgroup(self.controller, self.root)  # where this process came from
        self.base = os.path.join(parent or self.root, "%s_%d" % (prefix, os.getpid()))
        self.groups: List[str] = []
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
            problems.extend(rmdir_patiently(self.path(name)))
        self.groups = []
        problems.extend(rmdir_patiently(self.base))
        return problems


def rmdir_patiently(path: str, timeout: float = 5.0) -> List[str]:
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
        """`period_us`: the period asked for (None: the group's current one); a quota the kernel
        would refuse as too short lengthens the group's period instead (quota_and_period)."""
        p = self.path(name)
        period = int(period_us) if period_us is not None else _read_int(os.path.join(p, "cpu.cfs_period_us"))
        if cores is None:
            if period_us is not None:
                _write(os.path.join(p, "cpu.cfs_period_us"), period)
            _write(os.path.join(p, "cpu.cfs_quota_us"), -1)
            return
        quota, period = quota_and_period(cores, period)
        _write(os.path.join(p, "cpu.cfs_quota_us"), -1)  # a period shorter than the quota is refused
        _write(os.path.join(p, "cpu.cfs_period_us"), period)
        _write(os.path.join(p, "cpu.cfs_quota_us"), quota)


MIN_QUOTA_US = 1000  # the kernel refuses a shorter cpu.cfs_quota_us (EINVAL)


def quota_and_period(cores: float, period_us: int) -> Tuple[int, int]:
    """(quota, period) in µs for `cores` of CPU: the period asked for, unless the quota would be
    under the kernel's 1 ms; then a 1 ms quota over a period that long enough to keep the share
    (0.05 core over 10 ms periods: 1 ms per 20 ms, not the 1 ms per 10 ms, 0.1 core, it was)."""
    quota = int(round(cores * period_us))
    if quota >= MIN_QUOTA_US:
        return quota, int(period_us)
    return MIN_QUOTA_US, int(math.ceil(MIN_QUOTA_US / cores))


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
