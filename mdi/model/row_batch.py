"""Several samples in one forward (ORCA's selective batching): their token rows are stacked, so
every linear layer and norm reads its weights once for all of them, and only attention runs per
sample, against that sample's own cache slot and positions. A `RowBatch` says which rows are
whose."""
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from mdi.model.attention import causal_mask, window_mask
from mdi.system.transfers import ints_to_device, to_device

ROW_WISE_ENV = "MDI_ROW_WISE_VERIFY"  # "1" / "0": verification rows attend row by row / in one call, on any device


def verifies_row_by_row(device: Optional[torch.device]) -> bool:
    """Whether a verification's rows attend one by one (`RowBatch.row_wise`) on `device`.

    On a CPU, yes: a row's bits then equal its one-row decode step's. On a GPU, no. There each
    row's attention is its own handful of kernel launches, and a decode step is bound by
    launches, not arithmetic: row by row, a pass of 9 rows cost 2.19 one-row passes on an H200
    (SmolLM2 shape, float16), in one call 1.2 (with sample_mask). Nor did row by row keep the
    bits there: the linear layers multiply a pass's rows together in other tilings than one
    row's, and in float16 the greedy ids of a random 1.1B model parted from the plain run's as
    often either way (results/gpu/README.md). $MDI_ROW_WISE_VERIFY ("1" / "0") forces either
    way, to compare."""
    forced = os.environ.get(ROW_WISE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return device is None or torch.device(device).type != "cuda"


def decode_window_key(window: int) -> Tuple[int, int, int]:
    """RowBatch.window_masks' key of the decode mask (decode_index's, or a recorded step's over
    whole slots: mdi.model.graph_decode) narrowed to a sliding window."""
    return (-1, 1, window)


@dataclass
class RowBatch:
    """Which samples a stack of token rows belongs to: sample i owns `counts[i]` consecutive
    rows, at positions starts[i].., and its keys and values live in cache slot `slots[i]`."""
    slots: List[int]
    starts: List[int]
    counts: List[int]
    positions: torch.Tensor  # [rows] the absolute position of every row
    rope_tables: Optional[tuple] = None  # (cos, sin) of those positions, filled by the first layer
    local_rope_tables: Optional[tuple] = None  # the same for sliding-window layers' own RoPE base (Gemma 3)
    decode_tables: Optional[tuple] = None  # (slots, positions, mask) of one-row samples, filled once
    # Each multi-row sample's causal mask by (sample, query heads per KV head), built at its
    # first layer: ~5 small ops a layer, launches that a GPU's several-row passes paid 30 times.
    sample_masks: Dict[Tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # The same for sliding-window layers, by (sample or -1 for decode_index's, groups, window)
    window_masks: Dict[Tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    adapters: Optional[List[int]] = None  # each sample's adapter id (0: the base model alone)
    # Each row attends as the one-row decode step at its position would (speculative
    # verification): attention kernels round differently for one query row than for several,
    # and where the linear layers round to bfloat16 that difference can change a greedy token.
    # A row's bits then do not depend on how many rows its pass carried. Where it pays
    # (`verifies_row_by_row`): `of` leaves it off on a GPU.
    row_wise: bool = False
    # Every sample with the same rows, attending in one call through `decode_tables` alone,
    # whatever the samples' count and positions (a recorded CUDA graph's step,
    # mdi.model.graph_decode: the Python-side slots and starts are placeholders there).
    whole_slots: bool = False

    @classmethod
    def of(cls, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int],
           device: Optional[torch.device] = None, adapters: Optional[Sequence[int]] = None,
           row_wise: bool = False) -> "RowBatch":
        if not (len(slots) == len(starts) == len(counts)) or not slots:
            raise ValueError("a row batch needs as many slots, starts and counts, at least one")
        if adapters is not None and len(adapters) != len(slots):
            raise ValueError("a row batch needs one adapter id per sample")
        if all(c == 1 for c in counts):  # decode: one row per sample, at its start (one op, not S + 1)
            positions = torch.tensor(starts, dtype=torch.long)
        else:
            positions = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])
        return cls(list(slots), list(starts), list(counts), to_device(positions, device) if device is not None else positions,
                   adapters=list(adapters) if adapters is not None and any(adapters) else None,
                   row_wise=row_wise and verifies_row_by_row(device))

    def adapter_rows(self, device: torch.device) -> List[Tuple[int, Any]]:
        """(adapter id, the rows of its samples) for every adapter used (the base alone: none):
        a slice where they are consecutive (the starter orders a frame's samples by adapter),
        else an index tensor."""
        if not self.adapters:
            return []
        rows: Dict[int, List[int]] = {}
        row = 0
        for adapter, count in zip(self.adapters, self.counts):
            if adapter:
                rows.setdefault(adapter, []).extend(range(row, row + count))
            row += count
        return [(a, slice(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else ints_to_device(r, device))
                for a, r in sorted(rows.items())]

    def decode_index(self, device: torch.device, window: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For samples of one row each: their slots and positions as tensors, and the mask
        [S, 1, 1, longest] that lets each row see its own cache up to its position (`window` > 0:
        its last `window` positions only)."""
        if self.decode_tables is None:
            slots = ints_to_device(self.slots, device)
            positions = to_device(self.positions, device)
            end = max(s + c for s, c in zip(self.starts, self.counts))
            mask = torch.arange(end, device=device)[None, :] <= positions[:, None]
            self.decode_tables = (slots, positions, mask[:, None, None, :])
        if window <= 0:
            return self.decode_tables
        slots, positions, mask = self.decode_tables
        key = decode_window_key(window)
        if key not in self.window_masks:
            self.window_masks[key] = window_mask(mask, positions, window)
        return slots, positions, self.window_masks[key]

    def sample_mask(self, index: int, groups: int, device: torch.device, window: int = 0) -> Optional[torch.Tensor]:
        """attention.causal_mask of sample `index`'s rows (None for one row), built once a pass."""
        count = self.counts[index]
        if count == 1:
            return None
        if window > 0:
            wkey = (index, groups, window)
            if wkey not in self.window_masks:
                self.window_masks[wkey] = causal_mask(self.starts[index], count, groups, device, window)
            return self.window_masks[wkey]
        key = (index, groups)
        mask = self.sample_masks.get(key)
        if mask is None:
            mask = self.sample_masks[key] = causal_mask(self.starts[index], count, groups, device)
        return mask

    @property
    def rows(self) -> int:
        return int(sum(self.counts))

    def last_rows(self) -> List[int]:
        """The index of each sample's last row (the one a generation pass samples from)."""
        out, row = [], 0
        for c in self.counts:
            row += c
            out.append(row - 1)
        return out


# One SDPA call for several one-row samples gathers their caches (a copy) up to the longest:
# it saves ~9 small ops per sample and layer, but the copy grows with the context. Measured on
# SmolLM2 int4 (10 layers, 1 thread; kv_heads x head_dim = 192): 0.91x the per-sample time for 4
# samples at position 64, equal at ~512, 1.17x at 1900 (8 samples at 1900: 3.7x). So only while
# each sample's keys up to the longest position are at most this many values.
ONE_CALL_MAX_CACHE = 1 << 16


def attends_in_one_call(batch: RowBatch, kv_values_per_position: int) -> bool:
    """Whether a batch of one-row samples attends in one SDPA call (ONE_CALL_MAX_CACHE)."""
    return batch.rows == len(batch.slots) and (max(batch.starts) + 1) * kv_values_per_position <= ONE_CALL_MAX_CACHE
