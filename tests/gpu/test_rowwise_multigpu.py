"""RowwiseMoELayer across 2+ GPUs (symm vs torch transport, leases, poison, graph capture).

Skipped with fewer than 2 GPUs; run by tools/multigpu_check.sh on multi-GPU machines. Ranks
are spawned (not forked: CUDA is initialized) with NVLink multicast kept off.
"""

import os

import pytest
import torch

from tests.gpu.ep_layers import EXPERTS_PER_RANK, SAFE_ENV, SHAPE, ep_layer
from tests.gpu.ep_layers import ep_step as _step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")]


def _layer(transport, world, weights, **ext):
    return ep_layer(transport, world, weights, dropless=True, **ext)


def _rank_main(rank, world, port):
    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron_ext.cpu_ranks import ParallelSizes, init_megatron_parallel
    from megatron_ext.host_sync import capture_replay
    from tests.reference import MoEWeights, assert_close

    init_megatron_parallel(ParallelSizes(ep=world))
    weights = MoEWeights.random(EXPERTS_PER_RANK * world, SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    inputs = [(torch.randn(1024, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16(),
               torch.randn(1024, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()) for _ in range(2)]
    x, g = inputs[0]
    ref = _step(_layer("torch", world, weights), x, g)
    symm = _step(_layer("symm", world, weights), x, g)
    assert torch.equal(ref[5], symm[5]), "keep decisions / rows differ between transports"
    for name, a, b in zip(("output", "input grad", "router grad", "fc1 grad"), symm, ref):
        assert_close(a, b, 2e-2, f"rank {rank} symm vs torch {name}")
    poisoned = _layer("symm", world, weights, debug_poison=True)
    for _ in range(2):
        got = _step(poisoned, x, g)
    for name, a, b in zip(("output", "input grad", "router grad", "fc1 grad"), got, symm):
        assert torch.equal(a, b), f"rank {rank} {name} changed under tail/lease poison"
    # Two live microbatches on two lease slots.
    layer = _layer("symm", world, weights, lease_slots=2)
    alone = [_step(_layer("symm", world, weights), xi, gi) for xi, gi in inputs]
    xs = [xi.clone().requires_grad_(True) for xi, _ in inputs]
    outs = [layer(xi)[0] for xi in xs]
    outs[1].backward(inputs[1][1])
    outs[0].backward(inputs[0][1])
    for i in range(2):
        assert torch.equal(outs[i].detach().float(), alone[i][0]), f"rank {rank} microbatch {i} corrupted"
    # Whole layer in a CUDA graph at EP > 1.
    graph_layer = _layer("symm", world, weights)
    static_x = x.clone().requires_grad_(True)

    def step():
        static_x.grad = None
        out, _ = graph_layer(static_x)
        out.backward(g)
        return out

    graph, static_out = capture_replay(step)
    x2, _ = inputs[1]
    eager = _step(graph_layer, x2, g)
    static_x.data.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out.detach().float(), eager[0]), f"rank {rank} graph replay differs from eager"
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [w for w in (2, 4, 8) if w <= torch.cuda.device_count()])
def test_symm_transport_across_gpus(world):
    from megatron_ext.cpu_ranks import free_port

    os.environ.update(SAFE_ENV)
    torch.multiprocessing.spawn(_rank_main, args=(world, free_port()), nprocs=world, join=True)
