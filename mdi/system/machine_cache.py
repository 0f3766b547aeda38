"""Measurements remembered per machine: JSON files in the profile cache folder
($MDI_PROFILE_CACHE, default ~/.cache/mdi) that the nodes of one machine share: the backends'
(mdi.model.backend), the quantized kernels' (mdi.model.quantization.kernel_memory) and the planner's
(mdi.starter.planning.node_speeds).

A versioned file holds {"version": N, "entries": {...}}; one from another version, or one that
cannot be read, reads as empty (what it held is measured again). Writes go to a temporary file
renamed into place, under an exclusive lock that nodes starting side by side take in turn.
"""
import contextlib
import fcntl
import hashlib
import importlib.metadata as importlib_metadata
import json
import logging
import os
import platform
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Set, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_SAID_DAMAGED: Set[str] = set()  # cache files whose damage was said (MachineCache._damaged)
_SAID_UNWRITABLE: Set[str] = set()  # cache files found unwritable, said once (MachineCache.write)
MERGE_WAIT_S = 60.0  # for another process's merge into a file: milliseconds
MEASURE_WAIT_S = 300.0  # for another process's measurement: seconds (a minute on a busy board)
_HELD = threading.local()  # .paths: the cache files whose lock this thread holds


def cache_dir() -> str:
    return os.environ.get("MDI_PROFILE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mdi")


def machine_key() -> Dict[str, object]:
    """What a measurement on this machine depends on besides its shapes: the CPU (model name and
    flags), the core count, and the compute libraries' versions (read from their installed
    metadata: nothing imported)."""
    cpu, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith(("flags", "Features")) and not flags:
                    flags = hashlib.sha256(line.split(":", 1)[1].encode()).hexdigest()[:16]
    except OSError:
        pass
    versions: Dict[str, Optional[str]] = {}
    for dist in ("torch", "ggml-python"):
        try:
            versions[dist] = importlib_metadata.version(dist)
        except Exception:
            versions[dist] = None
    key: Dict[str, object] = {"cpu": cpu, "flags": flags, "cores": os.cpu_count(), "machine": platform.machine(),
                              "versions": versions}
    build = _ggml_build()
    if build:  # (absent where ggml is not installed: the keys from before stay valid there)
        key["ggml_build"] = build
    return key


def _ggml_build() -> Optional[str]:
    """Which build of the binding's libraries is installed (their sizes and times): one version
    rebuilt for another ISA (an AVX2 build beside AVX-512, ggml-cuda) had kept the choices the
    other build measured."""
    import importlib.util
    spec = importlib.util.find_spec("ggml")  # found, not imported
    if spec is None or not spec.origin:
        return None
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    try:
        stats = [(name, os.stat(os.path.join(lib, name))) for name in sorted(os.listdir(lib)) if ".so" in name
                 or name.endswith((".dylib", ".dll"))]
    except OSError:
        return None
    return digest([(name, st.st_size, int(st.st_mtime)) for name, st in stats])[:16] if stats else None


def digest(key: Any) -> str:
    """A stable name for a JSON-able key."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


class MachineCache:
    """One versioned JSON file of entries in the cache folder."""

    def __init__(self, name: str, version: int) -> None:
        self.name, self.version = name, version

    @property
    def path(self) -> str:
        return os.path.join(cache_dir(), self.name)

    def read(self) -> Dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self._damaged(str(e))
            return {}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            self._damaged("not {\"version\": N, \"entries\": {...}}")
            return {}
        if data.get("version") != self.version:  # another mdi's file: measured again, quietly
            return {}
        # an entry of another shape (a hand edit, another program) is measured again, never a traceback
        return {k: v for k, v in data["entries"].items() if isinstance(v, dict)}

    def _damaged(self, why: str) -> None:
        """One line, once per process and file: what it held is measured again (and written anew)."""
        if self.path not in _SAID_DAMAGED:
            _SAID_DAMAGED.add(self.path)
            log.warning("mdi: %s cannot be read (%s): what it held is measured again", self.path, why)

    def write(self, entries: Dict[str, Any]) -> None:
        """Replace the file's entries (a read-only folder: measured again next time, said once)."""
        path = os.path.realpath(self.path)  # a linked cache file keeps its link (its target is written)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"version": self.version, "entries": entries}, f)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # none left behind (a folder where the file should be: one a start)
            if self.path not in _SAID_UNWRITABLE:  # (it had been a debug line: every start measured, unsaid)
                _SAID_UNWRITABLE.add(self.path)
                log.warning("mdi: cannot keep measurements in %s (%s): each start measures again; set "
                            "$MDI_PROFILE_CACHE to a writable folder", self.path, e.strerror or e)

    def recall(self, key: str) -> Any:
        """What this machine (machine_key) remembered under `key`, or None."""
        return self.read().get(digest(machine_key()), {}).get(key)

    def remember(self, key: str, value: Any, wait_s: float = MERGE_WAIT_S) -> None:
        """Keep `value` under `key` for this machine, beside what other processes kept (a
        RuntimeError from `locked` where another holds the file too long: measured again next time)."""
        with self.locked(wait_s):
            machines = self.read()
            machines.setdefault(digest(machine_key()), {})[key] = value
            self.write(machines)

    def recall_or_measure(self, recall: Callable[[], Optional[T]], measure: Callable[[], T],
                          wait_s: float = MEASURE_WAIT_S) -> T:
        """`recall()`, else `measure()` (which keeps its result here with `remember`) under this
        file's lock, so a second process waits and then recalls the first's result instead of
        timing beside it (each timing the other's load); past `wait_s` it measures anyway, and
        says so."""
        got = recall()
        if got is not None:
            return got
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.locked(wait_s))
            except RuntimeError as e:
                log.warning("mdi: %s: measuring beside it", e)
            got = recall()  # measured by another process while this one waited
            return got if got is not None else measure()

    @contextlib.contextmanager
    def locked(self, wait_s: float) -> Iterator[None]:
        """This file's exclusive lock (none where the folder cannot be written); RuntimeError
        after `wait_s` seconds held by another process. Re-entrant in one thread (recall_or_measure's
        `measure` keeps its result with `remember`)."""
        held = getattr(_HELD, "paths", None)
        if held is None:
            held = _HELD.paths = set()
        if self.path in held:
            yield
            return
        held.add(self.path)
        try:
            with self._flocked(wait_s):
                yield
        finally:
            held.discard(self.path)

    @contextlib.contextmanager
    def _flocked(self, wait_s: float) -> Iterator[None]:
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            lock = open(os.path.realpath(self.path) + ".lock", "w")  # beside what is written (a link's target)
        except OSError:
            yield
            return
        with lock:
            deadline = time.monotonic() + wait_s
            said = False
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not said:  # a second starter on this machine waited 7 s here without a word
                        said = True
                        log.info("mdi: waiting for another process on this machine to finish measuring (%s, up to "
                                 "%.0f s)", self.name, wait_s)
                    if time.monotonic() > deadline:
                        raise RuntimeError("another process on this machine has held %s for over %.0f s"
                                           % (lock.name, wait_s))
                    time.sleep(0.2)
            yield
