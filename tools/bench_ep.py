"""Expert-parallel MoE layer benchmark across GPUs: Megatron's alltoall paths against rowwise EP.

Launched with torchrun, one process per GPU; EP = world size (every rank is one EP rank):

    torchrun --standalone --nproc-per-node 8 tools/bench_ep.py
    torchrun --standalone --nproc-per-node 2 tools/bench_ep.py --device cpu --tiny   # gloo smoke test

Default shape: the report's EP8 comparison (seeds/004 Table 7: 128 experts, top-8, no shared
expert, four sequences per rank microbatch). The report gives no hidden or expert ffn size for
that model, so hidden 4096 and expert ffn 1536 (SwiGLU), four sequences of 4096 tokens
(16384 tokens per rank), bf16, capacity factor 1.25 for the rowwise paths.

Paths (same weights, same tokens and output gradients per rank, hence the same routes):
  megatron_alltoall     Megatron MoELayer, alltoall dispatcher, SequentialMLP (local spec)
  megatron_alltoall_gg  Megatron's alltoall dispatcher with DeviceOffsetGroupedMLP experts
  megatron_flex_deepep_gg  Megatron's flex dispatcher with the DeepEP backend (its fast path today)
                        and the same DeviceOffsetGroupedMLP experts; not available without deep_ep
  rowwise_torch         RowwiseMoELayer, reference all_to_all_single transport
  rowwise_symm          RowwiseMoELayer, symmetric-memory Triton PUT/GET transport
  rowwise_symm_put      rowwise_symm with return_transfer="put" (combine and dispatch backward PUT the
                        rows back: no copy into scratch; moe/transport/put_return.py)
  rowwise_symm_mxfp8    rowwise_symm with MoEExtConfig(mxfp8_dispatch=True); reported as not
                        available when the flag is refused or the dispatch payload stays BF16
                        (output bitwise equal to rowwise_symm's)
  rowwise_symm_dropless rowwise_symm with dropless=True (capacity for the worst case, EP * T * K rows)
  rowwise_symm_bounded  rowwise_symm with on_overflow="error" (bounded dropless: capacity from the factor,
                        an overflow is an error, checked after the timed steps)
  rowwise_symm_graph    rowwise_symm with MoEExtConfig.cuda_graphs (the layer's graph runner: forward and
                        backward replayed; layer time only: the phases cannot be timed inside a graph)

Weights: expert e's fc1/fc2 come from a generator seeded with (seed, e), the router from
(seed), so every rank builds exactly the global model's weights for its own experts whatever
the EP size, without materializing all 128 experts on every rank. Tokens and output gradients
are seeded per rank.

What is measured, per path, after warm-up (medians over all ranks and iterations):
- layer fwd+bwd ms: CUDA events around one forward+backward of the layer (no gradient
  accumulation adds: parameter grads are reset to None), without any timing hooks installed.
- dispatch+combine ms: the six token-dispatcher methods MoELayer calls (dispatch_preprocess,
  token_dispatch, dispatch_postprocess, combine_preprocess, token_combine, combine_postprocess),
  forward and backward, in separate iterations with timing wrappers installed. Megatron's
  alltoall: permute, metadata all-gather and host split-size wait, the token and prob
  all-to-alls, sort by local expert, and their inverses. Rowwise: top-k extraction, route-map
  build (count all-gather, keep plan), dispatch PUT, combine GET with the prob-weighted sum and
  their backward legs (GET, PUT, prob-gradient dot). This matches the phases of Table 7.
  Forward: events at each method's entry and exit. Backward: an identity autograd node on each
  differentiable input and output of a method records an event when the gradient passes it;
  a method's backward is the time on the compute stream from the first gradient reaching its
  outputs to the last gradient leaving its inputs (disjoint stretches summed). Events sit on
  the compute stream, so host stalls inside a phase (Megatron's split-size synchronization)
  count, as they do in training. The JSON's phases_ms also has the whole step time of those
  same iterations ("layer"), of which dispatch+combine is a part. The table's dispatch+combine
  is the sum of the four phase medians (forward and backward of each), so the columns add up
  to it; the JSON also keeps the median of the per-iteration sums.
- model TFLOP/s per GPU: useful routed-token expert FLOPs of this rank's tokens (tokens * top-k
  rows less the routes dropped, fc1 + fc2, forward+backward = 3x forward; capacity padding not
  counted) / layer time. Rows with drops are marked in the table's dropped column.
- peak memory: the highest allocation during one step, above what was allocated before it
- held memory: what one forward leaves allocated for its backward (buffers and saved tensors;
  summed over a model's MoE layers, this is what bounded dropless is sized against)
  (and absolute), max over ranks.
- blocking CUDA calls per step (profiler, max over ranks), dropped routes (rowwise), output
  difference against the first path (same weights and routes: bf16 rounding only unless the
  rowwise capacity dropped routes), and a digest of the router's routing map, compared across
  paths to prove the routes were the same.
Result JSON via megatron_ext.bench.results.write_result on rank 0; a table on rank 0 with the
ratio of rowwise symm dispatch+combine to Megatron alltoall dispatch+combine (issue 11 target: at
least 35% shorter). With --device cuda (the default) and no GPU visible, it exits 2 at once.
"""

