"""Steps that must not count: the graph runner's eager warm-up and its capture run the layer, and
neither may add to what training logs or to what the step's end consumes (`metrics_untouched`).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def metrics_untouched(layer):
    """Run steps whose metrics must not count: Megatron's MoE metrics tracker (the logged
    load-balancing loss, per layer), the layer's own routing metrics and the layer's buffers are
    as before afterwards. Entries first created inside stay (so a later capture records into
    tensors that already exist) but hold zero. The buffers are what a forward accumulates for the
    step's end: the router's tokens per expert for the expert-bias update, the global aux loss's
    counts and steps, quantile balancing's sums (Megatron's own graph runner zeroes them after
    capture, finalize_model_grads.reset_model_temporary_tensors). Megatron internals:
    MoEMetricsTracker.metrics[name].values (transformer/moe/moe_logging.py, megatron-core 0.19.2);
    tests/unit/test_graph_runner_metrics.py fails if they move."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    saved = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
    saved_own = {name: counter.clone() for name, counter in _layer_counters(layer).items()}
    buffers = list(layer.buffers()) if isinstance(layer, torch.nn.Module) else []
    saved_buffers = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        for name, entry in tracker.metrics.items():
            if name in saved:
                entry.values.copy_(saved[name])
            else:
                entry.values.zero_()
        for name, counter in _layer_counters(layer).items():
            if name in saved_own:
                counter.copy_(saved_own[name])
            else:
                counter.zero_()
        for buffer, saved_buffer in zip(buffers, saved_buffers):
            buffer.copy_(saved_buffer)


def _layer_counters(layer) -> dict[str, torch.Tensor]:
    """The layer's own device counters a step adds to: its routing metrics and, under
    on_overflow='error', the overflow guard's (whose next check would count warm-up forwards)."""
    guard = getattr(layer, "_overflow", None)
    counters = {"metrics": getattr(layer, "_metrics", None), "overflow_sums": getattr(guard, "sums", None),
                "overflow_peak_demand": getattr(guard, "peak_demand", None)}
    return {name: counter for name, counter in counters.items() if counter is not None}
