"""MXFP8 rows: the payload format of MXFP8 expert-parallel dispatch (docs/design.md, "MXFP8 payloads").

Format
------
A row of ``H`` values (``H % 32 == 0``) is split along the hidden dim into ``H / 32`` blocks of
32 consecutive elements. Each block stores 32 E4M3 values (``torch.float8_e4m3fn``: bias 7,
max normal 448, min normal 2^-6, min subnormal 2^-9, no infinities, NaN = ``S.1111.111``) and
one E8M0 scale (``torch.float8_e8m0fnu``: the byte ``b`` means ``2^(b - 127)``, ``b = 255`` is
NaN). A row costs ``H + H/32`` bytes instead of ``2H`` for BF16 (ratio 33/64 = 0.516).

Scales are stored as ``torch.float8_e8m0fnu`` (present since torch 2.7, so on both 2.11 and
2.13); kernels read and write its raw byte through a ``uint8`` view.

Scale rule (OCP Microscaling Formats v1.0, section 6.3)
-------------------------------------------------------
For a block with ``amax = max |x_i|`` (inputs are widened to fp32 exactly first):

* shared exponent ``X = floor(log2(amax)) - emax_elem`` with ``emax_elem = 8`` (E4M3's largest
  normal exponent), clamped to the E8M0 range ``[-127, 127]``; ``floor(log2(amax))`` is read
  from amax's fp32 exponent field, so it is exact and subnormal amax (< 2^-126) clamps to -127.
  Only the lower clamp is reachable from fp32/bf16 input (finite amax gives X <= 119).
* scale byte = ``X + 127``.
* values: ``x_i / 2^X`` (exact: a power-of-two scaling with no overflow) rounded to E4M3 with
  round-to-nearest, ties-to-even, including E4M3 subnormals (quantum 2^-9).

Saturation: ``amax / 2^X`` lies in ``[256, 512)``, so elements with ``|x_i / 2^X| > 448`` are
clamped to ``±448`` (E4M3's max normal; the spec's "clamp normal numbers to max"). A block's
largest element saturates whenever amax's mantissa is >= 1.75 (relative error < 2^-3); this is
the cost of the spec's floor rule versus a ceiling rule. Nothing ever overflows to NaN.

Zero block (all elements ±0): amax's exponent field is 0, so the same formula gives the clamped
``X = -127`` (scale byte 0x00, i.e. 2^-127) and every value is a zero with the input's sign.

Non-finite policy: a block containing any NaN or ±Inf is poisoned as a whole: scale byte 0xFF
(E8M0 NaN, which the spec defines as making every element of the block NaN) and all 32 value
bytes 0x7F (E4M3 NaN). E4M3 has no infinity, so ±Inf is not preserved; dequantize returns NaN
for the whole block. Finite blocks of the same row are unaffected.

Signs: the sign bit of every value is the input's sign bit (``-0.0`` and negative values that
round to zero give 0x80).

Dequantize: ``e4m3 * 2^X`` in fp32 is exact for every scale byte a finite block can produce
(the smallest product 2^-9 * 2^-127 = 2^-136 is an fp32 subnormal multiple of 2^-149), then
one round-to-nearest-even cast to the output dtype (exact in bf16 too unless the product is
below bf16's normal range, 2^-126).

Buffer row layout (``pack_rows``): one ``uint8`` row of ``packed_row_bytes(H)`` bytes = the H
value bytes, then the H/32 scale bytes, then zero padding up to a multiple of 16 bytes, so
every packed row, its values and its scales start 16-byte aligned.

Costs: ``quantize_rows`` here is the torch reference (CPU and GPU, no host sync); it reads
the input once but materializes fp32 temporaries (~4 x N*H*4 bytes). The Triton kernels in
``megatron_ext/kernels/mxfp8_quant.py`` produce identical bytes in one read + one write.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MXFP8_BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))
E8M0_BIAS = 127
E8M0_NAN_BYTE = 0xFF
E4M3_NAN_BYTE = 0x7F
ROW_ALIGN_BYTES = 16
VALUE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu
INPUT_DTYPES = (torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float32)


class MXFP8Rows(NamedTuple):
    """Quantized rows: ``values`` [N, H] float8_e4m3fn, ``scales`` [N, H/32] float8_e8m0fnu.

    Either may be a strided view into a packed buffer (see ``unpack_rows``); the last dim is
    always contiguous.
    """

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def hidden(self) -> int:
        return self.values.shape[-1]


def check_hidden(hidden: int) -> int:
    """Return the number of 32-element blocks in a row of ``hidden`` values, or raise."""
    if hidden <= 0 or hidden % MXFP8_BLOCK != 0:
        raise ValueError(
            f"MXFP8 needs the hidden size to be a positive multiple of {MXFP8_BLOCK} "
            f"(one E8M0 scale per {MXFP8_BLOCK} values); got hidden={hidden}. Use a hidden size "
            f"that is a multiple of {MXFP8_BLOCK} (next one: "
            f"{max(MXFP8_BLOCK, -(-hidden // MXFP8_BLOCK) * MXFP8_BLOCK)}) or keep BF16 payloads."
        )
    return hidden // MXFP8_BLOCK


def payload_bytes_per_row(hidden: int) -> int:
    """Bytes of one MXFP8 row without padding: H value bytes + H/32 scale bytes."""
    return hidden + check_hidden(hidden)


def packed_row_bytes(hidden: int) -> int:
    """Bytes of one packed buffer row: ``payload_bytes_per_row`` rounded up to 16."""
    n = payload_bytes_per_row(hidden)
    return -(-n // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


def check_input_rows(x: torch.Tensor) -> int:
    """Validate a [N, H] bf16/fp32 input and return H/32."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of rows, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"MXFP8 quantize takes bfloat16 or float32 rows, got {x.dtype}; cast first")
    if x.dim() != 2:
        raise ValueError(f"MXFP8 quantize takes [N, H] rows, got shape {tuple(x.shape)}; reshape to 2-D")
    return check_hidden(x.shape[1])


