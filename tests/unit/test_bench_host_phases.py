"""megatron_ext/bench/host_phases.py on a toy layer and a simulated clock: the warm-up steps are
left out, a phase called twice in a step is charged both calls, times are milliseconds, and the
backward nodes are counted per step."""

import types

import pytest
import torch

from megatron_ext.bench import host_phases
from megatron_ext.bench.host_phases import backward_nodes, forward_phase_ms

_clock = [0.0]  # a simulated perf_counter (seconds): the figures stay exact on a loaded CI machine


@pytest.fixture(autouse=True)
def simulated_clock(monkeypatch):
    monkeypatch.setattr(host_phases, "time", types.SimpleNamespace(perf_counter=lambda: _clock[0]))


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _clock[0] += 0.007  # 7 ms
        return grad * 2


class _ToyLayer(torch.nn.Module):
    """route 1 ms, dispatch called twice at 2 ms each, combine 3 ms, 0.5 ms of its own; every phase
    costs 100 ms in the first three steps (cold caches that the warm-up must absorb)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.steps = 0

    def _spend(self, ms):
        _clock[0] += (100.0 if self.steps < 3 else ms) / 1e3

    def route(self, x):
        self._spend(1.0)
        return x

    def dispatch(self, x):
        self._spend(2.0)
        return x

    def combine(self, x):
        self._spend(3.0)
        return x

    def forward(self, x):
        _clock[0] += 0.0005
        out = self.combine(self.dispatch(self.dispatch(self.route(x * self.weight))))
        self.steps += 1
        return _SlowBackward.apply(out), None


def test_phase_times_leave_out_the_warm_up_and_sum_repeated_calls():
    layer = _ToyLayer()
    x, grad_out = torch.ones(3, 4), torch.ones(3, 4)
    phases = forward_phase_ms(layer, x, grad_out, iters=2)  # fewer timed steps than warm-up ones
    assert layer.steps == 3 + 2  # three warm-up steps, then the timed ones
    # forward: 1 + 2 x 2 + 3 + 0.5 of its own = 8.5 ms
    assert phases == pytest.approx({"route": 1.0, "dispatch": 4.0, "combine": 3.0, "forward": 8.5,
                                    "backward": 7.0})
    assert not {"route", "dispatch", "combine"} & set(vars(layer)), "the timing wrappers must be removed"


def test_backward_nodes_count_calls_per_step():
    """A Function applied once per step shows as one call of its backward node per step (the
    profiled steps' count divided by `iters`; the untimed first step is not profiled)."""
    leaf = torch.ones(4, requires_grad=True)

    def step():
        _SlowBackward.apply(leaf).sum().backward()

    rows = {row["node"]: row for row in backward_nodes(step, iters=3)}
    assert rows["_SlowBackwardBackward"]["calls"] == 1.0, rows
    assert rows["_SlowBackwardBackward"]["cpu_us"] >= 0.0
