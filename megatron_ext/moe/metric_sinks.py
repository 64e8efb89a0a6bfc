"""Where one forward's route metrics are added on the device (RouteMetrics.packed's layout).

The layer keeps running sums for `read_metrics` while it trains, and under on_overflow='error'
its OverflowGuard keeps its own (reset at each check) with the most rows each rank was asked
for. The fused route launch adds into them itself (kernels/route_plan.py): cost removed, up to
four small launches per layer step (the sums' adds, the per-rank demand and its running max),
~50 us of host time each inside the step. The torch form of the route map calls `add`.

A forward run inside the backward is an activation recompute (Megatron's full-layer or `moe`
recompute, reentrant or not): its routes were counted by the forward it repeats, so it adds
nothing (`recomputing`). The eager steps Megatron's own CUDA graphs run before their capture
(`--cuda-graph-impl local`) are no training steps either: they add into scratch sinks of the same
shapes (`in_megatron_graph_warmup`), so they compile and run the kernels the capture records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.cuda_graphs import is_graph_warmup


def recomputing() -> bool:
    """True while autograd runs a backward on this thread: a forward there recomputes one whose
    metrics were already added. Torch internal (torch.utils.checkpoint reads it the same way):
    `torch._C._current_graph_task_id`, -1 outside a backward; checked by
    tests/unit/test_metric_sinks.py, torch 2.11-2.13."""
    return torch._C._current_graph_task_id() != -1


def in_megatron_graph_warmup() -> bool:
    """True during the eager forward and backward steps Megatron's CudaGraphManager runs before it
    captures a layer (megatron-core 0.19.2: `transformer.cuda_graphs.is_graph_warmup`, set around
    the warm-up loop of `_CudaGraphRunner.create_fwd_graph`; checked by tests/unit/test_metric_sinks.py).
    Imported once, not per forward: every training forward asks."""
    return is_graph_warmup()


@dataclass(frozen=True)
class MetricSinks:
    running: torch.Tensor | None = None  # int64 [2E + 4], the layer's sums while it trains
    overflow: torch.Tensor | None = None  # int64 [2E + 4], the overflow guard's sums
    peak_demand: torch.Tensor | None = None  # int64 [EP], the most rows each rank was asked for (with `overflow`)

    def add(self, metrics, ep_size: int) -> None:
        """The torch form of what the fused route launch does with `metrics` (RouteMetrics)."""
        for sums in (self.running, self.overflow):
            if sums is not None:
                sums.add_(metrics.packed)
        if self.peak_demand is not None:
            demand = metrics.requested_per_expert.view(ep_size, -1).sum(1)  # rows each rank was asked for
            torch.maximum(self.peak_demand, demand, out=self.peak_demand)

    def check(self, num_experts: int, ep_size: int, device) -> None:
        """Refuse sinks the route launch would write out of bounds (or not at all)."""
        wants = [(self.running, 2 * num_experts + 4, "running"), (self.overflow, 2 * num_experts + 4, "overflow"),
                 (self.peak_demand, ep_size, "peak_demand")]
        for sums, size, name in wants:
            if sums is not None and (sums.dtype != torch.int64 or tuple(sums.shape) != (size,)
                                     or not sums.is_contiguous() or sums.device != device):
                raise ValueError(f"MetricSinks.{name} must be a contiguous int64 tensor of shape ({size},) on "
                                 f"{device} ({num_experts} experts, {ep_size} EP ranks); got {sums.dtype} "
                                 f"{tuple(sums.shape)} on {sums.device}")
        if (self.overflow is None) != (self.peak_demand is None):
            raise ValueError("MetricSinks: the overflow sums and peak_demand go together (on_overflow='error')")

    def scratch(self) -> "MetricSinks":
        """Sinks of the same shapes whose sums nobody reads (a warm-up's)."""
        fresh = {name: None if value is None else torch.zeros_like(value) for name, value in vars(self).items()}
        return MetricSinks(**fresh)