# The pieces, one idea a module, in megatron_ext.bench: ep_distributed (ranks, gather, result),
# ep_paths (shape, layers, weights, inputs), ep_phase_timing (clock, layer and dispatcher-phase
# timing), ep_report (summary and table). This file: measuring one path on every rank, and main.

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import asdict

# First: sets NVLINK_SAFE_ENV (multicast off) before torch is imported or NCCL initializes.
from megatron_ext.bench.ep_distributed import Ranks, finish_run, gather_to_all, init_distributed, warn_full_shape_on_cpu

import torch
import torch.distributed as dist

from megatron_ext.bench.cli_types import non_negative_int, positive_float, positive_int
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.ep_paths import (EP8_SHAPE, PATHS, TINY_SHAPE, Shape, build_layer, rank_inputs,
                                         routing_digest, unavailable_reason)
from megatron_ext.bench.ep_phase_timing import Clock, time_layer, time_phases
from megatron_ext.bench.ep_report import (TARGET_SHORTER, dispatch_combine_ratios, layer_ratios, mxfp8_vs_bf16,
                                          print_table, same_routes, summarize)
from megatron_ext.bench.flops import moe_model_flops
from megatron_ext.bench.layer_shape import check_topk
from megatron_ext.bench.measurement import held_for_backward, make_step, peak_memory
from megatron_ext.bench.results import add_results_dir_arg


