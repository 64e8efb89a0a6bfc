"""Row transfers straight into / out of peer capacity buffers (Triton PUT and GET).

Each EP rank owns a capacity buffer [C, H]. A device int64 *peer table* [M] holds the base
address of every rank's buffer (symmetric-memory peer pointers, or several local tensors for
EP=1 and for tests). A route map gives, for each route (t, k) of this source rank,
`dest_rank[t, k]` and `dest_row[t, k]` (int32; -1 = dropped).

- `put_rows`: every kept route stores src[t] (optionally times row_scale[t, k], in fp32) into
  row dest_row of rank dest_rank's buffer. Used by dispatch forward and combine backward.
- `get_rows`: out[t] = sum_k weights[t, k] * peer[dest_rank][dest_row], accumulated in fp32;
  optionally also keeps each fetched row in `gathered[t, k]`. Used by combine forward and
  dispatch backward.
- `copy_rows_below`: the rows of a capacity buffer below a device count, into another buffer
  (the symm transport's GET sources at EP > 1: only the rows that arrived, not all C).
- Per-route values (the router probabilities): `put_rows` can also store each kept route's fp32
  value at its row of the owner's [C] value array, and `get_rows` fetch it back per route, in
  the same launch and hence the same phase as the rows.

What this removes: no per-destination packing of send blocks, no host-side split lists
(no device-to-host copy), no receiver-side permutation; a row is moved once, by the source,
to its final position. What it accepts: the route map must give distinct rows to distinct
kept routes and stay inside [0, M) x [0, C) (not checked on device: that would need a host
sync); peer buffers are contiguous rows of width H, 16-byte aligned, of one dtype; ordering
between a phase's remote writes and their readers is the caller's job (barrier / signal).
H and K are compile-time constants (one compile per H, K, dtype and options; a model has few),
which unrolls the K routes so their row addresses and loads are independent.
"""

from __future__ import annotations

import functools

import torch

from megatron_ext.kernels.row_checks import (BUFFER_DTYPES, VALIDATED, check_common, check_put_rows_back,
                                             check_return_table, check_runnable, layout, require, row_bound)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch without Triton: use row_transfer_ref instead
    triton = None

_VECTOR_BYTES = 16  # one 128-bit load/store per thread and step


