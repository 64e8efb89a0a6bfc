"""The fused route-map kernels equal the torch route map (Triton interpreter, in a subprocess)."""

import pytest
import torch

from tests.unit.interpreter import run_under_interpreter


def test_fused_route_map_equals_torch_route_map_under_interpreter():
    stdout = run_under_interpreter("_route_plan_interp.py")
    assert "all route-plan checks passed" in stdout
    assert "ok non-finite probabilities" in stdout
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
