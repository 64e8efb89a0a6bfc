"""Static per-destination-rank capacity of the rowwise dispatch buffer (docs/design.md, "Route map").

The capacity is fixed before training so that every buffer, send block and kernel launch
has a shape known on the host: this removes the per-layer host wait for split sizes that
a variable-split all-to-all needs, and accepts that routes beyond the capacity are dropped
(unless `dropless`, which pays for the worst case in memory instead).
"""

from __future__ import annotations

import math

ROW_ALIGN = 16  # rows; keeps grouped-GEMM tiles and symmetric-buffer strides aligned


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def rank_capacity(max_tokens: int, topk: int, ep_size: int, capacity_factor: float,
                  dropless: bool) -> int:
    """Rows of the dispatch buffer on each destination rank (identical on all ranks).

    Non-dropless: round_up(ceil(capacity_factor * max_tokens * topk), 16). Under balanced
    routing a rank receives about max_tokens * topk rows whatever `ep_size` is, so the factor
    is the headroom for imbalance.
    Dropless: round_up(ep_size * max_tokens * topk, 16), the worst case where every source
    rank sends all its routes to one destination; nothing is ever dropped.
    A factor of `ep_size` or more is capped at the worst case: no rank can receive more rows, so
    such a capacity is dropless already (at EP=1 every factor >= 1 is), and the rows above it would
    only hold memory.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (the static number of tokens a rank holds in "
                         f"one microbatch), got {max_tokens}; pass seq_length * micro_batch_size "
                         f"divided by the tensor/context-parallel split")
    if topk < 1:
        raise ValueError(f"topk must be >= 1 (experts per token), got {topk}; set moe_router_topk")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1 (expert-model-parallel group size), got {ep_size}")
    if not capacity_factor > 0:  # also rejects NaN
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}; use e.g. 1.25, "
                         f"or set dropless=True to size for the worst case")
    worst_case = _round_up(ep_size * max_tokens * topk, ROW_ALIGN)
    if dropless or capacity_factor >= ep_size:  # the cap above (an infinite factor cannot reach ceil)
        return worst_case
    return min(_round_up(math.ceil(capacity_factor * max_tokens * topk), ROW_ALIGN), worst_case)
