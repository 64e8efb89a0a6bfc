"""RowwiseMoELayer across 2+ GPUs: symm vs torch transport, poison, leases, graphs, stress, exit.

Skipped with fewer than 2 GPUs; run by tools/multigpu_check.sh on multi-GPU machines. Ranks
are spawned (not forked: CUDA is initialized) with NVLink multicast kept off. The ordering
these tests stress is pinned on CPU too (tests/unit/test_symm_ordering.py, simulated ranks).
"""

import functools
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.gpu.ep_layers import EXPERTS_PER_RANK, SAFE_ENV, SHAPE, ep_layer
from tests.gpu.ep_layers import ep_step as _step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ("output", "input grad", "router grad", "fc1 grad", "fc2 grad")


def _init(rank, world, port):
    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron_ext.cpu_ranks import ParallelSizes, init_megatron_parallel
    from megatron_ext.testing.reference import MoEWeights

    init_megatron_parallel(ParallelSizes(ep=world))
    return MoEWeights.random(EXPERTS_PER_RANK * world, SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)


def _finish():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _inputs(rank, seed, tokens=1024):
    gen = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    x = torch.randn(tokens, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
    return x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16()


def _spawn(fn, world, *args):
    from megatron_ext.cpu_ranks import free_port

    os.environ.update(SAFE_ENV)
    torch.multiprocessing.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def _rank_main(rank, world, port):
    from megatron_ext.testing.reference import assert_close

    weights = _init(rank, world, port)
    layer = lambda transport, **ext: ep_layer(transport, world, weights, dropless=True, **ext)  # noqa: E731
    inputs = [_inputs(rank, i) for i in range(2)]
    x, g = inputs[0]
    ref = _step(layer("torch"), x, g)
    symm = _step(layer("symm"), x, g)
    assert torch.equal(ref[5], symm[5]), "keep decisions / rows differ between transports"
    for name, a, b in zip(NAMES, symm, ref):
        assert_close(a, b, 2e-2, f"rank {rank} symm vs torch {name}")
    # MXFP8 payloads at EP > 1: the symm transport's fused quantize+PUT equals the torch transport's
    # quantize-then-exchange (same bytes), so both paths agree to bf16 rounding of the combine.
    mx_ref, mx_symm = _step(layer("torch", mxfp8_dispatch=True), x, g), _step(layer("symm", mxfp8_dispatch=True), x, g)
    assert torch.equal(mx_ref[5], mx_symm[5]), "MXFP8: keep decisions differ between transports"
    for name, a, b in zip(NAMES, mx_symm, mx_ref):
        assert_close(a, b, 2e-2, f"rank {rank} MXFP8 symm vs torch {name}")
    assert not torch.equal(mx_symm[0], symm[0]), "MXFP8 output equals BF16's bitwise: the payload stayed BF16"
    poisoned = layer("symm", debug_poison=True)
    for _ in range(2):
        got = _step(poisoned, x, g)
    for name, a, b in zip(NAMES, got, symm):
        assert torch.equal(a, b), f"rank {rank} {name} changed under tail/lease poison"
    # Two live microbatches on two lease slots.
    two = layer("symm", lease_slots=2)
    alone = [_step(layer("symm"), xi, gi) for xi, gi in inputs]
    xs = [xi.clone().requires_grad_(True) for xi, _ in inputs]
    outs = [two(xi)[0] for xi in xs]
    outs[1].backward(inputs[1][1])
    outs[0].backward(inputs[0][1])
    for i in range(2):
        assert torch.equal(outs[i].detach().float(), alone[i][0]), f"rank {rank} microbatch {i} corrupted"
    # The whole layer from CUDA graphs at EP > 1: the runner (MoEExtConfig.cuda_graphs).
    graphed, eager = layer("symm", cuda_graphs=True), layer("symm")
    for step in range(3):
        xi, gi = _inputs(rank, 10 + step)
        got, want = _step(graphed, xi, gi), _step(eager, xi, gi)
        assert graphed._graph_runner.eager_reason is None, graphed._graph_runner.eager_reason
        for name, a, b in list(zip(NAMES, got, want))[:2]:
            assert torch.equal(a, b), f"rank {rank} step {step} graph replay {name} differs from eager"
    _finish()


@pytest.mark.parametrize("world", [w for w in (2, 4, 8) if w <= torch.cuda.device_count()])
def test_symm_transport_across_gpus(world):
    _spawn(_rank_main, world)


# ----------------------------------------------------------------------------- stress (issue 15, item 1)
STRESS_STEPS = 20


def _run_schedule(layer, batches, order):
    """Forwards of every microbatch, then backwards in `order`; per microbatch the _step tuple."""
    for p in layer.parameters():
        p.grad = None
    xs = [x.clone().requires_grad_(True) for x, _ in batches]
    outs, routes = [], []
    for x in xs:
        outs.append(layer(x)[0])
        routes.append(layer.token_dispatcher.route_map.dest_row.clone())
    for i in order:
        outs[i].backward(batches[i][1])
    grads = (layer.router.weight.grad.float(), layer.experts.fc1_weight.grad.float(),
             layer.experts.fc2_weight.grad.float())
    return [(o.detach().float(), x.grad.float()) for o, x in zip(outs, xs)], grads, routes


def _stress_rank(rank, world, port, return_transfer="get"):
    from megatron_ext.testing.reference import assert_close

    weights = _init(rank, world, port)
    dropped = 0
    for cf in (1.0, 1.25):
        for live in (1, 2):
            for poison in (False, True):
                ext = dict(capacity_factor=cf, debug_poison=poison)
                symm = ep_layer("symm", world, weights, return_transfer=return_transfer, lease_slots=live, **ext)
                torch_ref = ep_layer("torch", world, weights, **ext)  # autograd owns its buffers: no lease slots
                for step in range(STRESS_STEPS):
                    batches = [_inputs(rank, 100 * step + mb, tokens=512) for mb in range(live)]
                    order = list(range(live)) if step % 2 else list(reversed(range(live)))
                    got, got_grads, got_routes = _run_schedule(symm, batches, order)
                    want, want_grads, want_routes = _run_schedule(torch_ref, batches, order)
                    where = f"rank {rank} cf {cf} live {live} poison {poison} step {step}"
                    for mb in range(live):
                        assert torch.equal(got_routes[mb], want_routes[mb]), f"{where} mb {mb}: routes differ"
                        dropped += int((got_routes[mb] < 0).sum())
                        for name, a, b in zip(NAMES, got[mb], want[mb]):
                            assert not torch.isnan(a).any(), f"{where} mb {mb}: NaN in {name}"
                            assert_close(a, b, 2e-2, f"{where} mb {mb}: symm vs torch {name}")
                    for name, a, b in zip(NAMES[2:], got_grads, want_grads):
                        assert_close(a, b, 3e-2, f"{where}: symm vs torch {name}")
    total = torch.tensor([dropped], device="cuda")
    torch.distributed.all_reduce(total)
    assert int(total) > 0, "no route was dropped at capacity factor 1.0: the stress did not exercise drops"
    _finish()


@pytest.mark.parametrize("return_transfer", ["get", "put"])
def test_symm_stress_ep2_against_torch_transport(return_transfer):
    """>= 20 steps per setting, fresh routes every step, cf 1.0 (drops) and 1.25, 1 and 2 live
    microbatches in both backward orders on 2 lease slots, poison on and off; rows returned by GET
    and by PUT (transport/put_return.py)."""
    _spawn(_stress_rank, 2, return_transfer)


# ----------------------------------------------------------------------------- dropless arena (issue 20)
ARENA_LAYERS, ARENA_STEPS = 3, 10


def _arena_stack(world, **ext):
    """ARENA_LAYERS rowwise layers (symm transport), each with its own seeded weights, routers
    biased toward rank 0's first expert so that rank runs past its region and spills."""
    from megatron_ext.moe.arena import attach_arenas
    from megatron_ext.testing.reference import MoEWeights

    layers = torch.nn.ModuleList()
    for index in range(ARENA_LAYERS):
        weights = MoEWeights.random(EXPERTS_PER_RANK * world, SHAPE["hidden"], SHAPE["ffn"], seed=60 + index,
                                    dtype=torch.bfloat16)
        weights.router[0] += 0.05
        layers.append(ep_layer("symm", world, weights, **ext))
    if ext.get("dropless_arena"):
        attach_arenas(layers)
    return layers


def _arena_rank(rank, world, port, variant):
    from megatron_ext.testing.moe_stack import stack_forward, stack_grads

    _init(rank, world, port)
    spilled = 0
    graphs = variant == "graphs"
    ext = {"return_transfer": "put"} if variant == "put" else {"cuda_graphs": True} if graphs else {}
    for live in (1, 2):
        for poison in ((False,) if graphs else (False, True)):  # the runner refuses nothing, poison adds no case
            arena = _arena_stack(world, dropless_arena=True, capacity_factor=1.5, arena_region_factor=0.75,
                                 lease_slots=live, debug_poison=poison, **ext)
            dropless = _arena_stack(world, dropless=True, lease_slots=live)
            region = arena[0].token_dispatcher.arena_layer.layout.region
            for step in range(ARENA_STEPS):
                batches = [_inputs(rank, 300 + 10 * step + mb, tokens=512) for mb in range(live)]
                order = list(range(live)) if step % 2 else list(reversed(range(live)))
                results = []
                for stack in (arena, dropless):
                    for p in stack.parameters():
                        p.grad = None
                    xs = [x.clone().requires_grad_(True) for x, _ in batches]
                    outs = [stack_forward(stack, x) for x in xs]  # every forward, then the backwards
                    received = [int(layer.token_dispatcher.route_map.recv_offsets[-1]) for layer in stack]
                    values = [o.detach().clone() for o in outs]  # a replay's output is its slot's buffer
                    for i in order:
                        outs[i].backward(batches[i][1])
                    results.append((values, [x.grad for x in xs], stack_grads(stack), received))
                where = f"rank {rank} live {live} poison {poison} step {step}"
                (got, got_x, got_w, received), (want, want_x, want_w, _) = results
                spilled += sum(max(r - region, 0) for r in received[:-1])
                dropped = sum(int(layer.read_metrics()["dropped_routes"]) for layer in arena)
                assert dropped == 0, f"{where}: the arena dropped {dropped} routes (budget too small for the skew)"
                for mb in range(live):
                    assert torch.equal(got[mb], want[mb]), f"{where} mb {mb}: output differs from dropless"
                # The graph runner sums the layers' input gradients in another order (as on one GPU,
                # tests/gpu/test_dropless_arena_gpu.py): gradients within bf16 rounding there, bitwise eagerly.
                same = functools.partial(torch.testing.assert_close, rtol=1e-2, atol=1e-2) if graphs else \
                    functools.partial(torch.testing.assert_close, rtol=0, atol=0)
                for mb in range(live):
                    same(got_x[mb], want_x[mb], msg=lambda m, mb=mb: f"{where} mb {mb}: input grad\n{m}")
                for index, (a, b) in enumerate(zip(got_w, want_w)):
                    same(a, b, msg=lambda m, index=index: f"{where}: weight grad {index}\n{m}")
            if graphs:
                reasons = [layer._graph_runner.eager_reason for layer in arena]
                assert reasons == [None] * ARENA_LAYERS, f"rank {rank}: a layer ran eagerly: {reasons}"
    total = torch.tensor([spilled], device="cuda")
    torch.distributed.all_reduce(total)
    assert int(total) > 0, "no layer spilled: the test did not exercise the spill"
    _finish()


@pytest.mark.parametrize("variant", ["get", "put", "graphs"])
def test_dropless_arena_equals_dropless_at_ep2(variant):
    """Three layers sharing one arena per microbatch, the first two spilling, equal bitwise to
    dropless=True over 10 steps of fresh routes, one and two live microbatches in both backward
    orders, poison on and off: the spills and the next layers' PUTs keep their order across GPUs.
    Rows return by GET, by PUT (transport/put_return.py), or every layer runs from the graph
    runner (captured at the first step, replayed after)."""
    _spawn(_arena_rank, 2, variant)


# ----------------------------------------------------------------------------- failed capture (item 3)
def _failed_capture_rank(rank, world, port):
    weights = _init(rank, world, port)
    graphed, eager = ep_layer("symm", world, weights, cuda_graphs=True), ep_layer("symm", world, weights)
    if rank == 1:  # only one rank's capture fails: every rank must fall back together
        def sync_while_capturing(module, inputs, output):
            if torch.cuda.is_current_stream_capturing():
                output[0].sum().item()
        graphed.router.register_forward_hook(sync_while_capturing)
    for step in range(3):
        x, g = _inputs(rank, 30 + step)
        got, want = _step(graphed, x, g), _step(eager, x, g)
        for name, a, b in list(zip(NAMES, got, want))[:2]:
            assert torch.equal(a, b), f"rank {rank} step {step} eager fallback {name} differs"
    reason = graphed._graph_runner.eager_reason
    assert reason is not None, f"rank {rank} did not fall back"
    assert ("capture failed" in reason) if rank == 1 else ("another rank" in reason), reason
    torch.cuda.empty_cache()
    _finish()


def test_failed_capture_on_one_rank_falls_back_on_every_rank():
    _spawn(_failed_capture_rank, 2)


# ----------------------------------------------------------------------------- clean exit (item 4)
@pytest.mark.parametrize("graphs", [False, True])
def test_two_rank_run_exits_within_60s_of_its_last_step(graphs):
    script = os.path.join(REPO, "tests", "gpu", "_two_rank_exit.py")
    env = dict(os.environ, **SAFE_ENV, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
           "--graphs" if graphs else "--eager"]
    # In its own session, so a hang kills torchrun's workers too; under pytest-timeout's 300 s, so the output shows.
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the 2-rank run did not exit within 240 s:\n{stdout[-3000:]}\n{stderr[-5000:]}")
    ended = time.time()
    found = re.findall(r"LAST_STEP_DONE ([0-9.]+)", stdout)
    assert proc.returncode == 0 and len(found) == 2, stdout[-3000:] + stderr[-3000:]
    assert ended - max(map(float, found)) < 60, f"exit took {ended - max(map(float, found)):.0f} s after the last step"
    assert ("eager_reason=None" in stdout) if graphs else True, stdout[-2000:]
