"""How the samples of one frame lay out their rows: which of them carry a soft prompt's virtual
tokens, which samples share a frame so that each adapter's delta is added once, and which rows
of a frame that came back are whose."""
from typing import Any, Iterator, List, Tuple

import numpy as np

from mdi.ring.wire import Frame
from mdi.starter.sample import Sample


def virtual_rows(group: List[Sample], starts: List[int], counts: List[int], host_arrays: bool):
    """(rows, embeddings) of the virtual tokens a pass carries (soft prompts), else None: numpy
    arrays for a chunk that takes them (ggml's), else torch tensors viewing them."""
    rows: List[int]
    rows, values, row = [], [], 0
    for sample, start, count in zip(group, starts, counts):
        n = sample.virtual
        if sample.soft_prompt is not None and start < n:  # n is 0 without one
            end = min(n, start + count)
            rows.extend(range(row, row + end - start))
            values.append(sample.soft_prompt[start:end])
        row += count
    if not rows:
        return None
    out = np.array(rows, dtype=np.int64), np.concatenate(values)
    if host_arrays:
        return out
    from mdi.system.transfers import torch_view  # a torch chunk's: torch is loaded already
    return torch_view(out[0]), torch_view(out[1])


def adapters_together(ready: List[Sample], max_batch: int) -> List[Sample]:
    """`ready` (shortest pass first) reordered for filling one frame: the shortest pass leads,
    then the passes of the adapters already in the frame, then the rest in order. A node adds
    each distinct adapter's delta once per frame, so a frame's adapter cost grows with the
    adapters in it: 8 samples over 4 adapters in frames of 3 go as 2 + 2 + 1 adapters instead
    of 3 + 3 + 2. A frame still holds at most `prefill_chunk` prompt tokens, and the passes
    that circulate together after prefill keep this grouping."""
    if len(ready) <= max_batch or not any(s.adapter for s in ready):
        return ready
    chosen: List[Sample] = []
    rest = list(ready)
    while rest and len(chosen) < max_batch:
        # The shortest pass left leads (or tops the frame up) and pulls in its adapter's fellows.
        head = rest.pop(0)
        same = [s for s in rest if s.adapter == head.adapter][:max_batch - len(chosen) - 1]
        chosen += [head] + same
        taken = set(id(s) for s in same)  # by identity: a Sample's == compares its tensors
        rest = [s for s in rest if id(s) not in taken]
    return chosen + rest


def returned_rows(frame: Frame) -> Iterator[Tuple[int, int, int, Any]]:
    """(slot, count, epoch, rows) of each sample in a frame back from the ring, whose rows are
    either every position of every sample or only each one's last."""
    tensor = frame.tensor
    assert tensor is not None, "a frame without rows carries no sample's"
    all_rows, row = tensor.shape[0] == sum(frame.count), 0
    for slot, count, epoch in zip(frame.samples, frame.count, frame.epoch_ids()):
        rows = tensor[row:row + (count if all_rows else 1)]
        row += rows.shape[0]
        yield slot, count, epoch, rows
