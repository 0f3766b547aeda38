"""What a node's kernel report says, read without torch: the weight matrices per kernel and
a one-line summary of `kernel_choice.chosen_by_weight()`'s texts (which kernel_choice writes;
the starter's and every worker's reach /metrics, /v1/mdi/state and the run summary, whatever
the reading node computes with)."""
import re
from typing import Dict, Mapping

DOES_NOT_RUN = "does not run here on"  # a named kernel that does not apply to a layer, as reports say it

# In a why, kernel_choice._prefill_pick's words: a second kernel kept, or one the node's memory did not spare.
_SECOND_KERNEL = re.compile(r"; prefill: (\S+) from (\d+) rows")
_NOT_SPARED = re.compile(r"; prefill: \S+ \((\S+) would be [0-9.]+x faster")
_MATRICES = re.compile(r"; on (\d+) matri(?:x|ces)$")  # chosen_by_weight's count (absent: one)
_NOT_RUN = re.compile(r"^\S+: policy (\S+): \S+ " + DOES_NOT_RUN)


def _matrices(text: str) -> int:
    many = _MATRICES.search(text)
    return int(many.group(1)) if many else 1


def kernel_counts(kernels: Mapping[str, str]) -> Dict[str, int]:
    """Weight matrices per kernel over `chosen_by_weight()`'s texts (a node's report)."""
    counts: Dict[str, int] = {}
    for text in kernels.values():
        name = text.split(":", 1)[0]
        counts[name] = counts.get(name, 0) + _matrices(text)
    return counts


def summary(kernels: Mapping[str, str]) -> str:
    """'int4pack-cpu x90, int8dyn-fbgemm x31' over the weight matrices of `chosen_by_weight()`;
    where some keep a second kernel for prefill passes, '; prefill passes from 8-16 rows:
    int8dyn-fbgemm x60 (a second copy each)', and where the memory did not spare one, '; faster
    for prefill but not spared ...'."""
    counts = kernel_counts(kernels)
    prefill: Dict[str, int] = {}
    refused: Dict[str, int] = {}
    rows = set()
    not_run: Dict[str, int] = {}
    for text in kernels.values():
        n = _matrices(text)
        named = _NOT_RUN.search(text)
        if named:
            not_run[named.group(1)] = not_run.get(named.group(1), 0) + n
        second, spared = _SECOND_KERNEL.search(text), _NOT_SPARED.search(text)
        if second:
            prefill[second.group(1)] = prefill.get(second.group(1), 0) + n
            rows.add(int(second.group(2)))
        elif spared:
            refused[spared.group(1)] = refused.get(spared.group(1), 0) + n
    text = _counted(counts)
    if prefill:
        text += "; prefill passes from %s rows: %s (a second copy each)" % (
            "-".join(str(r) for r in sorted({min(rows), max(rows)})), _counted(prefill))
    if refused:
        text += "; faster for prefill but not spared by the node's memory: %s" % _counted(refused)
    for name, n in sorted(not_run.items()):
        text += "; %s (runtime.quant_kernel) does not run on %d of them" % (name, n)
    return text


def _counted(counts: Mapping[str, int]) -> str:
    return ", ".join("%s x%d" % kv for kv in sorted(counts.items()))
