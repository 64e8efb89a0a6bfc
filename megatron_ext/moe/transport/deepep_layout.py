"""Index maps between the rowwise route map and DeepEP V1's token order (pure torch, device only).

DeepEP V1 intranode dispatch receives tokens grouped by source rank (rank 0's first), each
source's tokens in the order that source listed them; combine sends each received row back
to its source token and sums over the ranks the token went to. The rowwise layout wants each
kept route (t, k) at row dest_row[t, k] of rank dest_rank[t, k]'s expert-major buffer. Two
orderings reconcile them without any expert id on the wire:

  send order   each source lists one DeepEP token per route, kept routes sorted by
               (dest_rank, dest_row), dropped routes last (DeepEP id -1: sent nowhere). So a
               destination receives source s's routes in ascending dest_row.
  receive map  a destination's rows written by source s are exactly the rows with
               row_source == s; sorting the rows by (row_source, row) lists them in DeepEP's
               receive order, so the j-th received token belongs at that sorted list's j-th row.

The DeepEP "expert" of a route is its destination rank (one pseudo-expert per rank): the
extension keeps its own capacity policy and expert-major layout, DeepEP only moves rows.
Cost accepted: two sorts ([T*K] at the source, [C] at the destination) and their inverses,
computed once per route map and reused by all four transfers. Nothing here reads a device
value on the host, and every shape is static (the tests run it on the "meta" device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.moe.route_map import RouteMap
from megatron_ext.moe.transport.base import routes_in_range


@dataclass(frozen=True)
class DeepEPLayout:
    """Where each route sits in DeepEP's send list and each received token in the buffer."""

    send_route: torch.Tensor  # [N = T*K] int64, route index t*K + k of the i-th DeepEP token sent
    send_token: torch.Tensor  # [N] int64, source token of the i-th DeepEP token (send_route // K)
    send_rank: torch.Tensor  # [N, 1] int64, DeepEP topk_idx: destination rank, -1 dropped
    route_send_pos: torch.Tensor  # [T, K] int64, DeepEP token index of route (t, k) (inverse)
    route_kept: torch.Tensor  # [T, K] bool
    row_of_recv: torch.Tensor  # [C] int64, buffer row of the j-th received DeepEP token
    recv_of_row: torch.Tensor  # [C] int64, received-token index that lands in each row (inverse)
    row_written: torch.Tensor  # [C] bool, rows some source writes (the tail is never written)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def build_layout(route: RouteMap, num_ranks: int, capacity: int) -> DeepEPLayout:
    """Send and receive index maps of one route map (all ranks call it on their own map)."""
    num_tokens, topk = route.dest_row.shape
    kept = routes_in_range(route, num_ranks, capacity)  # a route outside [0, M) x [0, C) travels nowhere
    flat_kept = kept.reshape(-1)
    slot = route.dest_rank.long().reshape(-1) * capacity + route.dest_row.long().reshape(-1)
    send_key = torch.where(flat_kept, slot, num_ranks * capacity)  # dropped routes after every kept one
    send_route = torch.sort(send_key, stable=True).indices
    send_rank = torch.where(flat_kept, route.dest_rank.long().reshape(-1), -1)[send_route]

    written = route.row_source >= 0
    recv_key = torch.where(written, route.row_source.long(), num_ranks)  # unwritten tail rows last
    row_of_recv = torch.sort(recv_key, stable=True).indices  # stable: ascending rows per source
    return DeepEPLayout(
        send_route=send_route,
        send_token=torch.div(send_route, topk, rounding_mode="floor"),
        send_rank=send_rank[:, None].contiguous(),
        route_send_pos=_inverse(send_route).view(num_tokens, topk),
        route_kept=kept,
        row_of_recv=row_of_recv,
        recv_of_row=_inverse(row_of_recv),
        row_written=written,
    )


def send_rows(tokens: torch.Tensor, layout: DeepEPLayout) -> torch.Tensor:
    """Token rows [T, H] -> one row per route in DeepEP send order, [T*K, H]."""
    return tokens.index_select(0, layout.send_token)


def place_received(received: torch.Tensor, layout: DeepEPLayout, tail_value: float = 0.0) -> torch.Tensor:
    """DeepEP's received tokens [C, H] -> the expert-major buffer [C, H]; unwritten rows = tail_value."""
    buffer = received.index_select(0, layout.recv_of_row)
    return torch.where(layout.row_written[:, None], buffer, tail_value)


def rows_to_return(buffer: torch.Tensor, layout: DeepEPLayout) -> torch.Tensor:
    """Expert-major buffer rows [C, H] -> DeepEP's received-token order, ready for combine."""
    return buffer.index_select(0, layout.row_of_recv)


def returned_routes(combined: torch.Tensor, layout: DeepEPLayout) -> torch.Tensor:
    """DeepEP combine output in send order [N, H] -> per-route rows [T, K, H], exactly 0 if dropped."""
    num_tokens, topk = layout.route_kept.shape
    rows = combined.index_select(0, layout.route_send_pos.reshape(-1)).view(num_tokens, topk, combined.shape[1])
    return torch.where(layout.route_kept[..., None], rows, 0.0)
