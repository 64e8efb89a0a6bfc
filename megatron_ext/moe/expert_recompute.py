"""Megatron's `--recompute-modules moe_act` for the experts' general paths (any activation, biases,
padding, MXFP8 payloads): fc2 on an activation that is not kept for the backward. The fast path
does the same inside its own autograd node (moe/expert_mlp.py).

One autograd node runs activation -> fc2's grouped GEMM; its backward runs the activation again
from fc1's output (under autograd, for the activation's own gradient) just before fc2's two
gradient GEMMs, which read it, as Megatron's grouped experts do with its CheckpointWithoutOutput.
Unlike that helper it works under `torch.autograd.grad` too, which the graph runner's capture
uses. Cost removed: [rows, F] saved per layer (non-gated activations: also what their ops saved
inside); cost accepted: the activation runs twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from megatron_ext.moe.expert_wgrad import expert_weight_grad


class _RecomputedActivationFc2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, probs, fc2_weight, valid_rows, offsets, activation: Callable, wgrad_fusion: bool):
        with torch.no_grad():
            act = activation(h, valid_rows, probs)
        ctx.save_for_backward(h, probs, fc2_weight, valid_rows, offsets)
        ctx.activation = activation
        ctx.fc2_param, ctx.wgrad_fusion = fc2_weight, wgrad_fusion  # the parameter, with DDP's main_grad
        return torch._grouped_mm(act, fc2_weight.transpose(1, 2), offs=offsets)

    @staticmethod
    @once_differentiable  # a double backward is refused loudly, not given without its graph
    def backward(ctx, grad_out):
        h, probs, fc2_weight, valid_rows, offsets = ctx.saved_tensors
        need_h, need_probs, need_fc2 = ctx.needs_input_grad[:3]
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in ((h, need_h), (probs, need_probs))]
        with torch.enable_grad():
            act = ctx.activation(leaves[0], valid_rows, leaves[1])
        grad_out = grad_out.contiguous()
        grad_act = torch._grouped_mm(grad_out, fc2_weight, offs=offsets) if need_h or need_probs else None
        grad_fc2 = (expert_weight_grad(ctx.fc2_param, grad_out, act.detach(), offsets, ctx.wgrad_fusion)
                    if need_fc2 else None)
        grad_h = grad_probs = None
        wanted = [leaf for leaf, need in zip(leaves, (need_h, need_probs)) if need]
        if wanted:
            grads = iter(torch.autograd.grad(act, wanted, grad_act))
            grad_h = next(grads) if need_h else None
            grad_probs = next(grads) if need_probs else None
        return grad_h, grad_probs, grad_fc2, None, None, None, None


def activation_then_fc2(activation: Callable, h: torch.Tensor, valid_rows: torch.Tensor, probs: torch.Tensor | None,
                        fc2_weight: torch.Tensor, offsets: torch.Tensor, wgrad_fusion: bool = False) -> torch.Tensor:
    """fc2 [L, H, F] on activation(h, valid_rows, probs), the activation kept only while fc2's
    forward reads it (`activation` as moe/expert_activation.ExpertActivation, or any function of
    those three arguments). `wgrad_fusion`: fc2's weight gradient goes into DDP's main_grad where
    the weight has one (moe/expert_wgrad.py)."""
    return _RecomputedActivationFc2.apply(h, probs, fc2_weight, valid_rows, offsets, activation, wgrad_fusion)
