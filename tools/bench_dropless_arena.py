"""A stack of MoE layers on one GPU: the dropless arena (moe/arena.py) against bounded buffers per layer.

Paths (same weights, tokens and output gradients; symm transport, bf16; each layer's input is the
previous output plus the tokens, megatron_ext.testing.moe_stack):
  megatron_gg        Megatron's alltoall dispatcher (dropless: it holds the rows that arrive, after a host
                     wait per layer) with the same grouped experts
  dropless           rowwise, dropless=True (every layer sized for the worst case, EP * T * K rows)
  per_layer          capacity factor per layer (--capacity-factor; at EP=1 every factor >= 1 is T * K rows)
  arena              the arena with regions of T * K rows (nothing runs on at EP=1); it keeps the
                     activation in the arena as the others keep it for their backward
  arena_spill        the arena with regions of --region-factor x T * K rows: every layer runs on past
                     its region and every layer but the last spills (the copies' cost)
A path is one of those, then optionally "_moe_act" (Megatron's --recompute-modules moe_act: the
experts keep no activation and run it again in the backward), then optionally "_graph" (the whole
stack's forward+backward captured in one CUDA graph: device work without the host) or "_runner"
(each rowwise layer replayed by megatron_ext's graph runner, --moe-ext-cuda-graphs); e.g.
arena_spill_moe_act_graph.
Reported: device ms per stack step in turns (--rounds rounds, dense GEMMs of the step's FLOPs first
in every round), host ms, bytes the forward leaves held for the backward plus the dispatch slots or
arena the layers keep between steps, peak above that, blocking CUDA calls. `--profile A,B`
(two of --paths, e.g. per_layer,arena) also profiles those two steps after the timed rounds and lists
the kernels whose device time differs most, with each step's busy and idle device time: where
one path loses time to the other.
At EP=1 every layer receives exactly T * K rows, so the arena holds what the others hold: this
measures what its mechanisms cost. Under torchrun EP is the world size (issue 20's EP=2 figures:
memory is the largest rank's; the arena budget is --arena-capacity-factor); --skew biases the
routers toward rank 0's experts.

    python tools/bench_dropless_arena.py [--layers 4 --tokens 8192 --experts 64 --topk 8 --hidden 2048 --ffn 1024]
    torchrun --nproc-per-node 2 tools/bench_dropless_arena.py --paths megatron_gg,dropless,per_layer,arena
    python tools/bench_dropless_arena.py --paths per_layer,arena --profile per_layer,arena
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass

import torch

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.flops import moe_model_flops
from megatron_ext.bench.kernel_profile import print_profile_pair, profile_pair
from megatron_ext.bench.layer_shape import add_layer_shape_args, check_layer_shape
from megatron_ext.bench.measurement import (cuda_time_ms, dense_gemm_step, held_after, host_time_ms, interleaved_ms,
                                            median, peak_memory, ratio_in_rounds, ratio_text)
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.testing.megatron_moe import load_weights, moe_config
from megatron_ext.testing.moe_stack import stack_forward
from megatron_ext.testing.reference import MoEWeights
from megatron_ext.testing.single_rank import init_single_rank_megatron

BASES = ("megatron_gg", "dropless", "per_layer", "arena", "arena_spill")
PATHS = ("megatron_gg", "megatron_gg_moe_act", "dropless", "per_layer", "per_layer_moe_act", "arena",
         "arena_moe_act", "arena_spill", "arena_spill_graph", "per_layer_runner", "arena_spill_runner")
MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)


@dataclass(frozen=True)
class Path:
    base: str
    moe_act: bool = False
    replay: str | None = None  # "graph" (the whole step) or "runner" (megatron_ext's per-layer runner)


def parse_path(name: str) -> Path:
    """base[_moe_act][_graph|_runner] (module docstring); a name outside that says which exist."""
    rest, replay = name, None
    for suffix in ("graph", "runner"):
        if rest.endswith("_" + suffix):
            rest, replay = rest[:-len(suffix) - 1], suffix
    moe_act = rest.endswith("_moe_act")
    base = rest[:-len("_moe_act")] if moe_act else rest
    if base not in BASES or (replay is not None and base == "megatron_gg"):  # it waits on the host per layer
        raise SystemExit(f"unknown path {name!r}: a path is one of {', '.join(BASES)}, then optionally _moe_act, "
                         f"then optionally _graph or _runner (not megatron_gg: it synchronizes with the host)")
    return Path(base, moe_act, replay)


def build_stack(path: Path, args, world: int):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.moe.arena import attach_arenas
    from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import megatron_moe_layer

    ext = None
    runner = path.replay == "runner"
    if path.base.startswith("arena"):
        region = args.region_factor if path.base == "arena_spill" else min(1.0, args.arena_capacity_factor)
        ext = MoEExtConfig(transport="symm", dropless_arena=True, capacity_factor=args.arena_capacity_factor,
                           arena_region_factor=region, cuda_graphs=runner)
    elif path.base != "megatron_gg":
        sizing = dict(dropless=True) if path.base == "dropless" else dict(capacity_factor=args.capacity_factor)
        ext = MoEExtConfig(transport="symm", **sizing, cuda_graphs=runner)
    layers = torch.nn.ModuleList()
    for index in range(args.layers):
        config = moe_config(hidden=args.hidden, ffn=args.ffn, experts=args.experts, topk=args.topk, ep=world,
                            dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32",
                            **(MOE_ACT if path.moe_act else {}))
        if ext is None:
            layer = megatron_moe_layer(config, experts_builder=DeviceOffsetGroupedMLP)
        else:
            layer = moe_builder(ext)(config=config)
        weights = layer_weights(index, args)
        load_weights(layer.cuda(), weights)
        layers.append(layer)
    if ext is not None and ext.dropless_arena:
        attach_arenas(layers)
    return layers


@functools.cache
def _weights_of(index: int, experts: int, hidden: int, ffn: int, skew: float) -> MoEWeights:
    weights = MoEWeights.random(experts, hidden, ffn, seed=index, dtype=torch.bfloat16)
    weights.router[: max(1, experts // 8)] += skew  # toward rank 0's experts
    return weights


def layer_weights(index: int, args) -> MoEWeights:
    """Layer `index`'s weights, the same on every path: drawn on the CPU once (seconds per layer at
    the reference shape with torchrun's one thread), not once per path."""
    return _weights_of(index, args.experts, args.hidden, args.ffn, args.skew)