def _launch_config(H: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for rows of H elements of `dtype`.

    A block covers a whole row up to 8 KiB (4096 bf16, 2048 fp32 elements), so H = 1024..8192
    bf16 takes 1 or 2 H-steps per program; 4 warps, fewer only when a block would leave a
    thread less than one 16-byte vector. On one H200 (T=4096, K=8, 4 local peers) this
    moves 3.5-4.0 TB/s for H >= 4096; other warp counts and blocks were within noise or slower.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    block_h = min(1 << max(H - 1, 0).bit_length(), 8192 // elem)  # next power of two, capped
    num_warps = max(1, min(4, block_h * elem // (_VECTOR_BYTES * 32)))
    return block_h, num_warps


def peer_table_from_buffers(buffers) -> torch.Tensor:
    """An int64 peer table of the given buffers' base addresses (init time, not per step)."""
    buffers = list(buffers)
    if not buffers:
        raise ValueError("peer_table_from_buffers needs at least one buffer")
    first = buffers[0]
    for i, buf in enumerate(buffers):
        if buf.dim() != 2 or buf.shape != first.shape or buf.dtype != first.dtype or buf.device != first.device:
            raise ValueError(f"buffer {i} is {tuple(buf.shape)} {buf.dtype} on {buf.device}; every peer buffer "
                             f"must be [C, H] like buffer 0 ({tuple(first.shape)} {first.dtype} on {first.device})")
        if not buf.is_contiguous():
            raise ValueError(f"buffer {i} is not contiguous; allocate peer buffers as contiguous [C, H] tensors")
        if buf.data_ptr() % _VECTOR_BYTES:
            raise ValueError(f"buffer {i} starts at an address that is not {_VECTOR_BYTES}-byte aligned; "
                             "use a freshly allocated tensor, not an offset view")
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=first.device)


if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _route_target(dest_rank_ptr, dest_row_ptr, route, num_peers, capacity):
        """(rank, row, kept?) of a route: kept unless dropped (-1) or outside [0, num_peers) x [0, capacity)."""
        rank = tl.load(dest_rank_ptr + route)
        row = tl.load(dest_row_ptr + route)
        return rank, row, (rank >= 0) & (row >= 0) & (rank < num_peers) & (row < capacity)

    @triton.jit
    def _peer_row(peer_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, H: tl.constexpr,
                  BUF: tl.constexpr):
        """(pointer to the route's destination row, kept?) — a route that is not kept (_route_target)
        points at rank 0 row 0 and nothing is read or written."""
        rank, row, kept = _route_target(dest_rank_ptr, dest_row_ptr, route, num_peers, capacity)
        base = tl.load(peer_table_ptr + tl.where(kept, rank, 0)).to(tl.pointer_type(BUF))
        base = tl.multiple_of(base, 16)  # peer buffers are 16-byte aligned: allows 128-bit accesses
        return base + tl.where(kept, row, 0).to(tl.int64) * H, kept

    @triton.jit
    def _route_source(peer_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, H: tl.constexpr,
                      BUF: tl.constexpr, OWN_ROWS: tl.constexpr, IN_PLACE: tl.constexpr):
        """(pointer to the row route reads, kept?). OWN_ROWS: row `route` of the one buffer in the
        table (a source's receive buffer, filled by put_rows_back), kept where put_rows delivered
        the route. IN_PLACE: `peer_table_ptr` is the one rank's rows themselves, no table. Otherwise
        the route's destination row (_peer_row)."""
        if OWN_ROWS:
            _, _, kept = _route_target(dest_rank_ptr, dest_row_ptr, route, num_peers, capacity)
            base = tl.multiple_of(tl.load(peer_table_ptr).to(tl.pointer_type(BUF)), 16)
            return base + route * H, kept
        elif IN_PLACE:
            _, row, kept = _route_target(dest_rank_ptr, dest_row_ptr, route, num_peers, capacity)
            return peer_table_ptr + tl.where(kept, row, 0).to(tl.int64) * H, kept
        else:
            return _peer_row(peer_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, H, BUF)

    @triton.jit
    def _put_route_values(values_ptr, value_table_ptr, dest_rank_ptr, dest_row_ptr, token, num_peers, capacity,
                          K: tl.constexpr):
        """Store each kept route's fp32 value (its router probability) at its destination row of the
        owner's [C] value array: the per-row probabilities travel with the rows, in the same phase."""
        for k in tl.static_range(K):
            route = token * K + k
            dst, kept = _peer_row(value_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, 1,
                                  tl.float32)
            tl.store(dst, tl.load(values_ptr + route), mask=kept)

    @triton.jit
    def _get_route_values(value_table_ptr, dest_rank_ptr, dest_row_ptr, values_out_ptr, token, num_peers, capacity,
                          K: tl.constexpr, OWN_ROWS: tl.constexpr, IN_PLACE: tl.constexpr):
        """values_out[t, k] = the fp32 value at route (t, k)'s row of its owner's [C] value array, 0 if dropped."""
        for k in tl.static_range(K):
            route = token * K + k
            src, kept = _route_source(value_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, 1,
                                      tl.float32, OWN_ROWS, IN_PLACE)
            tl.store(values_out_ptr + route, tl.where(kept, tl.load(src, mask=kept, other=0.0), 0.0))

    @triton.jit
    def _put_return_ids(return_table_ptr, dest_rank_ptr, dest_row_ptr, token, source_rank, num_peers, capacity,
                        K: tl.constexpr):
        """Store each kept route's return id, route * num_peers + source_rank (int32), at its
        destination row of the owner's [C] return-id array: where that row's result goes back to."""
        for k in tl.static_range(K):
            route = token * K + k
            dst, kept = _peer_row(return_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, 1,
                                  tl.int32)
            tl.store(dst, (route * num_peers + source_rank).to(tl.int32), mask=kept)

    @triton.jit
    def _put_rows_kernel(src_ptr, dest_rank_ptr, dest_row_ptr, peer_table_ptr, row_scale_ptr, values_ptr,
                         value_table_ptr, return_table_ptr, source_rank, num_peers, capacity, H: tl.constexpr,
                         K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_VALUES: tl.constexpr,
                         HAS_RETURN: tl.constexpr, BUF: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            col = h0 + cols
            in_row = col < H
            x = tl.load(src_ptr + token * H + col, mask=in_row)
            for k in tl.static_range(K):  # unrolled: the K row addresses are independent
                route = token * K + k
                dst, kept = _peer_row(peer_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, H, BUF)
                if HAS_SCALE:
                    value = (x.to(tl.float32) * tl.load(row_scale_ptr + route)).to(BUF)
                else:
                    value = x
                tl.store(dst + col, value, mask=in_row & kept)
        if HAS_VALUES:
            _put_route_values(values_ptr, value_table_ptr, dest_rank_ptr, dest_row_ptr, token, num_peers, capacity, K)
        if HAS_RETURN:
            _put_return_ids(return_table_ptr, dest_rank_ptr, dest_row_ptr, token, source_rank, num_peers, capacity, K)

    @triton.jit
    def _put_rows_back_kernel(src_ptr, return_ids_ptr, count_ptr, peer_table_ptr, values_ptr, value_table_ptr,
                              num_peers, routes, H: tl.constexpr, HAS_VALUES: tl.constexpr, BUF: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        """Row r < count goes back to route (id // num_peers) of rank (id % num_peers), id =
        return_ids[r]: into that rank's [routes, H] buffer (and [routes] values). An id outside
        [0, routes * num_peers) writes nothing."""
        row = tl.program_id(0).to(tl.int64)
        if row < tl.load(count_ptr):
            rid = tl.load(return_ids_ptr + row)
            kept = (rid >= 0) & (rid < routes * num_peers)
            rank = tl.where(kept, rid % num_peers, 0)
            route = tl.where(kept, rid // num_peers, 0).to(tl.int64)
            base = tl.load(peer_table_ptr + rank).to(tl.pointer_type(BUF))
            base = tl.multiple_of(base, 16)
            cols = tl.arange(0, BLOCK_H)
            for h0 in range(0, H, BLOCK_H):
                col = h0 + cols
                in_row = col < H
                tl.store(base + route * H + col, tl.load(src_ptr + row * H + col, mask=in_row), mask=in_row & kept)
            if HAS_VALUES:
                value_base = tl.load(value_table_ptr + rank).to(tl.pointer_type(tl.float32))
                tl.store(value_base + route, tl.load(values_ptr + row), mask=kept)

    @triton.jit
    def _get_rows_kernel(peer_table_ptr, dest_rank_ptr, dest_row_ptr, out_ptr, weights_ptr, gathered_ptr,
                         value_table_ptr, values_out_ptr, num_peers, capacity, H: tl.constexpr, K: tl.constexpr,
                         HAS_WEIGHTS: tl.constexpr, HAS_GATHERED: tl.constexpr, HAS_VALUES: tl.constexpr,
                         BUF: tl.constexpr, BLOCK_H: tl.constexpr, OWN_ROWS: tl.constexpr,
                         IN_PLACE: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            col = h0 + cols
            in_row = col < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for k in tl.static_range(K):  # unrolled: the K loads are in flight together
                route = token * K + k
                src, kept = _route_source(peer_table_ptr, dest_rank_ptr, dest_row_ptr, route, num_peers, capacity, H,
                                          BUF, OWN_ROWS, IN_PLACE)
                row = tl.load(src + col, mask=in_row & kept, other=0.0).to(tl.float32)
                if HAS_WEIGHTS:
                    acc += tl.where(kept, tl.load(weights_ptr + route), 0.0) * row
                else:
                    acc += row
                if HAS_GATHERED:
                    tl.store(gathered_ptr + route * H + col, row.to(gathered_ptr.dtype.element_ty), mask=in_row)
            tl.store(out_ptr + token * H + col, acc.to(out_ptr.dtype.element_ty), mask=in_row)
        if HAS_VALUES:
            _get_route_values(value_table_ptr, dest_rank_ptr, dest_row_ptr, values_out_ptr, token, num_peers, capacity,
                              K, OWN_ROWS, IN_PLACE)


    @triton.jit
    def _copy_rows_below_kernel(src_ptr, dst_ptr, bound_ptr, values_src_ptr, values_dst_ptr, H: tl.constexpr,
                                HAS_VALUES: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0)
        if row < tl.load(bound_ptr):  # rows at or past the device count: nothing to read or write
            base = row.to(tl.int64) * H
            cols = tl.arange(0, BLOCK_H)
            for h0 in range(0, H, BLOCK_H):
                col = h0 + cols
                in_row = col < H
                tl.store(dst_ptr + base + col, tl.load(src_ptr + base + col, mask=in_row), mask=in_row)
            if HAS_VALUES:
                tl.store(values_dst_ptr + row, tl.load(values_src_ptr + row))


@functools.lru_cache(maxsize=None)
def _cached_launch_config(H: int, dtype: torch.dtype) -> tuple[int, int]:
    return _launch_config(H, dtype)


def _config(H, dtype, block_h, num_warps):
    default_block_h, default_warps = _cached_launch_config(H, dtype)
    block_h = default_block_h if block_h is None else block_h
    require(block_h > 0 and block_h & (block_h - 1) == 0, f"block_h must be a power of two, got {block_h}")
    return block_h, default_warps if num_warps is None else num_warps


def put_rows(src: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor, peer_table: torch.Tensor,
             row_scale: torch.Tensor | None = None, *, route_values: torch.Tensor | None = None,
             value_table: torch.Tensor | None = None, return_table: torch.Tensor | None = None,
             source_rank: int = 0, capacity: int | None = None, block_h: int | None = None,
             num_warps: int | None = None) -> None:
    """Store src[t] (times row_scale[t, k] in fp32, if given) into peer dest_rank[t, k]'s buffer row
    dest_row[t, k] for every kept route; dropped routes (-1) write nothing. Buffers have src's dtype.
    With `route_values` [T, K] fp32 and `value_table` (the owners' [C] fp32 arrays), each kept route
    also stores its value at the same row of its owner's array, in the same launch. With
    `return_table` (the owners' [C] int32 arrays), each kept route also stores its return id
    (t * K + k) * M + source_rank there, for put_rows_back.
    Routes outside [0, M) x [0, capacity) are masked (no write); pass the buffers' row count as
    `capacity` (None: only the rank is bounded)."""
    T, K, H = check_common("put_rows", src, dest_rank, dest_row, peer_table, (("row_scale", row_scale),),
                           ("route_values", route_values), value_table)
    require(src.dtype in BUFFER_DTYPES, f"put_rows: src dtype {src.dtype} not supported; use one of "
            f"{BUFFER_DTYPES}", TypeError)
    check_return_table("put_rows", return_table, peer_table)
    check_runnable("put_rows", src)
    if T == 0 or K == 0 or H == 0:
        return
    block_h, num_warps = _config(H, src.dtype, block_h, num_warps)
    has_values = route_values is not None
    _put_rows_kernel[(T,)](src, dest_rank, dest_row, peer_table, src if row_scale is None else row_scale,
                           route_values if has_values else src, value_table if has_values else peer_table,
                           peer_table if return_table is None else return_table,
                           0 if return_table is None else source_rank,
                           peer_table.numel(), row_bound(capacity), H, K,
                           HAS_SCALE=row_scale is not None, HAS_VALUES=has_values, HAS_RETURN=return_table is not None,
                           BUF=_TL_DTYPES[src.dtype], BLOCK_H=block_h, num_warps=num_warps)


def put_rows_back(src: torch.Tensor, return_ids: torch.Tensor, count: torch.Tensor, peer_table: torch.Tensor,
                  routes: int, values: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The reverse of a dispatch PUT: row r < count[0] of src [C, H] (a device int32 count) goes to
    route id // M of rank id % M, id = return_ids[r] (written by put_rows' `return_table`), in
    that rank's [routes, H] buffer. With `values` = (values_src [C] fp32, value_table), each row's
    value goes to the same route of the owner's [routes] fp32 array. Ids outside
    [0, routes * M) write nothing."""
    check_put_rows_back(src, return_ids, count, peer_table, values)
    check_runnable("put_rows_back", src)
    rows, H = src.shape
    if rows == 0 or H == 0:
        return
    block_h, num_warps = _cached_launch_config(H, src.dtype)
    values_src, value_table = values if values is not None else (src, peer_table)
    _put_rows_back_kernel[(rows,)](src, return_ids, count, peer_table, values_src, value_table, peer_table.numel(),
                                   routes, H, HAS_VALUES=values is not None, BUF=_TL_DTYPES[src.dtype],
                                   BLOCK_H=block_h, num_warps=num_warps)


def get_rows(peer_table: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor, out: torch.Tensor,
             weights: torch.Tensor | None = None, gathered: torch.Tensor | None = None, *,
             value_table: torch.Tensor | None = None, values_out: torch.Tensor | None = None,
             capacity: int | None = None, buffer_dtype: torch.dtype | None = None, block_h: int | None = None,
             num_warps: int | None = None, own_rows_of: int | None = None, in_place: bool = False) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * peer[dest_rank[t, k]][dest_row[t, k]] (fp32 accumulation, weights
    None = 1, dropped routes add exactly 0); if `gathered` [T, K, H] is given, it receives every fetched
    row (0 for dropped). With `value_table` (the owners' [C] fp32 arrays) and `values_out` [T, K] fp32,
    each route also fetches the value at its row (0 for dropped), in the same launch. Peer buffers
    hold `buffer_dtype` (default: out's dtype). Routes outside [0, M) x [0, capacity) read nothing
    and add 0, like dropped ones. `own_rows_of` = M: the table holds one buffer, this rank's [T*K, H]
    receive buffer (and its values), and route (t, k) reads its row t * K + k, where put_rows_back
    left it, if put_rows delivered the route to one of the M ranks (return_transfer="put").
    `in_place` (one rank): `peer_table` is that rank's [C, H] rows themselves and `value_table` its
    [C] fp32 values, read where they are: no address table to write before the launch.
    Returns out."""
    T, K, H = check_common("get_rows", out, dest_rank, dest_row, peer_table, (("weights", weights),),
                           ("values_out", values_out), value_table, in_place=in_place)
    buffer_dtype = out.dtype if buffer_dtype is None else buffer_dtype
    for name, dtype in (("buffer_dtype", buffer_dtype), ("out", out.dtype)):
        require(dtype in BUFFER_DTYPES, f"get_rows: {name} {dtype} not supported; use one of {BUFFER_DTYPES}",
                 TypeError)
    if gathered is not None:
        require(gathered.shape == (T, K, H), f"get_rows: gathered must be [T, K, H] = {(T, K, H)}, "
                 f"got {tuple(gathered.shape)} (H must match out's)")
        require(gathered.dtype in BUFFER_DTYPES, f"get_rows: gathered dtype {gathered.dtype} not supported",
                 TypeError)
        require(gathered.is_contiguous(), "get_rows: gathered is not contiguous; pass a contiguous tensor")
        require(gathered.device == out.device, f"get_rows: gathered is on {gathered.device}, out on {out.device}")
    if in_place:
        require(own_rows_of is None and peer_table.dtype == buffer_dtype,
                f"get_rows: in place reads rows of buffer_dtype {buffer_dtype} (got {peer_table.dtype}), "
                f"and not together with own_rows_of")
        capacity = peer_table.shape[0] if capacity is None else min(capacity, peer_table.shape[0])
    check_runnable("get_rows", out)
    if T == 0 or H == 0:
        return out
    block_h, num_warps = _config(H, buffer_dtype, block_h, num_warps)
    has_values = values_out is not None
    if own_rows_of is not None:
        require(peer_table.numel() == 1 and capacity is not None,
                f"get_rows: own_rows_of needs a one-entry table (this rank's receive buffer) and the owners' "
                f"capacity; got a table of {peer_table.numel()} and capacity {capacity}")
    _get_rows_kernel[(T,)](peer_table, dest_rank, dest_row, out, out if weights is None else weights,
                           out if gathered is None else gathered, value_table if has_values else peer_table,
                           values_out if has_values else out,
                           1 if in_place else peer_table.numel() if own_rows_of is None else own_rows_of,
                           row_bound(capacity), H, K,
                           HAS_WEIGHTS=weights is not None, HAS_GATHERED=gathered is not None,
                           HAS_VALUES=has_values, BUF=_TL_DTYPES[buffer_dtype], BLOCK_H=block_h,
                           num_warps=num_warps, OWN_ROWS=own_rows_of is not None, IN_PLACE=in_place)
    return out


def copy_rows_below(src: torch.Tensor, dst: torch.Tensor, bound: torch.Tensor,
                    values: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """dst[r] = src[r] for the rows r < bound[0], a device int32 count (no host read); rows at or
    past it stay as they are. Moves the rows a capacity buffer holds instead of all C. With
    `values` = (values_src, values_dst), two [C] fp32 arrays, values_dst[r] = values_src[r] for
    the same rows, in the same launch. Returns dst."""
    key = ("copy_rows_below", layout(src), layout(dst), layout(bound),
           None if values is None else tuple(layout(v) for v in values))
    if key not in VALIDATED:
        require(triton is not None, "copy_rows_below: Triton is not installed", RuntimeError)
        require(src.dim() == 2 and src.shape == dst.shape and src.dtype == dst.dtype,
                 f"copy_rows_below: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                 f"must be [C, H] of one shape and dtype")
        require(src.is_contiguous() and dst.is_contiguous(), "copy_rows_below: src and dst must be contiguous")
        require(bound.dtype == torch.int32 and bound.numel() >= 1,
                 f"copy_rows_below: bound must be a device int32 count, got {bound.dtype} of {bound.numel()} "
                 f"elements")
        require(src.device == dst.device == bound.device,
                 f"copy_rows_below: src, dst and bound must share a device ({src.device}, {dst.device}, "
                 f"{bound.device})")
        require(src.dtype in BUFFER_DTYPES, f"copy_rows_below: dtype {src.dtype} not supported", TypeError)
        for name, v in zip(("values_src", "values_dst"), values or ()):
            require(v.dtype == torch.float32 and v.shape == (src.shape[0],) and v.is_contiguous()
                     and v.device == src.device,
                     f"copy_rows_below: {name} must be a contiguous float32 [{src.shape[0]}] on {src.device}, got "
                     f"{v.dtype} {tuple(v.shape)} on {v.device}")
        VALIDATED.add(key)
    check_runnable("copy_rows_below", src)
    rows, H = src.shape
    if rows == 0 or H == 0:
        return dst
    block_h, num_warps = _cached_launch_config(H, src.dtype)
    values_src, values_dst = values if values is not None else (src, dst)
    _copy_rows_below_kernel[(rows,)](src, dst, bound, values_src, values_dst, H, HAS_VALUES=values is not None,
                                     BLOCK_H=block_h, num_warps=num_warps)
    return dst
