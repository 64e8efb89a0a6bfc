"""Fused MXFP8 quantize + PUT: token rows land in peers' dispatch buffers as packed MXFP8 rows.

`put_rows_mxfp8(src, dest_rank, dest_row, peer_table)` quantizes each token row of ``src``
([T, H] bf16/fp32) with the arithmetic of ``mxfp8_quant.mxfp8_quantize_tile`` and stores the
packed row (H E4M3 bytes, H/32 E8M0 bytes, zero pad to ``packed_row_bytes(H)``; layout in
``megatron_ext/formats/mxfp8.py``) into row ``dest_row[t, k]`` of rank ``dest_rank[t, k]``'s uint8
buffer [C, packed_row_bytes(H)] for every kept route; dropped routes (-1) write nothing. The
bytes equal ``pack_rows(quantize_rows(src))`` row for row.

Cost removed (vs ``quantize_rows_packed_triton`` then ``put_rows`` on the packed rows): no
packed [T, P] staging tensor (its write, its K re-reads, its pad fill), one launch instead of
two or three, and the token row is read and quantized once for all of its K destinations.
Costs accepted: one compile per (H, K, input dtype); per route the stores are byte rows
(values, then scales, then <= 15 pad bytes) rather than one vector copy; the route-map
contract of ``row_transfer`` (distinct rows for distinct kept routes, indices inside
[0, M) x [0, C); not checked on device, that would need a host sync); peer buffers 16-byte
aligned and contiguous with rows of exactly ``packed_row_bytes(H)`` bytes (any dtype whose
byte view is that, e.g. float32 [C, P/4] words).
"""

from __future__ import annotations

import torch

from megatron_ext.kernels.row_checks import check_common, check_return_table, check_runnable, require, row_bound
from megatron_ext.formats.mxfp8 import check_input_rows, packed_row_bytes

try:
    import triton
    import triton.language as tl

    from megatron_ext.kernels import mxfp8_quant
    from megatron_ext.kernels.mxfp8_quant import mxfp8_quantize_tile
    from megatron_ext.kernels.row_transfer import _peer_row, _put_return_ids, _put_route_values
except ImportError:  # CPU-only torch without Triton: quantize_rows + pack_rows + a torch transport
    triton = None

