"""The graph runner and layers that add weight gradients to Megatron DDP's main_grad themselves.

Layers that follow Megatron's gradient-accumulation-fusion contract (the grouped experts,
moe/expert_wgrad.py; Megatron's own linear layers) add a weight's gradient to `main_grad` inside
their backward and set `param.grad_added_to_main_grad`, so DDP's hook drops the placeholder
gradient instead of adding it. Under the graph runner:
- warm-up steps are not training steps: those layers add to a zeroed stand-in for main_grad
  (`main_grads_set_aside`), and DDP's main_grad is as before afterwards;
- a replayed backward runs no Python, so the flag is not set by the layer: DDP resets it every
  iteration (megatron-core 0.19.2, `DistributedDataParallel.zero_grad_buffer`), and its hook would
  add the placeholder. The runner learns at capture which parameters the captured backward
  flagged (`flagged_by`) and sets their flag after every replay.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


@contextlib.contextmanager
def main_grads_set_aside(params):
    """Inside, each parameter's `main_grad` is a zeroed tensor of its shape; the original after."""
    held = [(param, param.main_grad) for param in params if getattr(param, "main_grad", None) is not None]
    try:
        for param, main_grad in held:
            param.main_grad = torch.zeros_like(main_grad)
        yield
    finally:
        for param, main_grad in held:
            param.main_grad = main_grad


def flagged_by(params, backward: Callable[[], object]):
    """Run `backward()`; return its result and the parameters it set grad_added_to_main_grad on."""
    for param in params:
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = False
    result = backward()
    return result, [param for param in params if getattr(param, "grad_added_to_main_grad", False)]


def flag_added(params) -> None:
    """What the layers' backward would have done: their gradients are in main_grad already."""
    for param in params:
        param.grad_added_to_main_grad = True
