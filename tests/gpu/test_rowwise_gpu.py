"""RowwiseMoELayer on one H200 (EP=1): symm transport parity, poison, leases, sync freedom."""

import functools

import pytest
import torch
import torch.utils.checkpoint

from megatron_ext.config import MoEExtConfig
from megatron_ext.host_sync import capture_replay, profiled_sync_calls
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, megatron_moe_layer, moe_config
from megatron_ext.testing.reference import MoEWeights, assert_close

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden=1024, ffn=512, experts=16, topk=4)
TOKENS = 2048


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()


# Route paths a proof must cover: the fused router (softmax top-k, the default), Megatron's router
# with the fused route selection (any router the fused one does not take: here sigmoid with an
# expert bias, moe/fused_routes.select), and the torch route map (fused_route_map=False).
ROUTE_PATHS = {"fused_router": ({}, {}),
               "megatron_router_fused_select": (dict(moe_router_score_function="sigmoid",
                                                     moe_router_enable_expert_bias=True), {}),
               "torch_route_map": ({}, dict(fused_route_map=False))}


def make_layer(kind, weights, config_overrides=None, **ext):
    config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False,
                        moe_router_dtype="fp32", **(config_overrides or {}))
    if kind == "megatron":
        layer = megatron_moe_layer(config)
    else:
        layer = moe_builder(MoEExtConfig(transport=kind, dropless=True, **ext))(config=config)
    layer = layer.cuda()
    load_weights(layer, weights)
    return layer


def run_step(layer, x, grad_out):
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad_out)
    return out.detach().float(), x.grad.float(), layer.router.weight.grad.float()


def inputs(seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
    return x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16()


@pytest.fixture(scope="module")
def weights():
    return MoEWeights.random(SHAPE["experts"], SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)


def test_symm_matches_torch_transport_and_megatron(weights):
    x, g = inputs()
    ref = run_step(make_layer("megatron", weights), x, g)
    for kind in ("torch", "symm"):
        got = run_step(make_layer(kind, weights), x, g)
        for name, a, b in zip(("output", "input grad", "router grad"), got, ref):
            assert_close(a, b, 2e-2, f"{kind} vs Megatron alltoall {name}")


def test_poisoned_tails_and_slots_change_nothing(weights):
    x, g = inputs(1)
    clean = run_step(make_layer("symm", weights), x, g)
    poisoned_layer = make_layer("symm", weights, debug_poison=True)
    for _ in range(2):  # second step reuses released (poisoned) slots and scratch
        poisoned = run_step(poisoned_layer, x, g)
    for name, a, b in zip(("output", "input grad", "router grad"), poisoned, clean):
        assert torch.isfinite(a).all(), f"{name} read a poisoned row"
        assert torch.equal(a, b), f"{name} changed under poison"


def test_two_live_microbatches_need_two_slots(weights):
    layer = make_layer("symm", weights, lease_slots=2)
    (x1, g1), (x2, g2) = inputs(2), inputs(3)
    alone = [run_step(make_layer("symm", weights), x, g) for x, g in ((x1, g1), (x2, g2))]
    xs = [x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)]
    outs = [layer(x)[0] for x in xs]  # both forwards before either backward: 2 live slots
    outs[1].backward(g2)
    outs[0].backward(g1)
    for i in range(2):
        assert torch.equal(outs[i].detach().float(), alone[i][0]), f"microbatch {i} output corrupted"
        assert torch.equal(xs[i].grad.float(), alone[i][1]), f"microbatch {i} input grad corrupted"
    single = make_layer("symm", weights, lease_slots=1)
    single(x1.clone().requires_grad_(True))
    with pytest.raises(RuntimeError, match="lease-slots"):
        single(x2.clone().requires_grad_(True))


def test_expert_only_training_frees_the_dispatch_slot(weights):
    """Input and router frozen, experts training: autograd would skip the dispatch backward, which
    frees the symm transport's lease (a review found the next microbatch refused). Two steps with
    one lease slot; the experts' gradients equal those of the layer with everything training."""
    x, g = inputs(4)
    trained = make_layer("symm", weights)
    run_step(trained, x, g)
    frozen = make_layer("symm", weights, lease_slots=1)
    frozen.router.weight.requires_grad_(False)
    for step in range(2):
        for p in frozen.parameters():
            p.grad = None
        frozen(x)[0].backward(g)  # x needs no gradient
        assert frozen.token_dispatcher.transport.pool.live == 0, f"step {step} left its dispatch slot taken"
    for name in ("fc1_weight", "fc2_weight"):
        got, want = getattr(frozen.experts, name).grad, getattr(trained.experts, name).grad
        assert torch.equal(got, want), f"{name} gradient differs with the input and router frozen"


def capture_layer_step(layer, seed):
    """One forward+backward of `layer` captured on static inputs: a function that replays it on
    (x, grad_out) and returns (output, input grad)."""
    static_x, static_g = inputs(seed)
    static_x = static_x.clone().requires_grad_(True)

    def step():
        static_x.grad = None
        layer.router.weight.grad = None
        out, _ = layer(static_x)
        out.backward(static_g)
        return out

    graph, static_out = capture_replay(step)

    def replay(x, g):
        static_x.data.copy_(x)
        static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        return static_out.detach().float(), static_x.grad.float()
    return replay


