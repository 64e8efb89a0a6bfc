"""Autograd for the rowwise transfers: dispatch = PUT / GET, combine = GET / PUT (DESIGN 3.4).

Backward reuses the forward's route map, so no metadata moves again. Router-probability
gradients are dot(grad_out[t], expert_out_row[t, k]); dropped routes get exactly zero in every
direction. Cost accepted: combine keeps the K fetched rows per token ([T, K, H], the GET
destination anyway) for that dot product, because the expert-output buffer is scratch shared
by all layers and is gone by backward.
"""

from __future__ import annotations

import torch

from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import RowTransport


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, transport: RowTransport, route: RouteMap):
        ctx.transport, ctx.route = transport, route
        return transport.put(tokens, route)

    @staticmethod
    def backward(ctx, grad_buf):
        grad_tokens, _ = ctx.transport.get(grad_buf.contiguous(), ctx.route)
        return grad_tokens, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, probs, transport: RowTransport, route: RouteMap):
        out, gathered = transport.get(expert_out, route, weights=probs, keep_gathered=True)
        ctx.transport, ctx.route = transport, route
        ctx.save_for_backward(gathered, probs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gathered, probs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_probs = torch.einsum("tkh,th->tk", gathered.float(), grad_out.float()).to(probs.dtype)
        grad_expert_out = ctx.transport.put(grad_out, ctx.route, row_scale=probs)
        return grad_expert_out, grad_probs, None, None


def dispatch_rows(tokens: torch.Tensor, transport: RowTransport, route: RouteMap) -> torch.Tensor:
    """Token rows [T, H] -> this rank's expert-major capacity buffer [C, H]."""
    return _DispatchRows.apply(tokens, transport, route)


def combine_rows(expert_out: torch.Tensor, probs: torch.Tensor, transport: RowTransport,
                 route: RouteMap) -> torch.Tensor:
    """Expert outputs in the owners' buffers [C, H] -> sum_k probs[t, k] * row, [T, H]."""
    return _CombineRows.apply(expert_out, probs, transport, route)
