"""The experts' fast path (SwiGLU, no biases, 16-byte aligned sizes) as one autograd node.

fc1 -> SwiGLU -> fc2 on `torch._grouped_mm` with device int32 end offsets, forward and backward
written out: the same five grouped GEMMs and two SwiGLU kernels that autograd would run for the
three separate ops, in one node. Cost removed: four autograd nodes per layer step (two grouped-GEMM
backward nodes, the SwiGLU node, two transpose views) and their host time; the fc2 weight
gradient comes out in the parameter's own layout [L, H, F] instead of a transposed view, so
Megatron's DDP adds it to main_grad without a strided pass. Cost accepted: the backward is this
module's code rather than torch's formula (checked against torch's autograd in the tests).
Saved for backward, as autograd would: the input rows, fc1's output and the activation, each
released in backward when torch's own backward would release it (peak memory as torch's). With
`recompute_activation` (Megatron's `--recompute-modules moe_act`) the activation is not kept: the
backward runs the SwiGLU kernel again from fc1's output. Cost removed: [rows, F] of saved
activations per layer; cost accepted: one more SwiGLU forward (memory bound) in the backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megatron_ext.kernels.row_span import device_int
from megatron_ext.kernels.swiglu import RowPlace, swiglu_backward, swiglu_forward
from megatron_ext.moe.expert_wgrad import expert_weight_grad


class _SwiGLUGroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, fc1_weight, fc2_weight, offsets, probs, recompute_activation: bool, arena,
                wgrad_fusion: bool):
        valid_rows = offsets[-1]
        ctx.arena = arena
        # The parameters themselves (with DDP's main_grad), for moe/expert_wgrad.py
        ctx.fused_weights = (fc1_weight, fc2_weight) if wgrad_fusion else None
        if arena is None:
            fc1_out = torch._grouped_mm(hidden, fc1_weight.transpose(1, 2), offs=offsets)
            act = swiglu_forward(fc1_out, valid_rows, probs)
            ctx.save_for_backward(hidden, fc1_weight, fc2_weight, offsets, probs)
            # The two intermediates live on ctx, not in saved_tensors, so backward can drop each as
            # soon as its last reader has run: peak memory as in torch's own three-node backward.
            ctx.intermediates = [fc1_out, None if recompute_activation else act]
        else:  # moe/arena.py: the rows, fc1's rows past P and (kept) the activation live in the arena
            ctx.keeps_act = not recompute_activation
            fc1_rows = _fc1_in_two_parts(hidden, fc1_weight, offsets, arena.region)
            width = fc1_rows.region_rows.shape[1]
            act_rows = arena.act_view(width // 2, hidden.dtype) if ctx.keeps_act else None
            # The SwiGLU kernel stores fc1's rows past P in the arena as it reads them.
            act = swiglu_forward(None, valid_rows, probs, read_from=fc1_rows, save_to=arena.fc1_kept(
                fc1_rows.region_rows), rows=hidden.shape[0], out=act_rows)
            ctx.save_for_backward(fc1_weight, fc2_weight, offsets)
            ctx.arena_inputs = (hidden, probs)  # on ctx: the arena's copies write their storage (version counter)
            ctx.intermediates = [fc1_rows.region_rows, None]
            del fc1_rows
        out = torch._grouped_mm(act, fc2_weight.transpose(1, 2), offs=offsets)
        if arena is not None:  # fc1 read the rows, fc2 the activation: rows past P leave region i+1
            arena.spill(valid_rows)
        return out

    @staticmethod
    @once_differentiable  # the intermediates on ctx carry no graph: a double backward is refused, not wrong
    def backward(ctx, grad_out):
        if ctx.intermediates is None:
            raise RuntimeError("backward ran twice through the grouped experts (retain_graph=True); their "
                               "intermediates are released by the first backward: run the forward again")
        fc1_held, act = ctx.intermediates  # fc1's output; with an arena, its rows below P
        ctx.intermediates = None
        fc1_out, place = fc1_held, None  # place: where an arena's fc1 rows are read (RowPlace)
        if ctx.arena is None:
            hidden, fc1_weight, fc2_weight, offsets, probs = ctx.saved_tensors
        else:
            (fc1_weight, fc2_weight, offsets), (hidden, probs) = ctx.saved_tensors, ctx.arena_inputs
            ctx.arena.restore(offsets[-1])
            if ctx.keeps_act:
                act = ctx.arena.act_view(fc2_weight.shape[2], fc2_weight.dtype)
            # The SwiGLU kernels read the region rows and the rows past P where the forward kept them.
            place, fc1_out = ctx.arena.fc1_kept(fc1_held), None
        del fc1_held
        need_hidden, need_fc1, need_fc2, _, need_probs, _, _, _ = ctx.needs_input_grad
        fuse = ctx.fused_weights is not None
        fc1_param, fc2_param = ctx.fused_weights or (fc1_weight, fc2_weight)
        grad_out = grad_out.contiguous()
        need_act_grad = need_hidden or need_fc1 or need_probs
        if act is None and need_fc2:  # recomputed, alive through both fc2 GEMMs as if it had been kept
            act = swiglu_forward(fc1_out, offsets[-1], probs, read_from=place, rows=grad_out.shape[0])
        # fc2's two gradients while the activation is alive, then release it (torch's own order).
        # Releasing it between them hands its memory to the next GEMM's output; inside a captured
        # backward that gave NaN weight gradients in replays (tests/gpu/test_graph_runner_gpu.py,
        # the training-shape stack), although every kernel ran on one stream.
        grad_act = torch._grouped_mm(grad_out, fc2_weight, offs=offsets) if need_act_grad else None
        grad_fc2 = expert_weight_grad(fc2_param, grad_out, act, offsets, fuse) if need_fc2 else None
        del act
        if not need_act_grad:
            return None, None, grad_fc2, None, None, None, None, None
        grad_fc1_out, grad_probs = swiglu_backward(grad_act, fc1_out, probs, offsets[-1], read_from=place)
        del grad_act, fc1_out, place
        grad_hidden = torch._grouped_mm(grad_fc1_out, fc1_weight, offs=offsets) if need_hidden else None
        grad_fc1 = expert_weight_grad(fc1_param, grad_fc1_out, hidden, offsets, fuse) if need_fc1 else None
        return grad_hidden, grad_fc1, grad_fc2, None, grad_probs if need_probs else None, None, None, None


def _fc1_in_two_parts(hidden: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, region: int) -> RowPlace:
    """fc1's output for an arena's view: rows below P (the layer's region) and the rows past it, each
    a fresh tensor (moe/arena_rows.ArenaRows.fc1_kept keeps the first as it is, the second's rows in
    the arena). On GPUs two grouped GEMMs (`fc1_two_gemms`); cost removed: the store of every fc1
    row into the arena (one write of [rows, F'] per layer, ~95 us at the reference shape on an H100,
    since torch._grouped_mm has no `out=`); cost accepted: one more GEMM launch and three small
    offset ops per layer forward. On CPUs one GEMM and a copy of the region rows: CPU BLAS may sum
    an fp32 row differently when the GEMM's rows are split, and the arena must equal the per-layer
    path bitwise."""
    weight = fc1_weight.transpose(1, 2)
    if hidden.is_cuda:
        region_rows, spill_rows = fc1_two_gemms(hidden, weight, offsets, region)
    else:
        fc1_out = torch._grouped_mm(hidden, weight, offs=offsets)
        region_rows, spill_rows = fc1_out[:region].clone(), fc1_out[region:]
    return RowPlace(region_rows, spill_rows, device_int(0, hidden))


def fc1_two_gemms(hidden: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                  region: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One grouped GEMM over `hidden`'s rows below `region` and one over the rows from it on, each on
    the end offsets clamped to its range (an expert straddling `region` is split between the two;
    experts wholly on one side are empty groups of the other): (rows [region, N'], rows [C - region,
    N']), valid where one GEMM over all rows would be."""
    region_rows = torch._grouped_mm(hidden[:region], weight, offs=offsets.clamp(max=region))
    run_on = hidden[region:]
    if not run_on.shape[0]:
        return region_rows, run_on.new_empty(0, weight.shape[2])
    return region_rows, torch._grouped_mm(run_on, weight, offs=(offsets - region).clamp(min=0))


def swiglu_grouped_mlp(hidden: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
                       offsets: torch.Tensor, probs: torch.Tensor | None = None,
                       recompute_activation: bool = False, arena=None, wgrad_fusion: bool = False) -> torch.Tensor:
    """fc2(swiglu(fc1(hidden)) [* probs]) per expert on rows < offsets[-1]: hidden [rows, H], fc1
    [L, 2F, H] (gate rows, then up rows), fc2 [L, H, F], int32 end offsets [L], probs [rows] fp32.
    Rows at or past offsets[-1] are never read; their outputs and gradients are not defined.
    `recompute_activation`: keep fc1's output only and run the activation again in the backward.
    `arena` (moe/arena_rows.ArenaRows): `hidden` and `probs` are that arena's view; fc1's rows past the
    layer's region and, without `recompute_activation`, the activation are kept there.
    `wgrad_fusion`: the weight gradients go into Megatron DDP's main_grad where the weights have one
    (moe/expert_wgrad.py)."""
    if arena is not None and not hidden.is_contiguous():
        raise ValueError("the arena's rows are read in place: hidden must be the arena's (contiguous) view")
    return _SwiGLUGroupedMLP.apply(hidden.contiguous(), fc1_weight, fc2_weight, offsets, probs,
                                   recompute_activation, arena, wgrad_fusion)
