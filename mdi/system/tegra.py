"""Jetson (Tegra) helpers: is this a Jetson, which L4T release and what `tegrastats` says
(memory figures live in `mdi.system.memory`).

Stdlib only at import time, Python 3.8 compatible: every board imports it, and the probe script
runs it without torch. NVML does not work on Jetson (there is no nvidia-smi), so GPU load, power
rails and temperatures come from `tegrastats`, which prints one line per interval.
"""
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

TEGRA_RELEASE = "/etc/nv_tegra_release"
SENSOR_OFF_C = -256.0  # tegrastats prints this for a thermal zone that is powered down
# Rails that measure the whole module's input, by board family (TX2/Xavier NX/Orin NX and Nano:
# VDD_IN; Nano: POM_5V_IN). AGX Xavier and AGX Orin have none: their rails are summed instead.
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


def is_jetson(release_file: str = TEGRA_RELEASE) -> bool:
    """True on an NVIDIA Jetson (L4T release file, or a Tegra SoC in the device tree)."""
    if os.path.exists(release_file):
        return True
    try:
        with open("/proc/device-tree/compatible", "rb") as f:
            return b"nvidia,tegra" in f.read()
    except OSError:
        return False


_RELEASE_RE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)(?:\.(\d+))?")


def l4t_version(release_file: str = TEGRA_RELEASE) -> Optional[str]:
    """The L4T (Jetson Linux) release, e.g. "32.7.1" (JetPack 4.6.1) or "35.4.1" (JetPack 5.1.2).

    Read from /etc/nv_tegra_release ("# R35 (release), REVISION: 4.1, ..."), else from the
    version of the nvidia-l4t-core package; None when neither exists (not a Jetson).
    """
    try:
        with open(release_file, encoding="utf-8", errors="replace") as f:
            m = _RELEASE_RE.search(f.read())
        if m:
            return "%s.%s.%s" % (m.group(1), m.group(2), m.group(3) or "0")
    except OSError:
        pass
    try:
        out = subprocess.run(["dpkg-query", "--showformat=${Version}", "--show", "nvidia-l4t-core"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout.strip()) if out.returncode == 0 else None
    return "%s.%s.%s" % (m.group(1), m.group(2), m.group(3) or "0") if m else None


# --- tegrastats -----------------------------------------------------------------------------
# One line per interval; fields vary by board and JetPack (examples in tests/test_jetson_kit.py):
#   TX2, JetPack 4:     RAM 2040/7854MB (lfb 1027x4MB) SWAP 0/3927MB (cached 0MB) CPU [2%@345,off,...]
#                       EMC_FREQ 0%@1866 GR3D_FREQ 0%@114 ... GPU@37C ... VDD_IN 2058/2058 VDD_SYS_GPU 152/152
#   Xavier, JetPack 5:  ... GR3D_FREQ 0%@[0] ... VDD_IN 4044mW/4044mW VDD_CPU_GPU_CV 535mW/535mW
#   Orin, JetPack 6:    MM-DD-YYYY HH:MM:SS RAM ... GR3D_FREQ 0%@[305] ... VDD_IN 4712mW/4712mW
# Power rails read "NAME now/average" in mW (JetPack 5+ adds the unit); RAM and SWAP are
# system-wide, so they already count what the GPU holds.
_TIME = re.compile(r"^(\d\d-\d\d-\d{4} \d\d:\d\d:\d\d)\s")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)([kMG])B")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)([kMG])B(?: ?\(cached (\d+)([kMG])B\))?")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_FREQ = re.compile(r"\b(GR3D_FREQ|EMC_FREQ) (\d+)%(?:@\[?([\d,]+)\]?)?")
_TEMP = re.compile(r"\b([A-Za-z]\w*)@(-?\d+(?:\.\d+)?)C\b")
_RAIL = re.compile(r"\b([A-Za-z]\w*) (\d+)(?:mW)?/(\d+)(?:mW)?(?=\s|$)")
_TO_MB = {"k": 1.0 / 1024, "M": 1.0, "G": 1024.0}


def _mb(value: str, unit: str) -> int:
    return int(round(int(value) * _TO_MB[unit]))


