"""Attention's arithmetic for a chunk's decode and prefill rows: RoPE and scaled dot-product
attention against a sample's KV-cache slot.

Plain functions, one home for both paths: the eager blocks (mdi.model.transformer.Attention)
call them as Python and the scripted decode blocks (mdi.model.fused_decode) call them compiled,
so the two compute the same ops in the same order, bit for bit. They depend on torch alone:
neither caller imports the other for them.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout. rotate_half(x) * sin == roll(x, half) * [-sin, sin], bit for
    bit (negation is exact): 3 ops instead of 6, ~18 µs less per layer in a decode step."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def causal_mask(start: int, rows: int, groups: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """[groups * rows, start + rows]: which cached positions each of a sample's `rows` rows at
    positions start.. may see, for attend_sample's folded query axis (rows ordered (g, t)).
    `window` > 0: only the last `window` positions, its own included (sliding-window attention)."""
    t = torch.arange(rows, device=device).repeat(groups)
    keys = torch.arange(start + rows, device=device)[None, :]
    mask = keys <= (start + t)[:, None]
    if window > 0:
        mask = mask & (keys > (start + t - window)[:, None])
    return mask


def window_mask(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """A decode mask [S, 1, 1, len] (RowBatch.decode_index) narrowed to each row's last `window`
    positions."""
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (keys[None, None, None, :] > (positions - window)[:, None, None, None])


def _sdpa_with_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: Optional[float]) -> torch.Tensor:
    if scale is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_folding_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                        scale: Optional[float]) -> torch.Tensor:
    if scale is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # the scale folded into the queries (SDPA divides them by sqrt(D))
    return F.scaled_dot_product_attention(q * (scale * q.shape[-1] ** 0.5), k, v, attn_mask=mask)


# SDPA's `scale` argument came with torch 2.1: JetPack 5's torch 2.0 refused it (h36: every Gemma 3
# run on torch there failed at its first pass). Chosen here, not tested in the function: the
# TorchScript decode (mdi.model.fused_decode) scripts it and reads no Python global.
SDPA_TAKES_SCALE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 1)
sdpa = _sdpa_with_scale if SDPA_TAKES_SCALE else _sdpa_folding_scale


def attend_sample(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                  n_head: int, n_kv_head: int, head_dim: int, mask: Optional[torch.Tensor] = None,
                  window: int = 0, scale: Optional[float] = None) -> torch.Tensor:
    """One sample's T rows (qk [T, H + KV, D], v [T, KV, D]) at positions start.. against its
    own cache slot [KV, len, D], their keys and values written into it first. `mask`: the
    causal_mask of these rows when the caller holds it (the same in every layer of a pass, with
    this `window`). `window` > 0: each row sees its last `window` positions only (a sliding-window
    layer: one row reads just those). `scale`: the queries' (None: 1 / sqrt(head_dim))."""
    T = qk.shape[0]
    H, KV, D = n_head, n_kv_head, head_dim
    end = start + T
    k_cache[:, start:end] = qk[:, H:].transpose(0, 1)
    v_cache[:, start:end] = v.transpose(0, 1)
    # Grouped-query attention without repeating K/V: fold the G query heads that share a
    # KV head into the query-length axis, rows ordered (g, t).
    G = H // KV
    first = 0
    if T == 1:
        q = qk[:, :H].reshape(KV, G, D)
        mask = None
        if window > 0 and end > window:
            first = end - window
    else:
        q = qk[:, :H].transpose(0, 1).reshape(KV, G * T, D)
        if mask is None:
            mask = causal_mask(start, T, G, q.device, window)
    # 4-D: torch's CPU SDPA takes its fast path with a batch axis (3-D inputs: 1.7x the time)
    y = sdpa(q.unsqueeze(0), k_cache[:, first:end].unsqueeze(0), v_cache[:, first:end].unsqueeze(0), mask, scale)
    return y.reshape(1, H * D) if T == 1 else y.reshape(H, T, D).transpose(0, 1).reshape(T, H * D)


def attend_decode_rows(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       n_head: int, n_kv_head: int, head_dim: int, rows: int = 1,
                       scale: Optional[float] = None) -> torch.Tensor:
    """S samples of `rows` rows each (qk [S * rows, H + KV, D], v [S * rows, KV, D]) at
    `positions` [S * rows] in one SDPA call: their keys and values written with one indexed
    copy each, their caches [slots, KV, len, D] gathered up to the mask's length and the rest
    masked. Decode (one row each): mask [S, 1, 1, longest position + 1]. A recorded CUDA graph's
    step (mdi.model.graph_decode): whole slots, mask [S, 1, G * rows, len], its query rows
    ordered (g, t) as attend_sample folds them. A sliding-window layer passes its mask narrowed
    (window_mask). `scale`: the queries' (None: 1 / sqrt(head_dim))."""
    S = slots.shape[0]
    H, KV, D = n_head, n_kv_head, head_dim
    row_slots = slots if rows == 1 else slots[:, None].expand(S, rows).reshape(S * rows)  # no wait on a GPU
    k_cache[row_slots, :, positions] = qk[:, H:]
    v_cache[row_slots, :, positions] = v
    end = mask.shape[-1]
    keys = k_cache[:, :, :end].index_select(0, slots)
    values = v_cache[:, :, :end].index_select(0, slots)
    if rows == 1:
        q = qk[:, :H].reshape(S, KV, H // KV, D)
        return sdpa(q, keys, values, mask, scale).reshape(S, H * D)
    q = qk[:, :H].reshape(S, rows, H, D).transpose(1, 2).reshape(S, KV, H // KV * rows, D)
    y = sdpa(q, keys, values, mask, scale)
    return y.reshape(S, H, rows, D).transpose(1, 2).reshape(S * rows, H * D)
