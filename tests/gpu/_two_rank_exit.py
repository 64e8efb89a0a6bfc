"""A 2-rank training script with the rowwise layer (torchrun): steps, then a normal teardown.

tests/gpu/test_rowwise_multigpu.py runs it with --graphs and --eager and checks that it exits
within 60 s of the last step (a graph holding NCCL work used to keep destroy_process_group from
returning). Prints `LAST_STEP_DONE <unix time>` per rank after its last step.
"""

import os
import sys
import time

import torch


def main() -> None:
    graphs = "--graphs" in sys.argv
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    from megatron_ext.cpu_ranks import ParallelSizes, init_megatron_parallel
    from tests.gpu.ep_layers import EXPERTS_PER_RANK, SHAPE, ep_layer, ep_step
    from megatron_ext.testing.reference import MoEWeights

    init_megatron_parallel(ParallelSizes(ep=world))
    weights = MoEWeights.random(EXPERTS_PER_RANK * world, SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)
    layer = ep_layer("symm", world, weights, cuda_graphs=graphs)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for _ in range(5):
        x = torch.randn(1024, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
        ep_step(layer, x, torch.ones_like(x))
    torch.cuda.synchronize()
    runner = layer._graph_runner
    print(f"rank {rank} eager_reason={None if runner is None else runner.eager_reason}", flush=True)
    print(f"LAST_STEP_DONE {time.time()}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
