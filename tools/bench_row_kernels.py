"""Row-transfer kernels on one GPU, against a baseline copy of the kernel module (A/B in one process).

    git show <rev>:megatron_ext/kernels/row_transfer.py > /tmp/row_transfer_base.py
    python tools/bench_row_kernels.py --baseline /tmp/row_transfer_base.py

Times `put_rows` (plain and row-scaled) and `get_rows` (prob-weighted, rows kept) of the working
tree's `megatron_ext.kernels.row_transfer` and, with --baseline, of the given file loaded as a
separate module, on the same routes and buffers: M local buffers stand in for the peers (one GPU;
what changes between the two is the kernel, not NVLink). Shape: the EP8 report shape's per-rank
load (T tokens, top-8, hidden 4096, bf16, capacity factor 1.25, balanced random routes). Medians
of CUDA-event timings after warm-up, interleaved A/B rounds; JSON to bench/results/.
The kernels' call signatures must match (extra keyword arguments are passed only to the tree's).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from megatron_ext.bench.cuda_required import require_cuda
from megatron_ext.bench.measurement import cuda_time_ms, median
from megatron_ext.bench.results import add_results_dir_arg, write_result


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def routes(tokens: int, topk: int, peers: int, capacity: int, seed: int):
    """Balanced random (dest_rank, dest_row) with distinct rows per destination, int32 on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randint(0, peers, (tokens * topk,), generator=gen)
    order = torch.randperm(tokens * topk, generator=gen)
    onehot = torch.nn.functional.one_hot(rank[order], peers)
    row_in_order = (onehot.cumsum(0) - 1).gather(1, rank[order, None]).squeeze(1)
    row = torch.empty_like(row_in_order).scatter_(0, order, row_in_order)
    kept = row < capacity
    rank, row = torch.where(kept, rank, -1), torch.where(kept, row, -1)
    return rank.view(tokens, topk).int().cuda(), row.view(tokens, topk).int().cuda()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a copy of megatron_ext/kernels/row_transfer.py to compare against")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    add_results_dir_arg(parser)
    args = parser.parse_args(argv)
    require_cuda("tools/bench_row_kernels.py")
    from megatron_ext.kernels import row_transfer as tree

    variants = {"tree": (tree, {"capacity": None})}
    if args.baseline:
        variants["baseline"] = (load_module(args.baseline, "row_transfer_baseline"), {})
    T, K, H, M = args.tokens, args.topk, args.hidden, args.peers
    capacity = -(-int(1.25 * T * K / M) // 16) * 16
    variants["tree"][1]["capacity"] = capacity
    dest_rank, dest_row = routes(T, K, M, capacity, seed=0)
    src = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(T, K, device="cuda")
    bufs = [torch.zeros(capacity, H, device="cuda", dtype=torch.bfloat16) for _ in range(M)]
    table = tree.peer_table_from_buffers(bufs)
    out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty(T, K, H, device="cuda", dtype=torch.bfloat16)
    ops = {
        "put_rows": lambda mod, kw: mod.put_rows(src, dest_rank, dest_row, table, **kw),
        "put_rows scaled": lambda mod, kw: mod.put_rows(src, dest_rank, dest_row, table, scale, **kw),
        "get_rows weighted+gathered":
            lambda mod, kw: mod.get_rows(table, dest_rank, dest_row, out, scale, gathered, **kw),
    }
    times = {(op, v): [] for op in ops for v in variants}
    for _ in range(args.rounds):  # interleaved rounds: clock drift hits both variants alike
        for op, fn in ops.items():
            for name, (module, kwargs) in variants.items():
                times[(op, name)] += cuda_time_ms(lambda: fn(module, kwargs), warmup=5, iters=args.iters)
    kept_bytes = int((dest_row >= 0).sum()) * H * 2
    rows = []
    for op in ops:
        row = {"op": op}
        for name in variants:
            ms = median(times[(op, name)])
            row[f"{name}_ms"] = ms
            row[f"{name}_gb_s"] = kept_bytes / ms / 1e6
        if "baseline" in variants:
            row["tree_over_baseline"] = row["tree_ms"] / row["baseline_ms"]
        rows.append(row)
        print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    path = write_result("row_kernels", {"shape": {"tokens": T, "topk": K, "hidden": H, "peers": M,
                                                  "capacity": capacity}, "baseline": args.baseline, "rows": rows},
                        args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
