"""End-to-end loss with BF16 vs MXFP8 dispatch payloads on the same training job.

Runs a functional-test case's training (default gpt/moe_rowwise_1gpu: 50 steps of a small
GPT-MoE through `python -m megatron_ext.launch examples/pretrain_gpt.py`) twice, once as
configured (BF16 rows) and once with `--moe-ext-mxfp8-dispatch`, same seed and data, and
compares the per-step lm loss. MXFP8 rounds each expert input to E4M3 with one power-of-two
scale per 32 values, so the curves may differ slightly; a numerical divergence may not: the
tool exits 1 when the loss over the last `--window` steps differs by more than
`--max-rel-diff` (relative, mean over the window) or any loss is not finite.

    python tools/mxfp8_loss_curve.py [--case gpt/moe_rowwise_1gpu] [--bf16-values values_1st.json]

`--bf16-values` reuses the metrics JSON of a run that already trained the case as configured
(the functional runner writes it as values_1st.json) instead of training BF16 again.
Result JSON (both curves, differences, iteration time, memory) goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.functional.case_config import FunctionalCase
from megatron_ext.bench.functional.compare import values_by_step
from megatron_ext.bench.functional.training import train_variant
from megatron_ext.bench.results import add_results_dir_arg, write_result

METRICS = ["lm loss", "iteration-time", "mem-max-allocated-bytes"]


def series(values: dict, metric: str) -> dict[int, float]:
    """{step: value} of one metric ({} when the run did not log it)."""
    return values_by_step(values[metric]) if metric in values else {}


def compare(bf16: dict, mxfp8: dict, window: int, warmup: int = 10) -> dict:
    """Per-step loss differences and the summary the verdict uses; iteration time is the median
    over the steps after `warmup` (as in tools/bench_training.py)."""
    loss_bf16, loss_mxfp8 = series(bf16, "lm loss"), series(mxfp8, "lm loss")
    steps = sorted(set(loss_bf16) & set(loss_mxfp8))
    if not steps:
        raise SystemExit("no common lm-loss steps between the two runs; check the logs")
    tail = steps[-window:]
    mean_bf16 = statistics.fmean(loss_bf16[s] for s in tail)
    mean_mxfp8 = statistics.fmean(loss_mxfp8[s] for s in tail)

    def steady(metric: str, values: dict) -> float | None:
        points = series(values, metric)
        kept = [points[s] for s in sorted(points) if s > warmup]
        return statistics.median(kept) if kept else None

    return {
        "steps": steps,
        "loss_bf16": [loss_bf16[s] for s in steps],
        "loss_mxfp8": [loss_mxfp8[s] for s in steps],
        "max_abs_diff": max(abs(loss_bf16[s] - loss_mxfp8[s]) for s in steps),
        "window": [tail[0], tail[-1]],
        "window_mean_bf16": mean_bf16,
        "window_mean_mxfp8": mean_mxfp8,
        "window_rel_diff": abs(mean_mxfp8 - mean_bf16) / abs(mean_bf16),
        "all_finite": all(math.isfinite(v) for v in [*loss_bf16.values(), *loss_mxfp8.values()]),
        "loss_fell": loss_mxfp8[steps[-1]] < loss_mxfp8[steps[0]] and loss_bf16[steps[-1]] < loss_bf16[steps[0]],
        "iteration_time_s": {"bf16": steady("iteration-time", bf16), "mxfp8": steady("iteration-time", mxfp8)},
        "max_allocated_bytes": {"bf16": max(series(bf16, "mem-max-allocated-bytes").values(), default=None),
                                "mxfp8": max(series(mxfp8, "mem-max-allocated-bytes").values(), default=None)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="gpt/moe_rowwise_1gpu")
    parser.add_argument("--bf16-values", help="metrics JSON of a BF16 run of the same case (skips that run)")
    parser.add_argument("--output-dir", help="training logs (default: a new temporary folder)")
    parser.add_argument("--window", type=int, default=10, help="last steps averaged for the verdict")
    parser.add_argument("--max-rel-diff", type=float, default=0.02)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the iteration-time median")
    add_results_dir_arg(parser)
    options = parser.parse_args(argv)
    require_cuda("tools/mxfp8_loss_curve.py")

    case = FunctionalCase.load(options.case)
    output_dir = options.output_dir or tempfile.mkdtemp(prefix="mxfp8_loss_")
    os.makedirs(output_dir, exist_ok=True)
    if options.bf16_values:
        with open(options.bf16_values) as handle:
            bf16 = json.load(handle)
    else:
        bf16 = train_variant(case, [], output_dir, "bf16", METRICS)
    mxfp8 = train_variant(case, ["--moe-ext-mxfp8-dispatch"], output_dir, "mxfp8", METRICS)
    result = {"case": case.name, **compare(bf16, mxfp8, options.window, options.warmup),
              "max_rel_diff_allowed": options.max_rel_diff}
    path = write_result("mxfp8_loss", result, options.results_dir)

    print(f"{'step':>5} {'bf16':>10} {'mxfp8':>10} {'diff':>10}")
    for step, a, b in zip(result["steps"], result["loss_bf16"], result["loss_mxfp8"]):
        print(f"{step:>5} {a:>10.5f} {b:>10.5f} {b - a:>+10.5f}")
    print(f"last {options.window} steps: bf16 {result['window_mean_bf16']:.5f}, "
          f"mxfp8 {result['window_mean_mxfp8']:.5f} "
          f"(relative difference {result['window_rel_diff']:.4%}); max |diff| {result['max_abs_diff']:.5f}; "
          f"iteration time {result['iteration_time_s']}; result: {path}")
    ok = result["all_finite"] and result["window_rel_diff"] <= options.max_rel_diff
    print("PASS" if ok else "FAIL: losses not finite or MXFP8 diverges from BF16 beyond the allowed difference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
