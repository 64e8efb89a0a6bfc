"""Megatron's top-k softmax routing in one Triton kernel each way (docs/design.md, "Fused router").

Forward, per block of BLOCK_TOKENS tokens, from the router logits [T, E]:
  top-k     K rounds of "largest logit not yet taken, lowest expert id on ties"; NaN counts as
            the largest, as in torch.topk
  probs     softmax over the K selected logits (or, pre-softmax, the full softmax at them), times
            the scaling factor, rounded through the logits' dtype as Megatron's `type_as` does
  route     what the rowwise route map needs (kernels/route_plan.py's select kernel outputs):
            the [T, E] routing map, top-k ids ascending, their probs (fp32), per-expert counts,
            per-block histograms, the count of non-finite selected probs
  aux       per-block sums of the full softmax over tokens, [B, E] (the load-balancing loss's
            P_i before the final sum), and the loss itself, formed by the block that arrives last
            from those sums in block order and the final counts (`aux_scale`)
Backward, one kernel: the logits' gradient from the top-k probs' gradient (softmax over the
selected logits, or the full softmax when pre-softmax) plus the load-balancing loss's gradient
(full softmax), in fp32 or split into bf16 hi and lo halves for the gating GEMMs.
With bf16 tokens and weight and fp32 logits the gating GEMM runs inside the forward kernel and
the tokens' gradient inside the backward one (kernels/router_gate.py; `gate_router_topk`).

Cost removed: Megatron's routing (topk, softmax, two scatters into [T, E], the aux-loss softmax,
topk and scatter, a sum) and the separate select kernel: about 20 launches and 10 autograd
nodes per layer step. Cost accepted: softmax and sums in a different order than torch's, so
probabilities and the aux loss agree with Megatron's to fp32 rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_ext.kernels.route_plan import BLOCK_TOKENS, _store_selection, selection_outputs
from megatron_ext.kernels.router_gate import (GEMM_STAGES, GateTiles, arrival_blocks, gate_block_e, gate_logits,
                                              gate_token_grad, gate_weight_grad)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _load_logits(logits_ptr, block, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(tokens, experts, inside, offsets into [T, E], logits in fp32 with -inf outside)."""
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    inside = (tokens[:, None] < T) & (experts[None, :] < E)
    offsets = tokens[:, None].to(tl.int64) * E + experts[None, :]
    logits = tl.load(logits_ptr + offsets, mask=inside, other=float("-inf")).to(tl.float32)
    return tokens, experts, inside, offsets, logits


@triton.jit
def _softmax_rows(logits, keep):
    """Row softmax of `logits` over the entries where `keep` is set, 0 elsewhere. A row whose kept
    logits are all -inf gives NaN, as torch's softmax does (counted as non-finite, not routed at 0)."""
    top = tl.max(tl.where(keep, logits, float("-inf")), axis=1)
    kept_any = tl.max(keep.to(tl.int32), axis=1) > 0
    top = tl.where(kept_any, top, 0.0)  # rows with nothing kept (past T): 0, not inf - inf
    exp = tl.where(keep, tl.exp(logits - top[:, None]), 0.0)
    total = tl.sum(exp, axis=1)
    return exp / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _aux_loss_when_last(score_sums_ptr, counts_ptr, arrivals_ptr, aux_ptr, aux_scale, num_blocks, E, experts,
                        AUX_ROWS: tl.constexpr):
    """aux = aux_scale * sum_e (sum over blocks of score_sums[b, e]) * counts[e], formed by the block
    that arrives last, when every block's sums and count atomics are in. It sums AUX_ROWS blocks per
    load, in block order (the same bits whichever block is last). The arrival counter is a zeroed
    element of the counts' buffer, fresh every launch."""
    tl.debug_barrier()  # every thread's stores and count atomics before the release
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_blocks - 1:
        sums = tl.zeros_like(experts).to(tl.float32)
        rows = tl.arange(0, AUX_ROWS)
        for first in range(0, num_blocks, AUX_ROWS):  # AUX_ROWS blocks' sums per load, not one dependent load each
            block_rows = first + rows
            tile = tl.load(score_sums_ptr + block_rows[:, None] * E + experts[None, :],
                           mask=(block_rows[:, None] < num_blocks) & (experts[None, :] < E), other=0.0,
                           cache_modifier=".cg")
            sums += tl.sum(tile, axis=0)
        counts = tl.load(counts_ptr + experts, mask=experts < E, other=0, cache_modifier=".cg").to(tl.float32)
        tl.store(aux_ptr, tl.sum(sums * counts, axis=0) * aux_scale)


