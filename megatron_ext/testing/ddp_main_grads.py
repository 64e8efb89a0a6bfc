"""Megatron DDP's main_grad protocol on parameters without a DDP (CPU tests; Megatron's DDP
allocates its buffers on the GPU).

What megatron-core 0.19.2's DistributedDataParallel gives each parameter and does after autograd
accumulates a gradient (`_make_backward_post_hook`): a `main_grad` buffer, a
`grad_added_to_main_grad` flag, and a hook that adds `param.grad` to `main_grad` unless the flag
is set (or `zero_out_wgrad` is), then drops `param.grad`. tests/unit/test_expert_wgrad.py checks
that DDP's hook still reads like this.
"""

from __future__ import annotations

import torch


def attach_main_grads(params, dtype: torch.dtype = torch.float32) -> list:
    """Give each parameter a zeroed main_grad, the flag and DDP's hook; returns the hook handles."""
    handles = []
    for param in params:
        param.main_grad = torch.zeros(param.shape, dtype=dtype, device=param.device)
        param.grad_added_to_main_grad = False
        handles.append(param.register_post_accumulate_grad_hook(_add_to_main_grad))
    return handles


def _add_to_main_grad(param: torch.Tensor) -> None:
    if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
        param.main_grad.add_(param.grad.data)
    param.grad = None


def zero_main_grads(params) -> None:
    """DDP's zero_grad_buffer: main_grad zeroed and the flag reset, every iteration."""
    for param in params:
        param.main_grad.zero_()
        param.grad_added_to_main_grad = False
