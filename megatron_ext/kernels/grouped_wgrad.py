"""Grouped weight gradient accumulated straight into Megatron's main_grad.

`accumulate_grouped_wgrad(left, right, ends, out)`: out[e] += left_e^T @ right_e for each expert e,
where expert e's rows are [ends[e-1], ends[e]) of `left` [rows, M] and `right` [rows, N] (int32
device end offsets, as the grouped GEMMs read them) and `out` is [L, M, N] fp32 or bf16
(Megatron's DDP main_grad). One program owns one [BLOCK_M, BLOCK_N] tile of one expert and
loops over that expert's rows (a bound read on the device: no host sync, graph-safe), summing in
fp32; it adds its sum to `out` once, so every element is written by one program (the same bits
run to run). Experts without rows leave `out` untouched. Rows at or past ends[-1] are never read.

Cost removed: `torch._grouped_mm` returns the weight gradient as a fresh 16-bit tensor, which
Megatron's DDP then adds to main_grad in a separate pass (read 2 + 4 bytes, write 4, per weight:
~1.4 ms per layer step at the reference shape on an H200, a quarter of the step), and the
gradient is rounded to 16 bits once per microbatch. Megatron's own layers avoid that pass with
`gradient_accumulation_fusion` (APEX / Transformer Engine kernels); this is the same contract
for the grouped experts. Cost accepted: a Triton GEMM instead of CUTLASS's grouped kernel, and
the fp32 read-modify-write of `out` in the tile epilogue
(docs/design.md, "Expert weight gradients into main_grad").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class WgradTiles(NamedTuple):
    """A launch configuration: output tile, rows per step of the loop, warps, pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    block_rows: int = 32
    warps: int = 4
    stages: int = 4


# Measured on an H200 at the reference shape (BENCHMARKS.md, "Expert weight gradients into main_grad").
DEFAULT_TILES = WgradTiles()


@triton.jit
def _wgrad_accumulate_kernel(left_ptr, right_ptr, out_ptr, ends_ptr, M, N, left_stride, right_stride,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    expert = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m = tl.program_id(0) // tiles_n
    tile_n = tl.program_id(0) % tiles_n
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + expert).to(tl.int64)
    if end > start:
        cols_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for first in range(start, end, BLOCK_ROWS):
            rows = first + tl.arange(0, BLOCK_ROWS)
            inside = rows < end
            left = tl.load(left_ptr + rows[:, None] * left_stride + cols_m[None, :],
                           mask=inside[:, None] & (cols_m[None, :] < M), other=0.0)
            right = tl.load(right_ptr + rows[:, None] * right_stride + cols_n[None, :],
                            mask=inside[:, None] & (cols_n[None, :] < N), other=0.0)
            acc = tl.dot(tl.trans(left), right, acc)
        place = out_ptr + expert.to(tl.int64) * M * N + cols_m[:, None] * N + cols_n[None, :]
        tile = (cols_m[:, None] < M) & (cols_n[None, :] < N)
        total = tl.load(place, mask=tile, other=0.0).to(tl.float32) + acc
        tl.store(place, total.to(out_ptr.dtype.element_ty), mask=tile)


def accumulate_grouped_wgrad(left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                             tiles: WgradTiles = DEFAULT_TILES) -> None:
    """out[e] += left[rows of e]^T @ right[rows of e], in place (module docstring)."""
    if left.dim() != 2 or right.dim() != 2 or left.shape[0] != right.shape[0]:
        raise ValueError(f"accumulate_grouped_wgrad: left and right must be [rows, M] and [rows, N] with the same "
                         f"rows, got {tuple(left.shape)} and {tuple(right.shape)}")
    if ends.dim() != 1 or ends.dtype != torch.int32:
        raise ValueError(f"accumulate_grouped_wgrad: ends must be the int32 end offsets [L], got {ends.dtype} "
                         f"{tuple(ends.shape)}")
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
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), experts)
    _wgrad_accumulate_kernel[grid](left, right, out, ends, m, n, left.stride(0), right.stride(0),
                                   BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_ROWS=tiles.block_rows,
                                   num_warps=tiles.warps, num_stages=tiles.stages)


def accumulate_grouped_wgrad_reference(left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor,
                                       out: torch.Tensor) -> None:
    """The same sum in torch, one expert at a time: for CPU tensors (reads the offsets on the host)."""
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[expert] += (left[start:end].float().t() @ right[start:end].float()).to(out.dtype)
        start = end
