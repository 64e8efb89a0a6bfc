"""Row-transfer bandwidth across GPUs: the symm transport's PUT/GET against NVLink, per token count.

Launched with torchrun, one process per GPU; every rank is one EP rank:

    torchrun --standalone --nproc-per-node 8 tools/bench_transport.py
    torchrun --standalone --nproc-per-node 2 tools/bench_transport.py --device cpu --tiny   # gloo smoke test

Per token count T (default 1024 ... 16384 tokens per rank, top-8, hidden 4096, bf16, 128
experts spread over the ranks): balanced random routes (each token picks K distinct experts
uniformly, seeded per rank), the real route map (`megatron_ext.moe.route_map.route`,
capacity factor 1.25), and these measurements, each timed per iteration between a fence
(all ranks start together) and the end of the transfer:

  symm kernel   put_rows              dispatch forward PUT, the Triton kernel alone (token row
                                      -> the owner's capacity buffer row, straight over NVLink)
  symm kernel   get_rows              combine forward GET as combine runs it (prob-weighted fp32
                                      sum of the K fetched rows, and the fetched rows kept)
  symm kernel   put_rows, mxfp8-size rows
                                      dispatch PUT of rows the size of an MXFP8 payload (H + H/32
                                      bytes, padded to 16) moved as raw 16-bit words: the bytes
                                      MXFP8 dispatch puts on NVLink, without the quantization
  symm kernel   put_rows / get_rows, block_h=B warps=W
                                      the same kernels at the launch configurations that
                                      `--kernel-configs BxW,...` lists (row-block width, warps
                                      per program), to find the fastest over NVLink
  symm kernel   put_rows_mxfp8 (quantize+PUT)
                                      the fused MXFP8 quantize + PUT kernel from BF16 token rows
                                      (megatron_ext.kernels.mxfp8_put), where the checkout has it
  symm phase    dispatch / dispatch, mxfp8 / combine / combine_backward / dispatch_backward
                                      SymmRowTransport's transfers as the layer calls them (with
                                      their device barriers and, for GETs at EP>1, the copy of the
                                      source rows into symmetric scratch); "dispatch, mxfp8" is
                                      dispatch_quantized, where the transport has it
  symm phase, put return              the same with return_transfer="put": combine and dispatch
                                      backward PUT the rows back into the sources' receive
                                      buffers, then each source sums its routes locally (PUT bytes:
                                      this GPU's egress)
  torch phase   the same through TorchRowTransport (all_to_all_single of fixed [EP, C, row]
                blocks over NCCL or gloo), the reference

Bytes counted: only rows that cross to another rank (kept routes whose destination is not this
rank) times the row size (2H bytes for BF16, packed_row_bytes(H) for MXFP8); rows a rank keeps
for itself and the padding of the torch transport's blocks are not counted. GB/s per GPU =
those bytes / the transfer's median time on that rank; the table gives the median and the
slowest rank, and the share of NVLink's 450 GB/s per direction (H100/H200 NVLink 4: 18 links x
25 GB/s). A PUT phase is this GPU's egress, a GET its ingress. Issue 11's target: dispatch PUT
at the largest token count at least 60% of 450 GB/s.

On CPU (gloo) the symm transport and its kernels cannot run (symmetric memory and Triton need
CUDA GPUs): only the torch reference transport is timed, and its GB/s are not NVLink figures.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

# Importing megatron_ext.bench.ep_distributed sets NVLINK_SAFE_ENV (multicast off) before anything initializes NCCL.
from megatron_ext.bench.cli_types import list_of, names_from, non_negative_int, positive_float, positive_int
from megatron_ext.bench.ep_distributed import (Ranks, finish_run, gather_to_all, init_distributed, median,
                                              warn_full_shape_on_cpu)

import torch
import torch.distributed as dist

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.ep_phase_timing import Clock
from megatron_ext.bench.layer_shape import check_topk
from megatron_ext.bench.results import add_results_dir_arg

NVLINK_GBPS_PER_DIRECTION = 450.0
TARGET_FRACTION = 0.60  # issue 11: dispatch bandwidth >= 60% of 450 GB/s per GPU at the largest T
PHASES = ("dispatch", "combine", "combine_backward", "dispatch_backward")
CPU_NOTE = ("cpu run: the symm transport and its PUT/GET kernels are not available (GPU symmetric memory and "
            "Triton); the torch reference transport (gloo all_to_all_single) is benched instead, and its GB/s "
            "are not NVLink figures")


@dataclass(frozen=True)
class Setup:
    tokens: list[int]
    experts: int
    topk: int
    hidden: int


FULL = Setup(tokens=[1024, 2048, 4096, 8192, 16384], experts=128, topk=8, hidden=4096)
TINY = Setup(tokens=[64, 128], experts=8, topk=2, hidden=64)


@dataclass
class Routes:
    """One rank's route map for T tokens and what its rows cost on the wire."""

    route_map: object
    probs: torch.Tensor  # [T, K] fp32
    capacity: int
    remote_routes: int  # kept routes whose owner is another rank
    kept_routes: int


