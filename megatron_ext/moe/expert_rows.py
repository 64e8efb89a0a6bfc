"""Per-row views of an expert buffer on device end offsets: which rows are valid, and each
row's expert bias. No host read: the offsets stay on the device.

A buffer holds offsets[-1] valid rows (expert-major: expert e owns rows
[offsets[e-1], offsets[e])) followed by a tail whose contents must never reach a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowGroups:
    """What the rowwise dispatcher hands the experts as `tokens_per_expert` (the argument Megatron's
    MoELayer passes through): rows per local expert and their int32 end offsets, both on the device
    and both from the route map (so the experts run no cumsum of their own), and the MXFP8 payload
    (moe/mxfp8_dispatch.py) when rows travel as MXFP8, or where the rows live in a dropless arena."""

    counts: torch.Tensor  # [L] int32
    offsets: torch.Tensor  # [L] int32, torch._grouped_mm's end offsets
    payload: object = None  # an MXFP8Payload, or None for rows in the experts' dtype
    arena: object = None  # moe/arena_rows.ArenaRows when the rows live in a dropless arena


def valid_row_mask(valid_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] bool: row < valid_rows (a device scalar)."""
    return torch.arange(rows, device=valid_rows.device) < valid_rows


def row_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64 local expert of each row (tail rows get the last expert: nothing reads them)."""
    row = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, row, right=True).clamp_max(offsets.shape[0] - 1)


class _RowBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, offsets, experts):
        ctx.save_for_backward(offsets)
        return bias[experts]

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        # Per-expert sums of the valid rows as a grouped GEMM against ones: accumulated in fp32,
        # deterministic, rows past offsets[-1] never read. (Autograd of the gather would
        # scatter-add in the bias dtype, over the tail too.) The ones are as wide as one
        # 16-byte row needs; column 0 is the sum.
        ones = grad.new_ones(grad.shape[0], 16 // grad.element_size())
        return torch._grouped_mm(grad.contiguous().t(), ones, offs=offsets)[..., 0], None, None


def row_bias(bias: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[rows, N] bias of each row's expert (`bias` [L, N], `experts` from row_experts; tail rows
    get the last expert's, which nothing reads). The bias gradient sums valid rows only. N must
    be a multiple of 16 bytes (the experts pad odd sizes)."""
    return _RowBias.apply(bias, offsets, experts)
