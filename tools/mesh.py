#!/usr/bin/env python3
"""Parallel Folding planner: print both meshes and the per-rank model-state memory.

No GPU and no process group: pure arithmetic (megatron_ext.parallel.folding / .memory).

    python tools/mesh.py --world 512 --tp 1 --cp 1 --pp 8 --ep 8 --layers 48 --hidden 4096 \
        --ffn 12288 --moe-ffn 1536 --experts 128 --topk 8 --vocab 151936 --dtype bf16 \
        --optimizer adam --gpu-mem-gib 141

Without the model flags (--layers, --hidden, --moe-ffn, --experts, --topk, --vocab) only the
meshes are printed. Worlds above --table-limit ranks print a summary and the first pipeline
stage's rank table (--all-stages prints every stage). Exit status: 0, or 2 for invalid
arguments, or 1 with --strict when some stage does not fit --gpu-mem-gib.
"""

from __future__ import annotations

import argparse
import sys

from megatron_ext.bench.cli_types import non_negative_int, positive_float, positive_int
from megatron_ext.parallel.folding import FoldingMesh
from megatron_ext.parallel.memory import (
    DTYPE_BYTES, OPTIMIZERS, ModelShape, Precision, estimate, fits, render_memory)
from megatron_ext.parallel.rank_groups import DEFAULT_ORDER

MODEL_FLAGS = ("layers", "hidden", "moe_ffn", "experts", "topk", "vocab")




def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mesh.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    world = parser.add_argument_group("world (give --world, or --nodes and --gpus-per-node)")
    world.add_argument("--world", type=positive_int, help="total ranks")
    world.add_argument("--nodes", type=positive_int, help="nodes (world = nodes * gpus-per-node)")
    world.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node; adds node columns")
    sizes = parser.add_argument_group("parallel sizes")
    for flag, help_text in (("--tp", "tensor parallel"), ("--cp", "context parallel"),
                            ("--pp", "pipeline parallel"), ("--ep", "expert model parallel (EP_MP)")):
        sizes.add_argument(flag, type=positive_int, default=1, help=f"{help_text} size (default 1)")
    sizes.add_argument("--etp", type=positive_int,
                       help="expert tensor parallel size (default 1: megatron_ext's experts are not sharded over "
                            "TP; Megatron's own default would be ETP = TP)")
    sizes.add_argument("--vpp", type=positive_int, help="virtual pipeline stages per rank")
    sizes.add_argument("--order", default=DEFAULT_ORDER, help=f"rank order (default {DEFAULT_ORDER})")
    model = parser.add_argument_group("model (all of layers/hidden/moe-ffn/experts/topk/vocab, or none)")
    model.add_argument("--layers", type=positive_int)
    model.add_argument("--hidden", type=positive_int)
    model.add_argument("--ffn", type=positive_int, help="dense-layer FFN size (default 4*hidden; "
                       "used only with --dense-layers)")
    model.add_argument("--moe-ffn", type=positive_int, help="routed expert FFN size")
    model.add_argument("--experts", type=positive_int)
    model.add_argument("--topk", type=positive_int)
    model.add_argument("--vocab", type=positive_int)
    model.add_argument("--dense-layers", type=non_negative_int, default=0, help="leading dense layers")
    model.add_argument("--shared-expert-ffn", type=non_negative_int, default=0)
    model.add_argument("--heads", type=positive_int, help="attention heads (for GQA)")
    model.add_argument("--query-groups", type=positive_int, help="GQA groups (default: MHA)")
    model.add_argument("--no-swiglu", action="store_true", help="2 MLP matrices instead of 3")
    model.add_argument("--tie-embeddings", action="store_true")
    train = parser.add_argument_group("precision and memory")
    train.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="parameter dtype")
    train.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES),
                       help="gradient buffer dtype (default fp32 for bf16 params, else the param dtype)")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    train.add_argument("--distributed-optimizer", action="store_true",
                       help="shard optimizer states over DP*CP (dense) and EDP (experts)")
    train.add_argument("--gpu-mem-gib", type=positive_float, help="GPU memory to check against")
    out = parser.add_argument_group("output")
    out.add_argument("--all-stages", action="store_true", help="print every stage's rank table")
    out.add_argument("--table-limit", type=positive_int, default=64,
                     help="worlds above this print a summary and stage 0 only (default 64)")
    out.add_argument("--strict", action="store_true", help="exit 1 when a stage does not fit")
    return parser


