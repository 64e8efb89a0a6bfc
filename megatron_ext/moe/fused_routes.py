"""The rowwise dispatcher's route selection and route map on GPUs: two Triton kernels
(kernels/route_plan.py) in place of the torch form (moe/route_map.py), same results.

`select` runs in dispatch_preprocess (top-k ids and probabilities from Megatron's [T, E]
routing map, the counts the EP group exchanges); `route` in token_dispatch (the count
exchange, then plan and rows). Only the probabilities carry a gradient: back to the [T, E]
probs at the selected experts, zero elsewhere, as `probs.gather` would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.moe.route_map import RouteMap, RouteMetrics, check_plan, exchange_counts, rows_by_source


@dataclass(frozen=True)
class Selection:
    """What `select` (or moe/fused_router's router) hands `route`: the routing map and its
    per-block expert histograms."""

    routing_map: torch.Tensor  # [T, E] bool
    counts: torch.Tensor  # [E] int32, this rank's routes per global expert
    block_hist: torch.Tensor  # [B, E] int32, the same per block of tokens
    nonfinite: torch.Tensor  # [] int32, selected routes whose probability is NaN/Inf
    top_idx: torch.Tensor | None = None  # [T, K] int32 ascending, set by FusedTopKRouter


class _SelectRoutes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routing_map, probs, topk: int):
        from megatron_ext.kernels.route_plan import select_routes

        top_idx, top_probs, counts, hist, nonfinite = select_routes(routing_map, probs, topk)
        ctx.save_for_backward(routing_map)
        ctx.probs_dtype = probs.dtype
        ctx.mark_non_differentiable(top_idx, counts, hist, nonfinite)
        return top_probs, top_idx, counts, hist, nonfinite

    @staticmethod
    def backward(ctx, grad_top_probs, *unused):
        from megatron_ext.kernels.route_plan import select_backward

        (routing_map,) = ctx.saved_tensors
        return None, select_backward(routing_map, grad_top_probs, ctx.probs_dtype), None


def select(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """-> (top_idx [T, K] int32 ascending, -1 for empty slots; top_probs [T, K] fp32; Selection)."""
    top_probs, top_idx, counts, hist, nonfinite = _SelectRoutes.apply(routing_map, probs, topk)
    return top_idx, top_probs, Selection(routing_map, counts, hist, nonfinite)


def route(selection: Selection, topk: int, capacity: int, group=None, gather_counts=None,
          ep_rank: int | None = None, need_row_source: bool = True,
          dest_capacity: torch.Tensor | None = None, arena=None, sinks=None) -> RouteMap:
    """Exchange the counts over the EP group, then plan and place (moe/route_map.route's contract,
    `dest_capacity` included). `arena` (moe/arena.ArenaCursor): the per-destination capacities
    come from the dropless arena's cursor, and the same launch moves it (what ArenaCursor's
    `capacities` and `advance` do around the torch form). `sinks` (moe/metric_sinks.MetricSinks):
    the launch also adds the route metrics into them."""
    from megatron_ext.kernels.route_plan import plan_and_place

    requested_all, ep_rank = exchange_counts(selection.counts, group, gather_counts, ep_rank)
    check_plan(requested_all.shape[0], selection.routing_map.shape[1], capacity)
    out = plan_and_place(selection.routing_map, selection.block_hist, selection.nonfinite, requested_all, topk,
                         capacity, ep_rank, dest_capacity, arena, sinks)
    row_source = rows_by_source(out["mine"], capacity) if need_row_source else None
    metrics = RouteMetrics(out["packed"], out["buffer_fill"])
    return RouteMap(out["dest_rank"], out["dest_row"], out["recv_counts"], out["recv_offsets"], row_source, metrics)
