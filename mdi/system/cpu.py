"""What CPU a figure was measured on: its instruction sets decide which kernels are fast.

The same benchmark on two machines "of the same kind" differed 2.5x because one CPU had
AVX-512 with bfloat16 instructions and the other AVX2 only (torch's packed int4 kernel computes
in bfloat16). Every benchmark record carries `cpu_info()` so that a figure says where it holds.
"""
import functools
import os
import platform
import sys
from typing import Any, Dict, List

# The flags that change which quantized kernel wins (x86: /proc/cpuinfo "flags"; ARM: "Features").
FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8",
                     "neon", "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm")


def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    out: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return out


def cpu_info() -> Dict[str, Any]:
    """{"model", "machine", "cores", "isa" (torch's CPU capability: AVX2, AVX512, ...),
    "flags" (those of FLAGS_THAT_MATTER this CPU has)}."""
    return dict(_cpu_info())


@functools.lru_cache(maxsize=1)
def _cpu_info() -> Dict[str, Any]:  # read once: a worker's /status, polled as a heartbeat, names its CPU
    fields = _cpuinfo()
    have = set((fields.get("flags") or fields.get("features") or "").split())
    flags: List[str] = [f for f in FLAGS_THAT_MATTER if f in have]
    isa = None
    torch = sys.modules.get("torch")  # asked where loaded: a node computing with ggml never loads it
    if torch is not None:
        try:
            isa = torch.backends.cpu.get_cpu_capability()
        except (AttributeError, RuntimeError):  # torch < 2.1 has no get_cpu_capability
            isa = None
    if isa is None:  # torch's rule from the flags: its AVX512 kernels need F, BW, VL and DQ
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have:
            isa = "AVX512"
        elif {"avx2", "fma"} <= have:
            isa = "AVX2"
        elif have:
            isa = "DEFAULT"
    model = fields.get("model name") or fields.get("hardware") or fields.get("cpu part") or platform.processor()
    return {"model": model, "machine": platform.machine(), "cores": os.cpu_count(), "isa": isa, "flags": flags}


def isa_text(info: Dict[str, Any]) -> str:
    """'AVX2 (avx2), 2 cores, AMD EPYC' for tables and log lines."""
    return "%s (%s), %s cores, %s" % (info.get("isa") or "?", " ".join(info.get("flags") or []) or "no flag listed",
                                      info.get("cores"), info.get("model") or "unknown CPU")
