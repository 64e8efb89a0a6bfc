"""Tail-aware SwiGLU for capacity buffers: silu(gate) * up [* prob], valid prefix only.

A capacity buffer holds `valid_rows` (a device scalar) useful rows followed by a tail. Plain
torch SwiGLU would read and write the whole buffer, spending (cf - 1) / cf of the work on the
tail and letting tail garbage (NaN, stale rows) flow into gradients. The Triton kernels read
`valid_rows` on the device and return early for blocks past it: no host sync, no tail work.
Cost accepted: tail rows of the outputs are left unwritten (the grouped GEMMs never read them).

Layout: `h` [C, 2F] with gate in columns [0, F) and up in [F, 2F) (Megatron's fc1 order).

With a dropless arena (moe/arena.py) `h` lives in two parts, a `RowPlace`: rows r < P in one
tensor, rows r >= P in another from a device row on (`read_from`). fc1 runs as two grouped GEMMs
(rows below P, rows past it), the forward reads both outputs and stores only the rows past P
where the arena keeps them (`save_to`: the first part stays where the GEMM wrote it); the
recomputation and the backward read the kept rows in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_ext.kernels.row_span import copy_row_span


@dataclass(frozen=True)
class RowPlace:
    """A buffer's [C, 2F] rows in two parts: row r < P at `region_rows[r]` ([P, 2F], P its rows),
    row r >= P at `spill_rows[spill + r - P]` (`spill` a device int64 scalar: no host read)."""

    region_rows: torch.Tensor
    spill_rows: torch.Tensor
    spill: torch.Tensor

    @property
    def region(self) -> int:
        return self.region_rows.shape[0]


@triton.jit
def _row_ptr(row, lo_ptr, hi_ptr, hi_start_ptr, split, width, SPLIT: tl.constexpr):
    """Buffer row `row`: row `row` of lo_ptr below `split`, else row hi_start + row - split of hi_ptr
    (a RowPlace); without SPLIT, row `row` of lo_ptr."""
    ptr = lo_ptr + row.to(tl.int64) * width
    if SPLIT:
        if row >= split:
            ptr = hi_ptr + (tl.load(hi_start_ptr) + row - split).to(tl.int64) * width
    return ptr


@triton.jit
def _swiglu_fwd_kernel(lo_ptr, hi_ptr, hi_start_ptr, split, prob_ptr, out_ptr, valid_ptr, F, save_ptr,
                       save_start_ptr, HAS_PROB: tl.constexpr, BLOCK_F: tl.constexpr, SPLIT: tl.constexpr,
                       SAVE: tl.constexpr):
    row = tl.program_id(0)
    if row >= tl.load(valid_ptr):
        return
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    h_ptr = _row_ptr(row, lo_ptr, hi_ptr, hi_start_ptr, split, 2 * F, SPLIT)
    gate = tl.load(h_ptr + cols, mask=mask, other=0.0)
    up = tl.load(h_ptr + F + cols, mask=mask, other=0.0)
    if SAVE:  # rows past the split go where the arena keeps them; those below stay where they are
        if row >= split:
            kept = save_ptr + (tl.load(save_start_ptr) + row - split).to(tl.int64) * 2 * F
            tl.store(kept + cols, gate, mask=mask)
            tl.store(kept + F + cols, up, mask=mask)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    if HAS_PROB:
        act = act * tl.load(prob_ptr + row).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * F + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, lo_ptr, hi_ptr, hi_start_ptr, split, prob_ptr, grad_h_ptr, grad_prob_ptr,
                       valid_ptr, F, HAS_PROB: tl.constexpr, BLOCK_F: tl.constexpr, SPLIT: tl.constexpr):
    # One program per row (loops over F) so the prob gradient is a plain per-row dot product.
    row = tl.program_id(0)
    if row >= tl.load(valid_ptr):
        return
    base = row.to(tl.int64) * 2 * F
    h_ptr = _row_ptr(row, lo_ptr, hi_ptr, hi_start_ptr, split, 2 * F, SPLIT)
    prob = 1.0
    if HAS_PROB:
        prob = tl.load(prob_ptr + row).to(tl.float32)
    prob_dot = tl.zeros([BLOCK_F], dtype=tl.float32)
    for start in range(0, F, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)
        mask = cols < F
        grad = tl.load(grad_ptr + row.to(tl.int64) * F + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + F + cols, mask=mask, other=0.0).to(tl.float32)
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


def _source_args(h: torch.Tensor | None, place: RowPlace | None, valid_rows: torch.Tensor) -> tuple:
    """The kernels' (lo, hi, hi_start, split) for rows in `h` or at `place`."""
    if place is None:
        return h, h, valid_rows, h.shape[0]
    return place.region_rows, place.spill_rows, place.spill, place.region


