"""Router-probability gradient: dot(grad_out[t], gathered[t, k]) for every route, fp32.

The torch form (einsum over fp32 copies) materializes two fp32 [T, K, H] tensors; this kernel
reads the bf16 rows once and accumulates in fp32 registers: one pass over T*K*H elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_dot_kernel(gathered_ptr, grad_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    routes = tl.arange(0, K)
    acc = tl.zeros([K, BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        in_row = cols < H
        grad = tl.load(grad_ptr + token * H + cols, mask=in_row, other=0.0).to(tl.float32)
        rows = tl.load(gathered_ptr + (token * K + routes[:, None]) * H + cols[None, :],
                       mask=in_row[None, :], other=0.0).to(tl.float32)
        acc += rows * grad[None, :]
    tl.store(out_ptr + token * K + routes, tl.sum(acc, axis=1))


def route_dot(gathered: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """[T, K, H] rows and [T, H] gradients -> [T, K] fp32 dot products."""
    num_tokens, topk, hidden = gathered.shape
    if grad_out.shape != (num_tokens, hidden):
        raise ValueError(f"grad_out must be [T, H] = {(num_tokens, hidden)}, got {tuple(grad_out.shape)}")
    power_of_two_k = topk & (topk - 1) == 0
    if not gathered.is_cuda or not power_of_two_k:
        return torch.einsum("tkh,th->tk", gathered.float(), grad_out.float())
    out = torch.empty(num_tokens, topk, dtype=torch.float32, device=gathered.device)
    # 8192 (route, column) pairs per step on 2 warps: the fastest of 2-8 warps x 256-2048 columns at
    # T=8192, K=8, H=2048 on an H200 (80 us against 100 us for 512 columns on 4 warps).
    block_h = min(triton.next_power_of_2(hidden), max(64, 8192 // topk))
    _route_dot_kernel[(num_tokens,)](gathered.contiguous(), grad_out.contiguous(), out, hidden, K=topk,
                                     BLOCK_H=block_h, num_warps=2)
    return out
