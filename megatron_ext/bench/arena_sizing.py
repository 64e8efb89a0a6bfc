"""What each way of sizing dispatch buffers would have needed for the rows ranks were asked for
(issue 20; docs/design.md, "Route map"). Pure functions of a demand record
`asked[steps, layers, ranks]` (rows each rank was asked for in each MoE layer of a microbatch,
before any capacity), in units of `balanced` rows (T * K, one layer's rows under even routing):

- per-layer bound (bounded dropless today): every layer sized for the largest demand of any layer;
- one budget for the microbatch's layers (a fully shared arena, which torch._grouped_mm's fixed
  start row rules out);
- regions and spill (the way around it): layer i gets a region of P rows at a fixed start and
  may run on into region i + 1; its rows past P are copied to a spill arena after its forward
  and back before its backward; the last layer's run-on needs a tail region of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RegionSpill:
    region_factor: float  # P / balanced
    total_factor: float  # (layers * P + spill arena + tail) / (layers * balanced)
    spill_arena_factor: float  # spill arena rows / balanced
    tail_factor: float  # tail region rows / balanced
    copied_fraction: float  # rows copied out (and back) / rows asked for, over the record
    fits: bool  # every layer's run-on stayed within the next region (demand <= 2 P)


def per_layer_bound(asked: torch.Tensor, balanced: int) -> float:
    """Capacity factor a bound per layer needs: the largest single demand."""
    return float(asked.max()) / balanced


def one_budget(asked: torch.Tensor, balanced: int) -> float:
    """Capacity factor one budget shared by all layers of a microbatch needs (per layer)."""
    return float(asked.sum(1).max()) / (balanced * asked.shape[1])


def region_spill(asked: torch.Tensor, balanced: int, region_factor: float) -> RegionSpill:
    """Rows the regions-and-spill scheme needs with regions of `region_factor * balanced` rows."""
    asked = asked.double()
    layers = asked.shape[1]
    region = region_factor * balanced
    run_on = (asked - region).clamp_min(0)  # [steps, layers, ranks]
    spilled = run_on[:, :-1]  # the last layer's run-on stays in the tail
    spill_arena = float(spilled.sum(1).max()) if layers > 1 else 0.0
    tail = float(run_on[:, -1].max())
    total = layers * region + spill_arena + tail
    return RegionSpill(region_factor, total / (layers * balanced), spill_arena / balanced, tail / balanced,
                       float(spilled.sum() / asked.sum()), bool((spilled <= region).all()))


def shared_area(asked: torch.Tensor, balanced: int, region_factor: float) -> RegionSpill:
    """Regions and spill as moe/arena.py builds it: one shared area holds the spills of the layers
    before the last and, growing from its other end, the last layer's run-on (no tail region of its
    own), so it needs the largest sum of all layers' run-ons (reported as `spill_arena_factor`)."""
    asked = asked.double()
    layers = asked.shape[1]
    region = region_factor * balanced
    run_on = (asked - region).clamp_min(0)  # [steps, layers, ranks]
    shared = float(run_on.sum(1).max())
    total = layers * region + shared
    return RegionSpill(region_factor, total / (layers * balanced), shared / balanced, 0.0,
                       float(run_on[:, :-1].sum() / asked.sum()), bool((run_on[:, :-1] <= region).all()))


def best_region_spill(asked: torch.Tensor, balanced: int, factors=None, scheme=region_spill) -> RegionSpill:
    """The region size (from `factors`, default 0.70..1.50 in steps of 0.05) with the fewest rows
    in all, among those whose run-on always fits the next region; `scheme`: region_spill or
    shared_area."""
    factors = factors or [0.70 + 0.05 * i for i in range(17)]
    options = [scheme(asked, balanced, f) for f in factors]
    fitting = [o for o in options if o.fits] or options
    return min(fitting, key=lambda o: (o.total_factor, o.copied_fraction))
