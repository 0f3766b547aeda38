"""How much memory this process and this board hold: RSS, MemAvailable, CUDA allocations.

Stdlib only at import time (torch is asked only if some other module imported it), Python 3.8
compatible: every board imports it, and the Jetson probe runs it without torch.

Unified memory: a Jetson has one pool of RAM shared by the CPU and the GPU. What CUDA allocates
(torch's caching allocator, cuDNN workspaces) comes out of the same MemTotal as ordinary pages,
but it is not in the process's RSS: see `unified_memory_bytes`.
"""
import hashlib
import os
import resource
import sys
import time
from typing import Any, Dict, Optional, Sequence


def meminfo(path: str = "/proc/meminfo") -> Dict[str, int]:
    """/proc/meminfo in bytes ({"MemTotal": ..., "MemAvailable": ..., ...}); {} if unreadable.

    L4T kernels add NvMapMemUsed: the RAM currently handed to the GPU (nvmap) by all processes.
    """
    out: Dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for row in f:
                key, _, rest = row.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[key.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def available_memory_bytes() -> Optional[int]:
    """MemAvailable (Jetson RAM is shared by CPU and GPU, so this is the figure that matters
    there too), or less where this process's cgroup allows less (a container, mdi-bench's
    emulated boards); None where it cannot be read."""
    avail = meminfo().get("MemAvailable")
    limited = cgroup_memory_free()
    if limited is None:
        return avail
    return limited if avail is None else min(avail, limited)


def free_bytes_on(device: str = "cpu") -> Optional[int]:
    """Bytes a chunk can still take on `device` ("cpu", "cuda", "cuda:N"): for the CPU, and for
    a GPU that shares the board's RAM (a Jetson: torch says `is_integrated`), the host's
    `available_memory_bytes`; for a discrete GPU its own memory, which host RAM says nothing
    about: what the driver reports free (every process counted) plus what torch's allocator
    holds reserved but unused in this process (handed out before the driver is asked). Checking
    an H200's weights against the host's RAM let a plan put more on the GPU than it had and
    refused layers the GPU could hold. Where torch cannot say (not loaded, as in a node computing
    with ggml, or without CUDA), ggml's CUDA backend answers if this process loaded it. None
    where it cannot be read."""
    if not device.startswith("cuda"):
        return available_memory_bytes()
    for own in (_torch_gpu_free, _ggml_gpu_free):
        free = own(device)
        if free is not None:
            return free
    return available_memory_bytes()


def _torch_gpu_free(device: str) -> Optional[int]:
    """`device`'s free bytes as torch sees them (the host's for a GPU sharing its RAM); None
    where torch is not loaded or sees no CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        index = torch.device(device)
        if not torch.cuda.is_available():
            return None
        if getattr(torch.cuda.get_device_properties(index), "is_integrated", True):
            return available_memory_bytes()
        free, _ = torch.cuda.mem_get_info(index)
        return int(free) + int(torch.cuda.memory_reserved(index)) - int(torch.cuda.memory_allocated(index))
    except (RuntimeError, AssertionError, ValueError):
        return None


def _ggml_gpu_free(device: str) -> Optional[int]:
    """A discrete GPU's free bytes as ggml's device registry reports them, where this process
    loaded the ggml binding (never loaded here: a node that computes on torch does not need it);
    None where it has no such device."""
    gg = sys.modules.get("ggml.ggml")
    if gg is None:
        return None
    import ctypes  # (here: the board probe imports this module, its imports kept to a few stdlib ones)
    from mdi.system.devices import GGML_DEVICE_GPU, ggml_device_name
    try:
        dev = gg.ggml_backend_dev_by_name(ggml_device_name(device).encode())
        if not dev:
            return None
        if gg.ggml_backend_dev_type(dev) != GGML_DEVICE_GPU:  # an integrated one shares the host's RAM
            return available_memory_bytes()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        gg.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return int(free.value)
    except (AttributeError, OSError, TypeError):
        return None


# (limit file, usage file, reclaimable page-cache key in memory.stat) of cgroup v2 and v1. Only
# the inactive file pages count as free (the working set, as the kubelet computes it): the
# active ones include the mapped code of torch's libraries, ~100 MB that a process in use
# cannot give back without thrashing. Counting all the cache as free overstated a 400 MB
# board's room by that much, and its next load was OOM-killed.
_CGROUP_MEMORY_FILES = (("", "memory.max", "memory.current", "inactive_file"),
                        ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def cgroup_memory_free(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """What this process's memory cgroup (v2, or v1's `memory` controller) and its ancestors
    still allow: the tightest limit minus what is used there, inactive page cache not counted
    (the kernel reclaims it first); None without a limit."""
    try:
        with open(proc_cgroup) as f:
            entries = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    best: Optional[int] = None
    for controller, limit_file, usage_file, cache_key in _CGROUP_MEMORY_FILES:
        rel = next((e[2] for e in entries if e[1] == controller and (controller or e[0] == "0")), None)
        if rel is None:
            continue
        top = os.path.join(root, controller) if controller else root
        path = os.path.normpath(top + "/" + rel.lstrip("/"))
        while path.startswith(top):
            free = _cgroup_free(path, limit_file, usage_file, cache_key)
            if free is not None:
                best = free if best is None else min(best, free)
            if path == top:
                break
            path = os.path.dirname(path)
    return max(best, 0) if best is not None else None


def memory_pool(boot_id: str = "/proc/sys/kernel/random/boot_id", proc_cgroup: str = "/proc/self/cgroup") -> Optional[str]:
    """Which memory this process draws on, as a name equal for processes that share it (a
    digest, so no path leaves the board): this boot of this machine (its kernel's boot id, the
    same in a container), and the process's cgroups where one limits its memory (an emulated
    board's own). None where it cannot be told."""
    try:
        with open(boot_id) as f:
            pool = f.read().strip()
        if cgroup_memory_free(proc_cgroup) is not None:
            with open(proc_cgroup) as f:
                pool += "\n" + "".join(sorted(f))
    except OSError:
        return None
    return hashlib.sha256(pool.encode()).hexdigest()[:32]