def gather_place(place: RowPlace, rows: int, valid_rows: torch.Tensor) -> torch.Tensor:
    """The torch form of reading a RowPlace: a fresh [rows, 2F] buffer, valid below valid_rows."""
    region = place.region
    out = place.region_rows.new_empty(rows, place.region_rows.shape[1])
    copy_row_span(place.region_rows, out[:region], valid_rows)
    copy_row_span(place.spill_rows, out[region:], valid_rows - region, src_start=place.spill)
    return out


def _check_save(save_to: RowPlace | None, read_from: RowPlace | None) -> None:
    if save_to is not None and (read_from is None or save_to.region_rows is not read_from.region_rows):
        raise ValueError("swiglu_forward: save_to stores the rows past P only, so its region rows must be "
                         "read_from's (the rows below P are kept where they were read)")


def swiglu_forward(h: torch.Tensor | None, valid_rows: torch.Tensor, prob: torch.Tensor | None,
                   save_to: RowPlace | None = None, read_from: RowPlace | None = None,
                   rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The activation of rows < valid_rows (0-d int32 on h's device); no autograd. CPU: torch, tail zero.
    `read_from`: the rows are read at that place instead of from `h` (None; `rows` then gives the
    buffer's rows). `save_to` (with `read_from`, the same region rows): the rows past P are also
    stored at that place's spill rows.
    `out` ([rows, F], contiguous): written in place, rows < valid_rows only (CPU too), and returned."""
    _check_save(save_to, read_from)
    source = h if read_from is None else read_from.region_rows
    rows = h.shape[0] if read_from is None else rows
    F = source.shape[1] // 2
    if out is not None and (out.shape != (rows, F) or out.dtype != source.dtype or not out.is_contiguous()):
        raise ValueError(f"swiglu_forward: out must be a contiguous [{rows}, {F}] {source.dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if not source.is_cuda:
        if read_from is not None:
            h = gather_place(read_from, rows, valid_rows)
        if save_to is not None:
            copy_row_span(read_from.spill_rows, save_to.spill_rows, valid_rows - read_from.region,
                          src_start=read_from.spill, dst_start=save_to.spill)
        act = _forward_torch(h, prob, valid_rows)
        if out is None:
            return act
        copy_row_span(act, out, valid_rows)
        return out
    if out is None:
        out = torch.empty(rows, F, dtype=source.dtype, device=source.device)
    return launch_forward(h, valid_rows, prob, save_to, read_from, out)


def launch_forward(h, valid_rows, prob, save_to, read_from, out) -> torch.Tensor:
    """The forward kernel over `out`'s rows (swiglu_forward's arguments checked; any device Triton
    runs on, the CPU under its interpreter)."""
    source = h if read_from is None else read_from.region_rows
    rows, F = out.shape
    block = _block_f(F)
    save, save_start = (save_to.spill_rows, save_to.spill) if save_to is not None else (source, valid_rows)
    _swiglu_fwd_kernel[(rows, triton.cdiv(F, block))](
        *_source_args(h, read_from, valid_rows), prob if prob is not None else source, out, valid_rows, F, save,
        save_start, HAS_PROB=prob is not None, BLOCK_F=block, SPLIT=read_from is not None, SAVE=save_to is not None)
    return out


def swiglu_backward(grad: torch.Tensor, h: torch.Tensor | None, prob: torch.Tensor | None, valid_rows: torch.Tensor,
                    read_from: RowPlace | None = None):
    """(d h, d prob or None) for rows < valid_rows from the activation's gradient; no autograd.
    Tail rows of d prob are zero (it is tiny and callers may reduce over it); of d h, unwritten.
    `read_from`: h's rows are read at that place (h None)."""
    grad = grad.contiguous()
    source = h if read_from is None else read_from.region_rows
    if not source.is_cuda:
        if read_from is not None:
            h = gather_place(read_from, grad.shape[0], valid_rows)
        return _backward_torch(grad, h, prob, valid_rows)
    return launch_backward(grad, h, prob, valid_rows, read_from)


def launch_backward(grad, h, prob, valid_rows, read_from):
    """The backward kernel (swiglu_backward's arguments, `grad` contiguous; any device Triton runs
    on, the CPU under its interpreter)."""
    source = h if read_from is None else read_from.region_rows
    rows, two_f = grad.shape[0], source.shape[1]
    grad_h = torch.empty(rows, two_f, dtype=source.dtype, device=source.device)
    grad_prob = torch.zeros_like(prob) if prob is not None else None
    _swiglu_bwd_kernel[(rows,)](grad, *_source_args(h, read_from, valid_rows), prob if prob is not None else source,
                                grad_h, grad_prob if grad_prob is not None else source, valid_rows, two_f // 2,
                                HAS_PROB=prob is not None, BLOCK_F=min(1024, _block_f(two_f // 2)),
                                SPLIT=read_from is not None)
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