@pytest.mark.parametrize("route_path", ROUTE_PATHS)
def test_whole_layer_captures_in_a_cuda_graph_and_replays_like_eager(weights, route_path):
    overrides, ext = ROUTE_PATHS[route_path]
    layer = make_layer("symm", weights, overrides, **ext)
    replay = capture_layer_step(layer, 4)
    for seed in (5, 6):  # new inputs, new routes, same static buffers
        x, g = inputs(seed)
        eager = run_step(layer, x, g)
        out, grad = replay(x, g)
        assert torch.equal(out, eager[0]), "replayed output differs from eager"
        assert torch.equal(grad, eager[1]), "replayed input grad differs from eager"


@pytest.mark.parametrize("capacity_factor", [None, 1.0])  # None: dropless; 1.0 drops routes
def test_put_return_equals_get_bitwise(weights, capacity_factor):
    """return_transfer="put" (transport/put_return.py) against the GET path: the same rows summed in
    the same fp32 order, so equal bitwise, eager, with poison, and replayed from a capture, with
    0 blocking calls. EP=1 runs the same kernels into this GPU's own receive buffer."""
    sizing = dict(dropless=True) if capacity_factor is None else dict(capacity_factor=capacity_factor)
    config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32")

    def layer(**ext):
        built = moe_builder(MoEExtConfig(transport="symm", **sizing, **ext))(config=config).cuda()
        load_weights(built, weights)
        return built

    get, put, put_poisoned = layer(), layer(return_transfer="put"), layer(return_transfer="put", debug_poison=True)
    for seed in (7, 8):
        x, g = inputs(seed)
        want = run_step(get, x, g)
        for name, a, b in zip(("output", "input grad", "router grad"), run_step(put, x, g), want):
            assert torch.equal(a, b), f"put return: {name} differs from get (seed {seed})"
        for name, a, b in zip(("output", "input grad", "router grad"), run_step(put_poisoned, x, g), want):
            assert torch.equal(a, b), f"put return under poison: {name} differs from get (seed {seed})"
    assert profiled_sync_calls(lambda: run_step(put, *inputs(9))) == {}
    x, g = inputs(11)
    out, grad = capture_layer_step(put, 10)(x, g)
    eager = run_step(get, x, g)
    assert torch.equal(out, eager[0]) and torch.equal(grad, eager[1]), "put return replayed differs from get eager"


@pytest.mark.parametrize("route_path", ROUTE_PATHS)
def test_eager_step_makes_no_blocking_cuda_calls(weights, route_path):
    overrides, ext = ROUTE_PATHS[route_path]
    layer = make_layer("symm", weights, overrides, **ext)
    if route_path == "megatron_router_fused_select":
        assert layer.router.unfused, "this case must run Megatron's routing and the fused route selection"
    x, g = inputs(7)
    run_step(layer, x, g)  # warm-up: allocation and compilation happen here
    assert profiled_sync_calls(functools.partial(run_step, layer, x, g)) == {}


def test_profiler_check_sees_megatron_alltoall_syncs(weights):
    layer = make_layer("megatron", weights)
    x, g = inputs(8)
    run_step(layer, x, g)
    assert profiled_sync_calls(functools.partial(run_step, layer, x, g)), "the check must be able to fail"