def check_quantized_rows(q: MXFP8Rows) -> int:
    """Validate dtypes and shapes of an ``MXFP8Rows`` and return H/32."""
    values, scales = q
    if values.dtype != VALUE_DTYPE or scales.dtype != SCALE_DTYPE:
        raise TypeError(
            f"MXFP8Rows needs values {VALUE_DTYPE} and scales {SCALE_DTYPE}, "
            f"got {values.dtype} and {scales.dtype}"
        )
    if values.dim() != 2:
        raise ValueError(f"MXFP8Rows.values must be [N, H], got shape {tuple(values.shape)}")
    blocks = check_hidden(values.shape[1])
    if tuple(scales.shape) != (values.shape[0], blocks):
        raise ValueError(
            f"MXFP8Rows.scales must be [N, H/32] = {(values.shape[0], blocks)}, got {tuple(scales.shape)}"
        )
    return blocks


def _check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"MXFP8 dequantize writes bfloat16 or float32, got {dtype}")


def quantize_rows(x: torch.Tensor) -> MXFP8Rows:
    """Quantize [N, H] bf16/fp32 rows to MXFP8 (torch reference; rules in the module docstring).

    No host synchronization; temporaries ~16 bytes per element.
    """
    blocks = check_input_rows(x)
    n = x.shape[0]
    x32 = x.float().unflatten(1, (blocks, MXFP8_BLOCK))  # exact widening
    magnitude_bits = x32.view(torch.int32) & 0x7FFFFFFF
    amax_bits = magnitude_bits.amax(dim=-1)  # integer order == |float| order for non-negative bits
    non_finite = amax_bits >= 0x7F800000
    shared_exp = ((amax_bits >> 23) - (127 + E4M3_EMAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    # 2^-X as an fp32 bit pattern; always a normal number because X <= 120 here.
    inv_scale = ((127 - shared_exp) << 23).view(torch.float32)
    scaled = (x32 * inv_scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
    value_bytes = scaled.to(VALUE_DTYPE).view(torch.uint8)
    value_bytes = torch.where(non_finite.unsqueeze(-1), E4M3_NAN_BYTE, value_bytes).to(torch.uint8)
    scale_bytes = torch.where(non_finite, E8M0_NAN_BYTE, shared_exp + E8M0_BIAS).to(torch.uint8)
    return MXFP8Rows(
        values=value_bytes.reshape(n, blocks * MXFP8_BLOCK).view(VALUE_DTYPE),
        scales=scale_bytes.view(SCALE_DTYPE),
    )


def dequantize_rows(q: MXFP8Rows, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, H] rows of ``dtype`` (bf16 or fp32) from MXFP8; exact in fp32, one RNE cast to bf16."""
    blocks = check_quantized_rows(q)
    _check_output_dtype(dtype)
    values = q.values.to(torch.float32).unflatten(1, (blocks, MXFP8_BLOCK))
    scales = q.scales.to(torch.float32).unsqueeze(-1)
    return (values * scales).flatten(1).to(dtype)


def pack_rows(q: MXFP8Rows, out: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``q`` into uint8 [N, packed_row_bytes(H)] rows: values, scales, zero padding.

    ``out`` (optional) may be a preallocated buffer slice with contiguous rows of that width.
    Cost: one copy of N * packed_row_bytes(H) bytes.
    """
    blocks = check_quantized_rows(q)
    hidden = blocks * MXFP8_BLOCK
    n, width = q.values.shape[0], packed_row_bytes(hidden)
    if out is None:
        out = torch.empty((n, width), dtype=torch.uint8, device=q.values.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != (n, width):
        raise ValueError(f"pack_rows out must be uint8 {(n, width)}, got {out.dtype} {tuple(out.shape)}")
    out[:, :hidden] = q.values.view(torch.uint8)
    out[:, hidden : hidden + blocks] = q.scales.view(torch.uint8)
    out[:, hidden + blocks :] = 0
    return out


def unpack_rows(packed: torch.Tensor, hidden: int) -> MXFP8Rows:
    """Zero-copy ``MXFP8Rows`` views into uint8 [N, packed_row_bytes(hidden)] packed rows."""
    blocks = check_hidden(hidden)
    width = packed_row_bytes(hidden)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != width:
        raise ValueError(
            f"packed MXFP8 rows for hidden={hidden} must be uint8 [N, {width}], "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    if packed.stride(1) != 1:
        raise ValueError("packed MXFP8 rows must have a contiguous last dimension")
    return MXFP8Rows(
        values=packed[:, :hidden].view(VALUE_DTYPE),
        scales=packed[:, hidden : hidden + blocks].view(SCALE_DTYPE),
    )
