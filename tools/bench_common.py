"""Shared helpers for the tools/ benchmarks (seeds/003 measurement contract, BENCHMARKS.md).

Timing: `cuda_time_ms` (device time per iteration from CUDA events, after warm-up) and
`host_time_ms` (Python submission time per iteration, no synchronization inside the timed
region); on a machine without CUDA both fall back to wall time so the tools can be smoke-run
on CPU. Results: `write_result` stores JSON with `env_info` under bench/results/.
FLOPs: `moe_model_flops` counts useful-token expert FLOPs only (no capacity padding).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def _synchronize() -> None:
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
    _synchronize()
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
        _synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    _synchronize()
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


def profile_kernels(fn: Callable[[], object], iters: int = 3, top: int = 10) -> dict:
    """What one iteration of `fn` ran: the top `top` device kernels by time, the top host ops
    by self CPU time, and the host synchronizations (cuda*Synchronize calls inside `fn`, each
    named with the innermost op that made it). Times are per iteration."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    fn()
    _synchronize()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            with record_function(_ITERATION):
                fn()
        _synchronize()
    events = [e for e in prof.events() if e.name != _ITERATION or e.device_type == DeviceType.CPU]
    iterations = [e.time_range for e in events if e.name == _ITERATION]
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and e.name != _ITERATION
                and any(r.start <= e.time_range.start <= r.end for r in iterations)]  # not the profiler's own
    kernels: dict[str, list[float]] = {}
    syncs: dict[str, int] = {}
    for event in events:
        if event.device_type == DeviceType.CUDA:  # (the iteration's GPU-side annotation is dropped above)
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
        elif event.name in _SYNC_CALLS and event in host_ops:
            site = f"{event.name} in {_innermost_op(event, host_ops)}"
            syncs[site] = syncs.get(site, 0) + 1
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
    total = sum(ms for ms, _ in kernels.values())
    host_totals: dict[str, float] = {}
    for event in host_ops:
        host_totals[event.name] = host_totals.get(event.name, 0.0) + event.self_cpu_time_total / 1e3
    return {
        "kernel_ms_per_iter": total / iters,
        "top_kernels": [{"name": name, "ms_per_iter": ms / iters, "calls_per_iter": n / iters,
                         "share": ms / total if total else 0.0} for name, (ms, n) in ranked[:top]],
        "top_host_ops": [{"name": name, "self_cpu_ms_per_iter": ms / iters}
                         for name, ms in sorted(host_totals.items(), key=lambda item: -item[1])[:top]],
        "host_syncs_per_iter": sum(syncs.values()) / iters,
        "host_sync_sites": syncs,
    }


def _innermost_op(event, host_ops) -> str:
    """Name of the shortest non-runtime host op whose time range contains `event`."""
    start = event.time_range.start
    enclosing = [op for op in host_ops if op.time_range.start <= start <= op.time_range.end
                 and not op.name.startswith("cuda") and op is not event]
    if not enclosing:
        return "?"
    return min(enclosing, key=lambda op: op.time_range.elapsed_us()).name


_ITERATION = "bench_iteration"
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def moe_model_flops(tokens: int, topk: int, hidden: int, ffn: int, gated: bool = True,
                    backward: bool = True) -> int:
    """Useful-token FLOPs of the expert MLPs: tokens * topk routed rows through fc1 (H -> 2F
    gated, H -> F plain) and fc2 (F -> H); forward+backward is 3x the forward."""
    fc1_out = 2 * ffn if gated else ffn
    forward = 2 * tokens * topk * (hidden * fc1_out + ffn * hidden)
    return 3 * forward if backward else forward


def env_info() -> dict:
    """Device, library versions and date for a result file."""
    from importlib import metadata

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "triton": version("triton"),
        "megatron_core": version("megatron-core"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def write_result(name: str, payload: dict, results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """Write {"name", "env", "result": payload} to <results_dir>/<name>_<YYYYmmdd-HHMMSS>.json."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = results_dir / f"{name}_{stamp}.json"
    suffix = 1
    while path.exists():  # two results within one second
        path = results_dir / f"{name}_{stamp}-{suffix}.json"
        suffix += 1
    path.write_text(json.dumps({"name": name, "env": env_info(), "result": payload}, indent=2) + "\n")
    return path


def init_single_rank_megatron(seed: int = 1234) -> None:
    """One-rank torch.distributed (nccl on GPU, gloo on CPU) on a free TCP port, and Megatron's
    parallel_state with every size 1 plus model_parallel_cuda_manual_seed. Idempotent."""
    from megatron_ext.cpu_ranks import ParallelSizes, free_port, init_megatron_parallel

    if not torch.cuda.is_available():
        from megatron_ext._cpu import apply_cpu_shims

        apply_cpu_shims()
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        port = free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                             init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init_megatron_parallel(ParallelSizes(), seed=seed)
