"""The grouped experts' two weight gradients, into main_grad: torch's grouped GEMM followed by
DDP's add (today's path without gradient-accumulation fusion) against the Triton kernel that
accumulates into main_grad in its epilogue (kernels/grouped_wgrad.py).

    python tools/bench_wgrad.py [--tokens 8192] [--skew 0.0] [--main-grad-dtype fp32] [--tiles 128x128x64x4x3,...]

Both weight gradients of one layer step (fc1 [L, 2F, H] and fc2 [L, H, F]) per timed step, on
the same rows, offsets and main_grad, timed in turns (device time, CUDA events). Also printed:
the grouped GEMMs alone (the floor today's path has without its add) and whether the kernel's
main_grad matches an fp32 reference. `--tiles` times more tile configurations in the same turns
(block_m x block_n x block_rows x warps x stages each). main_grad is fp32 in Megatron's bf16
training by default and bf16 with `--grad-reduce-in-bf16` (`--main-grad-dtype bf16`).
"""

from __future__ import annotations

import argparse

import torch

from megatron_ext.bench.cli_types import list_of, positive_int
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.measurement import cuda_time_ms, interleaved_ms, ratio_in_rounds
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.kernels.grouped_wgrad import DEFAULT_TILES, WgradTiles, accumulate_grouped_wgrad



def tiles_arg(text: str) -> WgradTiles:
    try:
        values = [int(part) for part in text.lower().split("x")]
    except ValueError:
        values = []
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"tiles must be block_m x block_n x block_rows x warps x stages, five "
                                         f"positive integers such as 128x128x32x4x4; got {text!r}")
    return WgradTiles(*values)


def expert_ends(rows: int, experts: int, skew: float, seed: int) -> torch.Tensor:
    """int32 end offsets of `rows` routed rows over the experts: balanced for skew 0, else drawn
    from a softmax of skew * normal weights."""
    gen = torch.Generator().manual_seed(seed)
    if skew == 0:
        counts = torch.full((experts,), rows // experts, dtype=torch.int64)
        counts[: rows - int(counts.sum())] += 1
    else:
        weights = torch.softmax(torch.randn(experts, generator=gen) * skew, dim=0)
        counts = torch.bincount(torch.multinomial(weights, rows, replacement=True, generator=gen), minlength=experts)
    return counts.cumsum(0).to(torch.int32).cuda()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=8192)
    parser.add_argument("--experts", type=positive_int, default=64)
    parser.add_argument("--topk", type=positive_int, default=8)
    parser.add_argument("--hidden", type=positive_int, default=2048)
    parser.add_argument("--ffn", type=positive_int, default=1024)
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="buffer rows per routed row (tail unread)")
    parser.add_argument("--skew", type=float, default=0.0, help="0: balanced experts; >0: lognormal-like loads")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--iters", type=positive_int, default=10)
    parser.add_argument("--tiles", type=list_of(tiles_arg, "tile configurations"), default=[],
                        help="more tile configurations to time, e.g. 128x128x32x4x4,256x128x32x8x4")
    parser.add_argument("--main-grad-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32 (Megatron's default in bf16 training) or bf16 (--grad-reduce-in-bf16)")
    parser.add_argument("--name", default="wgrad")
    add_results_dir_arg(parser)
    args = parser.parse_args()
    if args.capacity_factor < 1 or args.skew < 0:
        parser.error(f"--capacity-factor must be >= 1 (the buffer holds every routed row) and --skew >= 0, got "
                     f"{args.capacity_factor} and {args.skew}")
    require_cuda("tools/bench_wgrad.py")
    torch.manual_seed(0)
    routed = args.tokens * args.topk
    buffer_rows = int(routed * args.capacity_factor)
    ends = expert_ends(routed, args.experts, args.skew, seed=1)
    hidden, ffn, experts = args.hidden, args.ffn, args.experts
    rows = {name: torch.randn(buffer_rows, width, device="cuda").bfloat16()
            for name, width in (("x", hidden), ("grad_fc1_out", 2 * ffn), ("act", ffn), ("grad_out", hidden))}
    grad_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.main_grad_dtype]
    main_grads = {"fc1": torch.zeros(experts, 2 * ffn, hidden, device="cuda", dtype=grad_dtype),
                  "fc2": torch.zeros(experts, hidden, ffn, device="cuda", dtype=grad_dtype)}
    operands = {"fc1": (rows["grad_fc1_out"], rows["x"]), "fc2": (rows["grad_out"], rows["act"])}

    def grouped_mm_only():
        return [torch._grouped_mm(left.t(), right, offs=ends) for left, right in operands.values()]

    def grouped_mm_and_add():
        for name, (left, right) in operands.items():
            main_grads[name].add_(torch._grouped_mm(left.t(), right, offs=ends))

    def fused(tiles: WgradTiles):
        def step():
            for name, (left, right) in operands.items():
                accumulate_grouped_wgrad(left, right, ends, main_grads[name], tiles)
        return step

    # Correctness first: from zero, one fused step against an fp32 reference.
    for grad in main_grads.values():
        grad.zero_()
    fused(DEFAULT_TILES)()
    worst = 0.0
    first = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    for name, (left, right) in operands.items():
        for expert, (start, end) in enumerate(zip(first, ends.tolist())):
            reference = left[start:end].float().t() @ right[start:end].float()
            scale = reference.abs().max().clamp_min(1e-6)
            worst = max(worst, float((main_grads[name][expert].float() - reference).abs().max() / scale))
    print(f"fused main_grad against an fp32 reference: max error {worst:.2e} of each expert's largest value")

    steps = {"grouped_mm + add": grouped_mm_and_add, "grouped_mm only": grouped_mm_only,
             f"fused {tuple(DEFAULT_TILES)}": fused(DEFAULT_TILES)}
    for tiles in args.tiles:
        steps.setdefault(f"fused {tuple(tiles)}", fused(tiles))
    for step in steps.values():  # compile every configuration before timing
        step()
    timings = interleaved_ms(steps, rounds=args.rounds, iters=args.iters, timer=cuda_time_ms)
    flops = 2 * routed * hidden * 3 * ffn  # per routed row: fc1 2F x H and fc2 H x F multiply-adds
    print(f"\n{args.tokens} tokens x top-{args.topk}, {experts} experts, hidden {hidden}, ffn {ffn}, skew {args.skew}, "
          f"{args.main_grad_dtype} main_grad")
    print(f"{'path':34s} {'ms (min..max)':>22s} {'x today (per-round min..max)':>28s} {'TFLOP/s':>8s}")
    base = "grouped_mm + add"
    for name, timing in timings.items():
        ratio = ratio_in_rounds(timings, name, base)  # the median of per-round ratios, not of medians
        timing["ratio_to_today"] = ratio
        spread = f"{ratio['ratio']:.3f} ({ratio['min']:.3f}..{ratio['max']:.3f})"
        print(f"{name:34s} {timing['median_ms']:8.3f} ({timing['min_ms']:.3f}..{timing['max_ms']:.3f}) "
              f"{spread:>28s} {flops / timing['median_ms'] / 1e9:8.0f}")
    print("wrote", write_result(args.name, {"args": vars(args), "max_relative_error": worst,
                                            "timings": timings, "flops": flops}, args.results_dir))


if __name__ == "__main__":
    main()
