"""Row transfers: the torch reference against brute-force loops, the Triton kernels against the
reference under Triton's interpreter (in a subprocess), and the kernels' argument checks."""

from __future__ import annotations


import pytest
import torch

from megatron_ext.kernels.row_transfer import _launch_config, get_rows, peer_table_from_buffers, put_rows
from megatron_ext.kernels.row_transfer_ref import get_rows_ref, put_rows_ref
from tests.unit._row_transfer_interp import brute_force_get, brute_force_put, random_routes
from tests.unit.interpreter import run_under_interpreter
from tests.unit.put_arguments import COMMON_PUT_ERRORS, put_arguments



@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_reference_matches_brute_force(M, dtype, scaled):
    T, K, H, C = 9, 4, 24, 14
    gen = torch.Generator().manual_seed(M * 10 + scaled)
    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.3, seed=M + scaled)
    assert (dest_row < 0).any() and (dest_row >= 0).any()
    src = torch.randn(T, H, generator=gen).to(dtype)
    scale = torch.rand(T, K, generator=gen) if scaled else None

    got = [torch.full((C, H), float("nan"), dtype=dtype) for _ in range(M)]
    want = [b.clone() for b in got]
    put_rows_ref(src, dest_rank, dest_row, got, scale)
    brute_force_put(src, dest_rank, dest_row, want, scale)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)  # tails still NaN, rows exact

    peers = [torch.full((C, H), float("nan"), dtype=dtype) for _ in range(M)]
    for m, buf in enumerate(peers):  # only targeted rows hold data; reading anything else gives NaN
        buf[dest_row[dest_rank == m].long()] = torch.randn(int((dest_rank == m).sum()), H, generator=gen).to(dtype)
    weights = torch.rand(T, K, generator=gen) if scaled else None
    out, out_bf = torch.empty(T, H, dtype=dtype), torch.empty(T, H, dtype=dtype)
    gathered, gathered_bf = torch.empty(T, K, H, dtype=dtype), torch.empty(T, K, H, dtype=dtype)
    get_rows_ref(peers, dest_rank, dest_row, out, weights, gathered)
    brute_force_get(peers, dest_rank, dest_row, out_bf, weights, gathered_bf)
    torch.testing.assert_close(out, out_bf, rtol=0, atol=0)
    torch.testing.assert_close(gathered, gathered_bf, rtol=0, atol=0)
    assert not out.isnan().any()


def test_reference_dropped_routes_add_exact_zero():
    """A dropped route with a NaN weight, pointing (by its row) at a NaN row, still adds 0."""
    peers = [torch.tensor([[1.0, 2.0], [float("nan")] * 2])]
    dest_rank = torch.tensor([[0, -1]], dtype=torch.int32)
    dest_row = torch.tensor([[0, -1]], dtype=torch.int32)
    weights = torch.tensor([[0.5, float("nan")]])
    out = get_rows_ref(peers, dest_rank, dest_row, torch.empty(1, 2), weights)
    assert out.tolist() == [[0.5, 1.0]]


def test_reference_put_to_rank_without_routes_leaves_it_untouched():
    bufs = [torch.arange(6.0).view(3, 2), torch.full((3, 2), -1.0)]
    before = [b.clone() for b in bufs]
    put_rows_ref(torch.ones(2, 2), torch.tensor([[0], [-1]], dtype=torch.int32),
                 torch.tensor([[2], [-1]], dtype=torch.int32), bufs)
    assert torch.equal(bufs[0][:2], before[0][:2]) and bufs[0][2].tolist() == [1.0, 1.0]
    assert torch.equal(bufs[1], before[1])


def test_triton_kernels_match_reference_under_interpreter():
    stdout = run_under_interpreter("_row_transfer_interp.py")
    assert "0 mismatches" in stdout, stdout


def test_launch_config_defaults():
    assert _launch_config(2048, torch.bfloat16) == (2048, 4)
    assert _launch_config(8192, torch.bfloat16) == (4096, 4)
    assert _launch_config(1024, torch.bfloat16) == (1024, 4)
    assert _launch_config(4096, torch.float32) == (2048, 4)
    assert _launch_config(40, torch.float32) == (64, 1)


def _routes(T=3, K=2):
    return torch.zeros(T, K, dtype=torch.int32), torch.zeros(T, K, dtype=torch.int32)


