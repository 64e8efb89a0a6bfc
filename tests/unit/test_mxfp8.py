"""MXFP8 row format (megatron_ext/moe/mxfp8.py): bit-exact against the OCP MX spec reference,
round-trip error bounds, packing, sizes, errors, and the Triton kernels under the interpreter."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatron_ext.formats import mxfp8
from tests.unit.interpreter import run_under_interpreter
from tests.unit.mxfp8_spec_reference import (
    dequantize_rows_reference,
    make_spec_inputs,
    quantize_rows_reference,
    same_bits,
)

CASES = make_spec_inputs(seed=0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def scaled_magnitude(x: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """|x| / 2^X per element, in float64 (exact)."""
    exponent = scale_bytes.to(torch.float64).sub(127).repeat_interleave(mxfp8.MXFP8_BLOCK, dim=1)
    return x.double().abs() / torch.exp2(exponent)


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantize_matches_spec_reference(name):
    x = CASES[name]
    want_codes, want_scales = quantize_rows_reference(x)
    got = mxfp8.quantize_rows(x)
    assert got.values.dtype == torch.float8_e4m3fn and got.scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(as_bytes(got.scales), want_scales)
    assert torch.equal(as_bytes(got.values), want_codes)


def test_spec_inputs_cover_every_clause():
    """Guard against the inputs above silently losing the cases they exist for."""
    codes, scales, saturated, below_half_quantum = [], [], 0, 0
    for x in CASES.values():
        c, s = quantize_rows_reference(x)
        codes.append(c.flatten())
        scales.append(s.flatten())
        finite = (s != 0xFF).repeat_interleave(32, dim=1)
        mag = scaled_magnitude(x, s)[finite]
        saturated += int((mag > 448).sum())
        below_half_quantum += int(((mag > 0) & (mag <= 2.0**-10)).sum())
    codes, scales = torch.cat(codes), torch.cat(scales)
    e4m3_subnormal = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
    assert saturated > 50, "saturating elements"
    assert below_half_quantum > 50, "elements that round to zero"
    assert int(e4m3_subnormal.sum()) > 50, "E4M3 subnormal results"
    assert int((codes == 0x80).sum()) > 0 and int((codes == 0x7E).sum()) > 0, "-0 and 448"
    assert int((scales == 0).sum()) > 0, "zero / clamped blocks (scale 2^-127)"
    assert int((scales == 0xFF).sum()) > 0, "NaN/Inf blocks"
    assert int(scales[scales != 0xFF].max()) >= 127 + 110, "scales near the fp32 top"


def test_dequantize_every_code_and_scale_matches_spec_reference():
    codes = torch.arange(256, dtype=torch.uint8).repeat(32, 1)  # 8 blocks of 32 codes = all codes
    scales = torch.arange(256, dtype=torch.int32).reshape(32, 8).to(torch.uint8)  # every scale byte
    q = mxfp8.MXFP8Rows(codes.view(mxfp8.VALUE_DTYPE), scales.view(mxfp8.SCALE_DTYPE))
    exact = dequantize_rows_reference(codes, scales)
    assert same_bits(mxfp8.dequantize_rows(q, torch.float32), exact.float())  # fp32 is exact
    assert same_bits(mxfp8.dequantize_rows(q, torch.bfloat16), exact.float().bfloat16())


def test_round_trip_error_bounds():
    """Asserted bounds, with s = |x| / 2^X (X the block's shared exponent):
    E4M3 normal range 2^-6 <= s <= 448: relative error <= 2^-4 (half an ulp of 3 mantissa bits);
    saturated s > 448 (only possible since s < 512): relative error < 2^-3;
    s < 2^-6 (E4M3 subnormal range): absolute error <= 2^-10 * 2^X (half the 2^-9 quantum)."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(256, 1024, generator=g, dtype=torch.float64)
    rows *= torch.exp2(torch.empty(256, 1, dtype=torch.float64).uniform_(-99, 99, generator=g))
    for x in (rows.float(), rows.clamp(-1e30, 1e30).to(torch.bfloat16)):
        q = mxfp8.quantize_rows(x)
        scale = as_bytes(q.scales).to(torch.float64).sub(127).repeat_interleave(32, dim=1)
        for dtype in (torch.float32, torch.bfloat16):
            error = (mxfp8.dequantize_rows(q, dtype).double() - x.double()).abs()
            s = x.double().abs() / torch.exp2(scale)
            normal, saturated, small = (s >= 2.0**-6) & (s <= 448), s > 448, s < 2.0**-6
            assert normal.float().mean() > 0.5 and saturated.any() and small.any()
            assert (error[normal] <= 2.0**-4 * x.double().abs()[normal]).all()
            assert (error[saturated] < 2.0**-3 * x.double().abs()[saturated]).all()
            assert (error[small] <= torch.exp2(scale[small] - 10)).all()


def test_exact_e4m3_multiples_round_trip_exactly():
    x = CASES["special_fp32"][:1]  # grid values times 2^-100 with amax 256 * 2^-100 per block
    assert torch.equal(mxfp8.dequantize_rows(mxfp8.quantize_rows(x), torch.float32), x)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_poisons_only_its_block(bad):
    x = torch.randn(2, 128)
    x[1, 40] = bad  # block 1 of row 1
    q = mxfp8.quantize_rows(x)
    clean = mxfp8.quantize_rows(torch.cat([x[:, :32], x[:, 64:]], dim=1))
    assert int(as_bytes(q.scales)[1, 1]) == 0xFF
    assert (as_bytes(q.values)[1, 32:64] == 0x7F).all()
    keep = [0, 2, 3]
    assert torch.equal(as_bytes(q.scales)[:, keep], as_bytes(clean.scales))
    assert torch.equal(as_bytes(q.values)[0], as_bytes(mxfp8.quantize_rows(x[:1]).values)[0])
    out = mxfp8.dequantize_rows(q, torch.float32)
    assert out[1, 32:64].isnan().all() and not out[:, :32].isnan().any() and not out[:, 64:].isnan().any()


def test_zero_blocks():
    x = torch.zeros(1, 96)
    x[0, 32:64] = -0.0
    x[0, 64] = 1.0
    q = mxfp8.quantize_rows(x)
    assert as_bytes(q.scales)[0].tolist() == [0, 0, 127 - 8]
    assert (as_bytes(q.values)[0, :32] == 0).all() and (as_bytes(q.values)[0, 32:64] == 0x80).all()
    out = mxfp8.dequantize_rows(q, torch.float32)
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))  # signs of zeros kept


