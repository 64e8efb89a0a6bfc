"""MXFP8 on CUDA: Triton kernels byte-identical to the torch reference, and CUDA == CPU.

The CPU torch path is checked against the OCP MX spec reference in tests/unit/test_mxfp8.py, so
CUDA == CPU here ties the GPU results to the spec (including subnormal inputs, which would
expose a flush-to-zero denormal mode).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.formats import mxfp8
from tests.unit.mxfp8_spec_reference import make_spec_inputs, quantize_rows_reference, same_bits

pytestmark = pytest.mark.gpu


def rows(n: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
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


def test_kernels_replayed_from_a_cuda_graph_match_torch():
    """The layer replays these kernels from CUDA graphs (MoEExtConfig.cuda_graphs): captured on one
    input and replayed after the input changed, they give the torch reference's bytes for the new
    input (nothing taken from the data at capture time)."""
    from megatron_ext.kernels.mxfp8_quant import (
        dequantize_rows_triton,
        quantize_rows_packed_triton,
        quantize_rows_triton,
    )

    x = rows(8192, 2048, torch.bfloat16)
    dequantize_rows_triton(quantize_rows_triton(x))  # compile outside the capture
    quantize_rows_packed_triton(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = quantize_rows_triton(x)
        packed = quantize_rows_packed_triton(x)
        dequantized = dequantize_rows_triton(q)
    new = rows(8192, 2048, torch.bfloat16, seed=1)
    assert not same_bits(new, x)
    x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = mxfp8.quantize_rows(new)
    assert same_bits(q.scales, want.scales) and same_bits(q.values, want.values)
    assert same_bits(packed, mxfp8.pack_rows(want))
    assert same_bits(dequantized, mxfp8.dequantize_rows(want, torch.bfloat16))
