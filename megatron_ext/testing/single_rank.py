"""A one-rank process group and Megatron parallel state, for one-GPU tests and benchmarks.

Megatron's MoE layers read their groups from parallel_state, so even a single-GPU run needs a
(world size 1) process group and every model-parallel size set to 1. On a machine without CUDA
the CPU shims are applied first and the group uses gloo, so the same code runs on CPU.
"""

from __future__ import annotations

import os

import torch


def init_single_rank_megatron(seed: int = 1234) -> None:
    """One-rank torch.distributed (nccl on GPU, gloo on CPU) on a free TCP port, and Megatron's
    parallel_state with every size 1 plus model_parallel_cuda_manual_seed. Idempotent."""
    from megatron_ext.cpu_ranks import ParallelSizes, free_port, init_megatron_parallel

    if not torch.cuda.is_available():
        from megatron_ext._cpu import apply_cpu_shims

        apply_cpu_shims()
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        port = free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                             init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init_megatron_parallel(ParallelSizes(), seed=seed)
