"""Autograd for the rowwise transfers: dispatch = PUT / GET, combine = GET / PUT (docs/design.md, "Transfers").

Backward reuses the forward's route map, so no metadata moves again. Router-probability
gradients are dot(grad_out[t], expert_out_row[t, k]); dropped routes get exactly zero in every
direction. Cost accepted: combine keeps the K fetched rows per token ([T, K, H], the GET
destination anyway) for that dot product, because the expert-output buffer is scratch shared
by all layers and is gone by backward.
"""

from __future__ import annotations

import torch

from megatron_ext.kernels.route_dot import route_dot
from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import RowTransport


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, transport: RowTransport, route: RouteMap, holder: list):
        # [..., H] tokens are flattened here, not by a view node before the call
        buffer, lease = transport.dispatch(tokens.reshape(-1, tokens.shape[-1]), route)
        ctx.transport, ctx.route, ctx.lease, ctx.token_shape = transport, route, lease, tokens.shape
        holder.append(lease)
        return buffer

    @staticmethod
    def backward(ctx, grad_buffer):
        grad_tokens = ctx.transport.dispatch_backward(grad_buffer.contiguous(), ctx.route)
        ctx.transport.release(ctx.lease)  # the up-projection's Wgrad, its last reader, has run
        return grad_tokens.view(ctx.token_shape), None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, probs, transport: RowTransport, route: RouteMap, out_shape):
        out, gathered = transport.combine(expert_out.contiguous(), route, probs)
        ctx.transport, ctx.route = transport, route
        ctx.save_for_backward(gathered, probs)
        return out.view(out_shape)  # the layer's [S, B, H] here, not by a view node after the call

    @staticmethod
    def backward(ctx, grad_out):
        gathered, probs = ctx.saved_tensors
        grad_out = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        grad_probs = route_dot(gathered, grad_out).to(probs.dtype)
        grad_expert_out = ctx.transport.combine_backward(grad_out, ctx.route, probs)
        return grad_expert_out, grad_probs, None, None, None


def dispatch_rows(tokens: torch.Tensor, transport: RowTransport, route: RouteMap):
    """Token rows [T, H] (or [S, B, H]) -> (this rank's expert-major capacity buffer [C, H], its lease)."""
    holder: list = []
    buffer = _DispatchRows.apply(tokens, transport, route, holder)
    return buffer, holder[0]


def combine_rows(expert_out: torch.Tensor, probs: torch.Tensor, transport: RowTransport,
                 route: RouteMap, out_shape) -> torch.Tensor:
    """Expert outputs in the owners' buffers [C, H] -> sum_k probs[t, k] * row, shaped `out_shape`
    (the tokens' shape: [T, H] or [S, B, H])."""
    return _CombineRows.apply(expert_out, probs, transport, route, out_shape)