MAX_BLOCKS_PER_PROGRAM = 64  # 64 blocks x 32 values: a whole H = 2048 row per step
NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def _put_rows_mxfp8_kernel(bits_ptr, dest_rank_ptr, dest_row_ptr, peer_table_ptr, values_ptr, value_table_ptr,
                               return_table_ptr, source_rank, num_peers, capacity, H: tl.constexpr, K: tl.constexpr,
                               ROW_BYTES: tl.constexpr, INPUT_BF16: tl.constexpr, NATIVE_FP8_CAST: tl.constexpr,
                               HAS_VALUES: tl.constexpr, HAS_RETURN: tl.constexpr, BLOCKS: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        N_BLOCKS: tl.constexpr = H // 32
        PAD: tl.constexpr = ROW_BYTES - H - N_BLOCKS  # 0..15 bytes
        lane = tl.arange(0, 32)
        for b0 in range(0, N_BLOCKS, BLOCKS):
            block = b0 + tl.arange(0, BLOCKS)
            valid = block < N_BLOCKS
            column = block[:, None] * 32 + lane[None, :]
            raw = tl.load(bits_ptr + token * H + column, mask=valid[:, None], other=0)
            if INPUT_BF16:
                bits = (raw.to(tl.int32) & 0xFFFF) << 16  # exact bf16 -> fp32 widening
            else:
                bits = raw
            code, scale = mxfp8_quantize_tile(bits, NATIVE_FP8_CAST)
            code, scale = code.to(tl.uint8), scale.to(tl.uint8)
            for k in tl.static_range(K):  # unrolled: the K row addresses are independent
                dst, kept = _peer_row(peer_table_ptr, dest_rank_ptr, dest_row_ptr, token * K + k, num_peers,
                                      capacity, ROW_BYTES, tl.uint8)
                tl.store(dst + column, code, mask=valid[:, None] & kept)
                tl.store(dst + H + block, scale, mask=valid & kept)
        if PAD > 0:
            pad = tl.arange(0, 16)
            for k in tl.static_range(K):
                dst, kept = _peer_row(peer_table_ptr, dest_rank_ptr, dest_row_ptr, token * K + k, num_peers,
                                      capacity, ROW_BYTES, tl.uint8)
                tl.store(dst + H + N_BLOCKS + pad, tl.zeros([16], dtype=tl.uint8), mask=(pad < PAD) & kept)
        if HAS_VALUES:
            _put_route_values(values_ptr, value_table_ptr, dest_rank_ptr, dest_row_ptr, token, num_peers, capacity, K)
        if HAS_RETURN:
            _put_return_ids(return_table_ptr, dest_rank_ptr, dest_row_ptr, token, source_rank, num_peers, capacity, K)


def put_rows_mxfp8(src: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor, peer_table: torch.Tensor,
                   *, route_values: torch.Tensor | None = None, value_table: torch.Tensor | None = None,
                   return_table: torch.Tensor | None = None, source_rank: int = 0,
                   capacity: int | None = None, blocks_per_program: int | None = None,
                   num_warps: int | None = None) -> None:
    """Quantize src [T, H] (bf16/fp32, H % 32 == 0) to MXFP8 and store each packed row
    (``packed_row_bytes(H)`` bytes) into peer dest_rank[t, k]'s buffer row dest_row[t, k] for every
    kept route; dropped routes (-1) and routes outside [0, M) x [0, capacity) write nothing. Bytes equal
    ``pack_rows(quantize_rows(src))``. `route_values` / `value_table`, `return_table` / `source_rank`:
    as in row_transfer.put_rows."""
    op = "put_rows_mxfp8"
    T, K, H = check_common(op, src, dest_rank, dest_row, peer_table, values=("route_values", route_values),
                           value_table=value_table)
    try:
        n_blocks = check_input_rows(src)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{op}: {err}") from None
    check_return_table(op, return_table, peer_table)
    check_runnable(op, src)
    if T == 0 or K == 0:
        return
    if blocks_per_program is None:  # >= 4 values per thread (mxfp8_quant.MIN_ELEMENTS_PER_THREAD)
        blocks_per_program = min(max(triton.next_power_of_2(n_blocks), mxfp8_quant.MIN_ELEMENTS_PER_THREAD),
                                 MAX_BLOCKS_PER_PROGRAM)
    if num_warps is None:
        num_warps = max(1, min(NUM_WARPS, blocks_per_program // mxfp8_quant.MIN_ELEMENTS_PER_THREAD))
    require(blocks_per_program > 0 and blocks_per_program & (blocks_per_program - 1) == 0,
             f"{op}: blocks_per_program must be a power of two, got {blocks_per_program}")
    if src.is_cuda:  # the interpreter has no warps
        mxfp8_quant.check_tile_elements(blocks_per_program * 32, num_warps, op)
    bits = src.view(torch.int16) if src.dtype == torch.bfloat16 else src.view(torch.int32)
    _put_rows_mxfp8_kernel[(T,)](
        bits, dest_rank, dest_row, peer_table, route_values if route_values is not None else bits,
        value_table if value_table is not None else peer_table,
        return_table if return_table is not None else peer_table, 0 if return_table is None else source_rank,
        peer_table.numel(),
        row_bound(capacity), H, K, packed_row_bytes(H), INPUT_BF16=src.dtype == torch.bfloat16,
        NATIVE_FP8_CAST=src.is_cuda and mxfp8_quant.NATIVE_FP8_CAST_ON_GPU, HAS_VALUES=route_values is not None,
        HAS_RETURN=return_table is not None, BLOCKS=blocks_per_program, num_warps=num_warps,
    )

