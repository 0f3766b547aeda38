"""Which samples a pass's stacked rows belong to, without torch: sample i owns `counts[i]`
consecutive rows at positions starts[i].., its keys and values in cache slot `slots[i]`.

The ggml backend reads a pass as this (mdi.model.row_batch.RowBatch, torch's, has the same
fields and more); a node computing with ggml builds it without importing torch.
"""
from dataclasses import dataclass
from typing import List, Optional


@dataclass
class PassRows:
    slots: List[int]
    starts: List[int]
    counts: List[int]
    adapters: Optional[List[int]] = None  # each sample's adapter id (0: the base model alone)
    row_wise: bool = False

    @property
    def rows(self) -> int:
        return int(sum(self.counts))
