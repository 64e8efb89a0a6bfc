"""Grouped weight gradient accumulated straight into Megatron's main_grad.

`accumulate_grouped_wgrad(left, right, ends, out)`: out[e] += left_e^T @ right_e for each expert e,
where expert e's rows are [ends[e-1], ends[e]) of `left` [rows, M] and `right` [rows, N] (int32
device end offsets, as the grouped GEMMs read them) and `out` is [L, M, N] fp32 or bf16
(Megatron's DDP main_grad). One program owns one [BLOCK_M, BLOCK_N] tile of one expert and
loops over that expert's rows (a bound read on the device: no host sync, graph-safe), summing in
fp32; it adds its sum to `out` once, so every element is written by one program (the same bits
run to run). Experts without rows leave `out` untouched. Rows at or past ends[-1] are never read;
ends[-1] <= rows is the caller's to keep (checking it would need a host sync).
Where the rows are 16-byte aligned the whole row steps are read by TMA (host descriptors over the
full buffers) and only an expert's last, partial step by masked loads; an fp32 `out` takes the
sum by one relaxed atomic add per element (done in L2, no registers held for the old values;
the same bits as a load, add and store except that the hardware's fp32 atomic flushes subnormal
values to zero), a bf16 `out` by a load, an fp32 add and a store (rounded once).

Cost removed: `torch._grouped_mm` returns the weight gradient as a fresh 16-bit tensor, which
Megatron's DDP then adds to main_grad in a separate pass (read 2 + 4 bytes, write 4, per weight:
~1.4 ms per layer step at the reference shape on an H200, a quarter of the step), and the
gradient is rounded to 16 bits once per microbatch. Megatron's own layers avoid that pass with
`gradient_accumulation_fusion` (APEX / Transformer Engine kernels); this is the same contract
for the grouped experts. Cost accepted: a Triton GEMM instead of CUTLASS's grouped kernel, and
the read-modify-write of `out` in the tile epilogue (8 bytes per weight in fp32, 4 in bf16)
(docs/design.md, "Expert weight gradients into main_grad").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


class WgradTiles(NamedTuple):
    """A launch configuration: output tile, rows per step of the loop, warps, pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    block_rows: int = 64
    warps: int = 4
    stages: int = 3


# Measured on an H200 at the reference shape (BENCHMARKS.md, "The expert wgrad kernel reads its rows by TMA").
DEFAULT_TILES = WgradTiles()