def balanced_routes(tokens: int, setup: Setup, ranks: Ranks, capacity_factor: float, seed: int) -> Routes:
    from megatron_ext.moe.capacity import rank_capacity
    from megatron_ext.moe.route_map import route

    gen = torch.Generator(device=ranks.device).manual_seed(seed * 7919 + ranks.rank)
    scores = torch.rand(tokens, setup.experts, generator=gen, device=ranks.device)
    top_idx = torch.sort(scores.topk(setup.topk, dim=1).indices, dim=1).values
    probs = torch.softmax(torch.rand(tokens, setup.topk, generator=gen, device=ranks.device), dim=1)
    capacity = rank_capacity(tokens, setup.topk, ranks.world, capacity_factor, dropless=False)
    group = dist.group.WORLD if ranks.world > 1 else None
    route_map = route(top_idx, setup.experts, capacity, group)
    kept = route_map.dest_row >= 0
    remote = kept & (route_map.dest_rank != ranks.rank)
    return Routes(route_map, probs.float().contiguous(), capacity, int(remote.sum()), int(kept.sum()))


def timed(fn, fence, clock: Clock, warmup: int, iters: int) -> list[float]:
    """Per-iteration ms of `fn`, each iteration started after `fence` (all ranks aligned)."""
    for _ in range(warmup):
        fence()
        fn()
    stamps = []
    for _ in range(iters):
        fence()
        start = clock.stamp()
        fn()
        stamps.append((start, clock.stamp()))
    clock.synchronize()
    return [clock.ms(s, e) for s, e in stamps]


def host_fence() -> None:
    dist.barrier()


# ----------------------------------------------------------------------------- what is moved
def device_fence(ranks: Ranks, group):
    """A device-side barrier over the group (a small symmetric buffer's): no host wait. Between
    two iterations of a transfer it also keeps one rank from rewriting scratch rows a peer is
    still reading."""
    from megatron_ext.moe.buffers import allocate_symmetric

    return allocate_symmetric((16, 16), torch.bfloat16, ranks.device, group).barrier


def symm_kernel_cases(routes: Routes, setup: Setup, ranks: Ranks, tokens: torch.Tensor, fence,
                      kernel_configs=()):
    """(name, fn, fence, row_bytes) for the bare Triton PUT/GET kernels on symmetric buffers, at
    their default launch configuration and at each (block_h, num_warps) of `kernel_configs`."""
    from megatron_ext.kernels.row_transfer import get_rows, put_rows
    from megatron_ext.moe.buffers import allocate_symmetric

    group = dist.group.WORLD if ranks.world > 1 else None
    rm, shape = routes.route_map, (routes.capacity, setup.hidden)
    target = allocate_symmetric(shape, tokens.dtype, ranks.device, group)
    source = allocate_symmetric(shape, tokens.dtype, ranks.device, group)
    source.local.normal_()
    out = torch.empty_like(tokens)
    cases = [
        ("put_rows", lambda: put_rows(tokens, rm.dest_rank, rm.dest_row, target.peer_table), fence,
         setup.hidden * tokens.element_size()),
        ("get_rows", lambda: get_rows(source.peer_table, rm.dest_rank, rm.dest_row, out), fence,
         setup.hidden * tokens.element_size()),
    ]
    for block_h, warps in kernel_configs:
        config = dict(block_h=block_h, num_warps=warps)
        cases += [
            (f"put_rows, block_h={block_h} warps={warps}",
             lambda c=config: put_rows(tokens, rm.dest_rank, rm.dest_row, target.peer_table, **c), fence,
             setup.hidden * tokens.element_size()),
            (f"get_rows, block_h={block_h} warps={warps}",
             lambda c=config: get_rows(source.peer_table, rm.dest_rank, rm.dest_row, out, **c), fence,
             setup.hidden * tokens.element_size()),
        ]
    return cases + mxfp8_kernel_cases(routes, ranks, tokens, group, fence)