@triton.jit
def _router_topk_kernel(logits_ptr, hidden_ptr, weight_ptr, map_ptr, top_idx_ptr, top_probs_ptr, counts_ptr, hist_ptr,
                        nonfinite_ptr, score_sums_ptr, arrivals_ptr, aux_ptr, T, E, H, scale, aux_scale, num_blocks,
                        K: tl.constexpr, PRE_SOFTMAX: tl.constexpr, SCORE_SUMS: tl.constexpr,
                        AUX_LOSS: tl.constexpr, PROBS_DTYPE: tl.constexpr, GATE: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    block = tl.program_id(0)
    if GATE:  # logits computed here from the tokens and the weight, and stored for the backward
        tokens, experts, inside, offsets, logits = gate_logits(hidden_ptr, weight_ptr, logits_ptr, block, T, E, H,
                                                               BLOCK_T, BLOCK_E, BLOCK_H)
    else:
        tokens, experts, inside, offsets, logits = _load_logits(logits_ptr, block, T, E, BLOCK_T, BLOCK_E)
    key = tl.where(logits != logits, float("inf"), logits)  # NaN ranks first, as in torch.topk
    taken = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
    for _ in tl.static_range(K):
        candidate = inside & ~taken
        best = tl.max(tl.where(candidate, key, float("-inf")), axis=1)
        pick = tl.min(tl.where(candidate & (key == best[:, None]), experts[None, :], BLOCK_E), axis=1)
        taken = taken | (experts[None, :] == pick[:, None])
    if PRE_SOFTMAX:
        probs = _softmax_rows(logits, inside)
    else:
        probs = _softmax_rows(logits, taken)
    probs = (probs * scale).to(PROBS_DTYPE).to(tl.float32)  # Megatron's probs.type_as(logits)
    slot = tl.cumsum(taken.to(tl.int32), axis=1) - 1
    tl.store(map_ptr + offsets, taken.to(tl.int8), mask=inside)
    _store_selection(top_idx_ptr, top_probs_ptr, counts_ptr, hist_ptr, nonfinite_ptr, block, tokens, experts,
                     taken, slot, probs, E, K)
    if SCORE_SUMS:
        scores = _softmax_rows(logits, inside)
        tl.store(score_sums_ptr + block * E + experts, tl.sum(scores, axis=0), mask=experts < E)
        if AUX_LOSS:  # the last block to arrive forms the loss from every block's sums and the final counts
            _aux_loss_when_last(score_sums_ptr, counts_ptr, arrivals_ptr, aux_ptr, aux_scale, num_blocks, E, experts,
                                32)


@triton.jit
def _router_topk_backward_kernel(logits_ptr, map_ptr, grad_top_ptr, grad_aux_ptr, counts_ptr, grad_logits_ptr,
                                 weight_ptr, grad_hidden_ptr, arrivals_ptr, T, E, H, num_arrivals, scale, aux_scale,
                                 K: tl.constexpr, PRE_SOFTMAX: tl.constexpr, HAS_GRAD_TOP: tl.constexpr,
                                 HAS_GRAD_AUX: tl.constexpr, SPLIT: tl.constexpr, GATE: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    tokens, experts, inside, offsets, logits = _load_logits(logits_ptr, tl.program_id(0), T, E, BLOCK_T, BLOCK_E)
    taken = (tl.load(map_ptr + offsets, mask=inside, other=0) != 0) & inside
    scores = _softmax_rows(logits, inside)
    grad = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_GRAD_TOP:
        slot = tl.cumsum(taken.to(tl.int32), axis=1) - 1
        g = tl.load(grad_top_ptr + tokens[:, None].to(tl.int64) * K + slot, mask=taken, other=0.0) * scale
        if PRE_SOFTMAX:  # probs = softmax(all logits) at the selected experts
            grad += scores * (g - tl.sum(scores * g, axis=1)[:, None])
        else:  # probs = softmax(selected logits)
            probs = _softmax_rows(logits, taken)
            grad += probs * (g - tl.sum(probs * g, axis=1)[:, None])
    if HAS_GRAD_AUX:  # aux = scale * sum_e score_sums[e] * counts[e]; score_sums = sum over tokens of softmax
        counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.float32)
        a = ((tl.load(grad_aux_ptr) * aux_scale) * counts)[None, :]  # d aux / d score_sums, as torch forms it
        grad += scores * (a - tl.sum(scores * a, axis=1)[:, None])
    if SPLIT:  # [T, 2E] bf16: hi = bf16(grad) in columns [0, E), lo = bf16(grad - hi) in [E, 2E)
        hi = grad.to(tl.bfloat16)
        lo = (grad - hi.to(tl.float32)).to(tl.bfloat16)
        row = tokens[:, None].to(tl.int64) * (2 * E) + experts[None, :]
        tl.store(grad_logits_ptr + row, hi, mask=inside)
        tl.store(grad_logits_ptr + row + E, lo, mask=inside)
        if GATE:  # the tokens' gradient here; the weight's in router_gate.gate_weight_grad, next on the stream
            gate_token_grad(hi, lo, weight_ptr, grad_hidden_ptr, tokens, experts, T, E, H, BLOCK_H)
            if tl.program_id(0) == 0:  # counts arrivals from zero (stream order: it runs after this kernel)
                for start in range(0, num_arrivals, BLOCK_E):
                    at = start + experts
                    tl.store(arrivals_ptr + at, tl.zeros_like(at), mask=at < num_arrivals)
    else:
        tl.store(grad_logits_ptr + offsets, grad.to(grad_logits_ptr.dtype.element_ty), mask=inside)


def router_topk(logits: torch.Tensor, topk: int, pre_softmax: bool = False, scale: float = 1.0,
                score_sums: bool = False, aux_scale: float | None = None) -> dict:
    """[T, E] logits -> dict of routing_map [T, E] bool, top_idx [T, K] int32 ascending, top_probs
    [T, K] fp32, counts [E] int32, hist [B, E] int32, nonfinite [] int32, with `score_sums`
    score_sums [E] fp32 (sum over tokens of the full softmax), and with `aux_scale` aux_loss []
    fp32 = aux_scale * sum(score_sums * counts), formed in the same launch (Megatron's switch
    load-balancing loss of these counts; its score sums summed per block, then in block order).
    Not differentiable; see megatron_ext.moe.fused_router for the autograd wrapper."""
    return _route(logits, None, None, topk, pre_softmax, scale, score_sums, aux_scale)


def gate_router_topk(hidden: torch.Tensor, weight: torch.Tensor, topk: int, pre_softmax: bool = False,
                     scale: float = 1.0, score_sums: bool = False, aux_scale: float | None = None) -> dict:
    """router_topk of the fp32 logits of bf16 tokens [T, H] and router weight [E, H], the gating GEMM
    in the same kernel; the dict also holds those logits [T, E] fp32 (the backward's input)."""
    logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
    out = _route(logits, hidden.contiguous(), weight.contiguous(), topk, pre_softmax, scale, score_sums, aux_scale)
    out["logits"] = logits
    return out


def _route(logits, hidden, weight, topk, pre_softmax, scale, score_sums, aux_scale) -> dict:
    """One routing launch; with `hidden` and `weight` the kernel computes `logits` (its output)."""
    num_tokens, num_experts = logits.shape
    device = logits.device
    gate = hidden is not None
    aux = aux_scale is not None
    routing_map = torch.empty(num_tokens, num_experts, dtype=torch.bool, device=device)
    # the counters after the counts: the non-finite count, then the aux loss's arrival count
    top_idx, top_probs, counters, hist = selection_outputs(num_tokens, num_experts, topk, device, counters=2)
    blocks = hist.shape[0]
    sums = score_sums or aux
    partial_sums = torch.empty(blocks if sums else 1, num_experts, dtype=torch.float32, device=device)
    aux_loss = partial_sums  # never written without `aux`
    if aux:  # no tokens, no program: the loss of no tokens is 0
        aux_loss = (torch.empty if blocks else torch.zeros)((), dtype=torch.float32, device=device)
    block_e = gate_block_e(num_experts) if gate else triton.next_power_of_2(num_experts)
    _router_topk_kernel[(blocks,)](
        logits, hidden if gate else logits, weight if gate else logits, routing_map.view(torch.int8), top_idx,
        top_probs, counters, hist, counters[num_experts:], partial_sums, counters[num_experts + 1:], aux_loss,
        num_tokens, num_experts, hidden.shape[1] if gate else 0, float(scale), float(aux_scale or 0.0), blocks,
        K=topk, PRE_SOFTMAX=pre_softmax, SCORE_SUMS=sums, AUX_LOSS=aux, PROBS_DTYPE=_TL_DTYPES[logits.dtype],
        GATE=gate, BLOCK_T=BLOCK_TOKENS, BLOCK_E=block_e, BLOCK_H=GateTiles.for_experts(num_experts).logits_block_h,
        num_warps=4 if block_e <= 128 else 8, num_stages=GEMM_STAGES)
    return {"routing_map": routing_map, "top_idx": top_idx, "top_probs": top_probs,
            "counts": counters[:num_experts], "hist": hist, "nonfinite": counters[num_experts],
            "score_sums": partial_sums.sum(0) if score_sums else None, "aux_loss": aux_loss if aux else None}


def router_topk_backward(logits: torch.Tensor, routing_map: torch.Tensor, grad_top_probs: torch.Tensor | None,
                         grad_aux: tuple[torch.Tensor, torch.Tensor, float] | None, topk: int, pre_softmax: bool,
                         scale: float, split: bool = False) -> torch.Tensor:
    """Gradient of router_topk's top_probs and of the load-balancing loss -> the logits' gradient.

    grad_aux = (d loss / d aux [] fp32, counts [E], aux scale) for aux = aux_scale * sum(score_sums * counts).
    Returns [T, E] in the logits' dtype, or with `split` [T, 2E] bf16 holding hi = bf16(g) and
    lo = bf16(g - hi) side by side: g to ~16 mantissa bits for two bf16 GEMMs with fp32 accumulation."""
    return _route_backward(logits, routing_map, grad_top_probs, grad_aux, topk, pre_softmax, scale, split)[0]


def gate_router_topk_backward(logits: torch.Tensor, routing_map: torch.Tensor, grad_top_probs: torch.Tensor | None,
                              grad_aux: tuple[torch.Tensor, torch.Tensor, float] | None, topk: int, pre_softmax: bool,
                              scale: float, hidden: torch.Tensor, weight: torch.Tensor):
    """Gradient of gate_router_topk's top_probs and of the load-balancing loss -> the gating GEMMs'
    gradients (d tokens [T, H], d weight [E, H]), both bf16, for its bf16 tokens and router weight:
    the tokens' in the routing backward's launch, the weight's in one more (router_gate.py)."""
    grad_split, grad_hidden, arrivals = _route_backward(logits, routing_map, grad_top_probs, grad_aux, topk,
                                                        pre_softmax, scale, True, hidden, weight)
    return grad_hidden, gate_weight_grad(grad_split, hidden, arrivals)


def _route_backward(logits, routing_map, grad_top_probs, grad_aux, topk, pre_softmax, scale, split,
                    hidden=None, weight=None):
    """One routing backward launch -> (the logits' gradient, d tokens, the weight gradient's arrival
    counters); with `hidden` and `weight` the kernel also forms d tokens and clears the counters."""
    num_tokens, num_experts = logits.shape
    gate = hidden is not None
    if split:
        grad = torch.empty(num_tokens, 2 * num_experts, dtype=torch.bfloat16, device=logits.device)
    else:
        grad = torch.empty_like(logits)
    dummy = logits  # never read: the HAS_* or GATE flag is off
    grad_hidden = torch.empty_like(hidden) if gate else dummy
    num_arrivals = arrival_blocks(hidden.shape[1]) if gate else 0
    arrivals = torch.empty(num_arrivals, dtype=torch.int32, device=logits.device) if gate else dummy
    block_e = gate_block_e(num_experts) if gate else triton.next_power_of_2(num_experts)
    grad_aux_loss, counts, aux_scale = grad_aux if grad_aux is not None else (dummy, dummy, 0.0)
    blocks = triton.cdiv(num_tokens, BLOCK_TOKENS)
    if gate:  # program 0 clears the weight gradient's arrival counters, even with no tokens
        blocks = max(blocks, 1)
    _router_topk_backward_kernel[(blocks,)](
        logits, routing_map.view(torch.int8),
        grad_top_probs.contiguous() if grad_top_probs is not None else dummy, grad_aux_loss, counts, grad,
        weight if gate else dummy, grad_hidden, arrivals, num_tokens, num_experts, hidden.shape[1] if gate else 0,
        num_arrivals, float(scale), float(aux_scale), K=topk, PRE_SOFTMAX=pre_softmax,
        HAS_GRAD_TOP=grad_top_probs is not None, HAS_GRAD_AUX=grad_aux is not None, SPLIT=split, GATE=gate,
        BLOCK_T=BLOCK_TOKENS, BLOCK_E=block_e, BLOCK_H=GateTiles.for_experts(num_experts).token_grad_block_h,
        num_warps=4 if block_e <= 128 else 8, num_stages=GEMM_STAGES - 1)
    return grad, grad_hidden, arrivals
