"""Tail-aware SwiGLU for capacity buffers: silu(gate) * up [* prob], valid prefix only.

A capacity buffer holds `valid_rows` (a device scalar) useful rows followed by a tail. Plain
torch SwiGLU would read and write the whole buffer, spending (cf - 1) / cf of the work on the
tail and letting tail garbage (NaN, stale rows) flow into gradients. The Triton kernels read
`valid_rows` on the device and return early for blocks past it: no host sync, no tail work.
Cost accepted: tail rows of the outputs are left unwritten (the grouped GEMMs never read them).

Layout: `h` [C, 2F] with gate in columns [0, F) and up in [F, 2F) (Megatron's fc1 order).

With a dropless arena (moe/arena.py) `h` may live at a `RowPlace` instead: row r < P at
`region_start + r` of the arena's fc1 rows, row r >= P at `spill[0] + r - P`. The forward then
stores the rows it reads there (`save_to`: fc1's output kept without a copy kernel) or reads
them from there (`read_from`: the recomputation and the backward read the kept rows in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_ext.kernels.row_span import copy_row_span


@dataclass(frozen=True)
class RowPlace:
    """Where a buffer's rows live in an arena: rows [rows_total, 2F], the layer's region start and
    length P (host ints); buffer row P lives at arena row spill_offset + spill (a host int plus a
    device int64 scalar: the shared area's first row and the layer's spill start in it)."""

    rows: torch.Tensor
    region_start: int
    region: int
    spill: torch.Tensor
    spill_offset: int = 0


@triton.jit
def _arena_row(row, region_start, region, spill_ptr, spill_offset):
    """The arena row of buffer row `row` (RowPlace)."""
    return tl.where(row < region, region_start + row, spill_offset + tl.load(spill_ptr) + row - region).to(tl.int64)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, prob_ptr, out_ptr, valid_ptr, F, place_ptr, region_start, region, spill_ptr,
                       spill_offset,
                       HAS_PROB: tl.constexpr, BLOCK_F: tl.constexpr, READ_PLACE: tl.constexpr,
                       SAVE_PLACE: tl.constexpr):
    row = tl.program_id(0)
    if row >= tl.load(valid_ptr):
        return
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    base = row.to(tl.int64) * 2 * F
    if READ_PLACE:
        base = _arena_row(row, region_start, region, spill_ptr, spill_offset) * 2 * F
        h_ptr = place_ptr
    gate = tl.load(h_ptr + base + cols, mask=mask, other=0.0)
    up = tl.load(h_ptr + base + F + cols, mask=mask, other=0.0)
    if SAVE_PLACE:
        kept = _arena_row(row, region_start, region, spill_ptr, spill_offset) * 2 * F
        tl.store(place_ptr + kept + cols, gate, mask=mask)
        tl.store(place_ptr + kept + F + cols, up, mask=mask)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    if HAS_PROB:
        act = act * tl.load(prob_ptr + row).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * F + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, h_ptr, prob_ptr, grad_h_ptr, grad_prob_ptr, valid_ptr, F, region_start, region,
                       spill_ptr, spill_offset, HAS_PROB: tl.constexpr, BLOCK_F: tl.constexpr,
                       READ_PLACE: tl.constexpr):
    # One program per row (loops over F) so the prob gradient is a plain per-row dot product.
    row = tl.program_id(0)
    if row >= tl.load(valid_ptr):
        return
    base = row.to(tl.int64) * 2 * F
    h_base = base
    if READ_PLACE:
        h_base = _arena_row(row, region_start, region, spill_ptr, spill_offset) * 2 * F
    prob = 1.0
    if HAS_PROB:
        prob = tl.load(prob_ptr + row).to(tl.float32)
    prob_dot = tl.zeros([BLOCK_F], dtype=tl.float32)
    for start in range(0, F, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)
        mask = cols < F
        grad = tl.load(grad_ptr + row.to(tl.int64) * F + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + h_base + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + h_base + F + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        prob_dot += grad * silu * up
        grad_act = grad * prob
        grad_gate = grad_act * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = grad_act * silu
        tl.store(grad_h_ptr + base + cols, grad_gate.to(grad_h_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_h_ptr + base + F + cols, grad_up.to(grad_h_ptr.dtype.element_ty), mask=mask)
    if HAS_PROB:
        tl.store(grad_prob_ptr + row, tl.sum(prob_dot, axis=0))


def _block_f(F: int) -> int:
    return min(1024, triton.next_power_of_2(F))


def _valid_row_mask(valid_rows: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.arange(rows, device=valid_rows.device) < valid_rows


def _forward_torch(h, prob, valid_rows):
    gate, up = h.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    if prob is not None:
        act = act * prob.float()[:, None]
    return torch.where(_valid_row_mask(valid_rows, h.shape[0])[:, None], act, 0.0).to(h.dtype)


def _backward_torch(grad, h, prob, valid_rows):
    gate, up = h.float().chunk(2, dim=-1)
    grad = grad.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_act = grad if prob is None else grad * prob.float()[:, None]
    grad_h = torch.cat([grad_act * up * sig * (1 + gate * (1 - sig)), grad_act * silu], dim=-1)
    valid = _valid_row_mask(valid_rows, h.shape[0])
    grad_h = torch.where(valid[:, None], grad_h, 0.0).to(h.dtype)
    grad_prob = None
    if prob is not None:
        grad_prob = torch.where(valid, (grad * silu * up).sum(-1), 0.0).to(prob.dtype)
    return grad_h, grad_prob


def _place_args(place: RowPlace | None, like: torch.Tensor) -> tuple:
    if place is None:
        return like, 0, 0, like, 0
    return place.rows, place.region_start, place.region, place.spill, place.spill_offset


def swiglu_forward(h: torch.Tensor | None, valid_rows: torch.Tensor, prob: torch.Tensor | None,
                   save_to: RowPlace | None = None, read_from: RowPlace | None = None,
                   rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The activation of rows < valid_rows (0-d int32 on h's device); no autograd. CPU: torch, tail zero.
    CUDA only: `save_to` also stores h's rows at that place; `read_from` reads them there instead
    of from `h` (None; `rows` then gives the buffer's rows).
    `out` ([rows, F], contiguous): written in place, rows < valid_rows only (CPU too), and returned."""
    source = h if read_from is None else read_from.rows
    rows = h.shape[0] if read_from is None else rows
    F = source.shape[1] // 2
    if out is not None and (out.shape != (rows, F) or out.dtype != source.dtype or not out.is_contiguous()):
        raise ValueError(f"swiglu_forward: out must be a contiguous [{rows}, {F}] {source.dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if read_from is None and not h.is_cuda:
        act = _forward_torch(h, prob, valid_rows)
        if out is None:
            return act
        copy_row_span(act, out, valid_rows)
        return out
    if out is None:
        out = torch.empty(rows, F, dtype=source.dtype, device=source.device)
    block = _block_f(F)
    place, region_start, region, spill, spill_offset = _place_args(save_to or read_from, source)
    _swiglu_fwd_kernel[(rows, triton.cdiv(F, block))](
        source, prob if prob is not None else source, out, valid_rows, F, place, region_start, region, spill,
        spill_offset, HAS_PROB=prob is not None, BLOCK_F=block, READ_PLACE=read_from is not None,
        SAVE_PLACE=save_to is not None)
    return out


def swiglu_backward(grad: torch.Tensor, h: torch.Tensor | None, prob: torch.Tensor | None, valid_rows: torch.Tensor,
                    read_from: RowPlace | None = None):
    """(d h, d prob or None) for rows < valid_rows from the activation's gradient; no autograd.
    Tail rows of d prob are zero (it is tiny and callers may reduce over it); of d h, unwritten.
    `read_from` (CUDA): h's rows are read at that place (h None)."""
    grad = grad.contiguous()
    if read_from is None and not h.is_cuda:
        return _backward_torch(grad, h, prob, valid_rows)
    source = h if read_from is None else read_from.rows
    rows, two_f = grad.shape[0], source.shape[1]
    grad_h = torch.empty(rows, two_f, dtype=source.dtype, device=source.device)
    grad_prob = torch.zeros_like(prob) if prob is not None else None
    _, region_start, region, spill, spill_offset = _place_args(read_from, source)
    _swiglu_bwd_kernel[(rows,)](grad, source, prob if prob is not None else source, grad_h,
                                grad_prob if grad_prob is not None else source, valid_rows, two_f // 2,
                                region_start, region, spill, spill_offset, HAS_PROB=prob is not None,
                                BLOCK_F=min(1024, _block_f(two_f // 2)), READ_PLACE=read_from is not None)
    return grad_h, grad_prob


class _ValidPrefixSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, prob, valid_rows):
        ctx.save_for_backward(h, prob, valid_rows)
        return swiglu_forward(h, valid_rows, prob)

    @staticmethod
    def backward(ctx, grad):
        h, prob, valid_rows = ctx.saved_tensors
        grad_h, grad_prob = swiglu_backward(grad, h, prob, valid_rows)
        return grad_h, grad_prob, None


def swiglu_valid_prefix(h: torch.Tensor, valid_rows: torch.Tensor,
                        prob: torch.Tensor | None = None) -> torch.Tensor:
    """silu(h[:, :F]) * h[:, F:] (times `prob` per row) for rows < valid_rows.

    `valid_rows`: 0-d or 1-element int32 tensor on h's device. Rows at or past it are zero on
    CPU and unwritten on GPU; gradients there are likewise never produced from tail contents.
    """
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu_valid_prefix expects h [rows, 2F], got shape {tuple(h.shape)}")
    if valid_rows.device != h.device:
        raise ValueError(f"valid_rows is on {valid_rows.device} but h is on {h.device}; keep both on one device")
    if prob is not None and prob.shape != (h.shape[0],):
        raise ValueError(f"prob must be [rows] = [{h.shape[0]}], got {tuple(prob.shape)}")
    return _ValidPrefixSwiGLU.apply(h.contiguous(), prob, valid_rows.reshape(()))
