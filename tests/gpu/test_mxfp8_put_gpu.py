"""Fused MXFP8 quantize + PUT on CUDA: four local uint8 buffers standing in for peers, byte for
byte against the torch reference quantizer + pack (tied to the OCP spec reference on CPU by
tests/gpu/test_mxfp8_gpu.py and tests/unit/test_mxfp8.py), untargeted rows untouched, the symm
transport equal to the torch one, and the kernel capturable in a CUDA graph (no host sync)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.kernels import mxfp8_quant
from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
from megatron_ext.kernels.row_transfer import peer_table_from_buffers
from megatron_ext.formats import mxfp8
from tests.unit._mxfp8_put_interp import SENTINEL, expected_buffers, single_rank_route
from tests.unit._row_transfer_interp import random_routes
from tests.unit.mxfp8_spec_reference import make_spec_inputs

pytestmark = pytest.mark.gpu

T, H, K, M = 8192, 2048, 8, 4
C = (5 * T * K) // (4 * M)  # capacity factor 1.25 per destination


def tokens(n: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spread over 2^-60..2^60, saturating outliers, zero blocks, fp32-subnormal rows, NaN/Inf blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, hidden, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-60, 60, (n, 1), device="cuda", generator=g).float())
    x[:, ::97] *= 300.0
    x[1::50, 32:64] = 0.0
    x[2::50, 64:96] = -0.0
    x[3::50] *= 2.0**-100  # subnormal in fp32 after the row scale for many rows
    x[4::100, 7] = float("nan")
    x[5::100, 300] = float("inf")
    return x.to(dtype)


def _put(src, dest_rank, dest_row):
    bufs = [torch.full((C, mxfp8.packed_row_bytes(src.shape[1])), SENTINEL, dtype=torch.uint8, device="cuda")
            for _ in range(M)]
    put_rows_mxfp8(src, dest_rank, dest_row, peer_table_from_buffers(bufs))
    return bufs


@pytest.mark.parametrize("native_cast", [True, False], ids=["native_cast", "integer_cast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_put_bit_identical_8192x2048_k8_m4(dtype, native_cast, monkeypatch):
    monkeypatch.setattr(mxfp8_quant, "NATIVE_FP8_CAST_ON_GPU", native_cast)
    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.1, seed=1, device="cuda")
    src = tokens(T, H, dtype)
    got = _put(src, dest_rank, dest_row)
    want = expected_buffers(src, dest_rank, dest_row, M, C)  # sentinel + pack_rows(quantize_rows(src))
    assert (dest_row < 0).any() and any((w == SENTINEL).all(1).any() for w in want), "no dropped routes / tails"
    for m in range(M):
        differ = (got[m] != want[m]).any(1)
        assert not differ.any(), f"rank {m}: {int(differ.sum())} rows differ, first {differ.nonzero()[:8].flatten()}"


@pytest.mark.parametrize("name", sorted(make_spec_inputs()))
def test_fused_put_spec_inputs(name):
    x = make_spec_inputs()[name].cuda()
    dest_rank, dest_row = random_routes(x.shape[0], 3, M, C, drop=0.2, seed=2, device="cuda")
    got = _put(x, dest_rank, dest_row)
    want = expected_buffers(x, dest_rank, dest_row, M, C)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_symm_dispatch_quantized_matches_torch_transport():
    from megatron_ext.moe.transport.symm import SymmRowTransport
    from megatron_ext.moe.transport.torch_ref import TorchRowTransport

    capacity = 8000  # > the ~6550 kept routes: a tail no route writes
    dest_rank, dest_row = random_routes(1024, K, 1, capacity, drop=0.2, seed=3, device="cuda")
    route = single_rank_route(dest_rank, dest_row, capacity)
    x = tokens(1024, H, torch.bfloat16, seed=3)
    symm = SymmRowTransport(None, capacity, poison=True)
    probs = torch.rand(1024, K, device="cuda")
    got, got_probs, lease = symm.dispatch_quantized(x, probs, route)
    want, want_probs, _ = TorchRowTransport(None, capacity).dispatch_quantized(x, probs, route)
    written = route.row_source >= 0
    assert got.dtype == torch.uint8 and got.shape == want.shape and not written.all()
    assert torch.equal(got[written], want[written]) and torch.equal(got_probs[written], want_probs[written])
    assert got[~written].view(torch.float32).isnan().all() and got_probs[~written].isnan().all()
    symm.release(lease)


def test_fused_put_captures_in_cuda_graph():
    dest_rank, dest_row = random_routes(512, K, M, 1400, drop=0.1, seed=4, device="cuda")
    src = tokens(512, H, torch.bfloat16, seed=4)
    bufs = [torch.full((1400, mxfp8.packed_row_bytes(H)), SENTINEL, dtype=torch.uint8, device="cuda")
            for _ in range(M)]
    table = peer_table_from_buffers(bufs)
    put_rows_mxfp8(src, dest_rank, dest_row, table)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        put_rows_mxfp8(src, dest_rank, dest_row, table)
    src.copy_(tokens(512, H, torch.bfloat16, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    want = expected_buffers(src, dest_rank, dest_row, M, 1400)
    assert all(torch.equal(b, w) for b, w in zip(bufs, want))


def test_fused_put_equals_quantize_then_put():
    """The fused kernel writes the same bytes as the two kernels it replaces: quantize into a packed
    staging tensor, then put_rows of its 32-bit words (T=8192 H=2048 K=8 M=4, dropped routes and
    NaN/Inf inputs included). Their timings: tools/bench_transport.py (put_rows_mxfp8 against
    put_rows of MXFP8-size and BF16 rows)."""
    from megatron_ext.kernels.row_transfer import put_rows

    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.1, seed=1, device="cuda")
    src = tokens(T, H, torch.bfloat16)
    fused = _put(src, dest_rank, dest_row)
    staging = mxfp8_quant.quantize_rows_packed_triton(src)
    unfused = [torch.full_like(buf, SENTINEL) for buf in fused]
    put_rows(staging.view(torch.float32), dest_rank, dest_row,
             peer_table_from_buffers([buf.view(torch.float32) for buf in unfused]))
    assert (dest_row < 0).any() and any((buf == SENTINEL).all(1).any() for buf in fused), "no dropped routes / tails"
    for m in range(M):
        differ = (fused[m] != unfused[m]).any(1)
        assert not differ.any(), f"rank {m}: {int(differ.sum())} rows differ, first {differ.nonzero()[:8].flatten()}"


@pytest.mark.parametrize("hidden", [32, 64, 128, 256, 512, 1024, 4096])
def test_fused_put_every_small_hidden(hidden):
    """Default launch at each tile size: Triton 3.6 miscompiles uint8 tiles of 2 bytes per thread
    (every other byte unwritten; H=256 on 4 warps), which the launch configuration avoids."""
    x = torch.randn(24, hidden, device="cuda") * 3
    dest_rank, dest_row = random_routes(24, 3, M, 512, drop=0.2, seed=hidden, device="cuda")
    bufs = [torch.full((512, mxfp8.packed_row_bytes(hidden)), SENTINEL, dtype=torch.uint8, device="cuda")
            for _ in range(M)]
    put_rows_mxfp8(x, dest_rank, dest_row, peer_table_from_buffers(bufs))
    want = expected_buffers(x, dest_rank, dest_row, M, 512)
    for m in range(M):
        assert torch.equal(bufs[m], want[m]), (
            f"H={hidden} rank {m}: {int((bufs[m] != want[m]).any(1).sum())} rows differ")
    packed = mxfp8_quant.quantize_rows_packed_triton(x)  # the standalone quantizer, same tile rule
    assert torch.equal(packed, mxfp8.pack_rows(mxfp8.quantize_rows(x))), f"H={hidden} quantize_rows_packed_triton"


def test_fused_put_refuses_the_miscompiled_tile():
    x = torch.randn(4, 256, device="cuda")
    dest_rank, dest_row = random_routes(4, 1, 1, 8, drop=0.0, seed=0, device="cuda")
    buf = torch.zeros(8, mxfp8.packed_row_bytes(256), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="2 bytes"):
        put_rows_mxfp8(x, dest_rank, dest_row, peer_table_from_buffers([buf]), blocks_per_program=8, num_warps=4)
