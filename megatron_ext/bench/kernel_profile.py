"""What one benchmark step ran, from torch.profiler: the top device kernels, the top host ops and
the host synchronizations (each named with the op that made it), per iteration, and where the
device sat idle between them. Tells where a step's time goes and whether it waits on the device."""

from __future__ import annotations

from typing import Callable

import torch

from megatron_ext.bench.measurement import synchronize

_ITERATION = "bench_iteration"  # the profiler range around each profiled call
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_kernels(fn: Callable[[], object], iters: int = 3, top: int = 10) -> dict:
    """What one iteration of `fn` ran: the top `top` device kernels by time, the top host ops
    by self CPU time, and the host synchronizations (cuda*Synchronize calls inside `fn`, each
    named with the innermost op that made it). Times are per iteration."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    fn()
    synchronize()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            with record_function(_ITERATION):
                fn()
        synchronize()
    events = [e for e in prof.events() if e.name != _ITERATION or e.device_type == DeviceType.CPU]
    iterations = [e.time_range for e in events if e.name == _ITERATION]
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and e.name != _ITERATION
                and any(r.start <= e.time_range.start <= r.end for r in iterations)]  # not the profiler's own
    kernels: dict[str, list[float]] = {}
    syncs: dict[str, int] = {}
    intervals = []
    for event in events:
        if event.device_type == DeviceType.CUDA:  # (the iteration's GPU-side annotation is dropped above)
            intervals.append((event.time_range.start, event.time_range.end, event.name))
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
        "device_timeline": device_gaps(intervals, iters=iters, top=top),
    }


def device_gaps(intervals: list[tuple[float, float, str]], iters: int, top: int = 10) -> dict:
    """Where the device sat idle while `iters` back-to-back iterations ran: the span from the
    first device activity's start to the last one's end, the time some activity ran (overlaps
    counted once), the idle rest, per iteration, and the `top` longest idle gaps named by the
    activities on either side. Input: (start_us, end_us, name) of every kernel, copy and fill.
    Idle time between dependent kernels is launch latency and, in an eager step, waiting for the
    host; it is what a step loses beyond its kernels' own time."""
    if not intervals:
        return {"span_ms_per_iter": 0.0, "busy_ms_per_iter": 0.0, "idle_ms_per_iter": 0.0,
                "gaps_per_iter": 0.0, "top_gaps": []}
    ordered = sorted(intervals)
    busy = 0.0
    gaps = []
    run_start, run_end, last_name = ordered[0]
    for start, end, name in ordered[1:]:
        if start > run_end:  # a gap: nothing ran between run_end and start
            busy += run_end - run_start
            gaps.append((start - run_end, last_name, name))
            run_start = start
        if end >= run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    span = run_end - ordered[0][0]
    gaps.sort(key=lambda gap: -gap[0])
    return {"span_ms_per_iter": span / 1e3 / iters, "busy_ms_per_iter": busy / 1e3 / iters,
            "idle_ms_per_iter": (span - busy) / 1e3 / iters, "gaps_per_iter": len(gaps) / iters,
            "top_gaps": [{"us": us, "after": ended, "before": started} for us, ended, started in gaps[:top]]}


def kernel_differences(first: dict, second: dict, top: int = 12) -> list[dict]:
    """Per kernel name, ms per iteration in two profile_kernels results (a kernel missing from one
    counts 0 there) and second - first, the largest absolute differences first. Profile with a
    `top` that lists every kernel, or the tail shows as missing."""
    def by_name(result):
        return {k["name"]: k["ms_per_iter"] for k in result["top_kernels"]}
    a, b = by_name(first), by_name(second)
    rows = [{"name": name, "first_ms": a.get(name, 0.0), "second_ms": b.get(name, 0.0),
             "difference_ms": b.get(name, 0.0) - a.get(name, 0.0)} for name in {**a, **b}]
    return sorted(rows, key=lambda row: (-abs(row["difference_ms"]), row["name"]))[:top]


def profile_pair(steps: dict[str, Callable[[], object]]) -> dict:
    """Two named steps under the profiler: each one's kernel time and device timeline (busy and
    idle time per step, its longest gaps) and the kernels whose time differs most, second - first."""
    if len(steps) != 2:
        raise ValueError(f"profile_pair compares two steps, got {len(steps)}: {sorted(steps)}")
    profiles = {name: profile_kernels(step, iters=5, top=1000) for name, step in steps.items()}
    first, second = profiles.values()
    timelines = {name: {k: v for k, v in p["device_timeline"].items() if k != "top_gaps"}
                 for name, p in profiles.items()}
    return {"kernel_ms_per_iter": {name: p["kernel_ms_per_iter"] for name, p in profiles.items()},
            "timeline": timelines, "top_gaps": {name: p["device_timeline"]["top_gaps"][:5]
                                                for name, p in profiles.items()},
            "kernel_differences": kernel_differences(first, second, top=15)}


def print_profile_pair(title: str, profile: dict) -> None:
    """profile_pair's result: a line per step (kernels, span, busy, idle), then the differences."""
    names = list(profile["timeline"])
    print(f"\nprofile {title} (ms per step):")
    for name, timeline in profile["timeline"].items():
        print(f"  {name:12s} kernels {profile['kernel_ms_per_iter'][name]:.3f}  span {timeline['span_ms_per_iter']:.3f}"
              f"  busy {timeline['busy_ms_per_iter']:.3f}  idle {timeline['idle_ms_per_iter']:.3f}")
    print(f"  {names[0][:12]:>12s} {names[1][:12]:>12s} {'difference':>11s}  kernel")
    for row in profile["kernel_differences"]:
        print(f"  {row['first_ms']:12.3f} {row['second_ms']:12.3f} {row['difference_ms']:+11.3f}  {row['name'][:90]}")


def _innermost_op(event, host_ops) -> str:
    """Name of the shortest non-runtime host op whose time range contains `event`."""
    start = event.time_range.start
    enclosing = [op for op in host_ops if op.time_range.start <= start <= op.time_range.end
                 and not op.name.startswith("cuda") and op is not event]
    if not enclosing:
        return "?"
    return min(enclosing, key=lambda op: op.time_range.elapsed_us()).name
