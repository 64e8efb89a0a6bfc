"""Bounded dropless (MoEExtConfig.on_overflow="error"): capacity from the capacity factor, no
worst-case buffers, and no route dropped silently.

Cost removed (against dropless=True): dispatch buffers and expert activations sized
cf * T_max * K rows per rank instead of EP * T_max * K (at EP=8, top-8, 16384 tokens, hidden 4096,
bf16: 1.3 GB instead of 8.6 GB per layer slot). Cost accepted: routes beyond the capacity are
still dropped by the fair policy in the step where they happen (the step cannot wait for the host
to learn it); the layer counts them on the device, in place (CUDA-graph safe), and
`OverflowGuard.check` (one host read, at logging steps: megatron_ext.training_hooks) stops
training with CapacityExceeded naming the layer, the overflow and the capacity factor that the
largest load seen would have needed. With `dropless_arena` the bound is one budget for the MoE layers
of a microbatch instead (moe/arena.py; docs/design.md, "Dropless arena"); its overflows are
counted and checked here the same way.
"""

from __future__ import annotations

import torch

from megatron_ext.moe.route_map import unpack_metrics


class CapacityExceeded(RuntimeError):
    """Routes overflowed a bounded-dropless layer's capacity (on_overflow='error')."""


class OverflowGuard:
    """Device-side counters of one layer: the route metrics summed over forwards (overflow = routes
    requested - routes kept, the same on every rank; forwards) and the most rows each rank was
    asked for. The route launch adds into them (moe/metric_sinks.MetricSinks); the arithmetic waits
    for `check`."""

    def __init__(self):
        self.sums: torch.Tensor | None = None  # RouteMetrics.packed summed, int64
        self.peak_demand: torch.Tensor | None = None  # [EP] int64, the most rows each rank was asked for

    def ensure(self, num_experts: int, ep_size: int, device) -> None:
        """The counters, zeroed, at the layer's first forward."""
        if self.sums is None:
            self.sums = torch.zeros(2 * num_experts + 4, dtype=torch.int64, device=device)
            self.peak_demand = torch.zeros(ep_size, dtype=torch.int64, device=device)

    def check(self, where: str, capacity: int, rows_at_cf_1: int, capacity_factor: float,
              arena_view: tuple[int, str] | None = None) -> None:
        """Raise CapacityExceeded if any route overflowed since the last check (reads the device).
        `arena_view`: the layer is in a dropless arena, where a rank can take at most this many rows
        in it however the budget was spent, and the flag that widens that view."""
        if self.sums is None:
            return
        totals, peak = unpack_metrics(self.sums.cpu()), int(self.peak_demand.max())
        overflowed, forwards = int(totals["requested"].sum() - totals["kept"].sum()), int(totals["steps"])
        self.sums.zero_()
        self.peak_demand.zero_()
        if overflowed == 0:
            return
        needed = peak / max(rows_at_cf_1, 1)
        if arena_view is not None:  # bounded by the layer's view and by what earlier layers left
            policy, (view_rows, widen) = "the dropless arena's overflow policy (error)", arena_view
            if peak > view_rows:
                remedy = (f"A rank can take at most {view_rows} rows in this layer however the budget was spent: "
                          f"raise {widen} (the largest load seen was {needed:.2f}x a layer's balanced rows), or")
            else:
                remedy = (f"Earlier layers' spill used the budget: raise --moe-ext-capacity-factor (now "
                          f"{capacity_factor}; the largest load seen was {needed:.2f}x a layer's balanced rows), or")
        else:
            policy, remedy = "on_overflow='error'", (
                f"Raise --moe-ext-capacity-factor (now {capacity_factor}; the largest load seen needs >= "
                f"{needed:.2f}), or use --moe-ext-dropless (worst-case buffers), or")
        raise CapacityExceeded(
            f"megatron_ext bounded dropless: {where} received more routes than its capacity of {capacity} rows per "
            f"rank: {overflowed} route(s) overflowed in the last {forwards} forward(s) (the busiest rank was asked "
            f"for {peak} rows), and {policy} forbids dropping them. {remedy} "
            f"--moe-ext-on-overflow drop to drop and count them")
