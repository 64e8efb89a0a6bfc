"""The README's main job on a machine without a GPU: a tiny GPT-MoE on 2 CPU ranks.

Megatron-Core's GPTModel with megatron_ext's RowwiseMoELayer (reference transport, EP=2)
trains on synthetic data; every step prints loss, tokens/s, dropped routes, capacity fill
and the host synchronizations counted inside the MoE layers' forward.

    python examples/train_tiny_moe_cpu.py [--steps 30] [--ranks 2] [--capacity-factor 1.25]
    python examples/train_tiny_moe_cpu.py --megatron-baseline   # Megatron's own MoE layer
    python examples/train_tiny_moe_cpu.py --log-format megatron # Megatron's log lines (functional tests)
"""

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext._cpu import apply_cpu_shims  # noqa: E402

apply_cpu_shims()

from megatron_ext.config import MoEExtConfig  # noqa: E402
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks  # noqa: E402
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo); EP equals this")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--megatron-baseline", action="store_true", help="Megatron's alltoall MoE layer instead")
    parser.add_argument("--log-format", choices=("default", "megatron"), default="default",
                        help="megatron: Megatron's per-iteration log lines (lm loss: %%.6E), for functional tests")
    args = parser.parse_args()
    log = print_step if args.log_format == "default" else functools.partial(print_step_megatron, args.steps, args.ranks)
    ext = None if args.megatron_baseline else MoEExtConfig(transport="torch", capacity_factor=args.capacity_factor)
    what = "Megatron alltoall MoELayer" if ext is None else f"megatron_ext RowwiseMoELayer (torch transport, cf {args.capacity_factor})"
    print(f"tiny GPT-MoE, {args.ranks} CPU ranks, EP={args.ranks}, {what}", flush=True)
    records = run_on_ranks(train, args.ranks, TinyGPTConfig(), ext, args.steps, log,
                           sizes=ParallelSizes(ep=args.ranks), timeout=1800)[0]
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / min(3, len(records))
    print(f"loss {first:.4f} -> {last:.4f} (mean of last 3 steps)", flush=True)
    if not last < first:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
