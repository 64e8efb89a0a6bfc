"""Plain-torch row transfers over a list of peer buffers: the reference for the Triton kernels
in `row_transfer.py` and their CPU fallback.

Same semantics as `put_rows` / `get_rows`, with `buffers[m]` ([C, H]) in place of the peer
table entry m. No host synchronization: dropped routes are handled by masking
(torch.where), never by boolean indexing or `.item()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _kept(dest_rank: torch.Tensor, dest_row: torch.Tensor):
    rank, row = dest_rank.long(), dest_row.long()
    kept = (rank >= 0) & (row >= 0)
    return rank, torch.where(kept, row, 0), kept


def put_rows_ref(src: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
                 buffers: Sequence[torch.Tensor], row_scale: torch.Tensor | None = None) -> None:
    """buffers[dest_rank[t, k]][dest_row[t, k]] = src[t] (* row_scale[t, k] in fp32) for kept routes.

    Each buffer gets one index_put_ over all T*K routes. A dropped route (or one for another
    rank) must write *something*, and must not disturb a kept write: it repeats the write of
    the first kept route to this buffer (same row, same value), or, when the buffer receives
    nothing, rewrites row 0 with its own current value. Both choices are found on device.
    """
    T, H = src.shape
    rank, row, kept = _kept(dest_rank, dest_row)
    if row_scale is None:
        values = src.unsqueeze(1).expand(T, rank.shape[1], H)
    else:
        values = (src.float().unsqueeze(1) * row_scale.float().unsqueeze(-1)).to(src.dtype)
    values, rank, row, kept = values.reshape(-1, H), rank.flatten(), row.flatten(), kept.flatten()
    if values.shape[0] == 0:
        return
    for m, buf in enumerate(buffers):
        mine = kept & (rank == m)
        first = torch.argmax(mine.int()).view(1)  # first kept route to m (0 if none); 1-D: no .item()
        has_any = mine[first]
        filler_row = torch.where(has_any, row[first], 0)
        filler_value = torch.where(has_any.unsqueeze(1), values[first].to(buf.dtype), buf[:1])
        buf.index_put_((torch.where(mine, row, filler_row),),
                       torch.where(mine.unsqueeze(1), values.to(buf.dtype), filler_value))


def get_rows_ref(buffers: Sequence[torch.Tensor], dest_rank: torch.Tensor, dest_row: torch.Tensor,
                 out: torch.Tensor, weights: torch.Tensor | None = None,
                 gathered: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * buffers[dest_rank[t, k]][dest_row[t, k]], summed over k in
    order in fp32; dropped routes add exactly 0 (even if the row or weight is NaN). `gathered`
    [T, K, H], if given, receives the fetched rows (0 for dropped). Returns out."""
    T, H = out.shape
    rank, row, kept = _kept(dest_rank, dest_row)
    fetched = torch.zeros(T, rank.shape[1], H, dtype=buffers[0].dtype, device=out.device)
    for m, buf in enumerate(buffers):
        rows_m = buf.index_select(0, row.flatten()).view(fetched.shape)
        fetched = torch.where((kept & (rank == m)).unsqueeze(-1), rows_m, fetched)
    acc = torch.zeros(T, H, dtype=torch.float32, device=out.device)
    for k in range(rank.shape[1]):
        row_k = fetched[:, k].float()
        if weights is not None:
            row_k = torch.where(kept[:, k], weights[:, k].float(), 0.0).unsqueeze(-1) * row_k
        acc = acc + row_k
    out.copy_(acc)
    if gathered is not None:
        gathered.copy_(fetched)
    return out
