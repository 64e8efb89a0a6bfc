"""Host submission of the eager rowwise layer step with its threads' CPU affinity changed in turns.

One process, one layer (`bench_moe_layer`'s rowwise_symm at the reference shape), rounds in which
every configuration is timed one after another (host submission and device time, medians of
`--iters` steps), so the lent host's drift is charged to all alike:

  free           every thread may run on every allowed core (the default)
  one_core       every thread of the process on one core
  main_autograd  the main thread and PyTorch's autograd thread on one core, the rest free: what
                 --moe-ext-pin-host-threads does (megatron_ext/host_affinity.py)

    python tools/bench_host_affinity.py [--rounds 7 --iters 20]
"""

from __future__ import annotations

import argparse
import os
import threading

from megatron_ext.bench.cli_types import positive_int
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.measurement import cuda_time_ms, host_time_ms, median
from megatron_ext.bench.reference_layer import rowwise_layer_step
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.host_affinity import host_core

CONFIGS = ("free", "one_core", "main_autograd")


def set_affinity(config: str, core: int, allowed: set[int], main_thread: int) -> None:
    """Apply `config` to every thread of this process (Linux: /proc/self/task)."""
    for entry in os.listdir("/proc/self/task"):
        thread = int(entry)
        with open(f"/proc/self/task/{entry}/comm") as comm:
            autograd = comm.read().startswith("pt_autograd")
        pinned = config == "one_core" or (config == "main_autograd" and (thread == main_thread or autograd))
        try:
            os.sched_setaffinity(thread, {core} if pinned else allowed)
        except OSError:  # the thread ended meanwhile
            pass


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=8192)
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--iters", type=positive_int, default=20)
    add_results_dir_arg(parser)
    args = parser.parse_args()
    require_cuda("tools/bench_host_affinity.py")
    step = rowwise_layer_step(args.tokens)
    allowed, core, main_thread = os.sched_getaffinity(0), host_core(), threading.get_native_id()
    host = {config: [] for config in CONFIGS}
    device = {config: [] for config in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            set_affinity(config, core, allowed, main_thread)
            host[config].append(median(host_time_ms(step, warmup=2, iters=args.iters)))
            device[config].append(median(cuda_time_ms(step, warmup=2, iters=args.iters)))
    set_affinity("free", core, allowed, main_thread)
    result = {}
    for config in CONFIGS:
        ratio = median([h / f for h, f in zip(host[config], host["free"])])
        result[config] = {"host_ms": host[config], "device_ms": device[config], "host_median_ms": median(host[config]),
                          "device_median_ms": median(device[config]), "host_ratio_to_free": ratio}
        print(f"{config:14s} host {median(host[config]):.3f} ms ({min(host[config]):.3f}..{max(host[config]):.3f}) "
              f"x{ratio:.3f} of free; device {median(device[config]):.3f} ms "
              f"({min(device[config]):.3f}..{max(device[config]):.3f})", flush=True)
    path = write_result("host_affinity", {"args": vars(args), "core": core, "allowed_cores": sorted(allowed),
                                          "configs": result}, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
