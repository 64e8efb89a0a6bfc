"""The row-transport interface every backend implements: the four transfers (docs/design.md, "Transfers").

  dispatch(tokens [T, H], probs [T, K] fp32, route) -> (buffer [C, H], row_probs [C] fp32, lease)
      PUT: each kept route (t, k) writes tokens[t] into row dest_row[t, k] of rank
      dest_rank[t, k]'s dispatch buffer, and probs[t, k] into the same row of its [C]
      probability array, in the same phase; returns this rank's buffer and probabilities
      (valid rows packed from row 0) and the lease holding them (None where autograd owns
      the memory). The experts apply the probabilities (Megatron's permuted_probs).
  combine(expert_out [C, H], route) -> out [T, H]
      GET: each source fetches the K rows its routes point at and sums them in fp32; dropped
      routes add exactly zero.
  combine_backward(grad_out [T, H], route) -> grad_expert_out [C, H]
      PUT: each source writes grad_out[t] into every kept route's row of the owner's buffer.
  dispatch_backward(grad_buffer [C, H], grad_row_probs [C] fp32 | None, route)
      -> (grad_tokens [T, H], grad_probs [T, K] fp32 | None)
      GET: each source fetches and sums its K route gradients, and fetches each route's
      probability gradient (zero for dropped routes).
  release(lease): the dispatch buffer's last reader (the up-projection's Wgrad) is done.
  dispatch_quantized(tokens [T, H], probs, route) -> (packed uint8 [C, P], row_probs [C], lease)
      PUT of MXFP8 rows (moe/mxfp8_dispatch.py): quantize each token row once and write the
      packed bytes into every kept route's row (fused into the PUT kernel on symm).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_ext.moe.route_map import RouteMap


class RowTransport(Protocol):
    capacity: int
    reads_row_source: bool  # whether it reads RouteMap.row_source (absent: assumed True)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 route: RouteMap) -> tuple[torch.Tensor, torch.Tensor, object]: ...

    def combine(self, expert_out: torch.Tensor, route: RouteMap) -> torch.Tensor: ...

    def combine_backward(self, grad_out: torch.Tensor, route: RouteMap) -> torch.Tensor: ...

    def dispatch_backward(self, grad_buffer: torch.Tensor, grad_row_probs: torch.Tensor | None,
                          route: RouteMap) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def release(self, lease) -> None: ...

    def dispatch_quantized(self, tokens: torch.Tensor, probs: torch.Tensor,
                           route: RouteMap) -> tuple[torch.Tensor, torch.Tensor, object]: ...


def sum_routes(rows: torch.Tensor) -> torch.Tensor:
    """[T, K, W] rows fetched per route (zero for dropped routes) -> [T, W]: each token's routes
    summed in fp32, in the rows' dtype (combine and the dispatch backward of the transports that
    fetch whole route rows before summing)."""
    return rows.float().sum(1).to(rows.dtype)


def routes_in_range(route, num_ranks: int, capacity: int) -> torch.Tensor:
    """[T, K] routes that are kept and inside [0, M) x [0, C): the others move nothing (as the
    symm kernels mask them), whatever a corrupted route map says."""
    rank, row = route.dest_rank, route.dest_row
    return (rank >= 0) & (rank < num_ranks) & (row >= 0) & (row < capacity)
