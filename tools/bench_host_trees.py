"""This checkout against another version of megatron_ext, in one process, in turns: the eager
rowwise layer's host submission (and, with --device, its device time) at one shape.

    python tools/bench_host_trees.py --baseline HEAD~1            # a git revision of this repository
    python tools/bench_host_trees.py --baseline /path/with/pkg    # a folder holding megatron_ext/

Processes on one lent host differ by 15-30% in host time, more than most host changes move it
(BENCHMARKS.md), so this tool imports the baseline beside this checkout (bench/tree_copy.py) and
times both layers in interleaved rounds (measurement.interleaved_ms): same weights, tokens,
routes and output gradients. It also reports whether the two layers' outputs and gradients are
bitwise equal. Without the repository's .git (the GPU machines get a copy of the working tree),
extract the baseline first: `git archive REV megatron_ext | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import shutil

import torch

from megatron_ext.bench.cli_types import positive_int
from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.layer_shape import add_layer_shape_args, check_layer_shape
from megatron_ext.bench.measurement import cuda_time_ms, host_time_ms, interleaved_ms, make_step, ratio_text
from megatron_ext.bench.results import add_results_dir_arg, write_result
from megatron_ext.bench.tree_copy import import_tree
from megatron_ext.testing.megatron_moe import moe_config
from megatron_ext.testing.reference import MoEWeights
from megatron_ext.testing.single_rank import init_single_rank_megatron


def rowwise_layer(package, args, weights):
    """The rowwise symm layer of `package` (this checkout's megatron_ext or the baseline's copy)."""
    config = moe_config(hidden=args.hidden, ffn=args.ffn, experts=args.experts, topk=args.topk,
                        dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32")
    ext = package.config.MoEExtConfig(transport="symm", capacity_factor=args.capacity_factor)
    layer = package.specs.moe_builder(ext)(config=config).cuda()
    package.testing.megatron_moe.load_weights(layer, weights)
    return layer


def outputs_and_grads(layer, x, grad_out):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad_out)
    return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(parser)
    parser.add_argument("--baseline", required=True, help="a git revision of this repository, or a folder "
                        "holding the other version's megatron_ext/")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--iters", type=positive_int, default=20)
    parser.add_argument("--device", action="store_true", help="also device time (fwd+bwd) in turns")
    parser.add_argument("--name", default="host_trees")
    add_results_dir_arg(parser)
    args = parser.parse_args()
    check_layer_shape(parser, args)
    require_cuda("tools/bench_host_trees.py")
    import megatron_ext
    import megatron_ext.config
    import megatron_ext.specs
    import megatron_ext.testing.megatron_moe

    try:
        base, folder = import_tree(args.baseline)
    except ValueError as error:
        parser.error(str(error))
    try:
        for module in ("config", "specs", "testing.megatron_moe"):
            __import__(f"{base.__name__}.{module}")
        init_single_rank_megatron()
        weights = MoEWeights.random(args.experts, args.hidden, args.ffn, seed=0, dtype=torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(args.tokens, 1, args.hidden, device="cuda", generator=gen).bfloat16()
        grad_out = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
        layers = {"baseline": rowwise_layer(base, args, weights),
                  "this tree": rowwise_layer(megatron_ext, args, weights)}
        results = {name: outputs_and_grads(layer, x, grad_out) for name, layer in layers.items()}
        bitwise = all(torch.equal(a, b) for a, b in zip(*results.values()))
        max_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*results.values()))
        steps = {name: make_step(layer, x, grad_out) for name, layer in layers.items()}
        host = interleaved_ms(steps, rounds=args.rounds, iters=args.iters, timer=host_time_ms)
        device = interleaved_ms(steps, rounds=args.rounds, iters=args.iters, timer=cuda_time_ms) \
            if args.device else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nbaseline {args.baseline} against this tree, {args.tokens} tokens, {args.experts} experts, "
          f"top-{args.topk}, hidden {args.hidden}, ffn {args.ffn}; {args.rounds} rounds of {args.iters} steps")
    print(f"outputs and gradients bitwise equal: {bitwise} (max difference {max_diff:.3g})")
    for label, table in (("host", host), ("device", device)):
        for name, figures in (table or {}).items():
            print(f"  {label:6s} {name:10s} {figures['median_ms']:7.3f} ms ({figures['min_ms']:.3f}.."
                  f"{figures['max_ms']:.3f})  {ratio_text(table, name, 'baseline')} of the baseline "
                  "(median, min..max of per-round ratios)")
    print("wrote", write_result(args.name, {"args": vars(args), "bitwise_equal": bitwise,
                                            "max_difference": max_diff, "host": host, "device": device},
                                args.results_dir))


if __name__ == "__main__":
    main()