@pytest.mark.parametrize("hidden", [32, 2048, 2080, 7168])
def test_pack_unpack_round_trip(hidden):
    x = torch.randn(5, hidden, dtype=torch.bfloat16)
    q = mxfp8.quantize_rows(x)
    packed = mxfp8.pack_rows(q)
    width = mxfp8.packed_row_bytes(hidden)
    assert packed.shape == (5, width) and width % 16 == 0 and packed.stride(0) == width
    blocks = hidden // 32
    assert (packed[:, hidden + blocks :] == 0).all()
    views = mxfp8.unpack_rows(packed, hidden)
    assert views.values.data_ptr() == packed.data_ptr()  # zero-copy
    assert views.scales.data_ptr() == packed.data_ptr() + hidden and hidden % 16 == 0
    assert torch.equal(as_bytes(views.values), as_bytes(q.values))
    assert torch.equal(as_bytes(views.scales), as_bytes(q.scales))
    assert same_bits(mxfp8.dequantize_rows(views), mxfp8.dequantize_rows(q))
    buffer = torch.full((7, width), 0xAB, dtype=torch.uint8)
    assert torch.equal(mxfp8.pack_rows(q, out=buffer[1:6]), packed) and (buffer[0] == 0xAB).all()


def test_payload_sizes():
    for hidden in (32, 256, 512, 1024, 2048, 4096, 7168, 8192):
        assert mxfp8.payload_bytes_per_row(hidden) == hidden + hidden // 32
        assert mxfp8.payload_bytes_per_row(hidden) / (2 * hidden) == 33 / 64 <= 0.53
    for hidden in (512, 1024, 2048, 4096, 7168, 8192):  # padding to 16 B stays under 0.53 here
        assert mxfp8.packed_row_bytes(hidden) / (2 * hidden) <= 0.53
    assert mxfp8.packed_row_bytes(256) == 272 and mxfp8.packed_row_bytes(2080) == 2160