def mxfp8_row_bytes(hidden: int) -> int | None:
    try:
        from megatron_ext.formats.mxfp8 import packed_row_bytes
    except ImportError:
        return None
    return packed_row_bytes(hidden)


def fused_mxfp8_put():
    """megatron_ext's fused quantize+PUT kernel, or None where this checkout lacks it."""
    try:
        from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
    except ImportError:
        return None
    return put_rows_mxfp8


def mxfp8_kernel_cases(routes: Routes, ranks: Ranks, tokens: torch.Tensor, group, fence):
    """PUTs of MXFP8-sized rows (H + H/32 bytes, padded to 16): the bytes alone (raw 16-bit words
    through put_rows, a pure copy) and, where present, the fused quantize+PUT kernel."""
    from megatron_ext.kernels.row_transfer import put_rows
    from megatron_ext.moe.buffers import allocate_symmetric

    row_bytes = mxfp8_row_bytes(tokens.shape[1])
    if row_bytes is None:
        return []
    rm, capacity = routes.route_map, routes.capacity
    payload = torch.randn(tokens.shape[0], row_bytes // 2, device=ranks.device).to(torch.bfloat16)
    words = allocate_symmetric((capacity, row_bytes // 2), torch.bfloat16, ranks.device, group)
    cases = [("put_rows, mxfp8-size rows", lambda: put_rows(payload, rm.dest_rank, rm.dest_row, words.peer_table),
              fence, row_bytes)]
    fused = fused_mxfp8_put()
    if fused is not None:
        packed = allocate_symmetric((capacity, row_bytes // 4), torch.float32, ranks.device, group)
        cases.append(("put_rows_mxfp8 (quantize+PUT)",
                      lambda: fused(tokens, rm.dest_rank, rm.dest_row, packed.peer_table), fence, row_bytes))
    return cases


def phase_cases(make_transport, routes: Routes, tokens: torch.Tensor, fence, mxfp8: bool = True):
    """(name, fn, fence, row_bytes) for a transport's four transfers on these routes, and its
    MXFP8 dispatch where it has one and `mxfp8` (on a second instance: a transport's dispatch
    slots keep the row format of their first use)."""
    transport = make_transport()
    rm, probs = routes.route_map, routes.probs
    rows = torch.randn(routes.capacity, tokens.shape[1], device=tokens.device).to(tokens.dtype)
    row_probs = torch.rand(routes.capacity, device=tokens.device)

    def dispatch():
        *_, lease = transport.dispatch(tokens, probs, rm)
        transport.release(lease)

    dispatch()  # the first dispatch allocates the transport's buffers (collective), before any timing

    row_bytes = tokens.shape[1] * tokens.element_size()
    fns = {"dispatch": dispatch,
           "combine": lambda: transport.combine(rows, rm),
           "combine_backward": lambda: transport.combine_backward(tokens, rm),
           "dispatch_backward": lambda: transport.dispatch_backward(rows, row_probs, rm)}
    cases = [(name, fns[name], fence, row_bytes) for name in PHASES]
    mxfp8_bytes = mxfp8_row_bytes(tokens.shape[1])
    if mxfp8 and hasattr(transport, "dispatch_quantized") and mxfp8_bytes is not None:
        quantizing = make_transport()

        def dispatch_quantized():
            *_, lease = quantizing.dispatch_quantized(tokens, probs, rm)
            quantizing.release(lease)

        dispatch_quantized()  # its own buffers, allocated before timing
        cases.insert(1, ("dispatch, mxfp8", dispatch_quantized, fence, mxfp8_bytes))
    return cases


def transports_for(ranks: Ranks, routes: Routes, tokens: torch.Tensor, setup: Setup, wanted: list[str],
                   kernel_configs=()):
    """[(transport label, cases)] available on this device."""
    from megatron_ext.moe.transport.torch_ref import TorchRowTransport

    group = dist.group.WORLD if ranks.world > 1 else None
    found = []
    if "symm" in wanted and ranks.device.type == "cuda":
        from megatron_ext.moe.transport.symm import SymmRowTransport

        fence = device_fence(ranks, group)
        found.append(("symm kernel", symm_kernel_cases(routes, setup, ranks, tokens, fence, kernel_configs)))
        found.append(("symm phase", phase_cases(lambda: SymmRowTransport(group, routes.capacity), routes, tokens,
                                                fence)))
        # return_transfer="put": combine and dispatch backward PUT the rows back (no copy into scratch)
        found.append(("symm phase, put return", phase_cases(
            lambda: SymmRowTransport(group, routes.capacity, return_put=True), routes, tokens, fence, mxfp8=False)))
    if "torch" in wanted:
        found.append(("torch phase", phase_cases(lambda: TorchRowTransport(group, routes.capacity), routes, tokens,
                                                 host_fence)))
    return found


# ----------------------------------------------------------------------------- per rank, then rank 0
def measure(ranks: Ranks, setup: Setup, args) -> list[dict]:
    clock = Clock(ranks.device)
    results = []
    for num_tokens in setup.tokens:
        routes = balanced_routes(num_tokens, setup, ranks, args.capacity_factor, args.seed)
        gen = torch.Generator(device=ranks.device).manual_seed(args.seed + 17 * ranks.rank)
        tokens = torch.randn(num_tokens, setup.hidden, generator=gen, device=ranks.device).to(torch.bfloat16)
        for label, cases in transports_for(ranks, routes, tokens, setup, args.transports.split(","),
                                           args.kernel_configs):
            for name, fn, fence, row_bytes in cases:
                dist.barrier()
                ms = timed(fn, fence, clock, args.warmup, args.iters)
                results.append({"tokens": num_tokens, "transport": label, "transfer": name, "ms": ms,
                                "row_bytes": row_bytes, "remote_routes": routes.remote_routes,
                                "kept_routes": routes.kept_routes, "routes": num_tokens * setup.topk,
                                "capacity": routes.capacity, "remote_bytes": routes.remote_routes * row_bytes})
        del routes, tokens
        if ranks.device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for entries in zip(*per_rank):  # every rank measured the same cases in the same order
        first = entries[0]
        rank_ms = [median(e["ms"]) for e in entries]
        rank_gbps = [e["remote_bytes"] / ms / 1e6 for e, ms in zip(entries, rank_ms)]
        row = {k: first[k] for k in ("tokens", "transport", "transfer", "row_bytes", "routes", "capacity")}
        row.update(ms_median=median(ms for e in entries for ms in e["ms"]), gbps_per_gpu_median=median(rank_gbps),
                   gbps_per_gpu_slowest_rank=min(rank_gbps),
                   remote_fraction=sum(e["remote_routes"] for e in entries) / sum(e["routes"] for e in entries),
                   kept_fraction=sum(e["kept_routes"] for e in entries) / sum(e["routes"] for e in entries))
        row["pct_of_nvlink"] = 100 * row["gbps_per_gpu_median"] / NVLINK_GBPS_PER_DIRECTION
        rows.append(row)
    return rows


def dispatch_target(rows: list[dict]) -> dict | None:
    """The issue's check: symm dispatch PUT kernel at the largest token count vs 60% of 450 GB/s."""
    puts = [r for r in rows if r["transport"] == "symm kernel" and r["transfer"] == "put_rows"]
    if not puts:
        return None
    largest = max(puts, key=lambda r: r["tokens"])
    return {"tokens": largest["tokens"], "gbps_per_gpu": largest["gbps_per_gpu_median"],
            "fraction_of_nvlink": largest["gbps_per_gpu_median"] / NVLINK_GBPS_PER_DIRECTION,
            "met": largest["gbps_per_gpu_median"] >= TARGET_FRACTION * NVLINK_GBPS_PER_DIRECTION}


def print_table(rows: list[dict], setup: Setup, ranks: Ranks, target: dict | None) -> None:
    print(f"\nrow transfers over {ranks.world} ranks ({ranks.device.type}): top-{setup.topk}, hidden {setup.hidden}, "
          f"bf16, {setup.experts} experts, balanced random routes; GB/s per GPU count only rows that cross to "
          f"another rank; NVLink {NVLINK_GBPS_PER_DIRECTION:.0f} GB/s per direction")
    if ranks.device.type != "cuda":
        print(f"note: {CPU_NOTE}")
    print(f"{'tokens':>6s} {'transport':12s} {'transfer':22s} {'row B':>6s} {'ms':>8s} {'GB/s/GPU':>9s} "
          f"{'slowest':>8s} {'%NVLink':>7s} {'remote':>6s} {'kept':>6s}")
    for r in rows:
        print(f"{r['tokens']:6d} {r['transport']:12s} {r['transfer']:22s} {r['row_bytes']:6d} {r['ms_median']:8.3f} "
              f"{r['gbps_per_gpu_median']:9.2f} {r['gbps_per_gpu_slowest_rank']:8.2f} {r['pct_of_nvlink']:6.1f}% "
              f"{r['remote_fraction']:6.3f} {r['kept_fraction']:6.3f}")
    if target is None:
        print("issue 11 target (dispatch PUT >= 60% of 450 GB/s at the largest token count): not evaluated "
              "(no symm kernel rows on this device)")
    else:
        print(f"issue 11 target (dispatch PUT >= 60% of 450 GB/s at {target['tokens']} tokens): "
              f"{target['gbps_per_gpu']:.0f} GB/s = {100 * target['fraction_of_nvlink']:.0f}%: "
              f"{'MET' if target['met'] else 'NOT MET'}")


def kernel_config(text: str) -> tuple[int, int]:
    """'BxW' -> (block_h, num_warps): a power-of-two row block and 1-32 warps (a power of two)."""
    block, _, warps = text.partition("x")
    try:
        block_h, num_warps = int(block), int(warps)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK_HxWARPS such as 4096x8, got {text!r}") from None
    for name, value, top in (("BLOCK_H", block_h, 1 << 16), ("WARPS", num_warps, 32)):
        if value < 1 or value > top or value & (value - 1):
            raise argparse.ArgumentTypeError(f"{name} must be a power of two in [1, {top}], got {value} in {text!r}")
    return block_h, num_warps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"smoke-test setup {TINY}")
    parser.add_argument("--tokens", type=list_of(positive_int, "token counts"),
                        help="comma-separated token counts per rank (default: the setup's)")
    parser.add_argument("--experts", type=positive_int)
    parser.add_argument("--topk", type=positive_int)
    parser.add_argument("--hidden", type=positive_int)
    parser.add_argument("--transports", type=names_from(("symm", "torch"), "transports"), default="symm,torch",
                        help="comma-separated: symm, torch")
    parser.add_argument("--kernel-configs", type=list_of(kernel_config, "kernel configurations"), default=[],
                        help="comma-separated BLOCK_HxWARPS (e.g. 4096x8,2048x4): the PUT and GET kernels are "
                             "also timed at each of these launch configurations")
    parser.add_argument("--capacity-factor", type=positive_float, default=1.25)
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--iters", type=positive_int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="transport")
    add_results_dir_arg(parser)
    args = parser.parse_args(argv)
    base = TINY if args.tiny else FULL
    check_topk(parser, args.topk or base.topk, args.experts or base.experts)
    return args


def setup_from_args(args) -> Setup:
    warn_full_shape_on_cpu("bench_transport", args)
    base = TINY if args.tiny else FULL
    return Setup(tokens=args.tokens or base.tokens,
                 experts=args.experts or base.experts, topk=args.topk or base.topk, hidden=args.hidden or base.hidden)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda("tools/bench_transport.py --device cuda")
    setup = setup_from_args(args)
    ranks = init_distributed(args.device, with_megatron=False)
    if setup.experts % ranks.world:
        raise SystemExit(f"{setup.experts} experts cannot be split over {ranks.world} ranks")
    per_rank = gather_to_all(measure(ranks, setup, args))
    payload = None  # the result JSON, written by rank 0
    if ranks.rank == 0:
        rows = summarize(per_rank)
        target = dispatch_target(rows)
        print_table(rows, setup, ranks, target)
        notes = [] if ranks.device.type == "cuda" else [CPU_NOTE]
        if mxfp8_row_bytes(setup.hidden) is None:
            notes.append("mxfp8 rows not measured: megatron_ext.formats.mxfp8 is not available in this checkout")
        payload = {"args": vars(args), "setup": vars(setup), "world_size": ranks.world, "dtype": "bf16",
                   "nvlink_gbps_per_direction": NVLINK_GBPS_PER_DIRECTION, "dispatch_target": target,
                   "notes": notes, "rows": rows}
    return finish_run(args, payload)


if __name__ == "__main__":
    sys.exit(main())