@pytest.mark.parametrize("put", ["put_rows", "put_rows_mxfp8"])
@pytest.mark.parametrize("bad", ["int32", "shape", "device"])
def test_both_puts_refuse_a_bad_return_table(put, bad):
    """The return table (put_rows_back's route ids) is checked like peer_table by both PUT kernels."""
    from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8

    src, dest_rank, dest_row, table = put_arguments("ok", hidden=64)
    returns = {"int32": torch.zeros(2, dtype=torch.int32), "shape": torch.zeros(3, dtype=torch.int64),
               "device": torch.zeros(2, dtype=torch.int64, device="meta")}[bad]
    launch = put_rows if put == "put_rows" else put_rows_mxfp8
    with pytest.raises(ValueError, match=f"{put}: return_table must be an int64 \\[2\\] table like peer_table"):
        launch(src, dest_rank, dest_row, table, return_table=returns)


@pytest.mark.parametrize("case, error, match", COMMON_PUT_ERRORS + [
    ("scale_shape", ValueError, "row_scale must be"),
    ("scale_dtype", TypeError, "row_scale must be float32"),
])
def test_put_rows_rejects_bad_arguments(case, error, match):
    src, dest_rank, dest_row, table = put_arguments(case, hidden=8)
    scale = None
    if case == "scale_shape":
        scale = torch.ones(3, 3)
    elif case == "scale_dtype":
        scale = torch.ones(3, 2, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        put_rows(src, dest_rank, dest_row, table, scale)


@pytest.mark.parametrize("case, error, match", [
    ("gathered_h", ValueError, r"gathered must be \[T, K, H\]"),
    ("weights_dtype", TypeError, "weights must be float32"),
    ("routes_mismatch", ValueError, "differ in shape"),
    ("out_int", TypeError, "not supported"),
])
def test_get_rows_rejects_bad_arguments(case, error, match):
    out = torch.zeros(3, 8)
    dest_rank, dest_row = _routes()
    weights, gathered = None, None
    if case == "gathered_h":
        gathered = torch.zeros(3, 2, 4)
    elif case == "weights_dtype":
        weights = torch.ones(3, 2, dtype=torch.float64)
    elif case == "routes_mismatch":
        dest_row = torch.zeros(3, 1, dtype=torch.int32)
    elif case == "out_int":
        out = torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(error, match=match):
        get_rows(torch.zeros(2, dtype=torch.int64), dest_rank, dest_row, out, weights, gathered)


def test_peer_table_rejects_mismatched_or_offset_buffers():
    with pytest.raises(ValueError, match="every peer buffer must be"):
        peer_table_from_buffers([torch.zeros(4, 8), torch.zeros(4, 16)])
    with pytest.raises(ValueError, match="aligned"):
        peer_table_from_buffers([torch.zeros(40)[2:34].view(4, 8)])
    table = peer_table_from_buffers([torch.zeros(4, 8), torch.zeros(4, 8)])
    assert table.dtype == torch.int64 and table.shape == (2,)


@pytest.mark.parametrize("dst_shape,bound,match", [
    ((6, 8), torch.tensor([3], dtype=torch.int32), "must be \\[C, H\\] of one shape and dtype"),
    ((5, 8), torch.tensor([3], dtype=torch.int64), "bound must be a device int32 count"),
    ((5, 8), torch.zeros(0, dtype=torch.int32), "bound must be a device int32 count"),
])
def test_copy_rows_below_refuses_bad_arguments(dst_shape, bound, match):
    from megatron_ext.kernels.row_transfer import copy_rows_below

    with pytest.raises(ValueError, match=match):
        copy_rows_below(torch.zeros(5, 8), torch.zeros(dst_shape), bound)


@pytest.mark.parametrize("case, error, match", [
    ("values_without_table", ValueError, "need both the values and value_table"),
    ("table_without_values", ValueError, "need both the values and value_table"),
    ("table_int32", TypeError, "value_table must be int64"),
    ("table_length", TypeError, "value_table must be int64 \\(2,\\)"),
    ("values_dtype", TypeError, "route_values must be float32"),
])
def test_put_rows_rejects_bad_route_values(case, error, match):
    src, dest_rank, dest_row, table = put_arguments("ok", hidden=8)
    values, value_table = torch.ones(3, 2), torch.zeros(2, dtype=torch.int64)
    if case == "values_without_table":
        value_table = None
    elif case == "table_without_values":
        values = None
    elif case == "table_int32":
        value_table = value_table.int()
    elif case == "table_length":
        value_table = torch.zeros(3, dtype=torch.int64)
    elif case == "values_dtype":
        values = values.double()
    with pytest.raises(error, match=match):
        put_rows(src, dest_rank, dest_row, table, route_values=values, value_table=value_table)


def test_get_rows_and_copy_rows_below_reject_bad_values():
    from megatron_ext.kernels.row_transfer import copy_rows_below

    dest_rank, dest_row = _routes()
    with pytest.raises(ValueError, match="need both the values and value_table"):
        get_rows(torch.zeros(2, dtype=torch.int64), dest_rank, dest_row, torch.zeros(3, 8),
                 values_out=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="values_out must be"):
        get_rows(torch.zeros(2, dtype=torch.int64), dest_rank, dest_row, torch.zeros(3, 8),
                 value_table=torch.zeros(2, dtype=torch.int64), values_out=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="values_dst must be a contiguous float32 \\[5\\]"):
        copy_rows_below(torch.zeros(5, 8), torch.zeros(5, 8), torch.tensor([3], dtype=torch.int32),
                        values=(torch.zeros(5), torch.zeros(5, dtype=torch.float64)))


def test_get_rows_in_place_rejects_bad_sources():
    """In place (one rank) the source is [C, H] rows of out's dtype and, with values, [C] fp32 values."""
    dest_rank, dest_row = _routes()
    out = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="in place, the source must be \\[C, H=8\\] rows"):
        get_rows(torch.zeros(5, 4), dest_rank, dest_row, out, in_place=True)
    with pytest.raises(ValueError, match="in place reads rows of buffer_dtype torch.float32 \\(got torch.bfloat16\\)"):
        get_rows(torch.zeros(5, 8, dtype=torch.bfloat16), dest_rank, dest_row, out, in_place=True)
    with pytest.raises(ValueError, match="not together with own_rows_of"):
        get_rows(torch.zeros(5, 8), dest_rank, dest_row, out, capacity=5, own_rows_of=2, in_place=True)
    with pytest.raises(ValueError, match="need both the values out and the source's \\[C\\] fp32 values"):
        get_rows(torch.zeros(5, 8), dest_rank, dest_row, out, value_table=torch.zeros(5), in_place=True)
    with pytest.raises(ValueError, match="the source values must be a contiguous float32 \\[5\\]"):
        get_rows(torch.zeros(5, 8), dest_rank, dest_row, out, value_table=torch.zeros(4),
                 values_out=torch.zeros(3, 2), in_place=True)


