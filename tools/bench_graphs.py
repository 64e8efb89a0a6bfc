"""Eager vs CUDA-graph replay of the rowwise MoE layer, small to large microbatches.

For each token count: layer step time (fwd+bwd, CUDA events, median), host submission time,
and the memory the graph slots and their pool add. Same weights and inputs for both modes.

    python tools/bench_graphs.py [--tokens 1024,2048,4096,8192] [--slots 1]
"""

from __future__ import annotations

import argparse

import torch

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.measurement import cuda_time_ms, host_time_ms, median
from megatron_ext.bench.results import write_result
from megatron_ext.testing.megatron_moe import load_weights, moe_config
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


def measure(layer, tokens: int, hidden: int, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 1, hidden, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    grad = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    params = list(layer.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        out, _ = layer(x)
        out.backward(grad)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    step()  # graphed: captures here
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() - before
    return {"step_ms": median(cuda_time_ms(step, warmup=3, iters=iters)),
            "host_submit_ms": median(host_time_ms(step, warmup=1, iters=iters)),
            "resident_after_first_step_mib": resident / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    require_cuda("tools/bench_graphs.py")
    init_single_rank_megatron()
    weights = MoEWeights.random(args.experts, args.hidden, args.ffn, seed=0, dtype=torch.bfloat16)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        row = {"tokens": tokens}
        for mode, graphed in (("eager", False), ("graph", True)):
            layer = layer_for(args, graphed, weights)
            row[mode] = measure(layer, tokens, args.hidden, args.iters)
            if graphed:
                row["graph_fallback"] = layer._graph_runner.eager_reason
            del layer
            torch.cuda.empty_cache()
        row["step_speedup"] = row["eager"]["step_ms"] / row["graph"]["step_ms"]
        row["host_reduction"] = row["eager"]["host_submit_ms"] / row["graph"]["host_submit_ms"]
        row["graph_extra_mib"] = (row["graph"]["resident_after_first_step_mib"]
                                  - row["eager"]["resident_after_first_step_mib"])
        rows.append(row)
        print(row, flush=True)
    print(f"\n{'tokens':>7s} {'eager ms':>9s} {'graph ms':>9s} {'speedup':>8s} {'eager host':>11s} "
          f"{'graph host':>11s} {'host cut':>9s} {'slot MiB':>9s}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['eager']['step_ms']:9.2f} {r['graph']['step_ms']:9.2f} {r['step_speedup']:7.2f}x "
              f"{r['eager']['host_submit_ms']:11.2f} {r['graph']['host_submit_ms']:11.2f} {r['host_reduction']:8.1f}x "
              f"{r['graph_extra_mib']:9.0f}")
    print("wrote", write_result("graphs", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