# ----------------------------------------------------------------------------- one path on one rank
def blocking_calls(step, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    from megatron_ext.host_sync import profiled_sync_calls

    return sum(profiled_sync_calls(step).values())


def routing_metrics(layer) -> dict:
    if not hasattr(layer, "read_metrics"):
        return {}
    metrics = layer.read_metrics()
    if not metrics:
        return {}
    found = {"dropped_routes_per_step": metrics["dropped_routes"] / metrics["steps"],
             "mean_buffer_fill": metrics["mean_buffer_fill"], "capacity_rows": metrics["capacity"]}
    for key in ("dispatch_row_bytes", "dispatch_buffer_bytes", "dispatched_bytes_per_step"):
        if key in metrics:  # payload size: 2H bytes per row for BF16, H + H/32 (padded) for MXFP8
            found[key] = metrics[key]
    return found


class Outputs:
    """First-step outputs of earlier paths on this rank: the parity reference and the MXFP8 check."""

    KEEP = ("rowwise_symm",)  # kept beyond the first path: the MXFP8 path is compared with it

    def __init__(self):
        self.first: torch.Tensor | None = None
        self.by_path: dict[str, torch.Tensor] = {}

    def record(self, path: str, out: torch.Tensor) -> float | None:
        """Max |out - first path's out| / max |first path's out| (None for the first path)."""
        out = out.detach().float()
        if path in self.KEEP:
            self.by_path[path] = out
        if self.first is None:
            self.first = out
            return None
        return float((out - self.first).abs().max() / self.first.abs().max().clamp_min(1e-12))


def mxfp8_payload_missing(out: torch.Tensor, outputs: Outputs) -> bool:
    """True on every rank if the MXFP8 path's output equals rowwise_symm's bitwise on all ranks:
    then the flag was accepted but the rows travelled as BF16."""
    bf16 = outputs.by_path.get("rowwise_symm")
    same = torch.tensor([int(bf16 is not None and torch.equal(out.detach().float(), bf16))], device=out.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def run_path(path: str, shape: Shape, args, ranks: Ranks, x, grad_out, outputs: Outputs) -> dict:
    """Everything measured for one path on this rank (a collective: all ranks run it together)."""
    dtype = x.dtype
    clock = Clock(ranks.device)
    layer = build_layer(path, shape, args, ranks.device, dtype)
    step = make_step(layer, x, grad_out)
    if path == "rowwise_symm_graph":  # the layer's graph runner: captured at the first training step
        first_out = step()
        reason = layer._graph_runner.eager_reason
        if reason is not None:
            return {"path": path, "unavailable": f"not available: the graph runner fell back to eager: {reason}"}
        with torch.no_grad():  # routes from an eager forward (a replay runs no Python hooks)
            result = {"path": path, "routing_digest": routing_digest(layer, functools.partial(layer, x))}
    else:
        result = {"path": path, "routing_digest": routing_digest(layer, step)}
        first_out = step()
    result["out_rel_diff_vs_first_path"] = outputs.record(path, first_out)
    if path == "rowwise_symm_mxfp8" and mxfp8_payload_missing(first_out, outputs):
        return {"path": path, "unavailable": "not available: MoEExtConfig(mxfp8_dispatch=True) is accepted but "
                "the dispatch payload stays BF16 (output bitwise equal to rowwise_symm)"}
    for _ in range(args.warmup):
        step()
    dist.barrier()
    result["layer_ms"] = time_layer(step, clock, args.iters)
    result["memory"] = peak_memory(step)  # None on CPU
    if result["memory"] is not None and path != "rowwise_symm_graph":  # a replay's memory is the graph's pool
        result["memory"]["held_for_backward_bytes"] = held_for_backward(layer, x, grad_out)
    result["blocking_cuda_calls"] = blocking_calls(step, ranks.device)
    if path != "rowwise_symm_graph":
        dist.barrier()
        result["phases"] = time_phases(layer, step, clock, args.iters)
    result.update(routing_metrics(layer))
    if path == "rowwise_symm_bounded":  # the same on every rank: the overflow count is global
        from megatron_ext.moe.overflow import CapacityExceeded

        try:
            layer.check_overflow()
            result["overflow"] = "none"
        except CapacityExceeded as error:
            result["overflow"] = str(error)
    del layer, step
    if ranks.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_path_guarded(path: str, shape: Shape, args, ranks: Ranks, x, grad_out, outputs: Outputs) -> dict:
    """run_path, or a row naming why the path could not run (every rank must fail alike; a path
    that fails on some ranks only hangs the others until the process-group timeout)."""
    reason = unavailable_reason(path, ranks.device)
    if reason:
        return {"path": path, "unavailable": reason}
    try:
        return run_path(path, shape, args, ranks, x, grad_out, outputs)
    except Exception as error:  # report and go on: one broken path must not hide the others
        if path == "rowwise_symm_mxfp8":
            return {"path": path, "unavailable": f"not available: {type(error).__name__}: {error}"}
        return {"path": path, "error": f"{type(error).__name__}: {error}"}


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"smoke-test shape {asdict(TINY_SHAPE)}")
    for name in ("seq_length", "sequences", "experts", "topk", "hidden", "ffn"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive_int, help=f"override the shape's {name}")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--capacity-factor", type=positive_float, default=1.25)
    parser.add_argument("--dropless", action="store_true")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--iters", type=positive_int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="ep_layer")
    add_results_dir_arg(parser)
    args = parser.parse_args(argv)
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {PATHS}")
    shape = asdict(TINY_SHAPE if args.tiny else EP8_SHAPE)
    check_topk(parser, args.topk or shape["topk"], args.experts or shape["experts"])
    return args


def shape_from_args(args) -> Shape:
    warn_full_shape_on_cpu("bench_ep", args)
    base = asdict(TINY_SHAPE if args.tiny else EP8_SHAPE)
    base.update({k: getattr(args, k) for k in base if getattr(args, k) is not None})
    return Shape(**base)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda("tools/bench_ep.py --device cuda")
    shape = shape_from_args(args)
    ranks = init_distributed(args.device)
    if shape.experts % ranks.world:
        raise SystemExit(f"{shape.experts} experts cannot be split over EP{ranks.world}; pick a divisible world size")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x, grad_out = rank_inputs(ranks, shape, args.seed, dtype)
    flops = moe_model_flops(shape.tokens, shape.topk, shape.hidden, shape.ffn)
    outputs, rows = Outputs(), []
    for path in args.paths.split(","):
        per_rank = gather_to_all(run_path_guarded(path, shape, args, ranks, x, grad_out, outputs))
        row = summarize(per_rank, flops, routes=shape.tokens * shape.topk)
        rows.append(row)
        if ranks.rank == 0:
            brief = {k: v for k, v in row.items() if k not in ("phases_ms", "routing_digests")}
            print(brief, flush=True)
    payload = None  # the result JSON, written by rank 0
    if ranks.rank == 0:
        ratios = dispatch_combine_ratios(rows)
        routes_equal = same_routes(rows)
        print_table(rows, ratios, shape, ranks.world, routes_equal)
        payload = {"args": vars(args), "shape": asdict(shape), "tokens_per_rank": shape.tokens,
                   "world_size": ranks.world, "ep": ranks.world, "dtype": args.dtype,
                   "model_flops_per_rank_step": flops, "same_routes_all_paths": routes_equal,
                   "dispatch_combine_ratios": ratios, "layer_ratios": layer_ratios(rows),
                   "mxfp8_vs_bf16": mxfp8_vs_bf16(rows),
                   "target_shorter_by": TARGET_SHORTER, "rows": rows}
    return finish_run(args, payload)


if __name__ == "__main__":
    sys.exit(main())
