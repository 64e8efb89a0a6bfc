"""The fused route-map kernels equal the torch route map (Triton interpreter, in a subprocess)."""

from tests.unit.interpreter import run_under_interpreter


def test_fused_route_map_equals_torch_route_map_under_interpreter():
    stdout = run_under_interpreter("_route_plan_interp.py")
    assert "all route-plan checks passed" in stdout
    assert "ok non-finite probabilities" in stdout
    assert stdout.count("\nok ") >= 7  # every case ran
