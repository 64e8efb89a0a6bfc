"""One experts forward+backward on fresh leaves, and the random rows, per-expert counts and
graph-replay inputs the expert tests feed it (tests/gpu/test_experts_gpu.py,
tests/gpu/test_expert_variants_gpu.py)."""

from __future__ import annotations

import torch


def expert_rows(rows: int, hidden: int, seed: int, dtype=torch.bfloat16, device="cuda"):
    """(x [rows, hidden], probs [rows] in (0.1, 1.1), grad_out [rows, hidden]) from one seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
    probs = torch.rand(rows, device=device, generator=gen) + 0.1
    grad_out = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
    return x, probs, grad_out


def expert_counts(experts: int, rows: int, seed: int, empty=(2,)) -> torch.Tensor:
    """Per-expert row counts (CPU int64) summing to `rows`, uneven, with the experts in `empty` at zero."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.2
    weights[list(empty)] = 0.0
    return torch.bincount(torch.multinomial(weights, rows, replacement=True, generator=gen), minlength=experts)


def replay_inputs(experts: int, hidden: int, capacity: int, device="cuda"):
    """The graph-capture tests' two steps on one capacity buffer: (x, probs, grad_out, counts) with
    3000 valid rows to capture with, then new rows, probabilities, gradient and 3500 valid rows (one
    more expert empty) to replay with."""
    first = (*expert_rows(capacity, hidden, seed=9, device=device),
             expert_counts(experts, 3000, seed=10).to(device))
    second = (*expert_rows(capacity, hidden, seed=12, device=device),
              expert_counts(experts, 3500, seed=11, empty=(5,)).to(device))
    return first, second


def experts_step(module, x, counts, probs, grad_out):
    """module(x, counts, probs) and its backward on fresh copies of x and probs that require grad,
    parameter grads cleared first: (output, x leaf, probs leaf); the leaves' .grad hold the result."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    out, bias = module(x, counts, probs)
    assert bias is None
    out.backward(grad_out)
    return out, x, probs
