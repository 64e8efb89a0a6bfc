"""Where a training step's device time goes, from the Chrome trace that Megatron's own profiler
writes (`--profile --use-pytorch-profiler`: <tensorboard dir>/../torch_profile/rank-0.json.gz).

Per profiled step: the device span, busy and idle time (`kernel_profile.device_gaps`), and the
kernel time by what the kernel is (this package's Triton kernels, the experts' grouped GEMMs, other
GEMMs, attention's softmax, the optimizer, copies and fills, the rest), with the top kernels. It
answers one question a step time cannot: how much of a device-bound step is the MoE layer's."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from megatron_ext.bench.kernel_profile import device_gaps

_KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# (category, pattern) in order: the first that matches a kernel's name names it. Checked against
# an H100 trace of torch 2.11 (thirty-second session): `torch._grouped_mm` runs a CUTLASS kernel
# whose mangled name holds "GroupProblemShape"; cuBLAS's are "nvjet_*"; a copy inside a CUDA graph
# is a "memcpy128" kernel; NCCL's one-rank reduce is "...onerank_cu...oneRankReduce...". A name
# that misses lands in a broader kind, and the top kernels are listed by name either way.
_PATTERNS = (
    ("grouped GEMM (experts)", re.compile(r"grouped|GroupProblemShape", re.IGNORECASE)),
    ("GEMM (cuBLAS, CUTLASS)", re.compile(r"gemm|xmma|cutlass|nvjet|cublas", re.IGNORECASE)),
    ("softmax", re.compile(r"softmax", re.IGNORECASE)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.IGNORECASE)),
    ("NCCL", re.compile(r"nccl|onerank", re.IGNORECASE)),
    ("copies", re.compile(r"^memcpy\d*$")),
)


def package_kernel_names() -> frozenset[str]:
    """The names of this package's Triton kernels (`def <name>_kernel(` in megatron_ext/kernels):
    a traced Triton kernel carries its function's name."""
    names = set()
    for path in _KERNELS_DIR.glob("*.py"):
        names.update(re.findall(r"^\s*def (\w+_kernel)\(", path.read_text(), flags=re.MULTILINE))
    return frozenset(names)


def categorize(name: str, cat: str, ours: frozenset[str]) -> str:
    """What a device activity is, by its trace category and kernel name."""
    if cat == "gpu_memcpy":
        return "copies"
    if cat == "gpu_memset":
        return "fills"
    if name in ours:
        return "megatron_ext Triton kernels"
    for category, pattern in _PATTERNS:
        if pattern.search(name):
            return category
    return "other (elementwise, norms, reductions, loss)"


def load_trace(path: str | Path) -> list[dict]:
    """The trace's events (a .json or .json.gz Chrome trace, as torch.profiler exports it)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def count_steps(events: list[dict]) -> int:
    """How many steps the trace profiled: the distinct "ProfilerStep#N" names. A step has one range
    on the host ("user_annotation") and one per stream it ran on ("gpu_user_annotation"), so the
    ranges themselves over-count; the device's are preferred where present, since a step the host
    opened after the last kernel (the profiler stopping) has none."""
    ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    on_device = {e["name"] for e in ranges if e.get("cat") == "gpu_user_annotation"}
    return len(on_device or {e["name"] for e in ranges})


def summarize_trace(events: list[dict], top: int = 15) -> dict:
    """Per profiled step: device span, busy and idle time, kernel time by category and the top
    `top` kernels. Raises ValueError where the trace holds no step or no device activity (a
    profiler that never started, or CUDA activity not recorded)."""
    steps = count_steps(events)
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES]
    if not steps:
        raise ValueError("the trace has no ProfilerStep# ranges: was it written by a scheduled torch.profiler?")
    if not device:
        raise ValueError("the trace has no kernel, copy or fill events: CUDA activity was not recorded")
    ours = package_kernel_names()
    by_category: dict[str, float] = {}
    by_kernel: dict[str, list] = {}
    intervals = []
    for event in device:
        start, duration = float(event["ts"]), float(event.get("dur", 0.0))
        intervals.append((start, start + duration, event["name"]))
        category = categorize(event["name"], event["cat"], ours)
        by_category[category] = by_category.get(category, 0.0) + duration
        entry = by_kernel.setdefault(event["name"], [0.0, 0, category])
        entry[0] += duration
        entry[1] += 1
    total = sum(by_category.values())
    timeline = device_gaps(intervals, iters=steps, top=5)
    ranked = sorted(by_kernel.items(), key=lambda item: -item[1][0])
    return {
        "steps": steps,
        "device_ms_per_step": total / 1e3 / steps,
        "timeline": timeline,
        "categories": {name: {"ms_per_step": us / 1e3 / steps, "share": us / total}
                       for name, us in sorted(by_category.items(), key=lambda item: -item[1])},
        "top_kernels": [{"name": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": calls / steps,
                         "category": category} for name, (us, calls, category) in ranked[:top]],
    }


def busy_ratios(profiles: dict[str, dict], baseline: str = "megatron") -> dict[str, float]:
    """Per profiled variant, the baseline's device busy time per step over the variant's: its speed-up
    where both steps are bound by the device (a host fast enough to keep the GPU busy), which the
    timed ratio to a host-bound baseline is not. Empty without a usable baseline profile."""
    def busy(summary):
        return summary["timeline"]["busy_ms_per_iter"] if "timeline" in summary else None
    base = busy(profiles.get(baseline, {}))
    if not base:
        return {}
    return {name: base / busy(summary) for name, summary in profiles.items() if busy(summary)}


def print_trace_summary(title: str, summary: dict) -> None:
    timeline = summary["timeline"]
    print(f"\nprofile {title}, {summary['steps']} steps (ms per step): span {timeline['span_ms_per_iter']:.1f}, "
          f"busy {timeline['busy_ms_per_iter']:.1f}, idle {timeline['idle_ms_per_iter']:.1f}, "
          f"kernels {summary['device_ms_per_step']:.1f}")
    for name, entry in summary["categories"].items():
        print(f"  {entry['ms_per_step']:9.2f} {entry['share']:6.1%}  {name}")
    print("  top kernels:")
    for kernel in summary["top_kernels"]:
        print(f"  {kernel['ms_per_step']:9.2f} x{kernel['calls_per_step']:<5.0f} {kernel['category'][:18]:18s} "
              f"{kernel['name'][:80]}")
