"""A dropless-arena layer's spill and restore in one launch (moe/arena.py, docs/design.md "Dropless arena").

A non-last layer's rows past its region P live in region i+1 until its experts have read them;
then the token rows, their probabilities, their return ids (return_transfer="put") and the kept
activations move to the shared area at the layer's spill start, and come back before the
experts' backward. `move_spill(arrays, valid_rows, region, start, restore)`: for 0 <= j <
valid_rows - region, view row P + j <-> shared row start + j of every array, where valid_rows and
start are device scalars (no host read).

Cost removed against one `copy_row_span` per array: three or four launches and their argument
tensors (count = valid_rows - P, the starts) per direction, on the host of every eager layer
step. Cost accepted: one program per row of the run-on room (host bound), most of which return
at once; a row outside either buffer is never touched (a backstop: the arena's plan keeps every
span inside). On CPU the torch form runs `copy_row_span` per array.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.kernels.row_span import copy_row_span

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch form serves
    triton = None


@dataclass(frozen=True)
class SpillArrays:
    """A layer's view arrays (row 0 = the layer's row 0) and the shared area's (row 0 = its first
    row): token rows [N, H], probabilities [N] fp32, optionally return ids [N] int32 and
    activations [N, F] (one dtype with the rows)."""

    view_rows: torch.Tensor
    shared_rows: torch.Tensor
    view_values: torch.Tensor
    shared_values: torch.Tensor
    view_ids: torch.Tensor | None = None
    shared_ids: torch.Tensor | None = None
    view_act: torch.Tensor | None = None
    shared_act: torch.Tensor | None = None

    def __post_init__(self):  # once per slot and layer: the kernel indexes rows without bounds per array
        pairs = {"rows": (self.view_rows, self.shared_rows), "values": (self.view_values, self.shared_values),
                 "return ids": (self.view_ids, self.shared_ids), "activations": (self.view_act, self.shared_act)}
        views, shared = len(self.view_rows), len(self.shared_rows)
        for name, (view, area) in pairs.items():
            if (view is None) != (area is None):
                raise ValueError(f"SpillArrays: {name} given for only one of the view and the shared area")
            if view is None:
                continue
            if len(view) != views or len(area) != shared:
                raise ValueError(f"SpillArrays: {name} have {len(view)} view and {len(area)} shared rows, the "
                                 f"token rows {views} and {shared}: every array must be laid out as the token rows")
            if not (view.is_contiguous() and area.is_contiguous()):
                raise ValueError(f"SpillArrays: the {name} arrays must be contiguous (the kernel indexes rows)")


if triton is not None:
    @triton.jit
    def _copy_row(src_ptr, dst_ptr, src_row, dst_row, W: tl.constexpr, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, W, BLOCK):
            col = c0 + cols
            inside = col < W
            tl.store(dst_ptr + dst_row * W + col, tl.load(src_ptr + src_row * W + col, mask=inside), mask=inside)

    @triton.jit
    def _spill_kernel(src_ptr, dst_ptr, src_val_ptr, dst_val_ptr, src_id_ptr, dst_id_ptr, src_act_ptr, dst_act_ptr,
                      valid_ptr, start_ptr, region, view_rows, shared_rows, H: tl.constexpr, F: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ACT: tl.constexpr,
                      RESTORE: tl.constexpr):
        """src -> dst: the view's arrays -> the shared area's, or (RESTORE) the other way."""
        j = tl.program_id(0).to(tl.int64)  # the layer's row P + j
        view_row = region + j
        shared_row = tl.load(start_ptr).to(tl.int64) + j
        inside = (j < tl.load(valid_ptr).to(tl.int64) - region) & (view_row < view_rows) & (shared_row >= 0) & (
            shared_row < shared_rows)
        src_row = shared_row if RESTORE else view_row
        dst_row = view_row if RESTORE else shared_row
        if inside:
            _copy_row(src_ptr, dst_ptr, src_row, dst_row, H, BLOCK_H)
            tl.store(dst_val_ptr + dst_row, tl.load(src_val_ptr + src_row))
            if HAS_IDS:
                tl.store(dst_id_ptr + dst_row, tl.load(src_id_ptr + src_row))
            if HAS_ACT:
                _copy_row(src_act_ptr, dst_act_ptr, src_row, dst_row, F, BLOCK_F)


def _block(width: int) -> int:
    return min(triton.next_power_of_2(width), 2048)


def launch_spill(a: SpillArrays, valid_rows: torch.Tensor, region: int, start: torch.Tensor, restore: bool) -> None:
    """The Triton kernel (CUDA; any device under Triton's interpreter, as tests/unit does)."""
    width, act_width = a.view_rows.shape[1], 1 if a.view_act is None else a.view_act.shape[1]
    pairs = [(a.view_rows, a.shared_rows), (a.view_values, a.shared_values),
             (a.view_ids, a.shared_ids) if a.view_ids is not None else (a.view_values, a.shared_values),
             (a.view_act, a.shared_act) if a.view_act is not None else (a.view_rows, a.shared_rows)]
    pointers = [array for pair in pairs for array in (pair[::-1] if restore else pair)]
    _spill_kernel[(a.view_rows.shape[0] - region,)](
        *pointers, valid_rows, start, region, a.view_rows.shape[0], a.shared_rows.shape[0], H=width, F=act_width,
        BLOCK_H=_block(width), BLOCK_F=_block(act_width), HAS_IDS=a.view_ids is not None,
        HAS_ACT=a.view_act is not None, RESTORE=restore, num_warps=4 if width >= 512 else 1)


def move_spill(arrays: SpillArrays, valid_rows: torch.Tensor, region: int, start: torch.Tensor,
               restore: bool = False) -> None:
    """Spill (view -> shared) or restore (shared -> view) rows P .. valid_rows - 1 of every array
    (module docstring); `valid_rows` and `start` are device scalars."""
    a = arrays
    run_on = a.view_rows.shape[0] - region
    if run_on <= 0 or a.shared_rows.shape[0] == 0:
        return
    if a.view_rows.is_cuda and triton is not None:
        launch_spill(a, valid_rows, region, start, restore)
        return
    count = valid_rows - region
    pairs = [(a.view_rows, a.shared_rows), (a.view_values, a.shared_values), (a.view_ids, a.shared_ids),
             (a.view_act, a.shared_act)]
    for view, shared in pairs:
        if view is None:
            continue
        if restore:
            copy_row_span(shared, view[region:], count, src_start=start)
        else:
            copy_row_span(view[region:], shared, count, dst_start=start)
