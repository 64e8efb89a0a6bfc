"""MXFP8 dispatch payloads: rows travel and land as E4M3 values + E8M0 scales per 32 values.

Cost removed: a BF16 row costs 2H bytes on the wire and in the symmetric dispatch buffer; a
packed MXFP8 row costs H + H/32 bytes rounded up to 16 (0.52x at H = 2048). Costs accepted
(the experts run a BF16 grouped GEMM on every GPU: Hopper has no MXFP8 GEMM and Blackwell's is
not wired in): the quantize of the source tokens (fused into the PUT kernel
by the symm transport, ``kernels/mxfp8_put.py``; a separate pass in the torch one) and two
dequantizes of the received payload into a transient BF16 copy: one for the up-projection in
forward, one for its Wgrad in backward. No BF16 copy of the expert input is saved for backward:
the leased MXFP8 payload is (0.52x the bytes), and the lease is returned when the dispatch
backward has run. Combine and both backward transfers stay BF16, as in the report. Gradients
pass the quantizer straight through: d(tokens) is the dispatch backward of d(expert input).

The dispatch returns a zero-stride BF16 "anchor" [C, H] and the payload. The anchor is the
autograd edge between the dispatch and the experts and costs no memory; the payload reaches
the experts explicitly, as the `tokens_per_expert` argument Megatron's MoELayer hands them
(`expert_rows.RowGroups`: the per-expert counts and offsets plus the payload), and the up-projection reads it
(``payload_fc1``). Nothing rides on a tensor attribute, which any op in between (a hook, a
timer's view) would drop, leaving fc1 to compute on the anchor's zeros.

Transports return the packed rows as uint8 [C, packed_row_bytes(H)] from
``dispatch_quantized``; both keep them in float32-word slots (16-byte aligned rows, no
arithmetic on them), so they carry the bytes exactly without a byte dtype of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from megatron_ext.formats import mxfp8
from megatron_ext.kernels.mxfp8_rows import dequantize_packed
from megatron_ext.moe.expert_wgrad import grouped_linear_grads
from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.row_autograd import detached_alias, dispatch_backward
from megatron_ext.moe.transport.base import RowTransport


@dataclass(frozen=True)
class MXFP8Payload:
    packed: torch.Tensor  # uint8 [C, packed_row_bytes(hidden)], a leased dispatch slot
    hidden: int
    dtype: torch.dtype  # the BF16/fp32 dtype the experts compute in


class _DispatchMXFP8Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, transport: RowTransport, route: RouteMap, holder: list):
        packed, row_probs, lease = transport.dispatch_quantized(tokens.contiguous(), probs, route)  # uint8 [C, P]
        ctx.transport, ctx.route, ctx.lease, ctx.probs_dtype = transport, route, lease, probs.dtype
        holder.append((MXFP8Payload(packed, tokens.shape[1], tokens.dtype), lease))
        return tokens.new_zeros(()).expand(packed.shape[0], tokens.shape[1]), detached_alias(row_probs)

    @staticmethod
    def backward(ctx, grad_buffer, grad_row_probs):
        grad_tokens, grad_probs = dispatch_backward(ctx, grad_buffer, grad_row_probs)  # the payload's last
        return grad_tokens, grad_probs, None, None, None  # reader, the up-projection's Wgrad, ran


def dispatch_rows_mxfp8(tokens: torch.Tensor, probs: torch.Tensor, transport: RowTransport, route: RouteMap):
    """Token rows [T, H] and route probabilities [T, K] -> (anchor [C, H], each row's probability
    [C] fp32, the MXFP8 payload, the payload's lease)."""
    mxfp8.check_hidden(tokens.shape[1])
    holder: list = []
    anchor, row_probs = _DispatchMXFP8Rows.apply(tokens, probs, transport, route, holder)
    payload, lease = holder[0]
    return anchor, row_probs, payload, lease


class _PayloadFc1(torch.autograd.Function):
    """Grouped up-projection that reads the MXFP8 payload and saves it (not a BF16 copy)."""

    @staticmethod
    def forward(ctx, anchor, weight, offsets, payload: MXFP8Payload, wgrad_fusion: bool):
        expert_input = dequantize_packed(payload.packed, payload.hidden, payload.dtype)
        ctx.save_for_backward(payload.packed, weight, offsets)
        ctx.hidden, ctx.dtype = payload.hidden, payload.dtype
        ctx.weight, ctx.wgrad_fusion = weight, wgrad_fusion  # the parameter, with DDP's main_grad
        return torch._grouped_mm(expert_input, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        packed, weight, offsets = ctx.saved_tensors

        def expert_input():  # the Wgrad's rows, from the saved payload
            return dequantize_packed(packed, ctx.hidden, ctx.dtype)

        # dW is formed as [L, 2F, H], the weight's own layout (moe/expert_wgrad.py)
        grads = grouped_linear_grads(ctx.weight, weight, offsets, grad_out, expert_input, ctx.wgrad_fusion,
                                     ctx.needs_input_grad[:2])
        return *grads, None, None, None


def payload_fc1(anchor: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                payload: MXFP8Payload, wgrad_fusion: bool = False) -> torch.Tensor:
    """fc1 of DeviceOffsetGroupedMLP on an MXFP8 payload: [C, 2F], rows past offsets[-1] never
    read (the grouped GEMMs stop at the last offset). `anchor` carries the gradient edge.
    `wgrad_fusion`: the weight gradient goes into DDP's main_grad where the weight has one
    (moe/expert_wgrad.py)."""
    rows = (payload.packed.shape[0], payload.hidden)
    if tuple(anchor.shape) != rows:
        raise ValueError(f"the experts got hidden {tuple(anchor.shape)} with an MXFP8 payload of {rows[0]} rows "
                         f"of {rows[1]}: pass the dispatcher's output and its MXFP8Rows together, unchanged")
    return _PayloadFc1.apply(anchor, weight, offsets, payload, wgrad_fusion)


def dispatch_row_bytes(hidden: int, dtype: torch.dtype, mxfp8_payload: bool) -> int:
    """Bytes one dispatched row occupies on the wire and in the dispatch buffer."""
    if mxfp8_payload:
        return mxfp8.packed_row_bytes(hidden)
    return hidden * torch.empty((), dtype=dtype).element_size()