def test_peer_table_rejects_no_buffers_other_dtypes_and_strided_buffers():
    """The kernels read every peer as contiguous [C, H] rows of one dtype from its base address: a
    peer of another dtype or a strided view would be read at the wrong offsets, so both are refused."""
    with pytest.raises(ValueError, match="at least one buffer"):
        peer_table_from_buffers([])
    with pytest.raises(ValueError, match="buffer 1 is .* torch.bfloat16 .*every peer buffer must be"):
        peer_table_from_buffers([torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="buffer 0 is not contiguous"):
        peer_table_from_buffers([torch.zeros(8, 4).t()])


def test_get_rows_rejects_a_bad_buffer_dtype_or_gathered_layout():
    """A buffer dtype the kernel has no type for, and a gathered output it would index as contiguous
    [T, K, H] rows of a float dtype on out's device, are refused before the launch."""
    dest_rank, dest_row = _routes()
    table, out = torch.zeros(2, dtype=torch.int64), torch.zeros(3, 8)
    with pytest.raises(TypeError, match="get_rows: buffer_dtype torch.int32 not supported"):
        get_rows(table, dest_rank, dest_row, out, buffer_dtype=torch.int32)
    with pytest.raises(ValueError, match="gathered is not contiguous"):
        get_rows(table, dest_rank, dest_row, out, gathered=torch.zeros(8, 2, 3).permute(2, 1, 0))
    with pytest.raises(TypeError, match="gathered dtype torch.int32 not supported"):
        get_rows(table, dest_rank, dest_row, out, gathered=torch.zeros(3, 2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="gathered is on meta, out on cpu"):
        get_rows(table, dest_rank, dest_row, out, gathered=torch.zeros(3, 2, 8, device="meta"))


def test_launch_options_are_checked_before_a_launch(monkeypatch):
    """Checks that come after check_runnable (so only a CUDA or interpreter run reaches them): a block
    that is not a power of two and an own-rows table of more than one entry or without the owners'
    capacity. With TRITON_INTERPRET=1 in the environment the launch is allowed, so reaching the
    error proves it is raised before any kernel runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dest_rank, dest_row = _routes()
    src, out = torch.zeros(3, 64), torch.zeros(3, 64)
    with pytest.raises(ValueError, match="block_h must be a power of two, got 48"):
        put_rows(src, dest_rank, dest_row, torch.zeros(2, dtype=torch.int64), block_h=48)
    with pytest.raises(ValueError, match="block_h must be a power of two, got 24"):
        get_rows(torch.zeros(2, dtype=torch.int64), dest_rank, dest_row, out, block_h=24)
    with pytest.raises(ValueError, match="own_rows_of needs a one-entry table .* got a table of 2"):
        get_rows(torch.zeros(2, dtype=torch.int64), dest_rank, dest_row, out, capacity=4, own_rows_of=2)
    with pytest.raises(ValueError, match="own_rows_of needs a one-entry table .* capacity None"):
        get_rows(torch.zeros(1, dtype=torch.int64), dest_rank, dest_row, out, own_rows_of=2)


@pytest.mark.parametrize("case, match", [
    ("src_noncontig", r"src must be a contiguous \[C, H\]"),
    ("ids_short", "return_ids must be contiguous int32 with >= 4 entries"),
    ("ids_int64", "return_ids must be contiguous int32"),
    ("count_int64", "count must be a device int32 count, got torch.int64"),
    ("count_empty", "count must be a device int32 count"),
    ("values_short", r"values_src must be a contiguous float32 \[4\], got torch.float32 \(3,\)"),
    ("values_fp16", r"values_src must be a contiguous float32 \[4\]"),
    ("peer_table_int32", r"peer_table must be a non-empty int64 \[M\]"),
    ("value_table_short", r"value_table must be an int64 \[1\] table like peer_table"),
    ("ids_elsewhere", r"must be on src's device cpu, got \['meta', 'cpu', 'cpu', 'cpu', 'cpu'\]"),
    ("count_elsewhere", r"must be on src's device cpu, got \['cpu', 'meta'"),
])
def test_put_rows_back_rejects_bad_arguments(case, match):
    """put_rows_back reads return_ids[r], values_src[r] for every row r < count of src [C, H]: each is
    checked to cover C rows (a shorter array would be read past its end), the count to be int32, the
    tables to be int64 address tables, and everything on src's device."""
    from megatron_ext.kernels.row_transfer import put_rows_back

    src, ids, count = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    values = (torch.zeros(4), torch.zeros(1, dtype=torch.int64))
    if case == "src_noncontig":
        src = torch.zeros(8, 4).t()
    elif case == "ids_short":
        ids = ids[:3]
    elif case == "ids_int64":
        ids = ids.long()
    elif case == "count_int64":
        count = count.long()
    elif case == "count_empty":
        count = count[:0]
    elif case == "values_short":
        values = (torch.zeros(3), values[1])
    elif case == "values_fp16":
        values = (torch.zeros(4, dtype=torch.float16), values[1])
    peer_table = torch.zeros(1, dtype=torch.int32 if case == "peer_table_int32" else torch.int64)
    if case == "value_table_short":
        values = (values[0], values[1][:0])
    elif case == "ids_elsewhere":  # a device the kernel could not read from src's (meta: no data needed)
        ids = torch.zeros(4, dtype=torch.int32, device="meta")
    elif case == "count_elsewhere":
        count = torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=match):
        put_rows_back(src, ids, count, peer_table, routes=4, values=values)


def test_copy_rows_below_refuses_a_strided_destination_or_another_device():
    """The kernel writes dst as contiguous rows: a transposed dst, or a bound on another device, is refused."""
    from megatron_ext.kernels.row_transfer import copy_rows_below

    bound = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="src and dst must be contiguous"):
        copy_rows_below(torch.zeros(5, 5), torch.zeros(5, 5).t(), bound)
    with pytest.raises(ValueError, match="must share a device"):
        copy_rows_below(torch.zeros(5, 8), torch.zeros(5, 8), bound.to("meta"))
