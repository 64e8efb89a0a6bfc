"""MXFP8 on CUDA: Triton kernels byte-identical to the torch reference, and CUDA == CPU.

The CPU torch path is checked against the OCP MX spec reference in tests/unit/test_mxfp8.py, so
CUDA == CPU here ties the GPU results to the spec (including subnormal inputs, which would
expose a flush-to-zero denormal mode).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.moe import mxfp8
from tests.unit.mxfp8_spec_reference import make_spec_inputs, quantize_rows_reference, same_bits

pytestmark = pytest.mark.gpu


def rows(n: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hidden, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-60, 60, (n, 1), device="cuda", generator=g).float())
    x[:, ::97] *= 300.0  # outliers: saturating blocks
    return x.to(dtype)


def assert_same_on_cuda(x: torch.Tensor) -> None:
    from megatron_ext.kernels.mxfp8_quant import (
        dequantize_rows_triton,
        quantize_rows_packed_triton,
        quantize_rows_triton,
    )

    want = mxfp8.quantize_rows(x)
    got = quantize_rows_triton(x)
    assert same_bits(got.scales, want.scales)
    assert same_bits(got.values, want.values)
    assert same_bits(quantize_rows_packed_triton(x), mxfp8.pack_rows(want))
    for dtype in (torch.bfloat16, torch.float32):
        assert same_bits(dequantize_rows_triton(want, dtype), mxfp8.dequantize_rows(want, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_torch_8192x2048(dtype):
    assert_same_on_cuda(rows(8192, 2048, dtype))


@pytest.mark.parametrize("name", sorted(make_spec_inputs()))
def test_cuda_matches_cpu_and_spec_on_special_inputs(name):
    from megatron_ext.kernels.mxfp8_quant import quantize_rows_triton

    x = make_spec_inputs()[name]
    codes, scales = quantize_rows_reference(x)
    for got in (mxfp8.quantize_rows(x.cuda()), quantize_rows_triton(x.cuda())):
        assert torch.equal(got.values.view(torch.uint8).cpu(), codes)
        assert torch.equal(got.scales.view(torch.uint8).cpu(), scales)
    assert_same_on_cuda(x.cuda())


def test_dequantize_every_code_and_scale_cuda_matches_cpu():
    from megatron_ext.kernels.mxfp8_quant import dequantize_rows_triton

    codes = torch.arange(256, dtype=torch.uint8).repeat(32, 1)
    scales = torch.arange(256, dtype=torch.int32).reshape(32, 8).to(torch.uint8)
    q_cpu = mxfp8.MXFP8Rows(codes.view(mxfp8.VALUE_DTYPE), scales.view(mxfp8.SCALE_DTYPE))
    q_cuda = mxfp8.MXFP8Rows(q_cpu.values.cuda(), q_cpu.scales.cuda())
    for dtype in (torch.bfloat16, torch.float32):
        want = mxfp8.dequantize_rows(q_cpu, dtype)
        assert same_bits(mxfp8.dequantize_rows(q_cuda, dtype).cpu(), want)
        assert same_bits(dequantize_rows_triton(q_cuda, dtype).cpu(), want)


def test_report_kernel_times(capsys):
    """Not a pass/fail bound: prints device microseconds (CUDA-graph replay, so Python launch
    overhead is excluded) and effective bandwidth for the report."""
    import triton.testing

    from megatron_ext.kernels.mxfp8_quant import dequantize_rows_triton, quantize_rows_triton

    x = rows(8192, 2048, torch.bfloat16)
    q = quantize_rows_triton(x)
    moved = {"quantize": x.numel() * (2 + 1 + 1 / 32), "dequantize": x.numel() * (1 + 1 / 32 + 2)}
    for name, fn in [
        ("quantize", lambda: quantize_rows_triton(x)),
        ("quantize torch", lambda: mxfp8.quantize_rows(x)),
        ("dequantize", lambda: dequantize_rows_triton(q)),
        ("dequantize torch", lambda: mxfp8.dequantize_rows(q)),
    ]:
        us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1000
        gbps = moved[name.split()[0]] / us / 1e3
        with capsys.disabled():
            print(f"\nmxfp8 {name} [8192, 2048] bf16: {us:.1f} us, {gbps:.0f} GB/s effective")