def parse_tegrastats(line: str) -> Dict[str, Any]:
    """One tegrastats line as a dict; raises ValueError for a line without a RAM field.

    Keys (those the line lacks are left out): time (when tegrastats printed one),
    ram_used_mb, ram_total_mb, swap_used_mb, swap_total_mb, swap_cached_mb, cpu_load (percent
    per core, None for an offline core), cpu_freq_mhz, gpu_load (GR3D_FREQ percent),
    gpu_freq_mhz, emc_load, emc_freq_mhz, temp_c {zone: degrees}, power_mw {rail: now},
    power_avg_mw {rail: average}, input_power_mw and input_power_rail (VDD_IN or POM_5V_IN,
    else "sum" of all rails on boards without an input monitor: AGX Xavier, AGX Orin).
    """
    line = line.strip()
    ram = _RAM.search(line)
    if not ram:
        raise ValueError("not a tegrastats line (no RAM field): %r" % line[:80])
    out: Dict[str, Any] = {"ram_used_mb": _mb(ram.group(1), ram.group(3)),
                           "ram_total_mb": _mb(ram.group(2), ram.group(3))}
    stamp = _TIME.match(line)
    if stamp:
        out["time"] = stamp.group(1)
    swap = _SWAP.search(line)
    if swap:
        out["swap_used_mb"] = _mb(swap.group(1), swap.group(3))
        out["swap_total_mb"] = _mb(swap.group(2), swap.group(3))
        if swap.group(4) is not None:
            out["swap_cached_mb"] = _mb(swap.group(4), swap.group(5))
    cpu = _CPU.search(line)
    if cpu:
        loads: List[Optional[int]] = []
        freqs: List[Optional[int]] = []
        for core in cpu.group(1).split(","):
            load, _, freq = core.strip().partition("%@")
            on = load.rstrip("%").isdigit()
            loads.append(int(load.rstrip("%")) if on else None)
            freqs.append(int(freq) if on and freq.isdigit() else None)
        out["cpu_load"], out["cpu_freq_mhz"] = loads, freqs
    for name, load, freq in _FREQ.findall(line):
        key = "gpu" if name == "GR3D_FREQ" else "emc"
        out[key + "_load"] = int(load)
        # Orin lists one frequency per GPU cluster ("0%@[305,305]"): report the highest.
        mhz = [int(f) for f in freq.split(",") if f]
        if mhz:
            out[key + "_freq_mhz"] = max(mhz)
    temps = {name: float(c) for name, c in _TEMP.findall(line) if float(c) != SENSOR_OFF_C}
    if temps:
        out["temp_c"] = temps
    rails = _RAIL.findall(line)
    if rails:
        out["power_mw"] = {name: int(now) for name, now, _ in rails}
        out["power_avg_mw"] = {name: int(avg) for name, _, avg in rails}
        source = next((r for r in INPUT_RAILS if r in out["power_mw"]), None)
        out["input_power_rail"] = source or "sum"
        out["input_power_mw"] = out["power_mw"][source] if source else sum(out["power_mw"].values())
    return out


def run_tegrastats(interval_ms: int = 1000, command: str = "tegrastats") -> Iterator[str]:
    """Start `tegrastats --interval MS` and yield its lines; stops it when the caller stops.

    Some fields (GR3D_FREQ on JetPack 4) need root: run the caller with sudo for all of them.
    """
    proc = subprocess.Popen([command, "--interval", str(int(interval_ms))], stdout=subprocess.PIPE,
                            universal_newlines=True, bufsize=1)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            yield line
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


class TegraStatsReader:
    """The latest tegrastats line, kept by a daemon thread reading `tegrastats --interval MS`.

    For figures asked for over and over (a worker's /status, the dashboard) without starting
    tegrastats each time: `latest()` returns the newest parsed line, or None before the first
    one, when it is older than `stale` seconds, or when tegrastats cannot run.
    """

    def __init__(self, interval_ms: int = 1000, command: str = "tegrastats", stale: float = 10.0) -> None:
        self.interval_ms, self.command, self.stale = interval_ms, command, stale
        self._latest: Optional[Dict[str, Any]] = None
        self._at = 0.0
        self.failed: Optional[str] = None  # why tegrastats is not running
        self._thread = threading.Thread(target=self._read, name="mdi-tegrastats", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in run_tegrastats(self.interval_ms, self.command):
                try:
                    parsed = parse_tegrastats(line)
                except ValueError:
                    continue
                self._latest, self._at = parsed, time.monotonic()
            self.failed = "tegrastats exited"
        except (OSError, subprocess.SubprocessError) as e:
            self.failed = "cannot run %s: %s" % (self.command, e)

    def latest(self) -> Optional[Dict[str, Any]]:
        if self._latest is None or time.monotonic() - self._at > self.stale:
            return None
        return self._latest


_reader_lock = threading.Lock()
_reader: Optional[TegraStatsReader] = None


def shared_reader() -> Optional[TegraStatsReader]:
    """One `TegraStatsReader` per process, started on the first call on a Jetson that has
    tegrastats on its PATH; None elsewhere (no process is started off a Jetson)."""
    global _reader
    with _reader_lock:
        if _reader is None and is_jetson() and shutil.which("tegrastats"):
            _reader = TegraStatsReader()
        return _reader
