"""The benchmarks' memory probe counts what a forward holds for its backward and nothing else."""

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

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.zeros(1 << 14, device="cuda")
        self.step_buffer = torch.empty(4096, device="cuda")  # releases the previous step's
        scaled = x * self.weight  # mul saves x and the weight: both allocated before the call
        return scaled.sin(), None  # sin saves `scaled`


def test_held_for_backward_counts_saved_tensors_and_output_only():
    layer = _LayerWithState(256)
    x, grad = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    layer.weight.grad = callers = torch.full_like(layer.weight, 3.0)
    want = 2 * x.numel() * x.element_size()  # `scaled` and the output
    assert [held_for_backward(layer, x, grad) for _ in range(3)] == [want] * 3
    assert layer.weight.grad is callers and torch.equal(callers, torch.full_like(callers, 3.0))
