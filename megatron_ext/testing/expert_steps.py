"""One experts forward+backward on fresh leaves, and the random rows the expert tests feed it
(tests/gpu/test_experts_gpu.py, tests/gpu/test_expert_variants_gpu.py)."""

from __future__ import annotations

import torch


def expert_rows(rows: int, hidden: int, seed: int, dtype=torch.bfloat16, device="cuda"):
    """(x [rows, hidden], probs [rows] in (0.1, 1.1), grad_out [rows, hidden]) from one seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
    probs = torch.rand(rows, device=device, generator=gen) + 0.1
    grad_out = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
    return x, probs, grad_out


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
