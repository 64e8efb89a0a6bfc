"""transport='deepep' with the real DeepEP V1 on 2+ GPUs of one host: parity, sync freedom, timing.

Skipped without the `deep_ep` package (build it from source: README, "DeepEP backend") or
with fewer than 2 GPUs; the multi-GPU run script (issue 11) runs it. Per EP size 2/4/8:
  - parity: RowwiseMoELayer (bf16) through deepep, torch and symm transports on the same
    weights and tokens, dropless and with drops: bitwise keep decisions; deepep equals torch
    to bf16 rounding of nothing (DeepEP moves bytes and reduces one row per DeepEP token in
    fp32), symm within the usual bf16 tolerance; two live microbatches; NaN-poisoned tails;
  - no host sync: the whole layer (forward + backward) captured in a CUDA graph and replayed,
    and the profiler finds no blocking CUDA call in an eager step;
  - timing: the four transfers of each transport (median ms per rank), printed; written as
    JSON under $MEGATRON_EXT_BENCH_RESULTS when that names a directory.
Ranks are spawned (CUDA is initialized) with NVLink multicast kept off.
"""

import importlib.util
import os

import pytest
import torch

from tests.gpu.ep_layers import EXPERTS_PER_RANK, SAFE_ENV, SHAPE
from tests.gpu.ep_layers import ep_layer as _layer
from tests.gpu.ep_layers import ep_step as _step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                       reason="needs deep_ep built from source (README, 'DeepEP backend')"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs"),
]

TOKENS = 1024
NAMES = ("output", "input grad", "router grad", "fc1 grad", "fc2 grad")


def _parity(rank, world, weights, x, g, ext):
    from megatron_ext.testing.reference import assert_close

    ref = _step(_layer("torch", world, weights, **ext), x, g)
    symm = _step(_layer("symm", world, weights, **ext), x, g)
    deep = _step(_layer("deepep", world, weights, **ext), x, g)
    assert torch.equal(deep[5], ref[5]) and torch.equal(symm[5], ref[5]), "keep decisions / rows differ"
    for name, a, b, c in zip(NAMES, deep, ref, symm):
        assert_close(a, b, 1e-6, f"rank {rank} deepep vs torch {name} ({ext})")
        assert_close(a, c, 2e-2, f"rank {rank} deepep vs symm {name} ({ext})")
    return deep


def _live_microbatches(rank, world, weights, inputs):
    layer = _layer("deepep", world, weights, dropless=True)
    alone = [_step(_layer("deepep", world, weights, dropless=True), xi, gi) for xi, gi in inputs]
    xs = [xi.clone().requires_grad_(True) for xi, _ in inputs]
    outs = [layer(xi)[0] for xi in xs]
    outs[1].backward(inputs[1][1])
    outs[0].backward(inputs[0][1])
    for i in range(2):
        assert torch.equal(outs[i].detach().float(), alone[i][0]), f"rank {rank} microbatch {i} corrupted"
        assert torch.equal(xs[i].grad.float(), alone[i][1]), f"rank {rank} microbatch {i} input grad corrupted"


def _sync_free(rank, world, weights, inputs):
    from megatron_ext.host_sync import capture_replay, profiled_sync_calls

    (x, g), (x2, _) = inputs
    layer = _layer("deepep", world, weights, dropless=True)
    _step(layer, x, g)  # DeepEP's buffer is created (a collective) outside any capture
    syncs = profiled_sync_calls(lambda: _step(layer, x, g))
    assert not syncs, f"rank {rank}: host-blocking CUDA calls in an eager deepep step: {syncs}"
    static_x = x.clone().requires_grad_(True)

    def step():
        static_x.grad = None
        out, _ = layer(static_x)
        out.backward(g)
        return out

    graph, static_out = capture_replay(step)
    eager = _step(layer, x2, g)
    static_x.data.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out.detach().float(), eager[0]), f"rank {rank} graph replay differs from eager"


def _time_transfers(world, weights, x, g, iters=20):
    """Median ms of each transport's four transfers on this rank (layer's own route map)."""
    from megatron_ext.bench.measurement import cuda_time_ms, median

    timings = {}
    for transport in ("torch", "symm", "deepep"):
        layer = _layer(transport, world, weights, capacity_factor=1.25)
        _step(layer, x, g)
        t, route = layer.token_dispatcher.transport, layer.token_dispatcher.route_map
        tokens = x.view(-1, x.shape[-1])
        probs = torch.rand(route.dest_row.shape, device="cuda")
        buffer, row_probs, lease = t.dispatch(tokens, probs, route)
        buffer, row_probs = buffer.clone(), row_probs.clone()
        t.release(lease)
        grad_out = g.view(-1, g.shape[-1])

        def dispatch():
            t.release(t.dispatch(tokens, probs, route)[2])

        phases = {"dispatch": dispatch,
                  "combine": lambda: t.combine(buffer, route),
                  "combine_backward": lambda: t.combine_backward(grad_out, route),
                  "dispatch_backward": lambda: t.dispatch_backward(buffer, row_probs, route)}
        timings[transport] = {name: median(cuda_time_ms(fn, warmup=3, iters=iters)) for name, fn in phases.items()}
    return timings


def _rank_main(rank, world, port):
    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron_ext.cpu_ranks import ParallelSizes, init_megatron_parallel
    from megatron_ext.testing.reference import MoEWeights

    init_megatron_parallel(ParallelSizes(ep=world))
    weights = MoEWeights.random(EXPERTS_PER_RANK * world, SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    inputs = [(torch.randn(TOKENS, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16(),
               torch.randn(TOKENS, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()) for _ in range(2)]
    x, g = inputs[0]
    clean = _parity(rank, world, weights, x, g, dict(dropless=True))
    _parity(rank, world, weights, x, g, dict(capacity_factor=0.5))
    poisoned = _step(_layer("deepep", world, weights, dropless=True, debug_poison=True), x, g)
    for name, a, b in zip(NAMES, poisoned, clean):
        assert torch.equal(a, b), f"rank {rank} {name} changed under tail poison"
    _live_microbatches(rank, world, weights, inputs)
    _sync_free(rank, world, weights, inputs)
    timings = _time_transfers(world, weights, x, g)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, timings)
    if rank == 0:
        print(f"\nEP={world}, {TOKENS} tokens/rank, hidden {SHAPE['hidden']}, top-{SHAPE['topk']}, bf16: "
              f"median ms per transfer (slowest rank)")
        for transport in gathered[0]:
            row = {phase: max(r[transport][phase] for r in gathered) for phase in gathered[0][transport]}
            print(f"  {transport:7s} " + "  ".join(f"{phase} {ms:.3f}" for phase, ms in row.items()))
        results_dir = os.environ.get("MEGATRON_EXT_BENCH_RESULTS")
        if results_dir:
            from megatron_ext.bench.results import write_result

            write_result(f"deepep_transport_ep{world}", dict(tokens=TOKENS, **SHAPE, per_rank=gathered),
                         results_dir)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [w for w in (2, 4, 8) if w <= torch.cuda.device_count()])
def test_deepep_transport_across_gpus(world):
    from megatron_ext.cpu_ranks import free_port

    os.environ.update(SAFE_ENV)
    torch.multiprocessing.spawn(_rank_main, args=(world, free_port()), nprocs=world, join=True)
