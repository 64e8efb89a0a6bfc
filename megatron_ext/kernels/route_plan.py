"""The route map in two Triton kernels (docs/design.md, "Route map"): the same plan and rows as
moe/route_map.py's torch form, from Megatron's [T, E] routing map directly.

Cost removed: ~25 small torch ops per layer forward (top-k ids from the routing map, probability
gather, counts, the keep plan, a stable sort for positions) or, compiled, a torch.compile call
with its guards, runtime wrappers and ~16 launches: about 1 ms of host time per layer. Cost
accepted: the routing map is read twice (select, then place), and a place program sums the
per-block expert histograms of all earlier token blocks (O(blocks^2 * E) small loads).

  select  [T, E] routing map + probs -> top-k ids [T, K] (ascending), their probs (fp32),
          per-expert counts [E], per-block histograms [B, E], non-finite probability count
  route   plan, per destination rank: max-min fair water-filling of its (local expert, source)
          buckets into `capacity` rows (binary search for the level, rotating remainder), done
          by every program (cheaper than a second launch); then place, per route: position
          among this rank's routes to its expert (tokens in order), kept iff below the plan's
          keep, row = the expert's and source's base + position
A token's k-th route is its k-th selected expert in ascending order, so "earlier routes win"
means earlier tokens win, as in the torch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_ext.kernels.route_checks import check_plan_inputs, check_selection

BLOCK_TOKENS = 32


@triton.jit
def _selection_tile(map_ptr, block, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """One block of routing-map rows: (tokens, experts, inside, offsets into [T, E], routes, slot).
    `routes` marks the selected experts that fill one of the token's K slots, `slot` is the k of
    each (its rank among the token's selected experts, ascending ids)."""
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    inside = (tokens[:, None] < T) & (experts[None, :] < E)
    offsets = tokens[:, None].to(tl.int64) * E + experts[None, :]
    selected = (tl.load(map_ptr + offsets, mask=inside, other=0) != 0) & inside
    slot = tl.cumsum(selected.to(tl.int32), axis=1) - 1
    return tokens, experts, inside, offsets, selected & (slot < K), slot


@triton.jit
def _empty_slots(tokens, routes, T, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(mask, offsets into [T, K]) of the slots a token leaves empty (fewer than K experts selected)."""
    ks = tl.arange(0, BLOCK_K)
    per_token = tl.sum(routes.to(tl.int32), axis=1)
    empty = (tokens[:, None] < T) & (ks[None, :] >= per_token[:, None]) & (ks[None, :] < K)
    return empty, tokens[:, None].to(tl.int64) * K + ks[None, :]


@triton.jit
def _store_selection(top_idx_ptr, top_probs_ptr, counts_ptr, hist_ptr, nonfinite_ptr, block, tokens, experts,
                     routes, slot, probs, E, K: tl.constexpr):
    """The selection of one block of tokens, as `route` reads it: each route's expert id and fp32
    probability at [t, slot], the block's expert histogram, its share of the per-expert counts and
    of the non-finite probability count (the select kernel's and the fused router's outputs)."""
    out = tokens[:, None].to(tl.int64) * K + slot
    tl.store(top_idx_ptr + out, (experts[None, :] + tl.zeros_like(slot)).to(tl.int32), mask=routes)
    tl.store(top_probs_ptr + out, probs, mask=routes)
    block_counts = tl.sum(routes.to(tl.int32), axis=0)
    tl.store(hist_ptr + block * E + experts, block_counts, mask=experts < E)
    tl.atomic_add(counts_ptr + experts, block_counts, mask=experts < E)
    bad = routes & ((probs != probs) | (tl.abs(probs) == float("inf")))
    tl.atomic_add(nonfinite_ptr, tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0))


@triton.jit
def _select_kernel(map_ptr, probs_ptr, top_idx_ptr, top_probs_ptr, counts_ptr, hist_ptr, nonfinite_ptr,
                   T, E, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    block = tl.program_id(0)
    tokens, experts, inside, offsets, routes, slot = _selection_tile(map_ptr, block, T, E, K, BLOCK_T, BLOCK_E)
    probs = tl.load(probs_ptr + offsets, mask=routes, other=0.0).to(tl.float32)
    _store_selection(top_idx_ptr, top_probs_ptr, counts_ptr, hist_ptr, nonfinite_ptr, block, tokens, experts,
                     routes, slot, probs, E, K)
    empty, empty_out = _empty_slots(tokens, routes, T, K, BLOCK_K)  # stay -1: invalid routes
    tl.store(top_idx_ptr + empty_out, tl.full([BLOCK_T, BLOCK_K], -1, tl.int32), mask=empty)
    tl.store(top_probs_ptr + empty_out, tl.zeros([BLOCK_T, BLOCK_K], tl.float32), mask=empty)


@triton.jit
def _select_backward_kernel(map_ptr, grad_top_ptr, grad_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_E: tl.constexpr):
    """grad [T, E] = the top-k probabilities' gradient at the selected experts, 0 elsewhere."""
    tokens, _, inside, offsets, routes, slot = _selection_tile(map_ptr, tl.program_id(0), T, E, K, BLOCK_T, BLOCK_E)
    grad = tl.load(grad_top_ptr + tokens[:, None].to(tl.int64) * K + slot, mask=routes, other=0.0)
    tl.store(grad_ptr + offsets, grad, mask=inside)


@triton.jit
def _plan_destination(requested_ptr, dest, capacity, M, E, L, BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr):
    """The keep plan of destination rank `dest`: (keep, req), [BLOCK_L, BLOCK_M] int64 per
    (local expert, source) bucket, 0 outside the L x M buckets."""
    local = tl.arange(0, BLOCK_L)[:, None]  # [L, 1]
    source = tl.arange(0, BLOCK_M)[None, :]  # [1, M]
    inside = (local < L) & (source < M)
    req = tl.load(requested_ptr + source * E + dest * L + local, mask=inside, other=0).to(tl.int64)
    n = L * M
    bucket = local * M + source  # the plan orders buckets l-major, then source
    total = tl.sum(tl.sum(req, axis=1), axis=0)
    # Largest integer level with sum(min(req, level)) <= capacity, by binary search.
    low = total * 0
    high = tl.max(tl.max(req, axis=1), axis=0)
    for _ in range(40):
        mid = (low + high + 1) // 2
        fits = tl.sum(tl.sum(tl.minimum(req, mid), axis=1), axis=0) <= capacity
        low = tl.where(fits, mid, low)
        high = tl.where(fits, high, mid - 1)
    level = low
    base = tl.minimum(req, level)
    remainder = capacity - tl.sum(tl.sum(base, axis=1), axis=0)
    # The remainder goes one row each to buckets still wanting more, in bucket order rotated to
    # start at total mod n: exclusive count of wanting buckets before each one in that order.
    wanting = ((req > level) & inside).to(tl.int64)
    row_totals = tl.sum(wanting, axis=1)
    before_row = tl.cumsum(row_totals, axis=0) - row_totals
    before = tl.cumsum(wanting, axis=1) - wanting + before_row[:, None]  # natural bucket order
    start = total % n
    before_start = tl.sum(tl.sum(tl.where((bucket == start) & inside, before, 0), axis=1), axis=0)
    all_wanting = tl.sum(row_totals, axis=0)
    rotated = tl.where(bucket >= start, before - before_start, all_wanting - before_start + before)
    extra = (wanting != 0) & (rotated < remainder)
    keep = tl.where(total <= capacity, req, base + extra.to(tl.int64))
    return tl.where(inside, keep, 0), req


@triton.jit
def _store_metric(packed_ptr, sums_ptr, guard_ptr, at, value, mask, SUMS: tl.constexpr, GUARD: tl.constexpr):
    """RouteMetrics.packed[at] = value (int32), also added (int64) into the layer's running sums
    (SUMS) and the overflow guard's (GUARD) (moe/metric_sinks.py). Atomic adds, not a load and a
    store: a value held by several threads of the program would otherwise be added once per thread
    (Triton predicates a store or an atomic to one of them)."""
    tl.store(packed_ptr + at, value.to(tl.int32), mask=mask)
    if SUMS:
        tl.atomic_add(sums_ptr + at, value.to(tl.int64), mask=mask)
    if GUARD:
        tl.atomic_add(guard_ptr + at, value.to(tl.int64), mask=mask)


@triton.jit
def _route_kernel(map_ptr, hist_ptr, requested_ptr, nonfinite_ptr, dest_rank_ptr, dest_row_ptr, packed_ptr,
                  recv_counts_ptr, recv_offsets_ptr, fill_ptr, mine_ptr, dest_capacity_ptr, capacity, rank, M, T, E, L,
                  cursor_ptr, next_cursor_ptr, start_ptr, region, shared, run_on, sums_ptr, guard_ptr, peak_ptr,
                  K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, PER_DEST: tl.constexpr, ARENA: tl.constexpr,
                  SPILLS: tl.constexpr, SUMS: tl.constexpr, GUARD: tl.constexpr):
    """Plan and place in one launch: every program plans all M destinations (a few thousand
    integer ops), keeps what its tokens need (this rank's keep and base row per expert), and
    program 0 also stores the plan's outputs and metrics. PER_DEST: destination d may keep
    dest_capacity[d] rows (int64, device) instead of `capacity` (the buffer's rows). ARENA (the
    dropless arena's cursor, moe/arena.ArenaCursor): destination d may keep region + min(shared -
    cursor[d], run_on) rows, and program 0 writes the cursor after this layer (SPILLS: each
    destination's rows past the region added) and this rank's spill start (shared - that). SUMS,
    GUARD: program 0 also adds the metrics into the layer's running sums, the overflow guard's sums
    and its peak of the rows each destination was asked for (moe/metric_sinks.MetricSinks)."""
    block = tl.program_id(0)
    first = block == 0
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_L)
    in_expert = lanes < L
    source = tl.arange(0, BLOCK_M)[None, :]
    keep_e = tl.zeros([BLOCK_E], dtype=tl.int64)  # this rank's kept routes per global expert
    base_e = tl.zeros([BLOCK_E], dtype=tl.int64)  # the row its first kept route takes
    kept_mine_total = tl.sum(keep_e, axis=0)
    for dest in range(M):
        if ARENA:
            spilled = tl.load(cursor_ptr + dest)
            room = region + tl.minimum(shared - spilled, run_on)
            keep, req = _plan_destination(requested_ptr, dest, room, M, E, L, BLOCK_L, BLOCK_M)
        elif PER_DEST:
            keep, req = _plan_destination(requested_ptr, dest, tl.load(dest_capacity_ptr + dest), M, E, L,
                                          BLOCK_L, BLOCK_M)
        else:
            keep, req = _plan_destination(requested_ptr, dest, capacity, M, E, L, BLOCK_L, BLOCK_M)
        kept = tl.sum(keep, axis=1)  # per local expert of this destination, all sources
        keep_mine = tl.sum(tl.where(source == rank, keep, 0), axis=1)
        row_base = tl.cumsum(kept, axis=0) - kept + tl.sum(tl.where(source < rank, keep, 0), axis=1)
        match = (experts[:, None] == dest * L + lanes[None, :]) & in_expert[None, :]
        keep_e += tl.sum(tl.where(match, keep_mine[None, :], 0), axis=1)
        base_e += tl.sum(tl.where(match, row_base[None, :], 0), axis=1)
        kept_mine_total += tl.sum(keep_mine, axis=0)
        global_experts = dest * L + lanes
        _store_metric(packed_ptr, sums_ptr, guard_ptr, global_experts, tl.sum(req, axis=1), in_expert & first, SUMS,
                      GUARD)
        _store_metric(packed_ptr, sums_ptr, guard_ptr, E + global_experts, kept, in_expert & first, SUMS, GUARD)
        if GUARD:  # the rows this destination was asked for, all sources
            tl.atomic_max(peak_ptr + dest, tl.sum(tl.sum(req, axis=1), axis=0), mask=first)
        is_mine = first & (dest == rank)
        tl.store(recv_counts_ptr + lanes, kept.to(tl.int32), mask=in_expert & is_mine)
        tl.store(recv_offsets_ptr + lanes, tl.cumsum(kept, axis=0).to(tl.int32), mask=in_expert & is_mine)
        local = lanes[:, None]
        tl.store(mine_ptr + local * M + source, keep.to(tl.int32), mask=(local < L) & (source < M) & is_mine)
        received = tl.sum(kept, axis=0)
        tl.store(fill_ptr, tl.div_rn(received.to(tl.float32), tl.maximum(capacity, 1).to(tl.float32)), mask=is_mine)
        _store_metric(packed_ptr, sums_ptr, guard_ptr, 2 * E + 1, received, is_mine, SUMS, GUARD)
        if ARENA:  # the next layer's cursor is another array: no program reads what program 0 writes
            moved = spilled + tl.maximum(received - region, 0) if SPILLS else spilled
            tl.store(next_cursor_ptr + dest, moved, mask=first)
            tl.store(start_ptr, shared - moved if SPILLS else moved * 0, mask=is_mine)
    # Dropped: every empty or unkept route slot of this rank (place keeps exactly the plan's keep).
    _store_metric(packed_ptr, sums_ptr, guard_ptr, 2 * E, T * K - kept_mine_total, first, SUMS, GUARD)
    _store_metric(packed_ptr, sums_ptr, guard_ptr, 2 * E + 2, tl.load(nonfinite_ptr), first, SUMS, GUARD)
    _store_metric(packed_ptr, sums_ptr, guard_ptr, 2 * E + 3, kept_mine_total * 0 + 1, first, SUMS, GUARD)  # a step

    tokens, experts, _, _, routes, slot = _selection_tile(map_ptr, block, T, E, K, BLOCK_T, BLOCK_E)
    in_experts = experts < E
    earlier = tl.zeros([BLOCK_E], dtype=tl.int32)  # this rank's routes to each expert in earlier blocks
    for previous in range(0, block):
        earlier += tl.load(hist_ptr + previous * E + experts, mask=in_experts, other=0)
    routes_i = routes.to(tl.int32)
    position = earlier[None, :] + tl.cumsum(routes_i, axis=0) - routes_i
    kept_route = routes & (position < keep_e.to(tl.int32)[None, :])
    row = base_e.to(tl.int32)[None, :] + position
    out = tokens[:, None].to(tl.int64) * K + slot
    tl.store(dest_row_ptr + out, tl.where(kept_route, row, -1), mask=routes)
    tl.store(dest_rank_ptr + out, tl.where(kept_route, experts[None, :] // L, -1), mask=routes)
    empty, empty_out = _empty_slots(tokens, routes, T, K, BLOCK_K)
    tl.store(dest_row_ptr + empty_out, tl.full([BLOCK_T, BLOCK_K], -1, tl.int32), mask=empty)
    tl.store(dest_rank_ptr + empty_out, tl.full([BLOCK_T, BLOCK_K], -1, tl.int32), mask=empty)


def select_routes(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """[T, E] bool routing map and [T, E] probs -> (top_idx [T, K] int32 ascending, top_probs [T, K]
    fp32, counts [E] int32, block histograms [B, E] int32, non-finite count [] int32). Not differentiable;
    see megatron_ext.moe.fused_routes for the autograd wrapper."""
    check_selection(routing_map, probs, topk)
    num_tokens, num_experts = routing_map.shape
    top_idx, top_probs, counts_and_nonfinite, hist = selection_outputs(num_tokens, num_experts, topk,
                                                                       routing_map.device)
    _select_kernel[(hist.shape[0],)](routing_map.contiguous(), probs.contiguous(), top_idx, top_probs,
                                     counts_and_nonfinite, hist, counts_and_nonfinite[num_experts:], num_tokens,
                                     num_experts, K=topk, BLOCK_K=triton.next_power_of_2(topk),
                                     BLOCK_T=BLOCK_TOKENS, BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4)
    return top_idx, top_probs, counts_and_nonfinite[:num_experts], hist, counts_and_nonfinite[num_experts]


def selection_outputs(num_tokens: int, num_experts: int, topk: int, device, counters: int = 1):
    """The tensors _store_selection fills: top_idx [T, K] int32, top_probs [T, K] fp32, the counts
    [E] with `counters` more zeroed int32 after them, the non-finite count first ([E + counters],
    zeroed: one memset), hist [B, E] int32."""
    return (torch.empty(num_tokens, topk, dtype=torch.int32, device=device),
            torch.empty(num_tokens, topk, dtype=torch.float32, device=device),
            torch.zeros(num_experts + counters, dtype=torch.int32, device=device),
            torch.empty(triton.cdiv(num_tokens, BLOCK_TOKENS), num_experts, dtype=torch.int32, device=device))


def select_backward(routing_map: torch.Tensor, grad_top_probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of select_routes' top_probs -> [T, E] in `dtype` (the router probabilities'), one kernel."""
    num_tokens, num_experts = routing_map.shape
    grad = torch.empty(num_tokens, num_experts, dtype=dtype, device=routing_map.device)
    _select_backward_kernel[(triton.cdiv(num_tokens, BLOCK_TOKENS),)](
        routing_map.contiguous(), grad_top_probs.contiguous(), grad, num_tokens, num_experts,
        K=grad_top_probs.shape[1], BLOCK_T=BLOCK_TOKENS, BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4)
    return grad


def plan_and_place(routing_map: torch.Tensor, hist: torch.Tensor, nonfinite: torch.Tensor, requested_all: torch.Tensor,
                   topk: int, capacity: int, ep_rank: int, dest_capacity: torch.Tensor | None = None,
                   arena=None, sinks=None) -> dict:
    """The keep plan from the gathered [M, E] counts and this rank's rows, in one launch: a dict
    with dest_rank, dest_row [T, K], recv_counts, recv_offsets [L], mine [L, M] (this rank's kept
    rows per (local expert, source)), buffer_fill [] and packed [2E + 4] (RouteMetrics.packed).
    `dest_capacity` [M] (device): rows each destination may keep (at most `capacity`).
    `arena` (moe/arena.ArenaCursor): the capacities come from its cursor, which the launch moves.
    `sinks` (moe/metric_sinks.MetricSinks): the launch adds `packed` into them (what `sinks.add`
    does in torch)."""
    check_plan_inputs(routing_map, hist, nonfinite, requested_all, topk, dest_capacity)
    m = requested_all.shape[0]
    if sinks is not None:
        sinks.check(routing_map.shape[1], m, routing_map.device)
    if arena is not None and dest_capacity is not None:
        raise ValueError("plan_and_place: give the arena's cursor or dest_capacity, not both (the cursor's "
                         "capacities replace dest_capacity)")
    num_tokens, num_experts = routing_map.shape
    local = num_experts // m
    device = routing_map.device
    ints = torch.empty(2 * num_tokens * topk + 2 * num_experts + 4 + 2 * local + local * m, dtype=torch.int32,
                       device=device)
    dest, packed, receive, mine = ints.split([2 * num_tokens * topk, 2 * num_experts + 4, 2 * local, local * m])
    dest, receive, mine = dest.view(2, num_tokens, topk), receive.view(2, local), mine.view(local, m)
    fill = torch.empty((), dtype=torch.float32, device=device)
    # At least one program: program 0 writes the plan, the metrics and the arena's cursor even for a
    # rank with no tokens (its peers still send it rows, and every rank must move the same cursor).
    _route_kernel[(max(1, triton.cdiv(num_tokens, BLOCK_TOKENS)),)](
        routing_map.contiguous(), hist, requested_all.contiguous(), nonfinite, dest[0], dest[1], packed, receive[0],
        receive[1], fill, mine, fill if dest_capacity is None else dest_capacity.long().contiguous(), capacity,
        ep_rank, m, num_tokens, num_experts, local,
        *((fill, fill, fill, 0, 0, 0) if arena is None else
          (arena.before, arena.after, arena.start, arena.region, arena.shared, arena.run_on)),
        *_sink_pointers(sinks, fill), K=topk, BLOCK_K=triton.next_power_of_2(topk),
        BLOCK_T=BLOCK_TOKENS, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_L=triton.next_power_of_2(local),
        BLOCK_M=triton.next_power_of_2(m), PER_DEST=dest_capacity is not None, ARENA=arena is not None,
        SPILLS=arena is not None and arena.spills, SUMS=sinks is not None and sinks.running is not None,
        GUARD=sinks is not None and sinks.overflow is not None, num_warps=4)
    return {"dest_rank": dest[0], "dest_row": dest[1], "recv_counts": receive[0], "recv_offsets": receive[1],
            "mine": mine, "buffer_fill": fill, "packed": packed}



def _sink_pointers(sinks, unused: torch.Tensor) -> tuple:
    """(running sums, guard sums, peak demand) for the launch; `unused` where a sink is absent (its
    flag is off, so the kernel never touches it)."""
    if sinks is None:
        return unused, unused, unused
    return tuple(unused if sink is None else sink for sink in (sinks.running, sinks.overflow, sinks.peak_demand))
