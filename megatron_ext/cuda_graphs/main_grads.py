"""The graph runner and layers that add weight gradients to Megatron DDP's main_grad themselves.

Layers that follow Megatron's gradient-accumulation-fusion contract (the grouped experts,
moe/expert_wgrad.py; Megatron's own linear layers) add a weight's gradient to `main_grad` inside
their backward and set `param.grad_added_to_main_grad`, so DDP's hook drops the placeholder
gradient instead of adding it. Under the graph runner:
- warm-up steps are not training steps: those layers add to a stand-in for main_grad
  (`main_grads_set_aside`), and DDP's main_grad is as before afterwards;
- a captured backward writes main_grad at the address it had at capture: if DDP's gradient
  buffers are re-created later (`offload_grad_buffers` / `restore_grad_buffers`, a new DDP), the
  runner captures again (`main_grads_moved`);
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
    """Inside, each parameter's `main_grad` is a view of one scratch buffer per dtype (what the
    warm-up adds there is thrown away, so the views may share it: memory of the largest main_grad,
    not of all); the original after."""
    held = [(param, param.main_grad) for param in params if getattr(param, "main_grad", None) is not None]
    sizes: dict = {}
    for _, main_grad in held:
        key = (main_grad.dtype, main_grad.device)
        sizes[key] = max(sizes.get(key, 0), main_grad.numel())
    scratch = {key: torch.empty(numel, dtype=key[0], device=key[1]) for key, numel in sizes.items()}
    try:
        for param, main_grad in held:
            param.main_grad = scratch[(main_grad.dtype, main_grad.device)][:main_grad.numel()].view(main_grad.shape)
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


def main_grad_addresses(params) -> list[int]:
    """Where each parameter's main_grad lives (a captured backward writes there)."""
    return [param.main_grad.data_ptr() for param in params]


def main_grads_moved(params, addresses: list[int]) -> bool:
    """Whether any main_grad lives elsewhere than at capture (host-side check, no device work)."""
    return main_grad_addresses(params) != addresses
