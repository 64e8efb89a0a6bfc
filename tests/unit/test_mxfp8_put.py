"""Fused MXFP8 quantize + PUT: the kernel byte for byte against pack_rows(quantize_rows(x)) under
Triton's interpreter (in a subprocess), its argument checks, and the torch transport's
dispatch_quantized on CPU."""

from __future__ import annotations


import pytest
import torch

from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
from megatron_ext.formats import mxfp8
from megatron_ext.moe.transport.torch_ref import TorchRowTransport
from tests.unit._mxfp8_put_interp import single_rank_route
from tests.unit._row_transfer_interp import random_routes
from tests.unit.interpreter import run_under_interpreter
from tests.unit.put_arguments import COMMON_PUT_ERRORS, put_arguments


def test_fused_put_bit_exact_under_interpreter():
    stdout = run_under_interpreter("_mxfp8_put_interp.py")
    assert " 0 mismatches" in stdout, stdout


@pytest.mark.parametrize("case, error, match", COMMON_PUT_ERRORS + [
    ("hidden_48", ValueError, "multiple of 32"),
    ("fp16", TypeError, "bfloat16 or float32"),
    ("table_device", ValueError, "keep all on one device"),
])
def test_put_rows_mxfp8_rejects_bad_arguments(case, error, match):
    src, dest_rank, dest_row, table = put_arguments(case, hidden=64)
    if case == "hidden_48":
        src = torch.zeros(3, 48)
    elif case == "fp16":
        src = src.half()
    elif case == "table_device":
        table = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(error, match=match):
        put_rows_mxfp8(src, dest_rank, dest_row, table)


@pytest.mark.parametrize("dtype, hidden, poison", [(torch.bfloat16, 96, False), (torch.float32, 64, True)])
def test_torch_transport_dispatch_quantized(dtype, hidden, poison):
    """One rank: every written row is its token's packed reference row, the tail is 0 (NaN words
    with poison_tail), and the buffer is uint8 [C, packed_row_bytes(H)]."""
    T, K, C = 10, 3, 32
    dest_rank, dest_row = random_routes(T, K, 1, C, drop=0.3, seed=hidden)
    route = single_rank_route(dest_rank, dest_row, C)
    tokens = (torch.randn(T, hidden) * 50).to(dtype)
    probs = torch.rand(T, K)
    buffer, row_probs, lease = TorchRowTransport(None, C, poison_tail=poison).dispatch_quantized(tokens, probs, route)
    assert lease is None
    assert buffer.dtype == torch.uint8 and buffer.shape == (C, mxfp8.packed_row_bytes(hidden))
    packed = mxfp8.pack_rows(mxfp8.quantize_rows(tokens))
    token = torch.arange(T)[:, None].expand(T, K)
    kept = dest_row >= 0
    assert torch.equal(buffer[dest_row[kept].long()], packed[token[kept]])
    assert torch.equal(row_probs[dest_row[kept].long()], probs[kept])
    tail = buffer[route.row_source < 0]
    assert tail.shape[0] > 0
    if poison:
        assert tail.view(torch.float32).isnan().all()
    else:
        assert not tail.any()


def test_tile_rule_refuses_two_bytes_per_thread():
    from megatron_ext.kernels.mxfp8_quant import check_tile_elements

    check_tile_elements(512, 4, "op")  # 4 per thread: fine
    check_tile_elements(128, 4, "op")  # 1 per thread: fine
    with pytest.raises(ValueError, match="2 bytes"):
        check_tile_elements(256, 4, "op")


def test_put_rows_mxfp8_refuses_blocks_per_program_not_a_power_of_two(monkeypatch):
    """The check sits after check_runnable (a CUDA or interpreter run only): with TRITON_INTERPRET=1 in
    the environment the launch is allowed, so the error proves it comes before any kernel runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    src, dest_rank, dest_row, table = put_arguments("ok", hidden=96)
    with pytest.raises(ValueError, match="put_rows_mxfp8: blocks_per_program must be a power of two, got 3"):
        put_rows_mxfp8(src, dest_rank, dest_row, table, blocks_per_program=3)
