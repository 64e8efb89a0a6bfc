"""return_transfer="put": results go back to their routes by PUT, not GET (docs/design.md, "Transfers").

Two phases bring rows back to the tokens that sent them: the combine forward (expert outputs)
and the dispatch backward (the rows' gradients and probability gradients). With the default GET,
at EP > 1 each first copies the owner's rows into symmetric scratch (torch._grouped_mm writes a
fresh tensor that peers cannot address), barriers, then every source reads its routes' rows from
the owners. Here the dispatch PUT also leaves each row's return id (route * M + source rank) next
to it in the owner's slot; the owner writes each row straight into its source's [T_max*K, H] receive
buffer at the row of its route (`put_rows_back`), barriers, and each source sums its K routes
locally (get_rows over a one-entry table of its own buffer, in the same fp32 order as the GET).

Cost removed: the copy of the received rows into scratch in each of the two phases, and the
remote half of the traffic moves as a PUT, the faster NVLink direction on two H200s (PUT kernel
81% of 450 GB/s, GET kernel 75%, GET phase with its copy 54%). Cost accepted: a [T_max*K, H]
symmetric receive buffer shared by the layers (in place of the [C, H] scratch, which this mode
does not allocate), a local read of T*K rows for the sum, 4 bytes per dispatch row, and one more
kernel launch per phase. The buffer is sized from T_max (one symmetric allocation, the same on
every rank), so ranks may hold different token counts in a microbatch, as with the GET.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.kernels.row_transfer import get_rows
from megatron_ext.moe.buffers import SymmetricBuffer, SymmetricHeap, rows_with_values
from megatron_ext.moe.route_map import RouteMap


@dataclass(frozen=True)
class ReceiveBuffer:
    """A source's [T*K, H] receive buffer and [T*K] fp32 values (one symmetric allocation, shared by
    the layers), with one-entry tables of this rank's own rows and values for the local sum."""

    buffer: SymmetricBuffer
    own_rows: torch.Tensor  # [1] int64: the address of this rank's rows
    own_values: torch.Tensor  # [1] int64: the address of this rank's values


def receive_buffer(heap: SymmetricHeap, routes: int, rows_like: torch.Tensor) -> ReceiveBuffer:
    """Allocate (collective, first forward) the receive buffer for `routes` = T*K rows like `rows_like`."""
    buffer = rows_with_values(heap, routes, rows_like.shape[1], rows_like.dtype, rows_like.device,
                              scratch_role="returned_rows")
    own = torch.tensor([buffer.local.data_ptr(), buffer.values.data_ptr()], dtype=torch.int64, device=rows_like.device)
    return ReceiveBuffer(buffer, own[:1], own[1:])


def sum_returned(receive: ReceiveBuffer, route: RouteMap, world: int, capacity: int, with_values: bool):
    """Each token's routes summed from this rank's receive buffer in fp32, k in order (as the GET
    sums them): ([T, H], [T, K] fp32 values or None). A route the dispatch did not deliver adds 0
    and gets value 0, read from the route map inside the kernel (get_rows' own_rows_of)."""
    num_tokens, topk = route.dest_rank.shape
    local = receive.buffer.local
    out = torch.empty(num_tokens, local.shape[1], dtype=local.dtype, device=local.device)
    values_out = torch.empty(num_tokens, topk, dtype=torch.float32, device=local.device) if with_values else None
    get_rows(receive.own_rows, route.dest_rank, route.dest_row, out,
             value_table=receive.own_values if with_values else None, values_out=values_out, capacity=capacity,
             own_rows_of=world)
    return out, values_out
