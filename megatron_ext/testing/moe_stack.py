"""A stack of MoE layers, each fed the previous layer's output plus the tokens: the smallest model
whose MoE layers share one microbatch (the dropless arena's tests and benchmark, moe/arena.py)."""

from __future__ import annotations

import torch


def stack_forward(layers, x: torch.Tensor) -> torch.Tensor:
    hidden = x
    for layer in layers:
        hidden = layer(hidden)[0] + x
    return hidden


def stack_grads(layers) -> list[torch.Tensor]:
    """Every layer's router, fc1 and fc2 weight gradients, in layer order."""
    return [p.grad for layer in layers for p in (layer.router.weight, layer.experts.fc1_weight,
                                                 layer.experts.fc2_weight)]


def stack_step(layers, x: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """One forward+backward from fresh gradients: [output, input grad, *stack_grads]."""
    for layer in layers:
        for param in layer.parameters():
            param.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = stack_forward(layers, x)
    out.backward(grad_out)
    return [out.detach(), x.grad, *stack_grads(layers)]
