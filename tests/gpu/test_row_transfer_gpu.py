"""Triton row transfers on CUDA, several local buffers standing in for peers: against the torch
reference at a real shape, untargeted rows untouched, and both paths capturable in a CUDA graph
(no host synchronization)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.kernels.row_transfer import get_rows, peer_table_from_buffers, put_rows
from megatron_ext.kernels.row_transfer_ref import get_rows_ref, put_rows_ref
from tests.unit._row_transfer_interp import random_routes

pytestmark = pytest.mark.gpu


def _targeted(dest_rank, dest_row, m, C):
    mask = torch.zeros(C, dtype=torch.bool, device=dest_row.device)
    mask[dest_row[dest_rank == m].long()] = True
    return mask


def _setup(T, K, H, M, dtype, seed=0):
    C = (5 * T * K) // (4 * M)  # capacity factor 1.25 per destination rank
    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.1, seed=seed, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    probs = torch.rand(T, K, device="cuda", generator=gen)
    return C, dest_rank, dest_row, src, probs


@pytest.mark.parametrize("dtype, T, K, H, M", [
    (torch.bfloat16, 4096, 8, 2048, 4),
    (torch.float32, 300, 4, 1000, 2),  # H not a multiple of the vector width
    (torch.bfloat16, 64, 2, 8192, 1),
])
def test_put_rows_matches_reference_and_leaves_tails(dtype, T, K, H, M):
    C, dest_rank, dest_row, src, probs = _setup(T, K, H, M, dtype)
    for scale in (None, probs):
        got = [torch.full((C, H), float("nan"), dtype=dtype, device="cuda") for _ in range(M)]
        want = [b.clone() for b in got]
        put_rows(src, dest_rank, dest_row, peer_table_from_buffers(got), scale)
        put_rows_ref(src, dest_rank, dest_row, want, scale)
        for m in range(M):
            targeted = _targeted(dest_rank, dest_row, m, C)
            assert got[m][~targeted].isnan().all(), f"rank {m}: an untargeted row was written"
            torch.testing.assert_close(got[m][targeted], want[m][targeted], rtol=0, atol=0)


@pytest.mark.parametrize("dtype, T, K, H, M", [
    (torch.bfloat16, 4096, 8, 2048, 4),
    (torch.float32, 300, 4, 1000, 2),
    (torch.bfloat16, 64, 2, 8192, 1),
])
def test_get_rows_matches_reference(dtype, T, K, H, M):
    C, dest_rank, dest_row, _, probs = _setup(T, K, H, M, dtype, seed=1)
    peers = [torch.full((C, H), float("nan"), dtype=dtype, device="cuda") for _ in range(M)]
    for m, buf in enumerate(peers):  # NaN everywhere no kept route reads
        targeted = _targeted(dest_rank, dest_row, m, C)
        buf[targeted] = torch.randn(int(targeted.sum()), H, device="cuda").to(dtype)
    table = peer_table_from_buffers(peers)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1.6e-2)
    for weights in (None, probs):
        out = torch.empty(T, H, dtype=dtype, device="cuda")
        gathered = torch.empty(T, K, H, dtype=dtype, device="cuda")
        out_ref, gathered_ref = torch.empty_like(out), torch.empty_like(gathered)
        get_rows(table, dest_rank, dest_row, out, weights, gathered)
        get_rows_ref(peers, dest_rank, dest_row, out_ref, weights, gathered_ref)
        assert not out.isnan().any()
        torch.testing.assert_close(out, out_ref, **tol)
        torch.testing.assert_close(gathered, gathered_ref, rtol=0, atol=0)
        out32, out32_ref = torch.empty(T, H, device="cuda"), torch.empty(T, H, device="cuda")
        get_rows(table, dest_rank, dest_row, out32, weights, buffer_dtype=dtype)
        get_rows_ref(peers, dest_rank, dest_row, out32_ref, weights)
        torch.testing.assert_close(out32, out32_ref, rtol=1e-5, atol=1e-5)


def test_route_values_travel_with_rows_and_come_back():
    """The product's form of the transfers: each kept route's probability lands at its row of the
    owner's [C] array with the PUT, and the GET fetches each route's value back (0 if dropped)."""
    T, K, H, M, dtype = 4096, 8, 2048, 4, torch.bfloat16
    C, dest_rank, dest_row, src, probs = _setup(T, K, H, M, dtype, seed=5)
    rows = [torch.full((C, H), float("nan"), dtype=dtype, device="cuda") for _ in range(M)]
    values = [torch.full((C, 1), float("nan"), device="cuda") for _ in range(M)]
    row_table, value_table = peer_table_from_buffers(rows), peer_table_from_buffers(values)
    put_rows(src, dest_rank, dest_row, row_table, route_values=probs, value_table=value_table, capacity=C)
    for m in range(M):
        targeted = _targeted(dest_rank, dest_row, m, C)
        mine = (dest_rank == m) & (dest_row >= 0)
        expected = torch.full((C,), float("nan"), device="cuda")
        expected[dest_row[mine].long()] = probs[mine]
        torch.testing.assert_close(values[m][:, 0], expected, rtol=0, atol=0, equal_nan=True)
        assert values[m][~targeted].isnan().all()
    out = torch.empty(T, H, dtype=dtype, device="cuda")
    fetched = torch.full((T, K), float("nan"), device="cuda")
    get_rows(row_table, dest_rank, dest_row, out, value_table=value_table, values_out=fetched, capacity=C)
    assert torch.equal(fetched, torch.where(dest_row >= 0, probs, 0.0))


def test_get_in_place_equals_the_table_form():
    """One rank (the symm transport at EP=1): get_rows reading the rows and their values in place
    gives the same bits as through one-entry address tables, at the reference shape."""
    T, K, H, dtype = 8192, 8, 2048, torch.bfloat16
    C, dest_rank, dest_row, _, weights = _setup(T, K, H, 1, dtype, seed=6)
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = torch.randn(C, H, device="cuda", generator=gen).to(dtype)
    values = torch.rand(C, device="cuda", generator=gen)
    results = []
    for in_place in (True, False):
        out = torch.empty(T, H, dtype=dtype, device="cuda")
        fetched = torch.full((T, K), float("nan"), device="cuda")
        source = (rows, values) if in_place else (peer_table_from_buffers([rows]),
                                                  peer_table_from_buffers([values[:, None]]))
        get_rows(source[0], dest_rank, dest_row, out, weights, value_table=source[1], values_out=fetched,
                 capacity=C, in_place=in_place)
        results.append((out, fetched))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][1], torch.where(dest_row >= 0, values[dest_row.clamp(min=0).long()], 0.0))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_transfers_capture_in_cuda_graph(impl):
    """Capturing proves no host synchronization; replaying with new inputs proves nothing was baked in."""
    T, K, H, M, dtype = 512, 4, 1024, 2, torch.bfloat16
    C, dest_rank, dest_row, src, probs = _setup(T, K, H, M, dtype, seed=2)
    bufs = [torch.zeros(C, H, dtype=dtype, device="cuda") for _ in range(M)]
    table = peer_table_from_buffers(bufs)
    out = torch.empty(T, H, dtype=dtype, device="cuda")

    def step():
        if impl == "triton":
            put_rows(src, dest_rank, dest_row, table, probs)
            get_rows(table, dest_rank, dest_row, out, probs)
        else:
            put_rows_ref(src, dest_rank, dest_row, bufs, probs)
            get_rows_ref(bufs, dest_rank, dest_row, out, probs)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    new_rank, new_row = random_routes(T, K, M, C, drop=0.1, seed=3, device="cuda")
    dest_rank.copy_(new_rank)
    dest_row.copy_(new_row)
    src.copy_(torch.randn_like(src))
    graph.replay()
    expected = get_rows_ref(bufs, dest_rank, dest_row, torch.empty_like(out), probs)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1.6e-2)
    check = [torch.zeros_like(b) for b in bufs]
    put_rows_ref(src, dest_rank, dest_row, check, probs)
    for m, (b, c) in enumerate(zip(bufs, check)):
        targeted = _targeted(dest_rank, dest_row, m, C)
        torch.testing.assert_close(b[targeted], c[targeted], rtol=0, atol=0)
    torch.cuda.synchronize()
