"""MXFP8 dispatch payloads: rows travel and land as E4M3 values + E8M0 scales per 32 values.

Cost removed: a BF16 row costs 2H bytes on the wire and in the symmetric dispatch buffer; a
packed MXFP8 row costs H + H/32 bytes rounded up to 16 (0.52x at H = 2048). Costs accepted
(Hopper has no MXFP8 GEMM): the quantize of the source tokens (fused into the PUT kernel
by the symm transport, ``kernels/mxfp8_put.py``; a separate pass in the torch one) and one
dequantize of the received buffer into BF16 for the grouped GEMM; the experts then save that
BF16 input for Wgrad (the payload itself is released right after the dequantize). Combine and
both backward transfers stay BF16, as in the report. Gradients pass the quantizer straight
through: d(tokens) is the dispatch backward of d(dequantized buffer).

Transports return the packed rows as uint8 [C, packed_row_bytes(H)] from
``dispatch_quantized``; both keep them in float32-word slots (16-byte aligned rows, no
arithmetic on them), so they carry the bytes exactly without a byte dtype of their own.
"""

from __future__ import annotations

import torch

from megatron_ext.moe import mxfp8
from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import RowTransport


def quantize_packed(tokens: torch.Tensor) -> torch.Tensor:
    """[T, H] bf16/fp32 -> packed uint8 [T, packed_row_bytes(H)] (Triton on GPU, torch on CPU)."""
    if tokens.is_cuda:
        from megatron_ext.kernels.mxfp8_quant import quantize_rows_packed_triton

        return quantize_rows_packed_triton(tokens)
    return mxfp8.pack_rows(mxfp8.quantize_rows(tokens))


def dequantize_packed(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    rows = mxfp8.unpack_rows(packed, hidden)
    if packed.is_cuda:
        from megatron_ext.kernels.mxfp8_quant import dequantize_rows_triton

        return dequantize_rows_triton(rows, dtype)
    return mxfp8.dequantize_rows(rows, dtype)


class _DispatchMXFP8Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, transport: RowTransport, route: RouteMap):
        buffer, lease = transport.dispatch_quantized(tokens.contiguous(), route)  # uint8 [C, P]
        expert_input = dequantize_packed(buffer, tokens.shape[1], tokens.dtype)
        transport.release(lease)  # the BF16 copy is what the experts read from here on
        ctx.transport, ctx.route = transport, route
        return expert_input

    @staticmethod
    def backward(ctx, grad_buffer):
        return ctx.transport.dispatch_backward(grad_buffer.contiguous(), ctx.route), None, None


def dispatch_rows_mxfp8(tokens: torch.Tensor, transport: RowTransport, route: RouteMap):
    """Token rows [T, H] -> dequantized expert-major capacity buffer [C, H] (no live lease)."""
    mxfp8.check_hidden(tokens.shape[1])
    return _DispatchMXFP8Rows.apply(tokens, transport, route), None


def dispatch_row_bytes(hidden: int, dtype: torch.dtype, mxfp8_payload: bool) -> int:
    """Bytes one dispatched row occupies on the wire and in the dispatch buffer."""
    if mxfp8_payload:
        return mxfp8.packed_row_bytes(hidden)
    return hidden * torch.empty((), dtype=dtype).element_size()
