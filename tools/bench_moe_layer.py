"""MoE layer forward+backward on one GPU: Megatron's paths against megatron_ext's, same inputs.

Paths (same router weights, expert weights, tokens and output gradients):
  megatron_alltoall        Megatron MoELayer, local spec (SequentialMLP), alltoall dispatcher
  megatron_alltoall_gg     Megatron's alltoall dispatcher with DeviceOffsetGroupedMLP experts
  rowwise_torch            RowwiseMoELayer, reference all_to_all transport
  rowwise_symm             RowwiseMoELayer, symmetric-memory Triton transport
  rowwise_symm_megatron_router  rowwise_symm with Megatron's own routing (fused_router=False)
  rowwise_symm_graph       rowwise_symm captured in one CUDA graph (forward+backward), replayed
  rowwise_symm_cublas_router        rowwise_symm with the router's gating GEMMs in cuBLAS
                           (router_gemms="cublas"; the other rowwise paths run them in the routing kernels)
  rowwise_symm_cublas_router_graph  that path captured in one CUDA graph
  rowwise_symm_mxfp8       rowwise_symm with MXFP8 dispatch payloads (quantize, PUT, dequantize)
  rowwise_symm_mxfp8_graph rowwise_symm_mxfp8 captured in one CUDA graph (no host submission cost)
  rowwise_symm_moe_act     rowwise_symm under Megatron's --recompute-modules moe_act (the experts
                           keep no activation for the backward)
Reported per path: median fwd+bwd ms (CUDA events, after warm-up), model TFLOP/s (useful
tokens only), peak memory above baseline, bytes a forward leaves held for its backward, blocking
CUDA calls per step (profiler), host
submission ms per layer step, and the measured dense bf16 GEMM rate for the same FLOPs.
Host submission drifts with the lent host; `--host-ab rowwise_symm,rowwise_symm_megatron_router
--host-rounds 5` also times the named paths in turns, all alive at once, and reports each one's
ratio to the first path (the figure to compare host changes by); `--device-ab` does the same for
device time, so eager and graphed are compared on the same clocks, with dense GEMMs of the
step's FLOPs timed first in every round as the reference of their share of the dense rate.
`--host-census rowwise_symm` times the layer's own functions inside the step (an op costs several
times more there than in a loop).
`--grads param` (the default, and every result before this option) hands the weight gradients to
`param.grad`; `--grads ddp` gives every parameter Megatron DDP's main_grad protocol, so the
grouped experts add theirs into fp32 main_grad inside their weight-gradient GEMM, the path
training takes (megatron_ext.testing.ddp_main_grads), accumulated over the steps as over the
microbatches of one iteration (DDP zeroes main_grad once per iteration). "% of dense" differs
between the two; the JSON records the choice. TFLOP/s credits only the routes kept (tokens x
top-k less the dropped).

    python tools/bench_moe_layer.py [--tokens 8192 --experts 64 --topk 8 --hidden 2048 --ffn 1024]
"""

from __future__ import annotations

import argparse
import os

import torch

from megatron_ext.bench.cli_types import names_from
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.flops import credited_flops, moe_model_flops
from megatron_ext.bench.layer_shape import add_layer_shape_args, check_layer_shape
from megatron_ext.bench.kernel_profile import profile_kernels
from megatron_ext.bench.measurement import (GRADS, cuda_time_ms, dense_gemm_step, held_for_backward, host_time_ms,
                                            make_step, median, peak_memory)
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.testing.megatron_moe import load_weights, megatron_moe_layer, moe_config
from megatron_ext.testing.reference import MoEWeights
from megatron_ext.testing.single_rank import init_single_rank_megatron

DENSE = "dense_gemm"  # --device-ab's reference, timed in the same rounds
PATHS = ("megatron_alltoall", "megatron_alltoall_gg", "rowwise_torch", "rowwise_symm", "rowwise_symm_megatron_router",
         "rowwise_symm_graph", "rowwise_symm_cublas_router", "rowwise_symm_cublas_router_graph", "rowwise_symm_mxfp8",
         "rowwise_symm_mxfp8_graph", "rowwise_symm_moe_act")
MOE_ACT_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)


