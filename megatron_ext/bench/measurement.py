"""How the benchmarks measure one step (seeds/003 measurement contract, BENCHMARKS.md).

`cuda_time_ms`: device time per iteration from CUDA events, after warm-up; `host_time_ms`:
Python submission time per iteration, no synchronization inside the timed region; on a machine
without CUDA both fall back to wall time so the CPU-capable tools can be smoke-run there.
`peak_memory`: the highest allocation during one call; `make_step`: the forward+backward a
layer benchmark times.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize() -> None:
    """Wait for the device (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median(values) -> float:
    return float(statistics.median(values))


def cuda_time_ms(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Per-iteration device time (ms) of `fn` after `warmup` calls.

    Events are recorded around each call without synchronizing in between, so a host-bound
    `fn` is charged its submission stalls, as it would be in training.
    """
    for _ in range(warmup):
        fn()
    synchronize()
    if not torch.cuda.is_available():
        return host_time_ms(fn, warmup=0, iters=iters)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def host_time_ms(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Per-iteration wall time (ms) of the Python call alone (submission, no sync inside);
    the device is synchronized between iterations, outside the timed region."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    synchronize()
    return times


def peak_memory(fn: Callable[[], object]) -> dict | None:
    """Peak device memory of one call of `fn`: absolute, and above what was allocated before
    the call (activations and workspaces). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_bytes": peak, "peak_above_baseline_bytes": peak - before}


def make_step(layer, x, grad_out):
    """One forward+backward of `layer` on its own copy of `x` (requires grad); parameter and input
    grads are reset to None first, so that a step does the layer's own work only."""
    params = list(layer.parameters())
    x = x.clone().requires_grad_(True)

    def step():
        x.grad = None
        for param in params:  # the layer's own work only: no gradient accumulation adds
            param.grad = None
        out, _ = layer(x)
        out.backward(grad_out)
        return out
    return step
