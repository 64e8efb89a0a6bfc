"""The router's gating GEMMs in Triton, for bf16 tokens and weight with fp32 logits (Megatron's
fp32 router under --bf16; docs/design.md, "Fused router").

  forward   logits [T, E] = tokens [T, H] @ weight[E, H]^T, computed inside the routing kernel's
            program for its block of tokens (`gate_logits`; kernels/router_topk.py)
  d tokens  [T, H] = g @ weight with g = hi + lo the logits' gradient as two bf16 halves, inside
            the routing backward kernel's program (`gate_token_grad`)
  d weight  [E, H] = g^T @ tokens, one kernel (`gate_weight_grad`): programs over (H block, token
            split) write fp32 partials; the last program of an H block to arrive sums the splits
            in split order, so the result does not depend on which program finishes first.

Cost removed: cuBLAS from the layer step (three GEMMs, a split-K reduce, a workspace memset) and
the `cat`, add and cast around them: on the lent hosts each library path costs its cold-cache
penalty per use (BENCHMARKS.md, "Cold host caches"), and the routing
kernels are Triton launches the step makes anyway. Cost accepted: the fp32 sums run in another
order than cuBLAS's (equal to fp32 rounding; bitwise run to run), the weight gradient makes one
more Triton launch, and with few tokens (64 blocks at 2048) the per-block GEMMs use too few
programs: up to 7% more device time there in a CUDA graph, where no host cost is left to save.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 256  # more experts: the tiles below would not fit in shared memory; cuBLAS gates those

# Tiles picked by a sweep on an H200 at 8192 tokens, 64 experts, hidden 2048 (BENCHMARKS.md,
# "The router's GEMMs in Triton"), narrowed for more experts so the pipelined tiles fit in shared
# memory: hidden columns per step of each GEMM loop, tokens per step of the weight gradient's
# loop, its program count (about two waves of 132 SMs) and the loops' pipelining depth.
WGRAD_PROGRAMS = 256
WGRAD_BLOCK_H = 64
GEMM_STAGES = 4


@dataclass(frozen=True)
class GateTiles:
    logits_block_h: int
    token_grad_block_h: int
    wgrad_block_t: int

    @staticmethod
    @functools.cache  # asked for on every routing launch
    def for_experts(num_experts: int) -> "GateTiles":
        narrow = gate_block_e(num_experts) // 64 or 1  # 1, 2 or 4
        return GateTiles(logits_block_h=128 // narrow, token_grad_block_h=256 // narrow,
                         wgrad_block_t=64 // min(narrow, 2))


def gate_block_e(num_experts: int) -> int:
    """Expert columns of a gating tile: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(num_experts))