def build(path: str, args, weights):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
    from megatron_ext.specs import moe_builder

    aux = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=args.aux_loss_coeff) \
        if args.aux_loss_coeff else {}
    recompute = MOE_ACT_RECOMPUTE if path.endswith("_moe_act") else {}
    config = moe_config(hidden=args.hidden, ffn=args.ffn, experts=args.experts, topk=args.topk,
                        dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32", **aux,
                        **recompute)
    if path == "megatron_alltoall":
        layer = megatron_moe_layer(config)
    elif path == "megatron_alltoall_gg":
        layer = megatron_moe_layer(config, experts_builder=DeviceOffsetGroupedMLP)
    else:
        transport = "torch" if path == "rowwise_torch" else "symm"
        layer = moe_builder(MoEExtConfig(transport=transport, capacity_factor=args.capacity_factor,
                                         dropless=args.dropless, mxfp8_dispatch="mxfp8" in path,
                                         fused_router="megatron_router" not in path,
                                         router_gemms="cublas" if "cublas_router" in path else "triton"))(config=config)
    layer = layer.cuda()
    load_weights(layer, weights)
    return layer


def dense_gemm_tflops(flops: float, hidden: int) -> float:
    """Rate of one square-ish bf16 matmul doing the same FLOPs, measured now."""
    step, done = dense_gemm_step(flops, hidden)
    return done / median(cuda_time_ms(step, warmup=5, iters=20)) / 1e9