@triton.jit
def _masked_step(acc, left_ptr, right_ptr, first, end, cols_m, cols_n, M, N, left_stride, right_stride,
                 BLOCK_ROWS: tl.constexpr):
    """acc += left[first:first+BLOCK_ROWS]^T @ right[...] for the rows below `end` (others read as 0)."""
    rows = (first + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    inside = rows < end
    left = tl.load(left_ptr + rows[:, None] * left_stride + cols_m[None, :],
                   mask=inside[:, None] & (cols_m[None, :] < M), other=0.0)
    right = tl.load(right_ptr + rows[:, None] * right_stride + cols_n[None, :],
                    mask=inside[:, None] & (cols_n[None, :] < N), other=0.0)
    return tl.dot(tl.trans(left), right, acc)


@triton.jit
def _wgrad_accumulate_kernel(left_ptr, right_ptr, left_desc, right_desc, out_ptr, ends_ptr, M, N, left_stride,
                             right_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                             TMA: tl.constexpr, ATOMIC_ADD: tl.constexpr):
    expert = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m = tl.program_id(0) // tiles_n
    tile_n = tl.program_id(0) % tiles_n
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(ends_ptr + expert)
    if end > start:
        cols_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TMA:
            # Whole steps by TMA (inside the buffer, so nothing to mask); the partial last step by
            # masked loads, since the rows after `end` are the next expert's.
            whole_end = start + (end - start) // BLOCK_ROWS * BLOCK_ROWS
            for first in range(start, whole_end, BLOCK_ROWS):
                left = left_desc.load([first, tile_m * BLOCK_M])
                right = right_desc.load([first, tile_n * BLOCK_N])
                acc = tl.dot(left.T, right, acc)
            if whole_end < end:
                acc = _masked_step(acc, left_ptr, right_ptr, whole_end, end, cols_m, cols_n, M, N, left_stride,
                                   right_stride, BLOCK_ROWS)
        else:
            for first in range(start, end, BLOCK_ROWS):
                acc = _masked_step(acc, left_ptr, right_ptr, first, end, cols_m, cols_n, M, N, left_stride,
                                   right_stride, BLOCK_ROWS)
        place = out_ptr + expert.to(tl.int64) * M * N + cols_m.to(tl.int64)[:, None] * N + cols_n[None, :]
        tile = (cols_m[:, None] < M) & (cols_n[None, :] < N)
        if ATOMIC_ADD:
            # One program per element, so the add is the read-modify-write's exact sum; done in L2,
            # it needs no registers for the old values and overlaps the next tiles' loads.
            tl.atomic_add(place, acc, mask=tile, sem="relaxed")
        else:
            total = tl.load(place, mask=tile, other=0.0).to(tl.float32) + acc
            tl.store(place, total.to(out_ptr.dtype.element_ty), mask=tile)


def _tma_descriptor(rows: torch.Tensor, block: list[int]):
    """A TMA descriptor over 16-bit [R, W] rows, or None where TMA cannot read them (alignment)."""
    width_bytes = rows.stride(0) * rows.element_size()
    if rows.element_size() != 2 or rows.data_ptr() % 16 or width_bytes % 16:
        return None
    return TensorDescriptor.from_tensor(rows, block)


@functools.lru_cache(maxsize=None)  # once per configuration, not per backward
def _check_tiles(tiles: WgradTiles) -> None:
    def power_of_two(value):
        return value > 0 and value & (value - 1) == 0
    if not (all(power_of_two(v) for v in tiles[:4]) and 16 <= min(tiles.block_m, tiles.block_n, tiles.block_rows)
            and max(tiles.block_m, tiles.block_n, tiles.block_rows) <= 256 and tiles.stages >= 1):
        raise ValueError(f"accumulate_grouped_wgrad: tiles must be powers of two from 16 to 256 (a TMA box holds at "
                         f"most 256 per side; a dot needs 16) and at least one stage, got {tiles}")


def accumulate_grouped_wgrad(left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                             tiles: WgradTiles = DEFAULT_TILES) -> None:
    """out[e] += left[rows of e]^T @ right[rows of e], in place (module docstring)."""
    _check_tiles(tiles)
    if left.dim() != 2 or right.dim() != 2 or left.shape[0] != right.shape[0]:
        raise ValueError(f"accumulate_grouped_wgrad: left and right must be [rows, M] and [rows, N] with the same "
                         f"rows, got {tuple(left.shape)} and {tuple(right.shape)}")
    if left.dtype != right.dtype or left.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"accumulate_grouped_wgrad: left and right must both be bf16 or both fp16 (fp32 rows "
                         f"would be rounded to TF32 by the kernel's dot), got {left.dtype} and {right.dtype}; "
                         f"use torch._grouped_mm for other dtypes")
    if ends.dim() != 1 or ends.dtype != torch.int32 or not ends.is_contiguous():
        raise ValueError(f"accumulate_grouped_wgrad: ends must be the contiguous int32 end offsets [L], got "
                         f"{ends.dtype} {tuple(ends.shape)} with stride {ends.stride()}")
    if not (left.device == right.device == ends.device == out.device):
        raise ValueError(f"accumulate_grouped_wgrad: left, right, ends and out must be on one device, got "
                         f"{left.device}, {right.device}, {ends.device} and {out.device}")
    experts, m, n = ends.shape[0], left.shape[1], right.shape[1]
    if tuple(out.shape) != (experts, m, n):
        raise ValueError(f"accumulate_grouped_wgrad: out must be [L, M, N] = [{experts}, {m}, {n}], got "
                         f"{tuple(out.shape)}")
    if not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"accumulate_grouped_wgrad: out must be contiguous fp32 or bf16 (main_grad), got "
                         f"{out.dtype}{'' if out.is_contiguous() else ', strided'}")
    if left.stride(1) != 1 or right.stride(1) != 1:
        raise ValueError(f"accumulate_grouped_wgrad: left and right need unit column stride (row-major rows), got "
                         f"strides {left.stride()} and {right.stride()}; pass .contiguous() rows")
    if experts == 0 or left.shape[0] == 0:
        return
    left_desc = _tma_descriptor(left, [tiles.block_rows, tiles.block_m])
    right_desc = _tma_descriptor(right, [tiles.block_rows, tiles.block_n])
    tma = left_desc is not None and right_desc is not None
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), experts)
    _wgrad_accumulate_kernel[grid](left, right, left_desc if tma else None, right_desc if tma else None, out, ends,
                                   m, n, left.stride(0), right.stride(0), BLOCK_M=tiles.block_m,
                                   BLOCK_N=tiles.block_n, BLOCK_ROWS=tiles.block_rows, TMA=tma,
                                   ATOMIC_ADD=out.dtype == torch.float32, num_warps=tiles.warps,
                                   num_stages=tiles.stages)


def accumulate_grouped_wgrad_reference(left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor,
                                       out: torch.Tensor) -> None:
    """The same sum in torch, one expert at a time: for CPU tensors (reads the offsets on the host)."""
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            # One rounding of old + sum, as the kernel's epilogue does.
            out[expert] = (out[expert].float() + left[start:end].float().t() @ right[start:end].float()).to(out.dtype)
        start = end
