"""Eager vs CUDA-graph replay of the rowwise MoE layer, small to large microbatches.

For each token count: layer step time (fwd+bwd, CUDA events, median of `--repeats` alternating
eager/graph measurements, each a median over `--iters` steps; the speedup's min..max printed),
the GPU's SM clock, power, share of time at the power cap and energy per step while each was
timed (nvidia-smi samples, bench/gpu_clocks.py), host submission time, and the memory the graph
slots and their pool add. Same weights and
inputs for both modes; by default as in training (inside Megatron's DDP, gradients into fp32
main_grad, input from a LayerNorm), `--grads autograd` for the layer alone with plain param.grad.

    python tools/bench_graphs.py [--tokens 1024,2048,4096,8192] [--slots 1] [--profile 8192]

`--profile N` also profiles both modes at N tokens (torch.profiler, after the timed repeats): the
kernels whose device time differs most between eager and graph, and each mode's device timeline
(busy and idle time per step), to show where a graph slower than eager loses its time.
"""

from __future__ import annotations

import argparse

import torch

from megatron_ext.bench.cli_types import list_of, positive_int
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.gpu_clocks import ClockSampler
from megatron_ext.bench.kernel_profile import print_profile_pair, profile_pair
from megatron_ext.bench.measurement import cuda_time_ms, held_after, host_time_ms, median
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.testing.megatron_moe import load_weights, megatron_ddp, moe_config
from megatron_ext.testing.reference import MoEWeights
from megatron_ext.testing.single_rank import init_single_rank_megatron


