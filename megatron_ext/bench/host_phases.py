"""Where an eager MoE layer step spends its host time: per forward phase and per backward node.

`bench_moe_layer --host-phases` reports, for one layer path:
  forward phases  host ms of MoELayer's route / preprocess / dispatch / routed_experts_compute /
                  combine / postprocess (perf_counter around each call, no profiler)
  backward        host ms of `backward()` as a whole, and the autograd nodes with the most CPU
                  time (torch.profiler, CPU only; the profiler adds ~1-2 us per op, so read the
                  node list as a ranking, the phase times as the figures)
  unit costs      host us of one small torch op, one Triton launch and a minimal autograd round
                  trip on this machine, to turn "N ops" into time
The device is synchronized between steps, outside the timed regions.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from megatron_ext.bench.measurement import median, synchronize

FORWARD_PHASES = ("route", "preprocess", "dispatch", "routed_experts_compute", "combine", "postprocess")


def forward_phase_ms(layer, x, grad_out, iters: int = 20) -> dict[str, float]:
    """Median host ms per forward phase, of the forward as a whole and of backward()."""
    samples: dict[str, list[float]] = defaultdict(list)
    current: dict[str, float] = {}

    def timed(name, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return call

    originals = {name: getattr(layer, name) for name in FORWARD_PHASES if hasattr(layer, name)}
    for name, method in originals.items():
        setattr(layer, name, timed(name, method))  # instance attributes shadow the class's methods
    x = x.clone().requires_grad_(True)
    try:
        for i in range(iters + 3):
            synchronize()
            current.clear()
            start = time.perf_counter()
            out, _ = layer(x)
            middle = time.perf_counter()
            out.backward(grad_out)
            end = time.perf_counter()
            if i >= 3:  # warm-up
                for name, ms in current.items():
                    samples[name].append(ms)
                samples["forward"].append((middle - start) * 1e3)
                samples["backward"].append((end - middle) * 1e3)
            x.grad = None
            for param in layer.parameters():
                param.grad = None
    finally:
        for name in originals:
            delattr(layer, name)
    synchronize()
    return {name: median(values) for name, values in samples.items()}


def backward_nodes(step, iters: int = 5, top: int = 25) -> list[dict]:
    """The autograd nodes (and other top-level backward ops) with the most CPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    step()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
    synchronize()
    rows = []
    for event in prof.key_averages():
        if event.key.startswith("autograd::engine::evaluate_function"):
            rows.append({"node": event.key.split(": ", 1)[-1], "calls": event.count / iters,
                         "cpu_us": event.cpu_time_total / iters})
    rows.sort(key=lambda row: -row["cpu_us"])
    return rows[:top]


def unit_costs_us(iters: int = 200) -> dict[str, float]:
    """Host us of: one small torch op, one Triton launch, and `Function.apply(leaf).sum().backward()`
    (one custom Function and one sum through the autograd engine, both ways)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(ptr):
        tl.store(ptr + tl.program_id(0), 1.0)

    small = torch.zeros(16, device="cuda")

    class _Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            return grad

    leaf = torch.zeros(16, device="cuda", requires_grad=True)

    def per_call(fn):
        for _ in range(10):
            fn()
        synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = time.perf_counter() - start
        synchronize()
        return elapsed / iters * 1e6

    return {"torch_op": per_call(lambda: small.add_(1)),
            "triton_launch": per_call(lambda: _touch[(1,)](small)),
            "function_sum_backward": per_call(lambda: _Identity.apply(leaf).sum().backward())}
