"""The benchmarks' memory probe counts what a forward holds for its backward and nothing else."""

import gc

import pytest
import torch

from megatron_ext.bench.measurement import held_for_backward

pytestmark = pytest.mark.gpu


class _LayerWithState(torch.nn.Module):
    """Saves one [N, W] fp32 tensor for its backward and returns another; besides, it makes a cache
    on first use and keeps a step buffer until its next forward, as the MoE layer's route plan does."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width, device="cuda"))
        self.cache = None
        self.step_buffer = None
        self.collect_in_backward = False  # as Python's cycle collector may, at any allocation

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.zeros(1 << 14, device="cuda")
        self.step_buffer = torch.empty(4096, device="cuda")  # releases the previous step's
        scaled = x * self.weight  # mul saves x and the weight: both allocated before the call
        if self.collect_in_backward:
            scaled.register_hook(lambda grad: gc.collect() and None)
        return scaled.sin(), None  # sin saves `scaled`


def test_held_for_backward_counts_saved_tensors_and_output_only():
    layer = _LayerWithState(256)
    x, grad = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    layer.weight.grad = callers = torch.full_like(layer.weight, 3.0)
    want = 2 * x.numel() * x.element_size()  # `scaled` and the output
    assert [held_for_backward(layer, x, grad) for _ in range(3)] == [want] * 3
    assert layer.weight.grad is callers and torch.equal(callers, torch.full_like(callers, 3.0))


class _Cycle:
    """Garbage only the cycle collector frees."""

    def __init__(self, nbytes: int):
        self.me = self
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def test_a_dead_layer_collected_mid_step_is_not_counted():
    """Memory a dead object held, freed by the collector during the measured backward, would count
    as held by the forward (800 MB did so in a GPU test run after other tests' layers)."""
    layer = _LayerWithState(256)
    x, grad = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    want = 2 * x.numel() * x.element_size()
    assert held_for_backward(layer, x, grad) == want
    _Cycle(64 << 20)  # unreachable at once, freed only by a collection
    layer.collect_in_backward = True
    assert held_for_backward(layer, x, grad) == want
