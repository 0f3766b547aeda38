"""The starter's own compute for a pass, whichever backend its chunk is (mdi.model.backend).

torch's chunk takes a RowBatch and token ids as tensors on its device and gives tensors back.
ggml's takes a torch-free PassRows and numpy ids and gives numpy rows back, which its head and
the draw take as they are: a decode step's Python runs cold after each graph (the graph has just
streamed the weights through the caches), where every torch call costs tens of microseconds.
A ggml chunk holding the whole model (a one-node ring) also computes a decode pass's logits in
its blocks' graph (GgmlChunk.embed_forward_logits): the rows that come back are logits then.
"""
import contextlib
from typing import Any, Iterator, List, Sequence, Tuple

import numpy as np

from mdi.model.pass_rows import PassRows


# The most logits a ggml starter's head computes at once (4 bytes x vocabulary a row; 1 MB on
# Gemma 3's 262k): more samples are scored in groups, each drawn from before the next is
# computed, so a node's memory stays within its bound however many samples it serves (Gemma 3
# alone at 64 samples held 64 MB of them).
LOGITS_BUDGET_BYTES = 32 << 20


def head_rows(chunk: Any) -> int:
    """Rows whose logits `chunk`'s head computes at once (LOGITS_BUDGET_BYTES; torch's: no cap)."""
    if not takes_host_arrays(chunk):
        return 1 << 30
    return max(1, LOGITS_BUDGET_BYTES // (4 * int(chunk.config.vocab_size)))


def head_groups(pending: List[Tuple[Any, Any, Any]], rows: int) -> Iterator[List[Tuple[Any, Any, Any]]]:
    """`pending` (sample, epoch, rows) in runs of at most `rows` rows (a sample's own rows never split)."""
    group: List[Tuple[Any, Any, Any]] = []
    n = 0
    for item in pending:
        if group and n + item[2].shape[0] > rows:
            yield group
            group, n = [], 0
        group.append(item)
        n += item[2].shape[0]
    if group:
        yield group


def takes_host_arrays(chunk: Any) -> bool:
    """Whether `chunk` takes and gives numpy arrays (ggml's) rather than torch tensors."""
    return getattr(chunk, "backend", "torch") == "ggml"


def inference_mode(chunk: Any) -> Any:
    """torch's inference mode around a torch chunk's work; nothing around ggml's (whose
    starter then never imports torch)."""
    if takes_host_arrays(chunk):
        return contextlib.nullcontext()
    import torch
    return torch.inference_mode()


def computes_logits(chunk: Any) -> bool:
    """Whether `chunk` can run its head in its blocks' graph (embedding, blocks and head held)."""
    return hasattr(chunk, "embed_forward_logits") and chunk.with_embedding and chunk.with_head


def pass_inputs(host_arrays: bool, slots: List[int], starts: List[int], counts: List[int],
                adapters: List[int], verify: bool, ids: Sequence[int], device: Any) -> Tuple[Any, Any]:
    """(the pass's batch, its token ids) as the chunk takes them (`host_arrays`: ggml's numpy)."""
    if host_arrays:
        return PassRows(slots, starts, counts, adapters if any(adapters) else None, verify), \
            np.array(ids, dtype=np.int32)
    from mdi.model.row_batch import RowBatch  # torch's chunk: torch is loaded already
    from mdi.system.transfers import ints_to_device
    return RowBatch.of(slots, starts, counts, device, adapters, row_wise=verify), ints_to_device(ids, device)


def logits_of(chunk: Any, rows: List[Any], device: Any) -> Any:
    """The logits of the stacked `rows` (torch tensors or numpy arrays), on the host in one
    copy (one wait on a GPU); a ggml chunk's read where its head wrote them, valid until its next
    pass (the pipeline draws from them first)."""
    if all(isinstance(r, np.ndarray) for r in rows):  # a ggml chunk's, back through the local loop
        x = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return chunk.head(x, lend=True) if takes_host_arrays(chunk) else chunk.head(x)
    import torch

    from mdi.system.transfers import to_device, to_host
    tensors = [torch.from_numpy(r) if isinstance(r, np.ndarray) else r for r in rows]
    x = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return to_host(chunk.head(to_device(x, device)))