def _cgroup_free(path: str, limit_file: str, usage_file: str, cache_key: str) -> Optional[int]:
    try:
        with open(os.path.join(path, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        with open(os.path.join(path, usage_file)) as f:
            used = int(f.read())
        cache = 0
        with open(os.path.join(path, "memory.stat")) as f:
            for row in f:
                key, _, value = row.partition(" ")
                if key == cache_key:
                    cache = int(value)
        return int(limit) - used + cache
    except (OSError, ValueError):
        return None


# Memory a worker keeps free besides the weights and cache it is asked to hold: what a run
# adds to an idle worker (zmq sockets and their threads, torch's thread pool, activations,
# frames, the float32 tiles of quantized weights the exact kernels expand per matmul). Measured
# under memory cgroups (mdi-bench): a GPT-2 12L/384 float32 worker at S = 6 adds ~16 MB (idle
# RSS 245 MB, running 261 MB plus weights and cache; with nothing kept, 8 layers ran on a 230
# MiB board and 9 were OOM-killed); SmolLM2's int4 blocks add ~25 MB (with 16 MB kept, a 190
# MiB board that passed the check for 3 layers was OOM-killed running them). With nothing kept,
# a 300 MB board told it could hold 149.5 MB took 143 MB and was killed. On ggml a run adds its
# graphs kept for reuse (up to 32 MB of buffers) and per-pass buffers that grow with the
# context: a Gemma 3 worker at 4 samples of 7,900 tokens added ~76 MB, and with 32 MB kept a
# 136 MB board that passed the check thrashed for minutes (h45). Loading adds nothing:
# tensors are read straight into their parameters (store.read_tensors_into). The worker's
# checks and the starter's figure of each worker's capacity use it; the starter keeps none for
# itself, as its own load check (capacity.starter_free_bytes).
LOAD_HEADROOM_BYTES = 64 * 1024 * 1024

_M_ARENA_MAX, _M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -8, -1, -3  # glibc's mallopt() parameter numbers
MMAP_THRESHOLD_BYTES = 4 << 20  # blocks this large get mappings of their own, unmapped when freed
TRIM_THRESHOLD_BYTES = 64 << 20  # free bytes the heap's top keeps (below it, every free would shrink it)


def _mallopt(settings: Dict[int, int], user_settings: Sequence[str]) -> bool:
    """glibc's mallopt(parameter, value) for each of `settings`, unless the user set one of the
    environment variables `user_settings` (theirs win); False where it cannot (not glibc)."""
    if any(os.environ.get(name) for name in user_settings):
        return False
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
        return all([bool(mallopt(parameter, value)) for parameter, value in settings.items()])
    except (AttributeError, OSError, TypeError):
        return False


def limit_malloc_arenas(arenas: int = 1) -> bool:
    """Have glibc's malloc keep at most `arenas` heaps (mallopt M_ARENA_MAX), unless the user
    set MALLOC_ARENA_MAX; False where it cannot (not glibc). A worker serves each HTTP request
    and each run on a new thread, and glibc gives threads their own arenas: memory one run's
    thread frees stays in its arena, and the next run's thread allocates afresh in another. A
    GPT-2 worker's RSS grew 33 MB over 12 runs, ~3 MB (a KV cache) a run; with one arena (and
    malloc_trim at a run's end) 1.5 MB over 10, at the same tokens/s (medians 211 vs 212 over
    12 interleaved runs). Called by an entry point before it starts threads."""
    return _mallopt({_M_ARENA_MAX: arenas}, ("MALLOC_ARENA_MAX",))


def fix_malloc_thresholds() -> bool:
    """Give glibc's malloc fixed thresholds (above), unless the user set MALLOC_MMAP_THRESHOLD_
    or MALLOC_TRIM_THRESHOLD_; False where it cannot (not glibc). Left to adjust itself, glibc
    raises its mmap threshold to the largest mapped block freed (up to 32 MB): after a node frees
    one graph buffer, later buffers and logits matrices come from the heap, whose holes stay
    resident. A Gemma 3 node alone at 16 samples of 500 words peaked at 592 MB, 567 with the heap
    trimmed when graphs are dropped, 536 with these too (the issue's bound is 546 there), at the
    same one-sample decode speed (15.4 against 15.1 tokens/s, medians of 3 alternations)."""
    return _mallopt({_M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES, _M_TRIM_THRESHOLD: TRIM_THRESHOLD_BYTES},
                    ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))


def rss_bytes() -> int:
    """This process's resident set (CPU pages only; see `unified_memory_bytes`)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM, the high-water mark of its own memory.
    Not ru_maxrss where VmHWM can be read: Linux keeps ru_maxrss across execve, so a worker
    started by a 300 MB process (a test run with torch loaded, a lab driver) reported that
    parent's size as its own peak. ru_maxrss (KiB on Linux) elsewhere, and never below the
    current RSS (it is updated lazily)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return max(int(line.split()[1]) * 1024, rss_bytes())
    except (OSError, ValueError, IndexError):
        pass
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes())


def cuda_reserved_bytes(peak: bool = False) -> int:
    """Bytes torch's CUDA caching allocator holds now (or at its peak), over all devices.

    0 when torch was never imported or CUDA never initialised: asking would import torch or
    create a CUDA context, which itself costs hundreds of MB on a Jetson.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    try:
        if not torch.cuda.is_initialized():
            return 0
        query = torch.cuda.max_memory_reserved if peak else torch.cuda.memory_reserved
        return sum(int(query(d)) for d in range(torch.cuda.device_count()))
    except (RuntimeError, AttributeError):
        return 0


def unified_memory_bytes(peak: bool = False) -> int:
    """RAM this process holds on a unified-memory board: RSS plus CUDA allocations.

    On a Jetson the GPU has no memory of its own: cudaMalloc takes pages from the same RAM
    through the nvmap driver. Those pages are not mapped as ordinary process memory, so they do
    not show in RSS (ps, /proc/self/statm, ru_maxrss) -- a worker holding 3 GB of fp16 weights on
    the GPU reports a few hundred MB of RSS -- and NVML, which would count them on a discrete
    GPU, does not work on Tegra. Count them as RSS + torch.cuda.memory_reserved() (reserved,
    not memory_allocated(): the allocator's cached blocks occupy RAM too). With peak=True the
    sum of the two peaks is returned, an upper bound since they need not coincide.

    System-wide, /proc/meminfo is already right on a Jetson: MemTotal - MemAvailable includes
    GPU allocations (NvMapMemUsed shows their share), and so does tegrastats' RAM figure. On a
    discrete GPU the result is host + device memory, two different pools.
    """
    return (peak_rss_bytes() if peak else rss_bytes()) + cuda_reserved_bytes(peak)


def memory_report() -> Dict[str, Optional[int]]:
    """This process and the board, in bytes: what a worker's /status or a probe can print."""
    info = meminfo()
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    return {"rss_bytes": rss_bytes(), "cuda_reserved_bytes": cuda_reserved_bytes(),
            "unified_bytes": unified_memory_bytes(), "peak_unified_bytes": unified_memory_bytes(peak=True),
            "total_bytes": total, "available_bytes": avail,
            "used_bytes": total - avail if total is not None and avail is not None else None,
            "nvmap_used_bytes": info.get("NvMapMemUsed")}


def board_memory() -> Dict[str, Any]:
    """The board's RAM in use and in total, in bytes, and where the figures come from:
    "tegrastats" on a Jetson where it runs (its RAM figure is the unified pool, CPU and GPU
    together; the first call starts a background reader, see `tegra.shared_reader`), else
    "meminfo" (MemTotal - MemAvailable, which on a Jetson also counts GPU allocations).
    Values are None where neither can be read."""
    from mdi.system import tegra
    reader = tegra.shared_reader()
    stats = reader.latest() if reader is not None else None
    if stats is not None:
        return {"used_bytes": stats["ram_used_mb"] << 20, "total_bytes": stats["ram_total_mb"] << 20,
                "source": "tegrastats"}
    info = meminfo()
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    return {"used_bytes": total - avail if total is not None and avail is not None else None,
            "total_bytes": total, "source": "meminfo" if total is not None else None}


_malloc_trim: list = []  # [glibc's malloc_trim or None], looked up once


def collect_freed_memory() -> None:
    """Free what was let go of with reference cycles (a chunk, a ring: their closures hold
    tensors and ggml buffers until Python's cycle collector runs, which counts none of their
    bytes), then hand the heap's free pages back (release_freed_memory)."""
    import gc
    gc.collect()
    release_freed_memory()


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).
    Picking a quantized layer's kernel allocates and frees temporaries of tens of MB between
    tensors that stay; glibc keeps such holes resident, ~150 MB over a 1.1B int4 model."""
    if not _malloc_trim:
        import ctypes
        try:
            _malloc_trim.append(ctypes.CDLL(None).malloc_trim)
        except (AttributeError, OSError, TypeError):  # not glibc
            _malloc_trim.append(None)
    if _malloc_trim[0] is not None:
        _malloc_trim[0](0)


IDLE_TRIM_S = 5.0  # seconds without work after which a process gives its heap's free pages back


class IdleTrim:
    """Gives the C heap's free pages back once its process has been idle IDLE_TRIM_S after some
    work: glibc keeps resident what a burst of requests freed (graph buffers, prefix cache
    copies, logits), 50-66 MB a process after a serving soak, which malloc_trim returned (h54).
    Once per idle spell: trimming costs a walk of the heap, and nothing is freed while idle."""

    def __init__(self, after_s: float = IDLE_TRIM_S) -> None:
        self.after_s = after_s
        self._worked: Optional[float] = None  # when the last work was noted, until the next trim

    def worked(self) -> None:
        self._worked = time.monotonic()

    def idle(self) -> None:
        if self._worked is not None and time.monotonic() - self._worked >= self.after_s:
            self._worked = None
            release_freed_memory()