def resolve_world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.nodes is not None and args.gpus_per_node is None:
        parser.error("--nodes needs --gpus-per-node")
    from_nodes = args.nodes * args.gpus_per_node if args.nodes is not None else None
    if args.world is None and from_nodes is None:
        parser.error("give --world, or --nodes and --gpus-per-node")
    if args.world is not None and from_nodes is not None and args.world != from_nodes:
        parser.error(f"--world {args.world} != --nodes {args.nodes} * --gpus-per-node "
                     f"{args.gpus_per_node} = {from_nodes}")
    world = args.world if args.world is not None else from_nodes
    if args.gpus_per_node is not None and world % args.gpus_per_node:
        parser.error(f"--world {world} is not a multiple of --gpus-per-node {args.gpus_per_node}")
    return world


def build_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelShape | None:
    given = [f for f in MODEL_FLAGS if getattr(args, f) is not None]
    if not given:
        return None
    missing = [f for f in MODEL_FLAGS if getattr(args, f) is None]
    if missing:
        parser.error("model flags missing: " + ", ".join("--" + f.replace("_", "-") for f in missing))
    try:
        return ModelShape(
            layers=args.layers, hidden=args.hidden, ffn=args.ffn, moe_ffn=args.moe_ffn,
            experts=args.experts, topk=args.topk, vocab=args.vocab, dense_layers=args.dense_layers,
            shared_expert_ffn=args.shared_expert_ffn, heads=args.heads, query_groups=args.query_groups,
            swiglu=not args.no_swiglu, tie_embeddings=args.tie_embeddings)
    except ValueError as error:
        parser.error(f"model: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = resolve_world(parser, args)
    etp = 1 if args.etp is None else args.etp
    if args.etp is None and args.tp > 1:
        print(f"mesh.py: expert tensor parallel size 1 (the rowwise dispatcher's experts are not sharded over TP; "
              f"Megatron alone would take ETP = TP = {args.tp}: pass --etp to choose)")
    try:
        mesh = FoldingMesh(world, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, etp=etp,
                           order=args.order, vpp=args.vpp)
    except ValueError as error:
        parser.error(f"mesh: {error}")
    model = build_model(parser, args)
    if args.gpu_mem_gib is not None and model is None:
        parser.error("--gpu-mem-gib needs the model flags")

    precision = Precision(param_dtype=args.dtype, grad_dtype=args.grad_dtype, optimizer=args.optimizer,
                          distributed_optimizer=args.distributed_optimizer)
    stage_memory = None
    if model is not None:
        try:
            stage_memory = estimate(model, mesh, precision)
        except ValueError as error:
            parser.error(f"model on mesh: {error}")

    stages = None if (args.all_stages or world <= args.table_limit) else [0]
    print(mesh.render(stages=stages, gpus_per_node=args.gpus_per_node))
    if stages is not None and mesh.pp > 1:
        shift = mesh.stage_ranks(1)[0] - mesh.stage_ranks(0)[0]
        print(f"\n(stage s, for s = 1..{mesh.pp - 1}, has the same table with every rank + s*{shift}; "
              f"--all-stages prints them)")
    if stage_memory is None:
        return 0
    print()
    print(render_memory(model, mesh, precision, stage_memory, args.gpu_mem_gib))
    if args.strict and args.gpu_mem_gib is not None and not all(fits(s, args.gpu_mem_gib) for s in stage_memory):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
