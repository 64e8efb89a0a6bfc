"""Copy a span of rows whose length and ends are device values (the dropless arena's spills).

`copy_row_span(src, dst, count, src_start, dst_start)`: dst[dst_start + j] = src[src_start + j]
for 0 <= j < count, where count and the starts are device integers (no host read). On CUDA one
Triton program per row of the host bound (the smaller of the two buffers) moves only the rows
below the count; elsewhere the torch form reads the span with a gather and writes every row of
`dst` back (fixed shapes: graph-capturable, and equal). A row outside either buffer is never
touched (a backstop: the arena's plan keeps every span inside).
Cost removed against the torch form on GPUs: the whole destination's read and rewrite.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch form serves
    triton = None

if triton is not None:
    @triton.jit
    def _copy_row_span_kernel(src_ptr, dst_ptr, count_ptr, src_start_ptr, dst_start_ptr, src_rows, dst_rows,
                              values_src_ptr, values_dst_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr,
                              HAS_VALUES: tl.constexpr):
        j = tl.program_id(0).to(tl.int64)
        src_row = tl.load(src_start_ptr).to(tl.int64) + j
        dst_row = tl.load(dst_start_ptr).to(tl.int64) + j
        inside = (j < tl.load(count_ptr)) & (src_row >= 0) & (src_row < src_rows) & (dst_row >= 0) & (
            dst_row < dst_rows)
        if inside:
            cols = tl.arange(0, BLOCK_H)
            for h0 in range(0, H, BLOCK_H):
                col = h0 + cols
                in_row = col < H
                value = tl.load(src_ptr + src_row * H + col, mask=in_row)
                tl.store(dst_ptr + dst_row * H + col, value, mask=in_row)
            if HAS_VALUES:
                tl.store(values_dst_ptr + dst_row, tl.load(values_src_ptr + src_row))


@functools.lru_cache(maxsize=None)
def _block(width: int) -> int:
    return min(triton.next_power_of_2(width), 2048)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_int(value, like: torch.Tensor) -> torch.Tensor:
    """A device int64 scalar. An int becomes one once per (value, device) and is kept: a copy from
    the host inside a CUDA-graph capture is refused, and the first call runs before any capture."""
    if torch.is_tensor(value):
        return value.reshape(()).to(device=like.device, dtype=torch.int64)
    key = (int(value), str(like.device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(value, dtype=torch.int64, device=like.device)
    return _CONSTANTS[key]


def copy_row_span(src: torch.Tensor, dst: torch.Tensor, count, src_start=0, dst_start=0,
                  values: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """dst[dst_start + j] = src[src_start + j] for 0 <= j < count (device scalars or ints); [N] or
    [N, W] of one dtype, contiguous. `values` = (values_src, values_dst), per-row fp32 arrays as
    long as src and dst: the same span of them, in the same launch. Returns dst."""
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or src.dim() not in (1, 2):
        raise ValueError(f"copy_row_span: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                         f"must be rows of one width and dtype")
    if src.shape[0] == 0 or dst.shape[0] == 0:
        return dst
    if values is not None and (values[0].shape != src.shape[:1] or values[1].shape != dst.shape[:1]):
        raise ValueError(f"copy_row_span: values {tuple(values[0].shape)} and {tuple(values[1].shape)} must have "
                         f"one entry per row of src {tuple(src.shape)} and dst {tuple(dst.shape)}")
    count, src_start, dst_start = (device_int(v, dst) for v in (count, src_start, dst_start))
    if dst.is_cuda and triton is not None and src.is_contiguous() and dst.is_contiguous():
        width = 1 if src.dim() == 1 else src.shape[1]
        grid = (min(src.shape[0], dst.shape[0]),)
        values_src, values_dst = values if values is not None else (src, dst)
        _copy_row_span_kernel[grid](src, dst, count, src_start, dst_start, src.shape[0], dst.shape[0], values_src,
                                    values_dst, H=width, BLOCK_H=_block(width), HAS_VALUES=values is not None,
                                    num_warps=4 if width >= 512 else 1)
        return dst
    if values is not None:
        _copy_row_span_torch(*values, count, src_start, dst_start)
    return _copy_row_span_torch(src, dst, count, src_start, dst_start)


def _copy_row_span_torch(src, dst, count, src_start, dst_start):
    j = torch.arange(dst.shape[0], device=dst.device) - dst_start  # each dst row's place in the span
    source = src_start + j
    take = (j >= 0) & (j < count) & (source >= 0) & (source < src.shape[0])
    moved = src.index_select(0, source.clamp(0, src.shape[0] - 1))
    mask = take if dst.dim() == 1 else take[:, None]
    return dst.copy_(torch.where(mask, moved, dst))