def buffer_bytes(layers) -> int:
    """Bytes the layers keep between steps outside autograd: dispatch slots, or the arena (token rows,
    probabilities, fc1's rows past the regions, activations). `held` does not see them (it sees fc1's
    region rows, which the experts' autograd node holds); a step holds both."""
    total, arenas = 0, {}
    for layer in layers:
        dispatcher = layer.token_dispatcher
        if getattr(dispatcher, "arena_layer", None) is not None:
            arenas[id(dispatcher.arena_layer.arena)] = dispatcher.arena_layer.arena
        elif getattr(getattr(dispatcher, "transport", None), "pool", None) is not None:
            total += sum(slot.local.nbytes + slot.values.nbytes for slot in dispatcher.transport.pool.slots)
    for arena in arenas.values():
        total += sum(slot.rows.local.nbytes + slot.rows.values.nbytes
                     + sum(local.nbytes for local in (slot.fc1, slot.act) if local is not None)
                     for slot in arena.slots)
    return total


def stack_step(layers, x, grad_out):
    """(step, its static input): forward+backward of the stack from fresh gradients."""
    x = x.clone().requires_grad_(True)
    params = list(layers.parameters())

    def step():
        x.grad = None
        for param in params:
            param.grad = None
        stack_forward(layers, x).backward(grad_out)
    return step, x


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    add_layer_shape_args(parser)
    parser.add_argument("--region-factor", type=float, default=0.75, help="arena_spill's regions (x T * K)")
    parser.add_argument("--arena-capacity-factor", type=float, default=1.0, help="the arena paths' budget")
    parser.add_argument("--skew", type=float, default=0.0, help="added to the router rows of rank 0's experts")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--name", default="dropless_arena")
    add_results_dir_arg(parser)
    parser.add_argument("--profile", default=None, help="two of --paths, comma-separated: their kernels compared")
    args = parser.parse_args()
    check_layer_shape(parser, args)
    profiled = profile_paths(parser, args)
    require_cuda("tools/bench_dropless_arena.py")
    world, rank = 1, 0
    if "WORLD_SIZE" in os.environ:  # torchrun: EP = world size
        from megatron_ext.bench.ep_distributed import init_distributed

        ranks = init_distributed("cuda")
        world, rank = ranks.world, ranks.rank
    else:
        init_single_rank_megatron()
    from megatron_ext.host_sync import capture_replay, profiled_sync_calls

    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(args.tokens, 1, args.hidden, device="cuda", generator=gen).bfloat16()
    grad_out = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    flops = args.layers * moe_model_flops(args.tokens, args.topk, args.hidden, args.ffn)
    steps, rows = {"dense_gemm": dense_gemm_step(flops, args.hidden, calls=3)[0]}, []
    paths = args.paths.split(",")
    for path in paths:
        parse_path(path)  # every name checked before the first is timed
    for path in paths:
        layers = build_stack(parse_path(path), args, world)
        step, static_x = stack_step(layers, x, grad_out)
        step()
        row = {"path": path}
        runners = [layer._graph_runner for layer in layers if getattr(layer, "_graph_runner", None) is not None]
        if runners:  # a runner that could not capture runs eagerly: say so instead of timing it as graphed
            row["runner_eager_reasons"] = [r.eager_reason for r in runners if r.eager_reason is not None]
        if parse_path(path).replay == "graph":
            step = capture_replay(step)[0].replay
        else:
            row["blocking_cuda_calls"] = sum(profiled_sync_calls(step).values())
            out, row["held_for_backward_bytes"] = held_after(lambda: stack_forward(layers, static_x))
            out.backward(grad_out)  # the backward frees the buffers the forward leased
            del out
        row["buffer_bytes"] = buffer_bytes(layers)
        row["host_ms"] = median(host_time_ms(step, warmup=2, iters=args.iters))
        row["peak_above_baseline_bytes"] = peak_memory(step)["peak_above_baseline_bytes"]
        metrics = [layer.read_metrics() for layer in layers if hasattr(layer, "read_metrics")]
        row["dropped_routes"] = sum(m["dropped_routes"] for m in metrics if m)
        row = _largest_rank(row, world)
        arena = getattr(layers[0].token_dispatcher, "arena_layer", None)
        if arena is not None:
            row["arena_layout"] = vars(arena.arena.layout)
        steps[path] = step
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    timed = interleaved_ms(steps, rounds=args.rounds, iters=args.iters, timer=cuda_time_ms)
    if rank != 0:
        return finish(world, None, args)
    print(f"\n{args.layers} layers x ({args.tokens} tokens, {args.experts} experts, top-{args.topk}, hidden "
          f"{args.hidden}, ffn {args.ffn}), bf16, EP={world}, in turns ({args.rounds} rounds; memory: the largest "
          f"rank's)")
    print(f"{'path':20s} {'device ms':>10s} {'min..max':>16s} {'vs per_layer (rounds)':>26s} {'%dense':>7s} "
          f"{'host ms':>8s} "
          f"{'held+buffers MiB':>17s} {'peak MiB':>9s} {'syncs':>6s} {'dropped':>8s}")
    base = "per_layer" in timed
    for row in rows:
        t = timed[row["path"]]
        row.update(device_ms=t["median_ms"], device_min_ms=t["min_ms"], device_max_ms=t["max_ms"],
                   pct_dense_gemm=100 / t["ratio_to_dense_gemm"])
        if base:  # the median of per-round ratios, with their min..max
            row["vs_per_layer"] = ratio_in_rounds(timed, row["path"], "per_layer")
        vs = ratio_text(timed, row["path"], "per_layer") if base else "-"
        held = row.get("held_for_backward_bytes")
        held = None if held is None else held + row["buffer_bytes"]
        print(f"{row['path']:20s} {t['median_ms']:10.3f} {t['min_ms']:7.3f}..{t['max_ms']:7.3f} {vs:>26s} "
              f"{row['pct_dense_gemm']:6.1f}% {row['host_ms']:8.2f} "
              f"{'-' if held is None else f'{held / 2**20:.0f}':>17s} {row['peak_above_baseline_bytes'] / 2**20:9.0f} "
              f"{row.get('blocking_cuda_calls', '-')!s:>6s} {row.get('dropped_routes', '-')!s:>8s}")
    if any(row.get("dropped_routes") for row in rows):
        print("A path that dropped routes did less work than a dropless one: compare its time and memory with that "
              "in mind, or raise --capacity-factor / --arena-capacity-factor.")
    payload = {"args": vars(args), "ep": world, "rows": rows, "dense_gemm_ms": timed["dense_gemm"]}
    if profiled:
        payload["profile"] = profile_pair({path: steps[path] for path in profiled})
        print_profile_pair(f"{profiled[0]} against {profiled[1]}", payload["profile"])
    finish(world, payload, args)


def profile_paths(parser, args) -> list[str]:
    """--profile's two paths, each one of --paths (checked before anything is built)."""
    if args.profile is None:
        return []
    names = args.profile.split(",")
    if len(names) != 2 or not set(names) <= set(args.paths.split(",")):
        parser.error(f"--profile takes two of --paths ({args.paths}), comma-separated, got {args.profile!r}")
    if "WORLD_SIZE" in os.environ:
        parser.error("--profile profiles one process: run it without torchrun")
    return names


def _largest_rank(row: dict, world: int) -> dict:
    """Memory and drops: the largest rank's (every rank calls this in the same order)."""
    if world == 1:
        return row
    import torch.distributed as dist

    keys = [k for k in ("held_for_backward_bytes", "buffer_bytes", "peak_above_baseline_bytes", "dropped_routes")
            if k in row]
    values = torch.tensor([float(row[k]) for k in keys], device="cuda", dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {**row, **{k: int(v) for k, v in zip(keys, values.tolist())}}


def finish(world: int, payload, args) -> None:
    if payload is not None:
        print(f"wrote {write_result(args.name, payload, args.results_dir)}")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