@triton.jit
def gate_logits(hidden_ptr, weight_ptr, logits_ptr, block, T, E, H, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Logits of one block of tokens, fp32 sums of bf16 products, stored to `logits_ptr` [T, E] for
    the backward. Returns what kernels/router_topk._load_logits returns: (tokens, experts, inside,
    offsets into [T, E], logits in fp32 with -inf outside)."""
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    token_rows = tokens[:, None].to(tl.int64) * H
    expert_rows = experts[:, None].to(tl.int64) * H
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        x = tl.load(hidden_ptr + token_rows + cols[None, :], mask=(tokens[:, None] < T) & (cols[None, :] < H),
                    other=0.0)
        w = tl.load(weight_ptr + expert_rows + cols[None, :], mask=(experts[:, None] < E) & (cols[None, :] < H),
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    inside = (tokens[:, None] < T) & (experts[None, :] < E)
    offsets = tokens[:, None].to(tl.int64) * E + experts[None, :]
    tl.store(logits_ptr + offsets, acc, mask=inside)
    return tokens, experts, inside, offsets, tl.where(inside, acc, float("-inf"))


@triton.jit
def gate_token_grad(hi, lo, weight_ptr, grad_hidden_ptr, tokens, experts, T, E, H, BLOCK_H: tl.constexpr):
    """d tokens for one block: [hi | lo] @ [weight; weight], fp32 sums, one rounding to bf16
    (what torch.mm of the halves against the stacked weight gives, in another order)."""
    token_rows = tokens[:, None].to(tl.int64) * H
    expert_rows = experts[:, None].to(tl.int64) * H
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        w = tl.load(weight_ptr + expert_rows + cols[None, :], mask=(experts[:, None] < E) & (cols[None, :] < H),
                    other=0.0)
        acc = tl.dot(hi, w)
        acc = tl.dot(lo, w, acc)
        tl.store(grad_hidden_ptr + token_rows + cols[None, :], acc.to(tl.bfloat16),
                 mask=(tokens[:, None] < T) & (cols[None, :] < H))


@triton.jit
def _gate_weight_grad_kernel(grad_split_ptr, hidden_ptr, partial_ptr, arrivals_ptr, grad_weight_ptr, T, E, H,
                             tokens_per_split, SPLITS, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_H: tl.constexpr):
    h_block, split = tl.program_id(0), tl.program_id(1)
    cols = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    experts = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    first = split * tokens_per_split
    end = tl.minimum(first + tokens_per_split, T)
    for start in range(first, end, BLOCK_T):
        tokens = start + tl.arange(0, BLOCK_T)
        rows = (tokens[:, None] < end)
        g_offsets = tokens[:, None].to(tl.int64) * (2 * E) + experts[None, :]
        g_mask = rows & (experts[None, :] < E)
        hi = tl.load(grad_split_ptr + g_offsets, mask=g_mask, other=0.0)
        lo = tl.load(grad_split_ptr + g_offsets + E, mask=g_mask, other=0.0)
        x = tl.load(hidden_ptr + tokens[:, None].to(tl.int64) * H + cols[None, :], mask=rows & (cols[None, :] < H),
                    other=0.0)
        acc = tl.dot(tl.trans(hi), x, acc)
        acc = tl.dot(tl.trans(lo), x, acc)
    tile = experts[:, None].to(tl.int64) * H + cols[None, :]
    tl.store(partial_ptr + split * E * H + tile, acc, mask=(experts[:, None] < E) & (cols[None, :] < H))
    # Every thread's part of the partial is stored (the barrier) before one thread's release
    # publishes the arrival; the program that sees the last count acquires them all.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + h_block, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:  # the last of this H block: sum the splits in split order
        total = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
        for s in range(SPLITS):
            total += tl.load(partial_ptr + s * E * H + tile, mask=(experts[:, None] < E) & (cols[None, :] < H),
                             other=0.0, cache_modifier=".cg")
        tl.store(grad_weight_ptr + tile, total.to(tl.bfloat16), mask=(experts[:, None] < E) & (cols[None, :] < H))


def gate_weight_grad(grad_split: torch.Tensor, hidden: torch.Tensor, arrivals: torch.Tensor) -> torch.Tensor:
    """d weight [E, H] bf16 = (hi + lo)^T @ tokens, fp32 sums, one rounding. `grad_split` is the
    routing backward's [T, 2E] bf16 (hi | lo), `hidden` the [T, H] bf16 tokens, `arrivals`
    arrival_blocks(H) int32 zeros (the routing backward kernel clears them just before, so this
    costs no fill launch; the counts are left at the number of splits)."""
    num_tokens, hidden_size = hidden.shape
    num_experts = grad_split.shape[1] // 2
    tiles = GateTiles.for_experts(num_experts)
    block_t = tiles.wgrad_block_t
    h_blocks = arrival_blocks(hidden_size)
    splits = max(1, min(triton.cdiv(num_tokens, block_t), WGRAD_PROGRAMS // h_blocks))
    tokens_per_split = triton.cdiv(triton.cdiv(num_tokens, splits), block_t) * block_t
    splits = triton.cdiv(num_tokens, tokens_per_split) if num_tokens else 1
    partial = torch.empty(splits, num_experts, hidden_size, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty(num_experts, hidden_size, dtype=torch.bfloat16, device=hidden.device)
    block_e = gate_block_e(num_experts)
    _gate_weight_grad_kernel[(h_blocks, splits)](
        grad_split, hidden, partial, arrivals, grad_weight, num_tokens, num_experts, hidden_size, tokens_per_split,
        splits, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=WGRAD_BLOCK_H, num_warps=4 if block_e <= 64 else 8,
        num_stages=GEMM_STAGES)
    return grad_weight


def arrival_blocks(hidden_size: int) -> int:
    """Length of gate_weight_grad's arrival counters for tokens of `hidden_size`."""
    return triton.cdiv(hidden_size, WGRAD_BLOCK_H)
