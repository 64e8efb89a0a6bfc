"""return_transfer="put": results go back to their routes by PUT, not GET (docs/design.md, "Transfers").

Two phases bring rows back to the tokens that sent them: the combine forward (expert outputs)
and the dispatch backward (the rows' gradients and probability gradients). With the default GET,
at EP > 1 each first copies the owner's rows into symmetric scratch (torch._grouped_mm writes a
fresh tensor that peers cannot address), barriers, then every source reads its routes' rows from
the owners. Here the dispatch PUT also leaves each row's return id (route * M + source rank) next
to it in the owner's slot; the owner writes each row straight into its source's [T*K, H] receive
buffer at the row of its route (`put_rows_back`), barriers, and each source sums its K routes
locally (get_rows over a one-entry table of its own buffer, in the same fp32 order as the GET).

Cost removed: the copy of the received rows into scratch in each of the two phases, and the
remote half of the traffic moves as a PUT, the faster NVLink direction on two H200s (PUT kernel
81% of 450 GB/s, GET kernel 75%, GET phase with its copy 54%). Cost accepted: a [T*K, H] symmetric
receive buffer shared by the layers (in place of the [C, H] scratch, which this mode does not
allocate), a local read of T*K rows for the sum, 4 bytes per dispatch row, and one more kernel
launch per phase. Needs the same token count on every EP rank (the receive buffers are one
symmetric allocation), as Megatron's microbatches have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.moe.route_map import RouteMap


@dataclass(frozen=True)
class OwnRoutes:
    """A route map's routes as rows of the source's own receive buffer: route (t, k) is row
    t * K + k of rank 0 of a one-entry table; a route the dispatch did not deliver is dropped."""

    rank: torch.Tensor  # [T, K] int32: 0 where delivered, -1 where not
    row: torch.Tensor  # [T, K] int32: t * K + k


def own_routes(route: RouteMap, world: int, capacity: int) -> OwnRoutes:
    """The routes put_rows delivered (its mask: rank in [0, M), row in [0, capacity)) as own rows."""
    dest_rank, dest_row = route.dest_rank, route.dest_row
    delivered = (dest_rank >= 0) & (dest_rank < world) & (dest_row >= 0) & (dest_row < capacity)
    rows = torch.arange(dest_rank.numel(), dtype=torch.int32, device=dest_rank.device).view(dest_rank.shape)
    return OwnRoutes(torch.where(delivered, 0, -1).to(torch.int32), rows)