@pytest.mark.parametrize("experts,topk", [(64, 8), (256, 8), (12, 3), (8, 2), (8, 1)])
def test_fused_route_map_equals_torch_route_map(experts, topk):
    from megatron_ext.moe import fused_routes
    from megatron_ext.moe.dispatcher import routing_map_to_topk
    from megatron_ext.moe.route_map import route

    gen = torch.Generator(device="cuda").manual_seed(9)
    for tokens, capacity in ((4096, 4096), (4096, 40000), (1000, 700)):  # with and without drops
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        logits[:, :4] += 2.0  # skew towards a few experts
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(topk, dim=1).indices, True)
        probs = (torch.softmax(logits, dim=1) * routing_map).requires_grad_(True)
        top_idx = routing_map_to_topk(routing_map, topk)
        want_probs = probs.gather(1, top_idx)
        want = route(top_idx, experts, capacity, probs=want_probs)
        fused_probs = probs.detach().clone().requires_grad_(True)
        got_idx, got_probs, selection = fused_routes.select(routing_map, fused_probs, topk)
        got = fused_routes.route(selection, topk, capacity)
        case = f"T={tokens} C={capacity}"
        assert torch.equal(got_idx.long(), top_idx), f"{case}: top-k ids differ"
        assert torch.equal(got_probs, want_probs), f"{case}: top-k probabilities differ"
        grad = torch.randn(got_probs.shape, device="cuda", generator=gen)
        want_probs.backward(grad)
        got_probs.backward(grad)
        assert torch.equal(fused_probs.grad, probs.grad), f"{case}: probability gradients differ"
        for name in ("dest_rank", "dest_row", "recv_counts", "recv_offsets", "row_source"):
            assert torch.equal(getattr(want, name).long(), getattr(got, name).long()), f"{case}: fused {name} differs"
        for name in ("dropped_routes", "kept_per_expert", "requested_per_expert", "packed"):
            assert torch.equal(getattr(want.metrics, name), getattr(got.metrics, name)), f"{case}: {name} differs"
        # torch divides by a host scalar as a multiply by its reciprocal on GPUs: equal within an ulp
        torch.testing.assert_close(got.metrics.buffer_fill, want.metrics.buffer_fill, rtol=1e-6, atol=0)
        # The launch adds the metrics into the layer's sinks once per call (program 0, whatever the
        # layout's threads), as MetricSinks.add does in torch
        from megatron_ext.moe.metric_sinks import MetricSinks

        fused_sinks, torch_sinks = (MetricSinks(torch.full((2 * experts + 4,), 5, dtype=torch.int64, device="cuda"),
                                                torch.zeros(2 * experts + 4, dtype=torch.int64, device="cuda"),
                                                torch.full((1,), 7, dtype=torch.int64, device="cuda"))
                                    for _ in range(2))
        for _ in range(3):
            fused_routes.route(selection, topk, capacity, sinks=fused_sinks)
            torch_sinks.add(want.metrics, 1)
        assert torch.equal(torch_sinks.running, 5 + 3 * want.metrics.packed.long()), "the torch form's sums"
        for name in ("running", "overflow", "peak_demand"):
            assert torch.equal(getattr(fused_sinks, name), getattr(torch_sinks, name)), f"{case}: sink {name} differs"


@pytest.mark.parametrize("route_path", ROUTE_PATHS)
def test_overflow_guard_counts_every_forward_once_on_each_route_path(weights, route_path):
    """Bounded dropless (on_overflow='error') through the layer: the route launch's adds (fused
    paths) and MetricSinks.add (the torch route map) count each training and evaluation forward
    once, a recomputed forward not at all; the check raises with the oracle's numbers, then resets."""
    import re

    from megatron_ext.moe.overflow import CapacityExceeded

    overrides, ext = ROUTE_PATHS[route_path]
    config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32",
                        **overrides)
    layer = moe_builder(MoEExtConfig(transport="symm", capacity_factor=0.5, on_overflow="error", **ext))(
        config=config).cuda()
    load_weights(layer, weights)
    x, g = inputs(11)
    run_step(layer, x, g)
    checkpointed = torch.utils.checkpoint.checkpoint(lambda t: layer(t)[0], x.clone().requires_grad_(True),
                                                     use_reentrant=True)  # Megatron's full recompute
    checkpointed.backward(g)
    layer.eval()
    with torch.no_grad():
        layer(x)
    layer.train()
    trained = layer.read_metrics()  # the two training forwards (the recompute adds nothing)
    assert trained["steps"] == 2 and trained["dropped_routes"] > 0, trained
    routes = TOKENS * SHAPE["topk"]
    with pytest.raises(CapacityExceeded) as raised:
        layer.check_overflow()
    numbers = re.search(r"(\d+) route\(s\) overflowed in the last (\d+) forward\(s\) \(the busiest rank was "
                        r"asked for (\d+) rows\)", str(raised.value))
    assert numbers, str(raised.value)
    overflowed, forwards, peak = map(int, numbers.groups())
    # three forwards of the same tokens (EP=1: this rank is asked for every route of each)
    assert (forwards, peak) == (3, routes), (forwards, peak)
    assert overflowed == 3 * trained["dropped_routes"] // 2, (overflowed, trained["dropped_routes"])
    layer.check_overflow()  # the counters were reset: nothing since


def test_mxfp8_dispatch_on_gpu(weights):
    x, g = inputs(10)
    bf16_layer = make_layer("symm", weights)
    mx_layer = make_layer("symm", weights, mxfp8_dispatch=True)
    bf16, mx = run_step(bf16_layer, x, g), run_step(mx_layer, x, g)
    for name, a, b in zip(("output", "input grad", "router grad"), mx, bf16):
        assert_close(a, b, 0.08, f"MXFP8 vs BF16 dispatch {name}")  # bound: tests/multirank/test_mxfp8_dispatch.py
    pool_bytes = lambda layer: layer.token_dispatcher.transport.pool.slots[0].local.nbytes  # noqa: E731
    assert pool_bytes(mx_layer) <= 0.53 * pool_bytes(bf16_layer)
    mx_put = run_step(make_layer("symm", weights, mxfp8_dispatch=True, return_transfer="put"), x, g)
    for name, a, b in zip(("output", "input grad", "router grad"), mx_put, mx):
        assert torch.equal(a, b), f"MXFP8 dispatch with rows returned by PUT: {name} differs from GET"
    static_x = x.clone().requires_grad_(True)

    def step():
        static_x.grad = None
        out, _ = mx_layer(static_x)
        out.backward(g)
        return out

    graph, out = capture_replay(step)  # the MXFP8 path is synchronization-free too
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.detach().float(), mx[0])
