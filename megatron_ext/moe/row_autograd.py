"""Autograd for the rowwise transfers: dispatch = PUT / GET, combine = GET / PUT (docs/design.md, "Transfers").

Backward reuses the forward's route map, so no metadata moves again. The router
probabilities travel with the rows: the dispatch PUT stores each route's probability at its
row, the experts apply it (as Megatron's experts apply permuted_probs), and the dispatch
backward's GET brings each row's probability gradient back to its route. Combine is an
unweighted sum. Cost removed (vs weighting in combine): combine keeps no [T, K, H] copy of the
fetched rows for backward and no separate pass computes dot(grad_out, row) per route; the
probability gradient comes out of the activation's backward, which reads those values anyway.
Cost accepted: the activation's backward writes one fp32 per row. Dropped routes get exactly
zero in every direction.
"""

from __future__ import annotations

import torch

from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import RowTransport


def detached_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object on the same memory. A leased slot's tensors live as long as the layer;
    autograd would hang this step's graph on them (the router weight's gradient accumulator
    included, through the probabilities) and keep it alive into the next step, where a CUDA-graph
    capture would then run that accumulator on the stream it was created on."""
    return tensor.detach()


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, transport: RowTransport, route: RouteMap, holder: list):
        # [..., H] tokens are flattened here, not by a view node before the call
        buffer, row_probs, lease = transport.dispatch(tokens.reshape(-1, tokens.shape[-1]), probs, route)
        ctx.transport, ctx.route, ctx.lease, ctx.token_shape = transport, route, lease, tokens.shape
        ctx.probs_dtype = probs.dtype
        holder.append(lease)
        return detached_alias(buffer), detached_alias(row_probs)

    @staticmethod
    def backward(ctx, grad_buffer, grad_row_probs):
        grad_tokens, grad_probs = dispatch_backward(ctx, grad_buffer, grad_row_probs)
        return grad_tokens.view(ctx.token_shape), grad_probs, None, None, None


def dispatch_backward(ctx, grad_buffer, grad_row_probs):
    """The GET of a dispatch node's backward (BF16 or MXFP8 rows alike): (grad tokens [T, H], grad
    probs [T, K] in the probabilities' dtype, or None when they need none), then the slot's
    release. `ctx` holds transport, route, lease and probs_dtype; input 1 is the probabilities."""
    if not ctx.needs_input_grad[1]:
        grad_row_probs = None
    elif grad_row_probs is not None:
        grad_row_probs = grad_row_probs.float().contiguous()
    grad_tokens, grad_probs = ctx.transport.dispatch_backward(grad_buffer.contiguous(), grad_row_probs, ctx.route)
    ctx.transport.release(ctx.lease)  # the up-projection's Wgrad and the activation's backward have run
    if grad_probs is not None:
        grad_probs = grad_probs.to(ctx.probs_dtype)
    return grad_tokens, grad_probs


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, transport: RowTransport, route: RouteMap, out_shape):
        out = transport.combine(expert_out.contiguous(), route)
        ctx.transport, ctx.route = transport, route
        return out.view(out_shape)  # the layer's [S, B, H] here, not by a view node after the call

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        return ctx.transport.combine_backward(grad_out, ctx.route), None, None, None


def dispatch_rows(tokens: torch.Tensor, probs: torch.Tensor, transport: RowTransport, route: RouteMap):
    """Token rows [T, H] (or [S, B, H]) and route probabilities [T, K] -> (this rank's expert-major
    capacity buffer [C, H], each row's probability [C] fp32, their lease)."""
    holder: list = []
    buffer, row_probs = _DispatchRows.apply(tokens, probs, transport, route, holder)
    return buffer, row_probs, holder[0]


def combine_rows(expert_out: torch.Tensor, transport: RowTransport, route: RouteMap, out_shape) -> torch.Tensor:
    """Expert outputs in the owners' buffers [C, H] (already probability-weighted) -> sum over each
    token's kept routes, shaped `out_shape` (the tokens' shape: [T, H] or [S, B, H])."""
    return _CombineRows.apply(expert_out, transport, route, out_shape)
