"""The row-transport interface every backend implements (DESIGN 3.4, 3.5).

Two primitives carry all four MoE transfers; the autograd Functions in moe/row_autograd.py
compose them:

  put(src [T, H], route, row_scale) -> [C, H]   each kept route (t, k) writes src[t] (times
      row_scale[t, k] in fp32) into row dest_row[t, k] of rank dest_rank[t, k]'s buffer; the
      result is this rank's buffer, valid rows packed from row 0.
      Dispatch forward (scale None) and combine backward (scale = router probs).
  get(buf [C, H], route, weights, keep_gathered) -> (out [T, H], gathered [T, K, H] | None)
      each source fetches the rows its routes point at in the owners' buffers and sums them,
      weighted by `weights` in fp32; dropped routes contribute exactly zero.
      Combine forward (weights = probs, gathered kept for the prob gradient) and dispatch
      backward (weights None).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_ext.moe.route_map import RouteMap


class RowTransport(Protocol):
    capacity: int

    def put(self, src: torch.Tensor, route: RouteMap, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        ...

    def get(self, buf: torch.Tensor, route: RouteMap, weights: torch.Tensor | None = None,
            keep_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        ...
