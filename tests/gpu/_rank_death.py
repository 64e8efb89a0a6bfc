"""Two-rank rowwise training (symm transport) where rank 1 dies mid-step (tests/gpu/test_rank_death_multigpu.py).

Started per rank by the test (RANK, WORLD_SIZE, MASTER_ADDR/PORT set; no torchrun, whose agent
would kill the survivor itself). Rank 1 SIGKILLs itself right before the combine of step 3 and
writes the time to argv[1]; rank 0 must then end on its own, through megatron_ext's barrier
watchdog, with a message naming the phase.
"""

import os
import signal
import sys
import time

import torch


def main() -> None:
    kill_note = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl")
    from megatron_ext.cpu_ranks import ParallelSizes, init_megatron_parallel
    from megatron_ext.testing.reference import MoEWeights
    from tests.gpu.ep_layers import EXPERTS_PER_RANK, SHAPE, ep_layer, ep_step

    init_megatron_parallel(ParallelSizes(ep=world))
    weights = MoEWeights.random(EXPERTS_PER_RANK * world, SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)
    layer = ep_layer("symm", world, weights, peer_timeout_s=20)
    dispatcher = layer.token_dispatcher
    combine = dispatcher.token_combine
    step = {"n": 0}

    def token_combine(hidden):
        if rank == 1 and step["n"] == 3:
            torch.cuda.synchronize()
            with open(kill_note, "w") as note:
                note.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return combine(hidden)

    dispatcher.token_combine = token_combine
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for n in range(6):
        step["n"] = n
        x = torch.randn(1024, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
        ep_step(layer, x, torch.ones_like(x))
        torch.cuda.synchronize()
        print(f"rank {rank} step {n} done", flush=True)
    print(f"rank {rank} finished all steps: the peer's death went unnoticed", flush=True)


if __name__ == "__main__":
    main()
