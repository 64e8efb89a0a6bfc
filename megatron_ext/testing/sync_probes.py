"""A step whose backward runs a given host-side action: what the sync proofs must catch there."""

from __future__ import annotations

from typing import Callable

import torch


def doubling_with_backward_action(x: torch.Tensor, action: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """2 * x, whose backward calls `action(grad)` (e.g. a host read or a stream synchronize)
    before returning 2 * grad: a sync inside a backward written in Python."""
    return _DoublingWithAction.apply(x, action)


class _DoublingWithAction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.action(grad)
        return grad * 2, None
