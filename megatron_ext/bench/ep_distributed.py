"""Distributed setup of the EP tools (bench_ep, bench_transport): one process per GPU under torchrun,
EP = world size, and what the ranks share (gather, median, writing the result and leaving).

Importing this module turns NVLink multicast off in the environment (nvlink_safe_env) before
it imports torch.
"""

from __future__ import annotations

import datetime
import os
import statistics
from dataclasses import dataclass

from megatron_ext.bench.nvlink_safe_env import NVLINK_SAFE_ENV  # first: multicast off before torch

import torch
import torch.distributed as dist

from megatron_ext.bench.results import write_result


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    device: torch.device


def init_distributed(device: str, seed: int = 1234, with_megatron: bool = True) -> Ranks:
    """Process group from torchrun's environment, or of one rank under plain python (nccl on GPUs,
    gloo on CPU) and, with `with_megatron`, Megatron's parallel state with EP = world size."""
    os.environ.update(NVLINK_SAFE_ENV)
    if "RANK" not in os.environ:  # run with plain python, not torchrun: one rank
        from megatron_ext.cpu_ranks import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU visible; use --device cpu for a gloo smoke test")
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=target, timeout=datetime.timedelta(minutes=10))
    else:
        if with_megatron:  # Megatron-Core's MoE layer runs on CPU after these shims
            from megatron_ext._cpu import apply_cpu_shims

            apply_cpu_shims()
        torch.set_num_threads(1)
        target = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    if with_megatron:
        from megatron_ext.cpu_ranks import ParallelSizes, init_megatron_parallel

        init_megatron_parallel(ParallelSizes(ep=dist.get_world_size()), seed=seed)
    return Ranks(dist.get_rank(), dist.get_world_size(), target)


def warn_full_shape_on_cpu(tool: str, args) -> None:
    """The tools' default shapes are the GPU's: on CPU they run for hours with no output."""
    if args.device == "cpu" and not args.tiny and int(os.environ.get("RANK", "0")) == 0:
        print(f"{tool}: --device cpu without --tiny runs the full GPU shape on CPU, which takes hours; add --tiny "
              f"for the smoke-test shape", flush=True)


def gather_to_all(value):
    """Every rank's picklable `value`, in rank order (a collective: all ranks call it)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def finish_run(args, payload: dict | None) -> int:
    """Write `payload` (rank 0 passes it, the others None) as args.name's result JSON under
    args.results_dir, then leave the process group on every rank together. Returns 0."""
    if payload is not None:
        path = write_result(args.name, payload, results_dir=args.results_dir)
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0
