"""How the benchmarks measure one step (seeds/003 measurement contract, BENCHMARKS.md).

`cuda_time_ms`: device time per iteration from CUDA events, after warm-up; `host_time_ms`:
Python submission time per iteration, no synchronization inside the timed region; on a machine
without CUDA both fall back to wall time so the CPU-capable tools can be smoke-run there.
`interleaved_ms`: host or device time of several steps in turns (an A/B that drift cannot bias);
`peak_memory`: the highest allocation during one call; `make_step`: the forward+backward a
layer benchmark times. Memory readings hold Python's cycle collector off (`collector_held_off`).
"""

from __future__ import annotations

import contextlib
import gc
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


def interleaved_ms(steps: dict[str, Callable[[], object]], rounds: int, iters: int,
                   timer: Callable = host_time_ms) -> dict[str, dict]:
    """Several steps timed in turns: each round times every step (`timer`, median of `iters`)
    one after another, so a machine whose speed drifts (lent hosts do, by tens of percent within
    minutes; a GPU's clocks follow its temperature) charges the drift to every step alike.
    `timer`: host_time_ms (submission) or cuda_time_ms (device). Returns per step: the median
    over rounds, min..max, and the median over rounds of its ratio to the first step of the
    same round (the A/B figure) with that ratio's min..max over the rounds, and each round's time
    (`round_ms`, for ratios to another step: `ratio_in_rounds`; print them with `ratio_text`)."""
    if rounds < 1 or iters < 1:
        raise ValueError(f"rounds and iters must be >= 1, got {rounds} and {iters}")
    names = list(steps)
    per_round = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            per_round[name].append(median(timer(steps[name], warmup=1, iters=iters)))
    first = per_round[names[0]]
    result = {}
    for name, times in per_round.items():
        ratios = [t / f for t, f in zip(times, first)]
        result[name] = {"median_ms": median(times), "min_ms": min(times), "max_ms": max(times), "rounds": rounds,
                        "round_ms": list(times),
                        f"ratio_to_{names[0]}": median(ratios), f"ratio_min_to_{names[0]}": min(ratios),
                        f"ratio_max_to_{names[0]}": max(ratios)}
    return result


def ratio_in_rounds(result: dict, name: str, base: str) -> dict:
    """`name`'s time over `base`'s in each round of an interleaved_ms result: the median of the
    per-round ratios and their min..max (not the ratio of the two medians)."""
    ratios = [t / b for t, b in zip(result[name]["round_ms"], result[base]["round_ms"])]
    return {"ratio": median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def ratio_text(result: dict, name: str, base: str) -> str:
    """`name` against `base` in an interleaved_ms result, as printed: 'x1.033 (0.990..1.050)', the
    median of the per-round ratios and their min..max."""
    figures = ratio_in_rounds(result, name, base)
    return f"x{figures['ratio']:.3f} ({figures['min']:.3f}..{figures['max']:.3f})"


@contextlib.contextmanager
def collector_held_off():
    """Python's cycle collector run first, then held off: a dead layer (modules hold reference
    cycles) freed in the middle of a memory reading would count against the measured one (a GPU
    test saw 800 MB appear that way after other tests' layers)."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def peak_memory(fn: Callable[[], object]) -> dict | None:
    """Peak device memory of one call of `fn`: absolute, and above what was allocated before
    the call (activations and workspaces). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    with collector_held_off():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    return {"peak_bytes": peak, "peak_above_baseline_bytes": peak - before}


def held_after(fn: Callable[[], object]) -> tuple[object, int]:
    """(fn(), device bytes allocated from before the call to after it): what its result holds,
    e.g. a forward's output with the autograd graph and everything saved for the backward."""
    with collector_held_off():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.memory_allocated() - before


def held_for_backward(layer, x, grad_out) -> int:
    """Device bytes one forward of `layer` holds for its backward, its output included: allocated
    while the output is alive, less what stays allocated once the backward has run and the output
    and gradients are dropped. So a cache the forward creates on first use, or a previous step's
    buffer it releases when it makes its own, does not count; the caller's parameter gradients are
    left as they were."""
    params = [p for p in layer.parameters() if p.requires_grad]
    callers_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    x = x.clone().requires_grad_(True)
    with collector_held_off():
        # Read after the sync, not before: on the H200 a read ahead of it counted differently (the
        # recompute GPU test failed with it there; likely the collector, held off since).
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out, _ = layer(x)
        torch.cuda.synchronize()
        alive = torch.cuda.memory_allocated() - before
        out.backward(grad_out)
        del out
        x.grad = None
        for p, grad in zip(params, callers_grads):
            p.grad = grad
        torch.cuda.synchronize()
        return alive - (torch.cuda.memory_allocated() - before)


GRADS = ("param", "ddp")  # how make_step receives the parameters' gradients


def make_step(layer, x, grad_out, grads: str = "param"):
    """One forward+backward of `layer` on its own copy of `x` (requires grad).

    grads="param": parameter and input grads are reset to None first, so that a step does the
    layer's own work only and each weight gradient lands in `param.grad`. grads="ddp": every
    parameter of the layer gets Megatron DDP's main_grad protocol (an fp32 `main_grad`, the
    `grad_added_to_main_grad` flag and DDP's add hook: megatron_ext.testing.ddp_main_grads); the
    grouped experts then add their weight gradients into main_grad inside their GEMM (the fused
    path training runs), and other parameters' gradients are added by the hook. main_grad
    accumulates over the steps as over the microbatches of one iteration (as in bench_graphs):
    DDP zeroes it once per iteration, a fill of the whole fp32 buffer (0.49 ms per step at the
    reference shape on an H100) that a layer step is not charged."""
    if grads not in GRADS:
        raise ValueError(f"grads must be one of {GRADS}, got {grads!r}")
    params = list(layer.parameters())
    x = x.clone().requires_grad_(True)
    if grads == "ddp":
        from megatron_ext.testing.ddp_main_grads import attach_main_grads

        attach_main_grads(params)

    def step():
        x.grad = None
        if grads == "param":
            for param in params:  # the layer's own work only: no gradient accumulation adds
                param.grad = None
        out, _ = layer(x)
        out.backward(grad_out)
        return out
    return step


def dense_gemm_step(flops: float, hidden: int, calls: int = 1):
    """(step, its FLOPs): `calls` square-ish bf16 matmuls [m, H] @ [H, H] doing `flops` in all."""
    n = hidden
    m = max(256, int(flops / calls / (2 * n * n)))
    a = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def step():
        for _ in range(calls):
            a @ b
    return step, 2 * m * n * n * calls