def test_errors():
    with pytest.raises(ValueError, match=r"multiple of 32.*hidden=100.*next one: 128"):
        mxfp8.quantize_rows(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.payload_bytes_per_row(48)
    with pytest.raises(TypeError, match="bfloat16 or float32 rows, got torch.float16"):
        mxfp8.quantize_rows(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[N, H\] rows"):
        mxfp8.quantize_rows(torch.zeros(2, 2, 64))
    q = mxfp8.quantize_rows(torch.zeros(2, 64))
    with pytest.raises(TypeError, match="writes bfloat16 or float32"):
        mxfp8.dequantize_rows(q, torch.float16)
    with pytest.raises(TypeError, match="values torch.float8_e4m3fn"):
        mxfp8.dequantize_rows(mxfp8.MXFP8Rows(q.values.view(torch.uint8), q.scales))
    with pytest.raises(ValueError, match=r"scales must be \[N, H/32\]"):
        mxfp8.dequantize_rows(mxfp8.MXFP8Rows(q.values, q.scales[:, :1]))
    with pytest.raises(ValueError, match=r"uint8 \[N, 80\]"):
        mxfp8.unpack_rows(torch.zeros(2, 64, dtype=torch.uint8), 64)


def test_errors_at_the_edges_of_shapes_and_layouts():
    """Inputs that would otherwise be read or written silently wrong: hidden 0 (no blocks, a row of
    0 bytes), 3-D values whose dim 1 happens to fit the scales, a pack destination wider than the
    packed rows (its padding never zeroed), and packed rows whose bytes are not adjacent."""
    with pytest.raises(ValueError, match=r"positive multiple of 32.*hidden=0.*next one: 32"):
        mxfp8.packed_row_bytes(0)
    with pytest.raises(ValueError, match=r"positive multiple of 32.*hidden=0"):
        mxfp8.quantize_rows(torch.zeros(2, 0))
    q = mxfp8.quantize_rows(torch.zeros(3, 64))
    cube = mxfp8.MXFP8Rows(torch.zeros(2, 64, 32, dtype=mxfp8.VALUE_DTYPE), q.scales[:2])  # scales [2, 64/32]
    with pytest.raises(ValueError, match=r"MXFP8Rows.values must be \[N, H\], got shape \(2, 64, 32\)"):
        mxfp8.dequantize_rows(cube)
    # H = 64: 64 value bytes + 2 scale bytes = 66, padded to 80
    with pytest.raises(ValueError, match=r"pack_rows out must be uint8 \(3, 80\), got torch.uint8 \(3, 96\)"):
        mxfp8.pack_rows(q, out=torch.empty(3, 96, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"pack_rows out must be uint8 \(3, 80\), got torch.int8"):
        mxfp8.pack_rows(q, out=torch.empty(3, 80, dtype=torch.int8))
    every_other = torch.zeros(2, 160, dtype=torch.uint8)[:, ::2]  # [2, 80], stride 2 along the row
    with pytest.raises(ValueError, match="contiguous last dimension"):
        mxfp8.unpack_rows(every_other, 64)


def test_kernels_module_imports_without_gpu():
    from megatron_ext.kernels import mxfp8_quant

    assert callable(mxfp8_quant.quantize_rows_triton) and callable(mxfp8_quant.dequantize_rows_triton)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="need CUDA tensors"):
            mxfp8_quant.quantize_rows_triton(torch.zeros(2, 64))


def test_triton_kernels_refuse_tensors_on_two_devices():
    """A destination on another device than the rows is named, before any launch (the kernel would
    read and write one device's addresses)."""
    from megatron_ext.kernels import mxfp8_quant

    x = torch.zeros(2, 64)
    elsewhere = mxfp8.MXFP8Rows(values=torch.empty(2, 64, dtype=mxfp8.VALUE_DTYPE, device="meta"),
                                scales=torch.empty(2, 2, dtype=mxfp8.SCALE_DTYPE))
    with pytest.raises(ValueError, match="x on cpu, out.values on meta, out.scales on cpu"):
        mxfp8_quant.quantize_rows_triton(x, out=elsewhere)
    with pytest.raises(ValueError, match="values on meta, scales on cpu"):
        mxfp8_quant.dequantize_rows_triton(elsewhere)


def test_triton_kernels_bit_exact_under_interpreter():
    assert "all interpreter checks passed" in run_under_interpreter("_mxfp8_interp.py")


def test_kernel_tiles_give_each_thread_at_least_four_values():
    """The quantize/dequantize launches never pick a uint8 tile of 2 values per thread (Triton 3.6
    stores every other byte of it on sm90). Only a GPU shows the wrong bytes (test_mxfp8_put_gpu.py's
    small hidden sizes) and CI has none, so the launch choice itself is checked here as well."""
    from megatron_ext.kernels import mxfp8_quant

    for n_blocks in range(1, 300):
        _, blocks_per_program = mxfp8_quant._grid(9, n_blocks)
        elements = mxfp8_quant.ROWS_PER_PROGRAM * blocks_per_program * mxfp8.MXFP8_BLOCK
        assert elements >= mxfp8_quant.MIN_ELEMENTS_PER_THREAD * 32 * mxfp8_quant.NUM_WARPS, n_blocks
