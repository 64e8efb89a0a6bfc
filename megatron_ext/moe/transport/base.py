"""The row-transport interface every backend implements: the four transfers (docs/design.md, "Transfers").

  dispatch(tokens [T, H], route) -> (buffer [C, H], lease)
      PUT: each kept route (t, k) writes tokens[t] into row dest_row[t, k] of rank
      dest_rank[t, k]'s dispatch buffer; returns this rank's buffer (valid rows packed from
      row 0) and the lease holding it (None where autograd owns the memory).
  combine(expert_out [C, H], route, probs [T, K]) -> (out [T, H], gathered [T, K, H])
      GET: each source fetches the K rows its routes point at, sums them weighted by probs in
      fp32; dropped routes add exactly zero. `gathered` keeps the fetched rows for the
      prob gradient.
  combine_backward(grad_out [T, H], route, probs) -> grad_expert_out [C, H]
      PUT: each source writes probs[t, k] * grad_out[t] into the owner's gradient buffer.
  dispatch_backward(grad_buffer [C, H], route) -> grad_tokens [T, H]
      GET: each source fetches and sums its K route gradients.
  release(lease): the dispatch buffer's last reader (the up-projection's Wgrad) is done.
  dispatch_quantized(tokens [T, H], route) -> (packed uint8 [C, P], lease)
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

    def dispatch(self, tokens: torch.Tensor, route: RouteMap) -> tuple[torch.Tensor, object]: ...

    def combine(self, expert_out: torch.Tensor, route: RouteMap,
                probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine_backward(self, grad_out: torch.Tensor, route: RouteMap, probs: torch.Tensor) -> torch.Tensor: ...

    def dispatch_backward(self, grad_buffer: torch.Tensor, route: RouteMap) -> torch.Tensor: ...

    def release(self, lease) -> None: ...

    def dispatch_quantized(self, tokens: torch.Tensor, route: RouteMap) -> tuple[torch.Tensor, object]: ...
