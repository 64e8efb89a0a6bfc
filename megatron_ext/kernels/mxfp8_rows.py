"""Packed MXFP8 rows on any device: the Triton kernels on CUDA, the format's torch reference elsewhere.

Used by the transports (the torch and DeepEP ones quantize before they send) and by the MXFP8
dispatch payloads (the experts dequantize what arrived); it sits below both.
"""

from __future__ import annotations

import torch

from megatron_ext.formats import mxfp8


def quantize_packed(tokens: torch.Tensor) -> torch.Tensor:
    """[T, H] bf16/fp32 -> packed uint8 [T, packed_row_bytes(H)] (Triton on GPU, torch on CPU)."""
    if tokens.is_cuda:
        from megatron_ext.kernels.mxfp8_quant import quantize_rows_packed_triton

        return quantize_rows_packed_triton(tokens)
    return mxfp8.pack_rows(mxfp8.quantize_rows(tokens))


def dequantize_packed(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed uint8 [C, packed_row_bytes(hidden)] -> [C, hidden] of `dtype`."""
    rows = mxfp8.unpack_rows(packed, hidden)
    if packed.is_cuda:
        from megatron_ext.kernels.mxfp8_quant import dequantize_rows_triton

        return dequantize_rows_triton(rows, dtype)
    return mxfp8.dequantize_rows(rows, dtype)
