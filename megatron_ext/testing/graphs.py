"""Capture one experts step (forward+backward) in a CUDA graph for the tests that compare replay with eager."""

from __future__ import annotations

import torch

from megatron_ext.cuda_graphs.capture import capture


def capture_experts_step(module, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor,
                         grad_out: torch.Tensor, warmup: int = 3):
    """(graph, static output) of `module(x, counts, probs)` + backward(grad_out); x and probs are leaves
    that require grad. Warm-up runs on a side stream (kernels compiled, allocations settled); every
    leaf's .grad is None before each run, so the replay writes fresh gradients."""
    leaves = (x, probs, *module.parameters())

    def step():
        out, _ = module(x, counts, probs)
        out.backward(grad_out)
        return out

    def clear():
        for leaf in leaves:
            leaf.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    static_out = capture(graph, step)  # raises CaptureFailed on any host synchronization inside
    return graph, static_out


@torch.no_grad()
def refill(static_tensors, new_values) -> None:
    """Copy new inputs into a graph's static tensors, pairwise."""
    for static, value in zip(static_tensors, new_values):
        static.copy_(value)


def replay_with_new_inputs(module, first, second) -> torch.Tensor:
    """Capture an experts step on `first` = (x, probs, grad_out, counts), copy `second` (the same four)
    into those tensors and replay once. x and probs become leaves that require grad, so their .grad
    (and the module's parameters' .grad) hold the replay's gradients; returns the static output."""
    x, probs, grad_out, counts = first
    x.requires_grad_(True)
    probs.requires_grad_(True)
    graph, static_out = capture_experts_step(module, x, counts, probs, grad_out)
    refill(first, second)
    graph.replay()
    torch.cuda.synchronize()
    return static_out
