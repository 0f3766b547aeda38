"""The quantized kernels' measurements (mdi.model.quantization.kernel_choice) remembered per machine, so a
node loading the same shapes again, or a second node of one machine, measures nothing: a fresh
ring of 3 on SmolLM2 spent most of its first minute timing the same kernels on every node.

One JSON file in the profile cache ($MDI_PROFILE_CACHE, default ~/.cache/mdi), its entries
keyed by the machine (CPU, flags, cores, library versions: mdi.system.machine_cache) and the
shape key kernel_choice uses (spec, out, in, device, threads, policy). Written atomically; a file
from another version or an unreadable one is ignored (the kernels are measured again).
"""
import logging
from typing import Any, Dict, Optional, Tuple

from mdi.system.machine_cache import MachineCache, digest, machine_key

log = logging.getLogger(__name__)

CACHE = MachineCache("kernels.json", 2)  # entries: machine digest -> shape key -> measurements
_loaded: Dict[str, Any] = {}  # this machine's entries, read once per process


def key_text(key: Tuple) -> str:
    spec, n_out, n_in, device, threads, policy = key
    return "%s|%d|%d|%s|%d|%s" % (spec.label(), n_out, n_in, device, threads, policy)


def recall(key: Tuple) -> Optional[Dict[str, Any]]:
    """What was measured for `key` on this machine: {"decode": {kernel: s or None}, "prefill": ...,
    "notes": ..., "crossovers": {"decode|prefill": [rows, gain]}}; None when never measured."""
    if not _loaded:
        _loaded.update(CACHE.read().get(digest(machine_key()), {}))
    entry = _loaded.get(key_text(key))
    return entry if isinstance(entry, dict) else None


def remember(key: Tuple, entry: Dict[str, Any]) -> None:
    """Keep `key`'s measurements for this machine (merged into the file under its lock, so nodes
    starting side by side each add theirs)."""
    _loaded[key_text(key)] = entry
    try:
        CACHE.remember(key_text(key), entry)
    except RuntimeError as e:  # measured again next time
        log.warning("mdi: kernel measurements not remembered: %s", e)
