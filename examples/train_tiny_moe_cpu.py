"""The README's main job on a machine without a GPU: a tiny GPT-MoE on 2 CPU ranks.

Megatron-Core's GPTModel with megatron_ext's RowwiseMoELayer (reference transport, EP=2)
trains on synthetic data; every step prints loss, tokens/s, dropped routes, capacity fill
and the host synchronizations counted inside the MoE layers' forward.

    python examples/train_tiny_moe_cpu.py [--steps 30] [--ranks 2] [--capacity-factor 1.25 | --dropless]
    python examples/train_tiny_moe_cpu.py --megatron-baseline   # Megatron's own MoE layer
    python examples/train_tiny_moe_cpu.py --log-format megatron # Megatron's log lines (functional tests)
"""

import argparse
import functools
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.quiet import quiet_known_warnings  # noqa: E402

quiet_known_warnings()
from megatron_ext._cpu import apply_cpu_shims  # noqa: E402
from megatron_ext.config import MoEExtConfig  # noqa: E402
from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, run_on_ranks  # noqa: E402
from megatron_ext.moe import drop_notice  # noqa: E402
from megatron_ext.moe.overflow import CapacityExceeded  # noqa: E402
from megatron_ext.tiny_gpt import TinyGPTConfig, train  # noqa: E402


def print_step(record):
    fill = "n/a" if record["capacity_fill"] is None else f"{record['capacity_fill']:.2f}"
    print(f"step {record['step']:3d} | loss {record['loss']:.4f} | {record['tokens_per_s']:8.0f} tokens/s | "
          f"dropped routes {record['dropped_routes']:3d} | capacity fill {fill} | "
          f"MoE host syncs {record['moe_host_syncs']}", flush=True)
    if record["routes_per_expert"] is not None and record["step"] % 10 == 0:
        print(f"         routes per expert (summed over layers): {record['routes_per_expert']}", flush=True)


def print_step_megatron(steps, ranks, record):
    """One line per step in Megatron's training-log format (read by tests/functional_tests)."""
    elapsed_ms = 1000.0 * ranks * TinyGPTConfig().micro_batch * TinyGPTConfig().seq_len / record["tokens_per_s"]
    print(f" iteration {record['step']:8d}/{steps:8d} | elapsed time per iteration (ms): {elapsed_ms:.1f} | "
          f"lm loss: {record['loss']:.6E} | dropped routes: {record['dropped_routes']} | "
          f"MoE host syncs: {record['moe_host_syncs']} |", flush=True)


def parse_args():
    """Parsed and checked flags: a bad value exits with a usage error (code 2) before any rank starts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30,
                        help="training steps, >= 2 (the job checks that the loss falls)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo); EP equals this, so it must divide "
                                                             "the expert count")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="per-rank dispatch capacity = cf x tokens x top-k rows (rounded up to 16); > 0; "
                             "default 1.25")
    layer = parser.add_mutually_exclusive_group()
    layer.add_argument("--dropless", action="store_true", help="size the capacity for the worst case: no route dropped")
    layer.add_argument("--dropless-arena", action="store_true",
                       help="one budget of --capacity-factor x tokens x top-k rows per layer, shared by the MoE "
                            "layers of a microbatch (moe/arena.py); an overflow stops training with a message")
    layer.add_argument("--megatron-baseline", action="store_true", help="Megatron's alltoall MoE layer instead")
    parser.add_argument("--log-format", choices=("default", "megatron"), default="default",
                        help="megatron: Megatron's per-iteration log lines (lm loss: %%.6E), for functional tests")
    args = parser.parse_args()
    experts = TinyGPTConfig().experts
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the job checks that the loss falls after the first step), "
                     f"got {args.steps}")
    if args.ranks < 1 or experts % args.ranks:
        divisors = ", ".join(str(n) for n in range(1, experts + 1) if experts % n == 0)
        parser.error(f"--ranks must divide the tiny model's {experts} experts (EP equals --ranks), got {args.ranks}; "
                     f"use one of {divisors}")
    if args.megatron_baseline and args.capacity_factor is not None:
        parser.error("--capacity-factor sizes megatron_ext's dispatch buffers; --megatron-baseline runs Megatron's "
                     "dropless alltoall layer, which has none: drop one of them")
    if args.dropless and args.capacity_factor is not None:
        parser.error("--dropless sizes the dispatch buffers for the worst case, so --capacity-factor would do "
                     "nothing: drop one of them")
    if args.capacity_factor is None:
        args.capacity_factor = 1.25
    if not (math.isfinite(args.capacity_factor) and args.capacity_factor > 0):
        parser.error(f"--capacity-factor must be a finite number > 0, got {args.capacity_factor}; "
                     f"use e.g. 1.25, or --dropless to never drop routes")
    return args


# The overflow message names megatron_ext's launcher flags; this script's own do the same here.
OWN_FLAGS = (
    (re.compile(r"--moe-ext-arena-region-factor \(now [^;]*; at most the capacity factor\)"),
     "--capacity-factor (this script sets the arena's regions to min(1, --capacity-factor))"),
    (re.compile(r"--moe-ext-capacity-factor"), "--capacity-factor"),
    (re.compile(r", or --moe-ext-on-overflow drop to drop and count them"),
     ", or use --dropless (worst-case buffers: nothing dropped)"),
)


def in_this_scripts_flags(message: str) -> str:
    for flag, own in OWN_FLAGS:
        message = flag.sub(own, message)
    return message


def main():
    args = parse_args()
    apply_cpu_shims()
    log = print_step if args.log_format == "default" else functools.partial(print_step_megatron, args.steps, args.ranks)
    # The arena's regions are at most its budget: below a factor of 1 each layer's region is the budget.
    region = min(1.0, args.capacity_factor) if args.dropless_arena else 1.0
    ext = None if args.megatron_baseline else MoEExtConfig(
        transport="torch", capacity_factor=args.capacity_factor, dropless=args.dropless,
        dropless_arena=args.dropless_arena, arena_region_factor=region)
    sizing = "dropless" if args.dropless else f"cf {args.capacity_factor}"
    sizing += ", dropless arena" if args.dropless_arena else ""
    what = "Megatron alltoall MoELayer" if ext is None else f"megatron_ext RowwiseMoELayer (torch transport, {sizing})"
    print(f"tiny GPT-MoE, {args.ranks} CPU ranks, EP={args.ranks}, {what}", flush=True)
    if ext is not None and drop_notice.drops_beyond_capacity(ext, args.ranks):  # in this script's flags
        drop_notice.mark_given()
        print(f"routes beyond --capacity-factor {args.capacity_factor:g} x the balanced load are dropped and "
              f"counted below; --dropless-arena or --dropless drops none", flush=True)
    try:
        records = run_on_ranks(train, args.ranks, TinyGPTConfig(), ext, args.steps, log,
                               sizes=ParallelSizes(ep=args.ranks), timeout=1800)[0]
    except RankFailure as failure:  # the arena's overflow: its message, not every rank's traceback
        overflow = [line for line in str(failure).splitlines() if line.startswith(CapacityExceeded.__module__)]
        if not overflow:
            raise
        raise SystemExit(f"training stopped: {in_this_scripts_flags(overflow[-1].split(': ', 1)[1])}") from None
    tail = records[-3:]
    first, last = records[0]["loss"], sum(r["loss"] for r in tail) / len(tail)
    print(f"loss {first:.4f} -> {last:.4f} (mean of last {len(tail)} steps)", flush=True)
    if not last < first:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
