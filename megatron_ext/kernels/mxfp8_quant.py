"""Triton MXFP8 quantize/dequantize kernels, byte-identical to ``megatron_ext.formats.mxfp8``.

The format and its rounding/saturation/zero/NaN rules are documented in
``megatron_ext/formats/mxfp8.py``. Importing this module needs no GPU (nothing compiles until the
first launch); the kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.

Two code paths give the same bytes:

* CUDA (``NATIVE_FP8_CAST_ON_GPU``, default): the hardware fp32 -> e4m3, e4m3 -> fp32 and
  fp32 -> bf16 conversions, all round-to-nearest-even; inputs are clamped to +-448 first, so
  saturation never depends on the conversion. About 16% faster than the integer path
  (quantize [8192, 2048] bf16 on H200: 15.6 vs 18.5 us). Checked byte for byte against the
  torch reference by tests/gpu/test_mxfp8_gpu.py.
* Everywhere else (the interpreter): integer bit arithmetic, exact power-of-two multiplies and
  one fp32 add whose round-to-nearest-even does the E4M3-subnormal rounding; bf16 inputs are
  widened by a 16-bit shift and bf16 outputs rounded with integer RNE. Needed because the
  interpreter's float conversion (``triton/runtime/interpreter.py:_convert_float``) rounds
  half-up on the guard bit without carrying into the exponent, truncates subnormals and
  mangles bf16 subnormals on widening, so ``.to(tl.float8e4nv)`` is not bit-exact there.

``mxfp8_quantize_tile`` is a ``@triton.jit`` helper on a [BLOCKS, 32] tile so that a fused
dispatch kernel can quantize while it copies rows.

Costs (per element): quantize reads 2 (bf16) or 4 (fp32) bytes and writes 1 + 1/32 bytes;
dequantize reads 1 + 1/32 bytes and writes 2 or 4. Both are memory bound; one launch each.
Measured on H200 at [8192, 2048] bf16 (device time, CUDA-graph replay): quantize 15.5 us
(3.3 TB/s effective), dequantize 12.9 us (3.9 TB/s); torch reference 369 us / 134 us. Each
Python call also costs ~35-55 us of host time (checks + Triton launch).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megatron_ext.formats.mxfp8 import (
    MXFP8_BLOCK,
    SCALE_DTYPE,
    VALUE_DTYPE,
    MXFP8Rows,
    _check_output_dtype,
    check_input_rows,
    check_quantized_rows,
    packed_row_bytes,
    unpack_rows,
)

ROWS_PER_PROGRAM = 4
MAX_BLOCKS_PER_PROGRAM = 32  # 32 blocks x 32 values = 1024 values of a row per program
NUM_WARPS = 4
# Triton 3.6 on sm90 stores only every other byte of a uint8 tile that gives each thread exactly
# 2 elements (measured on H200: the fused PUT at H=256, 8 blocks x 32 values over 4 warps).
# Tiles here give each thread at least MIN_ELEMENTS_PER_THREAD; masking covers the extra blocks.
MIN_ELEMENTS_PER_THREAD = 4


def check_tile_elements(elements: int, num_warps: int, op: str) -> None:
    """Refuse a uint8 tile layout of exactly 2 elements per thread (the miscompiled case)."""
    if elements == 2 * 32 * num_warps:
        raise ValueError(f"{op}: a tile of {elements} values over {num_warps} warps gives each thread 2 bytes, "
                         f"which Triton 3.6 stores wrongly on sm90; pick another blocks/num_warps pair")
# On CUDA, use the hardware fp32 <-> e4m3 and fp32 -> bf16 conversions (RNE; ~16% faster
# quantize at [8192, 2048] on H200); the interpreter always takes the integer path.
NATIVE_FP8_CAST_ON_GPU = True


@triton.jit
def mxfp8_quantize_tile(bits, NATIVE_FP8_CAST: tl.constexpr):
    """[BLOCKS, 32] int32 fp32 bit patterns -> (int32 E4M3 bytes [BLOCKS, 32], int32 E8M0 bytes [BLOCKS]).

    Implements the scale rule of mxfp8.py: X = clamp(floor(log2(amax)) - 8, -127, 127), values
    x / 2^X rounded to nearest-even, clamped to +-448, non-finite blocks -> 0x7F / 0xFF.
    NATIVE_FP8_CAST (GPU only) rounds with the hardware fp32 -> e4m3 conversion instead of the
    integer encoder; both give the same bytes (checked by tests/gpu/test_mxfp8_gpu.py).
    """
    magnitude_bits = bits & 0x7FFFFFFF
    amax_bits = tl.max(magnitude_bits, axis=1)
    non_finite = amax_bits >= 0x7F800000
    shared_exp = tl.minimum(tl.maximum((amax_bits >> 23) - 135, -127), 127)
    inv_scale = ((127 - shared_exp) << 23).to(tl.float32, bitcast=True)  # 2^-X, normal for X <= 120
    magnitude = magnitude_bits.to(tl.float32, bitcast=True) * inv_scale[:, None]  # exact
    magnitude = tl.minimum(magnitude, 448.0)
    if NATIVE_FP8_CAST:
        code = magnitude.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = _e4m3_code_of_magnitude(magnitude)
    code = code | ((bits >> 24) & 0x80)  # input's sign bit
    code = tl.where(non_finite[:, None], 0x7F, code)
    scale = tl.where(non_finite, 0xFF, shared_exp + 127)
    return code, scale


@triton.jit
def _e4m3_code_of_magnitude(magnitude):
    """E4M3 code (no sign) of fp32 magnitudes in [0, 448], round-to-nearest-even, integer-exact."""
    mag = magnitude.to(tl.int32, bitcast=True)
    # E4M3 normal range [2^-6, 448]: round the 23-bit mantissa to 3 bits (carry may bump the
    # exponent), then rebias the exponent from 127 to 7.
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal_code = (rounded >> 20) - (120 << 3)
    # Below 2^-6: count of 2^-9 quanta, rounded to nearest-even by one fp32 add: in
    # [2^14, 2^15) the fp32 ulp is 2^-9, so the hardware's RNE does the rounding and the low
    # mantissa bits of the sum are the count (8 quanta == code 0x08 == 2^-6, the carry case).
    subnormal_code = (magnitude + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return tl.where(mag >= 0x3C800000, normal_code, subnormal_code)


@triton.jit
def _e4m3_value_of_code(code):
    """fp32 value of int32 E4M3 codes: normals by rebiasing the exponent, subnormals as
    m * 2^-9, S.1111.111 as NaN; the sign bit is ORed in (0 - x would turn -0 into +0)."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    value = tl.where((code & 0x7F) == 0x7F, float("nan"), value)
    sign = (code & 0x80) << 24
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _tile_indices(pid_rows, pid_blocks, n_rows, n_blocks, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """Row, block and lane indices of a [ROWS*BLOCKS, 32] tile of 32-value blocks."""
    tile = tl.arange(0, ROWS * BLOCKS)
    row = (pid_rows * ROWS + tile // BLOCKS).to(tl.int64)
    block = pid_blocks * BLOCKS + tile % BLOCKS
    lane = tl.arange(0, 32)
    valid = (row < n_rows) & (block < n_blocks)
    return row, block, lane, valid


@triton.jit
def _quantize_kernel(
    x_ptr, values_ptr, scales_ptr, n_rows, n_blocks,
    x_row_stride, values_row_stride, scales_row_stride,
    INPUT_BF16: tl.constexpr, NATIVE_FP8_CAST: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
):
    row, block, lane, valid = _tile_indices(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, ROWS, BLOCKS)
    column = block[:, None] * 32 + lane[None, :]
    mask = valid[:, None]
    raw = tl.load(x_ptr + row[:, None] * x_row_stride + column, mask=mask, other=0)
    if INPUT_BF16:
        bits = (raw.to(tl.int32) & 0xFFFF) << 16  # exact bf16 -> fp32 widening
    else:
        bits = raw
    code, scale = mxfp8_quantize_tile(bits, NATIVE_FP8_CAST)
    tl.store(values_ptr + row[:, None] * values_row_stride + column, code.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + row * scales_row_stride + block, scale.to(tl.uint8), mask=valid)


@triton.jit
def _dequantize_kernel(
    values_ptr, scales_ptr, out_ptr, n_rows, n_blocks,
    values_row_stride, scales_row_stride, out_row_stride,
    OUTPUT_BF16: tl.constexpr, NATIVE_FP8_CAST: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
):
    row, block, lane, valid = _tile_indices(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, ROWS, BLOCKS)
    column = block[:, None] * 32 + lane[None, :]
    mask = valid[:, None]
    code = tl.load(values_ptr + row[:, None] * values_row_stride + column, mask=mask, other=0)
    scale = tl.load(scales_ptr + row * scales_row_stride + block, mask=valid, other=127).to(tl.int32)
    if NATIVE_FP8_CAST:
        value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        value = _e4m3_value_of_code(code.to(tl.int32))
    # E8M0 -> fp32: 2^(b-127); b = 0 is the subnormal 2^-127; b = 255 is NaN.
    scale_bits = tl.where(scale == 0, 0x00400000, scale << 23)
    scale_bits = tl.where(scale == 255, 0x7FC00000, scale_bits)
    out = value * scale_bits.to(tl.float32, bitcast=True)[:, None]  # exact, see mxfp8.py
    out_offsets = out_ptr + row[:, None] * out_row_stride + column
    if OUTPUT_BF16 and NATIVE_FP8_CAST:
        tl.store(out_offsets, out.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
    elif OUTPUT_BF16:
        out_bits = out.to(tl.uint32, bitcast=True)
        rounded = (out_bits + 0x7FFF + ((out_bits >> 16) & 1)) >> 16
        rounded = tl.where(out != out, 0x7FC0, rounded)  # keep NaN a (quiet) NaN
        tl.store(out_offsets, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_offsets, out, mask=mask)


def _grid(n_rows: int, n_blocks: int) -> tuple[tuple[int, int], int]:
    min_blocks = MIN_ELEMENTS_PER_THREAD * NUM_WARPS // ROWS_PER_PROGRAM  # tile = ROWS x BLOCKS x 32
    blocks_per_program = min(max(triton.next_power_of_2(n_blocks), min_blocks), MAX_BLOCKS_PER_PROGRAM)
    return (triton.cdiv(n_rows, ROWS_PER_PROGRAM), triton.cdiv(n_blocks, blocks_per_program)), blocks_per_program


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the Triton MXFP8 kernels need CUDA tensors (got {t.device}); on CPU use "
            "megatron_ext.formats.mxfp8.quantize_rows/dequantize_rows, or set TRITON_INTERPRET=1 before "
            "importing triton"
        )


def _check_same_device(op: str, named: dict[str, torch.Tensor]) -> None:
    """One kernel reads and writes all of them: a tensor on another device would be read as garbage
    (or fault), so refuse it here with the devices named."""
    first, *rest = named.values()
    if all(t.device == first.device for t in rest):
        return
    listed = ", ".join(f"{name} on {t.device}" for name, t in named.items())
    raise ValueError(f"{op}: the tensors must share one device, got {listed}; move them with .to(device)")


def _check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def _launch_quantize(x: torch.Tensor, values_u8: torch.Tensor, scales_u8: torch.Tensor) -> None:
    n_rows, n_blocks = x.shape[0], x.shape[1] // MXFP8_BLOCK
    if n_rows == 0:
        return
    grid, blocks_per_program = _grid(n_rows, n_blocks)
    bits = x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)
    _quantize_kernel[grid](
        bits, values_u8, scales_u8, n_rows, n_blocks,
        x.stride(0), values_u8.stride(0), scales_u8.stride(0),
        INPUT_BF16=x.dtype == torch.bfloat16, NATIVE_FP8_CAST=x.is_cuda and NATIVE_FP8_CAST_ON_GPU,
        ROWS=ROWS_PER_PROGRAM, BLOCKS=blocks_per_program,
        num_warps=NUM_WARPS,
    )


def quantize_rows_triton(x: torch.Tensor, out: MXFP8Rows | None = None) -> MXFP8Rows:
    """MXFP8 of [N, H] bf16/fp32 rows in one kernel; bytes equal ``mxfp8.quantize_rows(x)``.

    ``out`` may hold preallocated (possibly strided, e.g. ``unpack_rows`` views) destinations.
    """
    check_input_rows(x)
    _check_inner_contiguous("x", x)
    n, hidden = x.shape
    if out is None:
        out = MXFP8Rows(
            values=torch.empty((n, hidden), dtype=VALUE_DTYPE, device=x.device),
            scales=torch.empty((n, hidden // MXFP8_BLOCK), dtype=SCALE_DTYPE, device=x.device),
        )
    elif check_quantized_rows(out) != hidden // MXFP8_BLOCK or out.values.shape[0] != n:
        raise ValueError(f"out has shape {tuple(out.values.shape)}, expected {(n, hidden)}")
    _check_same_device("quantize_rows_triton", {"x": x, "out.values": out.values, "out.scales": out.scales})
    _check_device(x)
    _check_inner_contiguous("out.values", out.values)
    _check_inner_contiguous("out.scales", out.scales)
    _launch_quantize(x, out.values.view(torch.uint8), out.scales.view(torch.uint8))
    return out


def quantize_rows_packed_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed uint8 [N, packed_row_bytes(H)] rows (values, scales, zero pad); equals
    ``pack_rows(quantize_rows(x))``. Writes values and scales in one kernel, then zeroes the pad."""
    check_input_rows(x)
    n, hidden = x.shape
    if out is None:
        out = torch.empty((n, packed_row_bytes(hidden)), dtype=torch.uint8, device=x.device)
    views = unpack_rows(out, hidden)
    quantize_rows_triton(x, out=views)
    pad_start = hidden + hidden // MXFP8_BLOCK
    if pad_start < out.shape[1]:
        out[:, pad_start:] = 0
    return out


def dequantize_rows_triton(q: MXFP8Rows, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, H] ``dtype`` rows (bf16 or fp32) from MXFP8; equals ``mxfp8.dequantize_rows(q, dtype)``."""
    n_blocks = check_quantized_rows(q)
    _check_output_dtype(dtype)
    _check_same_device("dequantize_rows_triton", {"values": q.values, "scales": q.scales})
    _check_device(q.values)
    _check_inner_contiguous("values", q.values)
    _check_inner_contiguous("scales", q.scales)
    n_rows = q.values.shape[0]
    out = torch.empty((n_rows, n_blocks * MXFP8_BLOCK), dtype=dtype, device=q.values.device)
    if n_rows == 0:
        return out
    grid, blocks_per_program = _grid(n_rows, n_blocks)
    out_view = out.view(torch.int16) if dtype == torch.bfloat16 else out
    _dequantize_kernel[grid](
        q.values.view(torch.uint8), q.scales.view(torch.uint8), out_view, n_rows, n_blocks,
        q.values.stride(0), q.scales.stride(0), out.stride(0),
        OUTPUT_BF16=dtype == torch.bfloat16, NATIVE_FP8_CAST=q.values.is_cuda and NATIVE_FP8_CAST_ON_GPU,
        ROWS=ROWS_PER_PROGRAM, BLOCKS=blocks_per_program,
        num_warps=NUM_WARPS,
    )
    return out