def layer_for(args, cuda_graphs: bool, weights):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder

    config = moe_config(hidden=args.hidden, ffn=args.ffn, experts=args.experts, topk=args.topk,
                        dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32")
    ext = MoEExtConfig(transport="symm", cuda_graphs=cuda_graphs, lease_slots=args.slots)
    layer = moe_builder(ext)(config=config).cuda()
    load_weights(layer, weights)
    return layer


def step_for(layer, tokens: int, hidden: int, grads: str):
    """One forward+backward on fixed inputs. grads="ddp": as in training, the layer inside Megatron's
    DDP (parameter gradients accumulate into fp32 main_grad) and fed by a LayerNorm (Megatron's
    pre-MLP norm), so its input gradient goes to another layer's backward, not into a leaf's .grad;
    "autograd": the layer alone, param.grad reset to None before each step."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 1, hidden, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    grad = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    params = list(layer.parameters())
    model, norm = layer, torch.nn.Identity()
    if grads == "ddp":
        model = megatron_ddp(layer)
        norm = torch.nn.LayerNorm(hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        out, _ = model(norm(x))
        out.backward(grad)
    return step


def first_step_resident_mib(step) -> float:
    """Memory left allocated by the first step (graphed: the capture, its slots and pool)."""
    return held_after(step)[1] / 2**20


def spread(values) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values), "repeats": len(values)}


def measure_pair(args, weights, tokens: int) -> dict:
    """Eager and graphed layers side by side; repeats alternate the two so drift hits both alike."""
    layers = {mode: layer_for(args, mode == "graph", weights) for mode in ("eager", "graph")}
    steps = {mode: step_for(layer, tokens, args.hidden, args.grads) for mode, layer in layers.items()}
    row = {"tokens": tokens, "graph_fallback": None}
    for mode, step in steps.items():
        row[mode] = {"resident_after_first_step_mib": first_step_resident_mib(step), "step_ms_runs": [],
                     "host_submit_ms_runs": [], "clocks_runs": []}
    row["graph_fallback"] = layers["graph"]._graph_runner.eager_reason
    for _ in range(args.repeats):
        for mode, step in steps.items():
            with ClockSampler(torch.cuda.current_device()) as clocks:
                row[mode]["step_ms_runs"].append(median(cuda_time_ms(step, warmup=3, iters=args.iters)))
            row[mode]["clocks_runs"].append(clocks.summary())
            row[mode]["host_submit_ms_runs"].append(median(host_time_ms(step, warmup=1, iters=args.iters)))
    for mode in steps:
        row[mode]["step_ms"] = median(row[mode]["step_ms_runs"])
        row[mode]["host_submit_ms"] = median(row[mode]["host_submit_ms_runs"])
        row[mode].update(clock_figures(row[mode]["clocks_runs"], row[mode]["step_ms"]))
    speedups = [e / g for e, g in zip(row["eager"]["step_ms_runs"], row["graph"]["step_ms_runs"])]
    row["step_speedup"] = median(speedups)
    row["step_speedup_spread"] = spread(speedups)
    if tokens == args.profile:
        row["profile"] = profile_pair(steps)
    del layers, steps
    torch.cuda.empty_cache()
    return row


def clock_figures(clocks_runs: list[dict], step_ms: float) -> dict:
    """Medians over a mode's timed runs of its SM clock, power and the share of samples at the
    board's power cap, and the energy of one step (power x step time). Where both modes sit at the
    cap, a step's time follows its energy: removing idle gaps (what a graph does) cannot shorten it."""
    def over_runs(key: str):
        values = [run[key] for run in clocks_runs if run["samples"] and key in run]
        return median(values) if values else None
    figures = {"sm_mhz": over_runs("sm_mhz_median"), "power_w": over_runs("power_w_median"),
               "power_capped_fraction": over_runs("power_capped_fraction"),
               "power_limit_w": over_runs("power_limit_w")}
    figures["energy_mj_per_step"] = None if figures["power_w"] is None else figures["power_w"] * step_ms
    return figures


def mhz(mode: dict) -> str:
    return "-" if mode["sm_mhz"] is None else f"{mode['sm_mhz']:.0f}"


def pair(row: dict, key: str, spec: str) -> str:
    return "/".join("-" if row[mode][key] is None else format(row[mode][key], spec) for mode in ("eager", "graph"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=list_of(positive_int, "token counts"), default=[1024, 2048, 4096, 8192])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--grads", choices=("ddp", "autograd"), default="ddp",
                        help="ddp: grads into Megatron DDP's fp32 main_grad, as in training; autograd: param.grad")
    parser.add_argument("--repeats", type=int, default=3, help="alternating eager/graph measurements per size")
    parser.add_argument("--profile", type=positive_int, default=None,
                        help="token count (one of --tokens) whose eager and graph steps are also profiled")
    add_results_dir_arg(parser)
    args = parser.parse_args()
    if args.profile is not None and args.profile not in args.tokens:
        parser.error(f"--profile {args.profile} must be one of --tokens {args.tokens}")
    require_cuda("tools/bench_graphs.py")
    init_single_rank_megatron()
    weights = MoEWeights.random(args.experts, args.hidden, args.ffn, seed=0, dtype=torch.bfloat16)
    rows = []
    for tokens in args.tokens:
        row = measure_pair(args, weights, tokens)
        row["host_reduction"] = row["eager"]["host_submit_ms"] / row["graph"]["host_submit_ms"]
        row["graph_extra_mib"] = (row["graph"]["resident_after_first_step_mib"]
                                  - row["eager"]["resident_after_first_step_mib"])
        rows.append(row)
        print(row, flush=True)
    print(f"\n{'tokens':>7s} {'eager ms':>9s} {'graph ms':>9s} {'speedup':>8s} {'eager host':>11s} "
          f"{'graph host':>11s} {'host cut':>9s} {'slot MiB':>9s} {'speedup min..max':>17s} {'SM MHz e/g':>11s}")
    for r in rows:
        lo, hi = r["step_speedup_spread"]["min"], r["step_speedup_spread"]["max"]
        print(f"{r['tokens']:7d} {r['eager']['step_ms']:9.2f} {r['graph']['step_ms']:9.2f} {r['step_speedup']:7.2f}x "
              f"{r['eager']['host_submit_ms']:11.2f} {r['graph']['host_submit_ms']:11.2f} {r['host_reduction']:8.1f}x "
              f"{r['graph_extra_mib']:9.0f} {lo:7.2f}..{hi:.2f}x {mhz(r['eager']):>5s}/{mhz(r['graph'])}")
    print(f"\n{'tokens':>7s} {'power W e/g':>13s} {'at power cap e/g':>17s} {'mJ per step e/g':>16s}  (limit W)")
    for r in rows:
        print(f"{r['tokens']:7d} {pair(r, 'power_w', '.0f'):>13s} {pair(r, 'power_capped_fraction', '.0%'):>17s} "
              f"{pair(r, 'energy_mj_per_step', '.2f'):>16s}  {r['eager']['power_limit_w'] or '-'}")
    for r in rows:
        if "profile" in r:
            print_profile_pair(f"at {r['tokens']} tokens", r["profile"])
    print("wrote", write_result("graphs", {"args": vars(args), "rows": rows}, args.results_dir))


if __name__ == "__main__":
    main()
