"""The fused route-map kernels equal the torch route map (Triton interpreter, in a subprocess)."""

import pytest
import torch

from tests.unit.interpreter import run_under_interpreter


def test_fused_route_map_equals_torch_route_map_under_interpreter():
    stdout = run_under_interpreter("_route_plan_interp.py")
    assert "all route-plan checks passed" in stdout
    assert "ok non-finite probabilities" in stdout
    assert "ok select against loops" in stdout  # over-full tokens, selected -Inf probabilities
    assert stdout.count("\nok ") >= 7  # every case ran


def test_plan_and_place_refuses_sinks_the_launch_would_write_out_of_bounds():
    """The route launch adds its metrics into the sinks with raw pointers: a running sum of the wrong
    dtype or length must be refused before the launch (on CPU too), not written past its end."""
    from megatron_ext.kernels.route_plan import plan_and_place
    from megatron_ext.moe.metric_sinks import MetricSinks

    routing_map = torch.zeros(4, 4, dtype=torch.bool)  # E = 4, two ranks: the sums must be [2E + 4] = [12]
    for running in (torch.zeros(12, dtype=torch.int32), torch.zeros(11, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"MetricSinks.running must be a contiguous int64 tensor of shape \(12,\)"):
            plan_and_place(routing_map, torch.zeros(1, 4, dtype=torch.int32), torch.zeros((), dtype=torch.int32),
                           torch.zeros(2, 4, dtype=torch.int32), 1, 8, 0, sinks=MetricSinks(running=running))


def test_select_routes_refuses_inputs_its_kernel_would_read_out_of_bounds():
    """The select kernel reads probs at the routing map's [T, E] offsets: probs of another shape, a
    top-k outside [1, E] or probs on another device must be refused before the launch (on CPU too)."""
    from megatron_ext.kernels.route_plan import select_routes

    routing_map = torch.zeros(6, 4, dtype=torch.bool)
    cases = [(torch.zeros(6, 2), 2, r"probs must have the routing map's shape \(6, 4\), got \(6, 2\)"),
             (torch.zeros(6, 4), 0, r"topk must be an int in \[1, 4\]"),
             (torch.zeros(6, 4), 5, r"topk must be an int in \[1, 4\]"),
             (torch.zeros(6, 4, device="meta"), 2, r"probs are on meta, the routing map on cpu")]
    for probs, topk, message in cases:
        with pytest.raises(ValueError, match=message):
            select_routes(routing_map, probs, topk)
    with pytest.raises(TypeError, match="probs must be floating point, got torch.int64"):
        select_routes(routing_map, torch.zeros(6, 4, dtype=torch.int64), 2)


def test_plan_and_place_refuses_histograms_and_counts_of_another_shape():
    """The route kernel sums the block histograms and reads the gathered counts by raw offsets:
    each of its tables in another shape or dtype is refused before the launch, saying what it must be."""
    from megatron_ext.kernels.route_plan import plan_and_place

    routing_map = torch.zeros(40, 4, dtype=torch.bool)  # 40 tokens: two blocks of 32
    hist, nonfinite, requested = (torch.zeros(2, 4, dtype=torch.int32), torch.zeros((), dtype=torch.int32),
                                  torch.zeros(2, 4, dtype=torch.int32))
    cases = [(dict(hist=torch.zeros(1, 4, dtype=torch.int32)), r"hist must be select_routes' int32 \[2, 4\]"),
             (dict(hist=torch.zeros(2, 4, dtype=torch.int64)), r"hist must be select_routes' int32 \[2, 4\]"),
             (dict(nonfinite=torch.zeros(2, dtype=torch.int32)), "nonfinite must be select_routes' int32 count"),
             (dict(requested_all=torch.zeros(2, 3, dtype=torch.int32)), r"integer \[M, 4\] counts"),
             (dict(requested_all=torch.zeros(2, 4)), r"integer \[M, 4\] counts"),
             (dict(dest_capacity=torch.ones(3, dtype=torch.int64)), r"dest_capacity must be integer rows .* \[2\]"),
             (dict(topk=5), r"topk must be an int in \[1, 4\]"),
             (dict(hist=torch.zeros(2, 4, dtype=torch.int32, device="meta")), "hist is on meta")]
    for change, message in cases:
        args = dict(hist=hist, nonfinite=nonfinite, requested_all=requested, topk=1, dest_capacity=None) | change
        with pytest.raises(ValueError, match=message):
            plan_and_place(routing_map, capacity=8, ep_rank=0, **args)
