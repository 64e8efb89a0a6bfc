"""End-to-end training step time: Megatron's MoE layer vs megatron_ext's on the same job.

Trains one functional-test case (default gpt/moe_rowwise_1gpu: a small GPT-MoE on one GPU
through `python -m megatron_ext.launch examples/pretrain_gpt.py`, mock data) once per variant,
same seed, data and model, `--repeats` times with the variants interleaved, and reports the
median over the repeats of each run's median iteration time over the steady steps (with the
min..max over the repeats), the peak memory and the loss over the last steps. Against
Megatron: the median over rounds of the per-round ratio (the repeats are rounds, the variants
interleaved in each), with its min..max. Unlike the layer benchmarks, the variants are separate
training processes timed by Megatron's iteration time (host wall time per step); Megatron's layer
and megatron_ext's build and initialize their weights differently, so their losses and routes
differ. Variants (flags appended to the case's):

  megatron          Megatron's own layer: --spec megatron.training.models.gpt default_layer_spec
                    (alltoall dispatcher + SequentialMLP without Transformer Engine), dropless
  ext_experts       Megatron's alltoall dispatcher + megatron_ext's grouped experts
  rowwise           megatron_ext's rowwise layer as the case configures it (capacity factor)
  rowwise_megatron_router  the same with Megatron's own top-k routing (--moe-ext-no-fused-router)
  rowwise_dropless  the same, capacity sized so nothing is dropped (same work as Megatron's)
  rowwise_bounded   bounded dropless: the case's capacity factor as the bound, an overflow stops the
                    run with CapacityExceeded at a logging step (--moe-ext-on-overflow error)
  rowwise_pinned    rowwise with its host threads kept on one CPU core (--moe-ext-pin-host-threads)
  rowwise_ddp_buckets  rowwise with Megatron's DDP bucket groups launched in one fixed order
                    (--moe-ext-ddp-buckets)
  rowwise_wgrad_add rowwise with the experts' weight gradients added to main_grad by DDP, not in
                    their GEMM (--moe-ext-no-expert-wgrad-fusion)
  rowwise_graphs    the rowwise layer captured in CUDA graphs (--moe-ext-cuda-graphs)
  rowwise_layer_graphs  whole transformer layers (attention and the rowwise MoE layer) captured by
                    Megatron's own runner (--cuda-graph-impl local)
  rowwise_layer_graphs_wgrad_add  the same with DDP adding the experts' weight gradients

    python tools/bench_training.py [--variants megatron,rowwise] [--train-iters 30]

--profile-steps START:END then trains each variant once more under Megatron's own profiler
(`--profile --use-pytorch-profiler`, steps START..END-1; that run is not timed) and reports where
its device time goes per step: busy and idle time, kernel time by kind, the top kernels
(`megatron_ext/bench/trace_summary.py`), and Megatron's busy time per step over each variant's:
the speed-up where both steps are device-bound, which the timed ratio to Megatron's host-bound
step is not.

Result JSON under bench/results/ (training_<time>.json); ratios are against `megatron`.
Leave Megatron's timers at their default level for step-time comparisons: at
--timing-log-level 2 they synchronize the device around each microbatch's forward and backward.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.functional.case_config import FunctionalCase
from megatron_ext.bench.functional.compare import values_by_step
from megatron_ext.bench.functional.training import TrainingFailed, train_variant
from megatron_ext.bench.results import add_results_dir_arg, new_result_path, write_result
from megatron_ext.bench.trace_summary import busy_ratios, load_trace, print_trace_summary, summarize_trace

VARIANTS = {
    "megatron": ["--spec", "megatron.training.models.gpt", "default_layer_spec"],
    "ext_experts": ["--moe-ext-dispatcher", "megatron", "--moe-ext-transport", "auto"],
    "rowwise": [],
    "rowwise_megatron_router": ["--moe-ext-no-fused-router"],
    "rowwise_dropless": ["--moe-ext-dropless"],
    "rowwise_bounded": ["--moe-ext-on-overflow", "error"],
    "rowwise_pinned": ["--moe-ext-pin-host-threads"],
    "rowwise_ddp_buckets": ["--moe-ext-ddp-buckets"],
    "rowwise_wgrad_add": ["--moe-ext-no-expert-wgrad-fusion"],
    "rowwise_graphs": ["--moe-ext-cuda-graphs"],
    "rowwise_layer_graphs": ["--cuda-graph-impl", "local"],
    "rowwise_layer_graphs_wgrad_add": ["--cuda-graph-impl", "local", "--moe-ext-no-expert-wgrad-fusion"],
}
METRICS = ["lm loss", "iteration-time", "mem-max-allocated-bytes"]


def summarize(values: dict, warmup: int, window: int) -> dict:
    """Median iteration time after `warmup` steps, peak memory, mean loss over the last `window` steps."""
    times = values_by_step(values["iteration-time"])
    loss = values_by_step(values["lm loss"])
    steady = [times[s] for s in sorted(times) if s > warmup]
    if not steady:
        raise ValueError(f"no iteration after the {warmup} warm-up steps was logged")
    memory = values.get("mem-max-allocated-bytes")
    return {"iteration_time_s": statistics.median(steady), "steady_steps": len(steady),
            "max_allocated_gib": max(values_by_step(memory).values()) / 2**30 if memory else None,
            "final_loss": statistics.fmean(loss[s] for s in sorted(loss)[-window:])}


def combine_runs(runs: list[dict]) -> dict:
    """Median iteration time over the repeats (each already a median over steady steps), its spread,
    and the last run's memory and loss; failed if any run failed."""
    failed = [r["failed"] for r in runs if "failed" in r]
    if failed:
        return {"failed": failed[0], "runs": runs}
    times = [r["iteration_time_s"] for r in runs]
    return {"iteration_time_s": statistics.median(times), "iteration_time_min_s": min(times),
            "iteration_time_max_s": max(times), "repeats": len(runs),
            "max_allocated_gib": runs[-1]["max_allocated_gib"], "final_loss": runs[-1]["final_loss"], "runs": runs}