def host_hotspots(step, iters: int = 10, top: int = 25, sort: str = "tottime") -> list[str]:
    """Python functions with the most host time over `iters` steps (cProfile), by own time
    (`sort="tottime"`) or including callees (`"cumulative"`)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (_, calls, own, cumulative, _) in list(stats.stats.items()):
        key = own if sort == "tottime" else cumulative
        rows.append((key, f"{own / iters * 1e3:7.3f} ms own {cumulative / iters * 1e3:7.3f} ms cum "
                          f"{calls // iters:5d} calls  {func} ({os.path.basename(filename)}:{line})"))
    return [text for _, text in sorted(rows, reverse=True)[:top]]


def measure(path, args, weights, x, grad_out, flops):
    from megatron_ext.host_sync import capture_replay, profiled_sync_calls

    layer = build(path, args, weights)
    step = make_step(layer, x, grad_out, grads=args.grads)  # on its own copy of x that requires grad
    result = {"path": path, "grads": args.grads}
    if path.endswith("_graph"):
        graph, _ = capture_replay(step)
        step = graph.replay
    step()
    times = cuda_time_ms(step, warmup=args.warmup, iters=args.iters)
    result["fwd_bwd_ms"] = median(times)
    result["host_submit_ms"] = median(host_time_ms(step, warmup=2, iters=args.iters))
    result["memory"] = peak_memory(step)
    if not path.endswith("_graph"):
        result["memory"]["held_for_backward_bytes"] = held_for_backward(layer, x, grad_out)
    result["blocking_cuda_calls"] = sum(profiled_sync_calls(step).values())
    if path in args.profile.split(","):
        result["kernels"] = profile_kernels(step, iters=3, top=args.profile_top)
        result["host_hotspots"] = host_hotspots(step, top=args.profile_top)
        result["host_cumulative"] = host_hotspots(step, top=args.profile_top, sort="cumulative")
    if path in args.host_phases.split(","):
        from megatron_ext.bench.host_phases import backward_nodes, forward_phase_ms

        result["host_phases_ms"] = forward_phase_ms(layer, x, grad_out, iters=args.iters)
        result["backward_nodes"] = backward_nodes(step, top=args.profile_top)
    if path in args.host_census.split(","):
        from megatron_ext.bench.host_census import function_census

        result["host_census"] = function_census(step, iters=args.iters)
    if hasattr(layer, "read_metrics"):
        metrics = layer.read_metrics()
        if metrics:
            result["dropped_routes_per_step"] = metrics["dropped_routes"] / metrics["steps"]
            result["mean_buffer_fill"] = metrics["mean_buffer_fill"]
            result["capacity_rows"] = metrics["capacity"]
            result["dispatch_buffer_bytes"] = metrics["dispatch_buffer_bytes"]
            result["dispatched_bytes_per_step"] = metrics["dispatched_bytes_per_step"]
    routes = args.tokens * args.topk  # a dropped route is no work done: not credited
    result["credited_flops"] = credited_flops(flops, routes, result.get("dropped_routes_per_step", 0.0))
    result["tflops"] = result["credited_flops"] / result["fwd_bwd_ms"] / 1e9
    del layer
    torch.cuda.empty_cache()
    return result


def interleaved_ab(args, weights, x, grad_out, paths: str, device: bool, flops: float) -> dict:
    """Host submission (`device=False`, --host-ab) or device time (`device=True`, --device-ab) of
    `paths`, all layers alive and graph paths captured, measured in turns (measurement.interleaved_ms).
    Device time also times, first in every round, dense GEMMs doing the layer step's FLOPs, so each
    path's share of the dense rate compares the two under the same clocks (`pct_dense_gemm`)."""
    from megatron_ext.bench.measurement import cuda_time_ms, host_time_ms, interleaved_ms, ratio_text
    from megatron_ext.host_sync import capture_replay

    steps = {}
    if device:  # the dense reference in the same turns: a GPU's clocks follow its power and temperature
        steps[DENSE], _ = dense_gemm_step(flops, args.hidden, calls=3)
    for path in paths.split(","):
        step = make_step(build(path, args, weights), x, grad_out, grads=args.grads)
        steps[path] = capture_replay(step)[0].replay if path.endswith("_graph") else step
    for step in steps.values():
        step()
    rounds = args.device_rounds if device else args.host_rounds
    result = interleaved_ms(steps, rounds=rounds, iters=args.iters, timer=cuda_time_ms if device else host_time_ms)
    first = next(iter(steps))
    for path, figures in result.items():
        if device:
            figures["pct_dense_gemm"] = 100 / figures["ratio_to_" + first]
        spread = f"{figures['min_ms']:.3f}..{figures['max_ms']:.3f}"
        share = f", {figures['pct_dense_gemm']:5.1f}% of the dense rate" if device else ""
        print(f"  {'device' if device else 'host'} A/B: {path:30s} {figures['median_ms']:7.3f} ms ({spread})"
              f"  {ratio_text(result, path, first)} of {first} (median, min..max of per-round ratios){share}",
              flush=True)
    del steps
    torch.cuda.empty_cache()
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(parser)
    parser.add_argument("--dropless", action="store_true")
    parser.add_argument("--aux-loss-coeff", type=float, default=0.0,
                        help="Megatron's load-balancing loss (aux_loss) with this coefficient; 0: none")
    parser.add_argument("--paths", type=names_from(PATHS, "paths"), default=",".join(PATHS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--name", default="moe_layer")
    parser.add_argument("--profile", default="", help="comma-separated paths to profile (kernels, host hotspots)")
    parser.add_argument("--profile-top", type=int, default=12, help="kernels and host functions listed per profile")
    parser.add_argument("--host-phases", default="",
                        help="comma-separated paths: host ms per forward phase and the costliest backward nodes")
    parser.add_argument("--host-census", default="",
                        help="comma-separated paths: in-step host us of the layer's functions (bench/host_census.py)")
    parser.add_argument("--host-ab", default="",
                        help="comma-separated paths whose host submission is also measured in turns, all "
                             "layers alive, over --host-rounds rounds (ratios to the first path per round)")
    parser.add_argument("--host-rounds", type=int, default=5)
    parser.add_argument("--device-ab", default="",
                        help="comma-separated paths whose device time (fwd+bwd) is also measured in turns, all "
                             "layers alive, over --device-rounds rounds (ratios to the first path per round)")
    parser.add_argument("--device-rounds", type=int, default=7)
    parser.add_argument("--grads", choices=GRADS, default="param",
                        help="where the weight gradients go: param (param.grad, each step's own) or ddp (Megatron "
                             "DDP's fp32 main_grad protocol: the grouped experts' fused wgrad path, as in training)")
    add_results_dir_arg(parser)
    args = parser.parse_args(argv)
    check_layer_shape(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    require_cuda("tools/bench_moe_layer.py")
    init_single_rank_megatron()
    weights = MoEWeights.random(args.experts, args.hidden, args.ffn, seed=0, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, device="cuda", generator=gen).bfloat16()
    grad_out = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    flops = moe_model_flops(args.tokens, args.topk, args.hidden, args.ffn)
    dense = dense_gemm_tflops(flops / 3, args.hidden)
    unit_costs = None
    if args.host_phases:
        from megatron_ext.bench.host_phases import unit_costs_us

        unit_costs = unit_costs_us()
        print("host unit costs (us):", {k: round(v, 1) for k, v in unit_costs.items()}, flush=True)
    rows = []
    for path in args.paths.split(","):
        try:
            rows.append(measure(path, args, weights, x, grad_out, flops))
        except Exception as error:  # report and go on: one broken path must not hide the others
            rows.append({"path": path, "error": f"{type(error).__name__}: {error}"})
        for line in rows[-1].get("host_hotspots", []):
            print("  host:", line, flush=True)
        for line in rows[-1].get("host_cumulative", []):
            print("  host cumulative:", line, flush=True)
        for row in rows[-1].get("host_census", [])[:args.profile_top]:
            print(f"  host census: {row['us_per_step']:8.1f} us {row['calls_per_step']:4.1f} calls  {row['function']}",
                  flush=True)
        for name, ms in rows[-1].get("host_phases_ms", {}).items():
            print(f"  host phase: {ms:7.3f} ms {name}")
        for node in rows[-1].get("backward_nodes", []):
            print(f"  backward node: {node['cpu_us']:7.1f} us x{node['calls']:.0f} {node['node']}")
        for kernel in rows[-1].get("kernels", {}).get("top_kernels", []):
            print(f"  kernel: {kernel['ms_per_iter']:7.3f} ms x{kernel['calls_per_iter']:.0f} {kernel['name'][:110]}")
        timeline = rows[-1].get("kernels", {}).get("device_timeline")
        if timeline:
            print(f"  device timeline: span {timeline['span_ms_per_iter']:.3f} ms,"
                  f" busy {timeline['busy_ms_per_iter']:.3f}, idle {timeline['idle_ms_per_iter']:.3f}"
                  f" in {timeline['gaps_per_iter']:.0f} gaps per step")
            for gap in timeline["top_gaps"]:
                print(f"  idle gap: {gap['us']:7.1f} us after {gap['after'][:60]} before {gap['before'][:60]}")
        listed = ("kernels", "host_hotspots", "host_cumulative", "host_phases_ms", "backward_nodes", "host_census")
        print({k: v for k, v in rows[-1].items() if k not in listed}, flush=True)
    host_ab = interleaved_ab(args, weights, x, grad_out, args.host_ab, False, flops) if args.host_ab else None
    device_ab = interleaved_ab(args, weights, x, grad_out, args.device_ab, True, flops) if args.device_ab else None
    base = next((r["fwd_bwd_ms"] for r in rows if r["path"] == "megatron_alltoall" and "fwd_bwd_ms" in r), None)
    print(f"\nshape: {args.tokens} tokens, {args.experts} experts, top-{args.topk}, hidden {args.hidden}, "
          f"ffn {args.ffn}, bf16; dense bf16 GEMM {dense:.0f} TFLOP/s; weight gradients: --grads {args.grads}")
    print(f"{'path':22s} {'fwd+bwd ms':>10s} {'TFLOP/s':>8s} {'%dense':>7s} {'speedup':>8s} {'host ms':>8s} "
          f"{'syncs':>6s} {'peak MiB':>9s} {'held MiB':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:22s} ERROR {r['error']}")
            continue
        r["pct_dense_gemm"] = 100 * r["tflops"] / dense
        r["speedup_vs_megatron"] = base / r["fwd_bwd_ms"] if base else None
        mem = (r["memory"] or {}).get("peak_above_baseline_bytes", 0) / 2**20
        held = (r["memory"] or {}).get("held_for_backward_bytes")
        held = "-" if held is None else f"{held / 2**20:.0f}"
        speed = f"{r['speedup_vs_megatron']:.2f}x" if base else "-"
        print(f"{r['path']:22s} {r['fwd_bwd_ms']:10.2f} {r['tflops']:8.0f} {r['pct_dense_gemm']:6.0f}% {speed:>8s} "
              f"{r['host_submit_ms']:8.2f} {r['blocking_cuda_calls']:6d} {mem:9.0f} {held:>9s}")
    path = write_result(args.name, {"args": vars(args), "grads": args.grads, "dense_gemm_tflops": dense,
                                    "host_unit_costs_us": unit_costs,
                                    "rows": rows, "host_ab": host_ab, "device_ab": device_ab}, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