def per_round_speedup(base_runs: list[dict], runs: list[dict]) -> dict | None:
    """Megatron's step time over the variant's, round by round (the variants run interleaved, so
    round i of each shares the machine's state): the median of those ratios and their min..max.
    None until a round has both."""
    ratios = [b["iteration_time_s"] / r["iteration_time_s"] for b, r in zip(base_runs, runs)
              if "iteration_time_s" in b and "iteration_time_s" in r]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def profile_steps(text: str) -> tuple[int, int]:
    """START:END of --profile-steps: Megatron profiles steps START..END-1 (START >= 1)."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END (two integers), got {text!r}") from None
    if not 1 <= start < end:
        raise argparse.ArgumentTypeError(f"expected 1 <= START < END, got {start}:{end}")
    return start, end


def profile_variant(case: FunctionalCase, name: str, options, output_dir: str) -> dict:
    """Train `name` once under Megatron's profiler over --profile-steps and summarize its trace
    (Megatron writes it beside the TensorBoard folder: <dir>/torch_profile/rank-0.json.gz)."""
    start, end = options.profile_steps
    folder = os.path.join(output_dir, f"{name}_profile")
    flags = ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end",
             str(end), "--tensorboard-dir", os.path.join(folder, "tensorboard")]
    try:
        train_variant(case, [*VARIANTS[name], "--train-iters", str(end + 1), *shlex.split(options.extra_args),
                             *flags], output_dir, f"{name}_profile", ["lm loss"])
        return summarize_trace(load_trace(os.path.join(folder, "torch_profile", "rank-0.json.gz")))
    except (TrainingFailed, OSError, ValueError) as error:
        return {"failed": f"{type(error).__name__}: {str(error).splitlines()[0]}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="gpt/moe_rowwise_1gpu")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the time median")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (interleaved); median and spread; "
                        "0 with --profile-steps: the profiled runs only")
    parser.add_argument("--output-dir", help="training logs (default: a new temporary folder)")
    parser.add_argument("--extra-args", default="", help="flags appended to every variant, as one string; give a "
                        "single flag with '=' (--extra-args=--moe-ext-ddp-buckets), which argparse would otherwise "
                        "read as an option of this tool. Note: Megatron's "
                        "--timing-log-level 2 synchronizes the device around every microbatch's forward and "
                        "backward, which removes host/device overlap and slows eager variants more than graphed ones")
    parser.add_argument("--profile-steps", type=profile_steps, metavar="START:END",
                        help="after the timed runs, train each variant once more under Megatron's profiler "
                        "over steps START..END-1 and report its device time by kind of kernel")
    add_results_dir_arg(parser)
    options = parser.parse_args(argv)
    names = [name.strip() for name in options.variants.split(",") if name.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if options.train_iters <= options.warmup:
        parser.error(f"--train-iters {options.train_iters} must exceed --warmup {options.warmup}")
    if options.repeats < 0 or (options.repeats == 0 and not options.profile_steps):
        parser.error(f"--repeats {options.repeats}: give at least 1 timed run, or 0 with --profile-steps")
    require_cuda("tools/bench_training.py")

    case = FunctionalCase.load(options.case)
    output_dir = options.output_dir or tempfile.mkdtemp(prefix="bench_training_")
    os.makedirs(output_dir, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    path = new_result_path("training", options.results_dir)

    profiles: dict[str, dict] = {}

    def save(complete: bool) -> dict:
        """Rewrite the result file after every run: a run cut short keeps what it measured."""
        results = {name: combine_runs(name_runs) for name, name_runs in runs.items() if name_runs}
        base = results.get("megatron", {}).get("iteration_time_s")
        for name, result in results.items():
            if base and "iteration_time_s" in result:
                spread = per_round_speedup(runs["megatron"], runs[name])
                result["speedup_vs_megatron"] = spread["median"] if spread else None  # median of per-round ratios
                result["speedup_vs_megatron_rounds"] = spread
                result["speedup_ratio_of_medians"] = base / result["iteration_time_s"]
        write_result("training", {"case": case.name, "train_iters": options.train_iters,
                                  "warmup": options.warmup, "repeats": options.repeats, "complete": complete,
                                  "variants": {n: VARIANTS[n] for n in names},
                                  "extra_args": options.extra_args, "results": results,
                                  "profile_steps": options.profile_steps, "profiles": profiles}, path=path)
        return results

    for repeat in range(options.repeats):  # variants interleaved, so machine drift hits all alike
        for name in names:
            print(f"== {name} (run {repeat + 1}/{options.repeats}): "
                  f"{' '.join(VARIANTS[name]) or '(the case as configured)'}", flush=True)
            try:
                values = train_variant(case, [*VARIANTS[name], "--train-iters", str(options.train_iters),
                                              *shlex.split(options.extra_args)],
                                       output_dir, f"{name}_{repeat}", METRICS)
                runs[name].append(summarize(values, options.warmup, window=5))
            except TrainingFailed as error:  # report it and go on with the other variants
                runs[name].append({"failed": str(error).splitlines()[0]})
            except (KeyError, ValueError) as error:  # trained, but its log lacks a metric or steady steps
                runs[name].append({"failed": f"no summary from the log: {type(error).__name__}: {error}"})
            print(f"   {runs[name][-1]}", flush=True)
            save(complete=False)
    profiled = names if options.profile_steps else []  # one more, untimed run each under Megatron's profiler
    for name in profiled:
        print(f"== {name} (profiled run, not timed)", flush=True)
        profiles[name] = profile_variant(case, name, options, output_dir)
        if "failed" in profiles[name]:
            print(f"   FAILED: {profiles[name]['failed']}", flush=True)
        else:
            print_trace_summary(name, profiles[name])
        save(complete=False)
    results = save(complete=True)
    print("vs megatron: the median over rounds of Megatron's step time over the variant's in the same round, "
          "with its min..max; each variant is a separate training process (its own initialization and host "
          "wall time), not the same routes in one process")
    print(f"{'variant':<18} {'iter ms':>9} {'min..max ms':>15} {'vs megatron (min..max)':>24} {'max GiB':>8} "
          f"{'loss':>8}")
    for name, result in results.items():
        if "failed" in result:
            print(f"{name:<18} FAILED: {result['failed']}")
            continue
        rounds = result.get("speedup_vs_megatron_rounds")
        memory = result["max_allocated_gib"]
        spread = f"{result['iteration_time_min_s'] * 1e3:.0f}..{result['iteration_time_max_s'] * 1e3:.0f}"
        ratio = f"{rounds['median']:.2f}x ({rounds['min']:.2f}..{rounds['max']:.2f})" if rounds else "-"
        print(f"{name:<18} {result['iteration_time_s'] * 1e3:>9.1f} {spread:>15} {ratio:>24} "
              f"{memory if memory is None else round(memory, 2)!s:>8} {result['final_loss']:>8.4f}")
    ratios = busy_ratios(profiles)
    if ratios:
        print("device-bound: Megatron's device busy ms per profiled step over the variant's (the speed-up where a "
              "host keeps both GPUs busy): " + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()))
    print(f"result: {path}")
    return 1 if any("failed" in r for r in (*results.values(), *profiles.values())) else 0


if __name__ == "__main__":
    sys.exit(main())
