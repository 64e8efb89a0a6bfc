"""The dropless arena (moe/arena.py) on one H200: bf16, symm transport, the fused router, a stack of
three MoE layers whose regions (3/4 of each layer's rows) make every layer run on and the first
two spill. Equal bitwise to dropless=True; one forward+backward of the stack is captured in a CUDA
graph (no host synchronization inside) and its replays equal eager on new tokens; two
microbatches alive at once (two arena slots) give each its own results."""

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.host_sync import capture_replay, profiled_sync_calls
from megatron_ext.moe.arena import attach_arenas
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config
from megatron_ext.testing.moe_stack import stack_forward, stack_grads, stack_step
from megatron_ext.testing.reference import MoEWeights
from tests.gpu import test_graph_runner_gpu as graph_runner_tests

pytestmark = pytest.mark.gpu
SHAPE = graph_runner_tests.SHAPE
single_rank = graph_runner_tests.single_rank
TOKENS, LAYERS = 1024, 3  # the graph-runner tests' microbatch
ARENA = dict(dropless_arena=True, capacity_factor=1.0, arena_region_factor=0.75)
NAMES = ["output", "input grad"] + [f"layer {i} {p} grad" for i in range(LAYERS) for p in ("router", "fc1", "fc2")]


MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)


def make_stack(recompute: bool = False, **ext):
    layers = torch.nn.ModuleList()
    for index in range(LAYERS):
        config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32",
                            **(MOE_ACT if recompute else {}))
        layer = moe_builder(MoEExtConfig(transport="symm", **ext))(config=config).cuda()
        load_weights(layer, MoEWeights.random(SHAPE["experts"], SHAPE["hidden"], SHAPE["ffn"], seed=40 + index,
                                              dtype=torch.bfloat16))
        layers.append(layer)
    if ext.get("dropless_arena"):
        attach_arenas(layers)
    return layers


batch = graph_runner_tests.microbatch  # [1024, 1, hidden] tokens and output gradient, seeded


def assert_equal(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), f"{what}: {name} differs"


@pytest.mark.parametrize("return_transfer,recompute", [("get", False), ("put", False), ("get", True)],
                         ids=["get", "put", "get_moe_act"])
def test_arena_equals_dropless_with_every_layer_spilling(return_transfer, recompute):
    """The activation lives in the arena (spilled and restored with the rows), or with Megatron's
    moe_act recompute is recomputed as the per-layer path does: equal either way."""
    arena = make_stack(recompute, **ARENA, return_transfer=return_transfer, debug_poison=True)
    dropless = make_stack(recompute, dropless=True)
    layout = arena[0].token_dispatcher.arena_layer.arena
    for seed in range(3):
        x, g = batch(seed)
        assert_equal(stack_step(arena, x, g), stack_step(dropless, x, g), f"seed {seed}")
    assert all((slot.act is None) == recompute for slot in layout.slots)
    layout = layout.layout
    assert layout.region < TOKENS * SHAPE["topk"]  # every layer ran on past its region
    assert all(layer.read_metrics()["dropped_routes"] == 0 for layer in arena)
    assert profiled_sync_calls(lambda: stack_step(arena, *batch(9))) == {}


def test_whole_stack_step_replays_equal_to_eager():
    graphed, eager = make_stack(**ARENA), make_stack(**ARENA)
    x, g = batch(0)
    static_x = x.clone().requires_grad_(True)

    def step():
        static_x.grad = None
        for layer in graphed:
            for param in layer.parameters():
                param.grad = None
        stack_forward(graphed, static_x).backward(g)

    graph, _ = capture_replay(step)  # a host synchronization inside would fail the capture
    for seed in range(1, 4):
        x, _ = batch(seed)
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        want = stack_step(eager, x, g)
        got_grads = stack_grads(graphed)
        assert torch.equal(static_x.grad, want[1]), f"replay {seed}: input grad differs from eager"
        assert_equal([want[0], want[1], *got_grads], want, f"replay {seed}")


def test_two_live_microbatches_keep_their_own_arena():
    arena, dropless = make_stack(lease_slots=2, **ARENA), make_stack(dropless=True, lease_slots=2)
    batches = [batch(20), batch(21)]
    results = []
    for stack in (arena, dropless):
        for layer in stack:
            for param in layer.parameters():
                param.grad = None
        xs = [x.clone().requires_grad_(True) for x, _ in batches]
        outs = [stack_forward(stack, x) for x in xs]  # both forwards, then both backwards
        for out, (_, g) in reversed(list(zip(outs, batches))):
            out.backward(g)
        results.append([*(o.detach() for o in outs), *(x.grad for x in xs), *stack_grads(stack)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not any(slot.busy for slot in arena[0].token_dispatcher.arena_layer.arena.slots)


@pytest.mark.parametrize("width", [1, 7, 1024, 3000])
def test_span_kernel_equals_torch_form(width):
    from megatron_ext.kernels.row_span import _copy_row_span_torch, copy_row_span

    gen = torch.Generator(device="cuda").manual_seed(width)
    src = torch.randn(300, width, device="cuda", generator=gen).bfloat16()
    src = src[:, 0].contiguous() if width == 1 else src
    for count, src_start, dst_start in ((0, 0, 0), (120, 10, 30), (500, 0, 0), (50, 280, 5), (50, 0, 390), (-3, 0, 0)):
        dst = torch.randn((400,) + src.shape[1:], device="cuda", generator=gen).to(src.dtype)
        scalars = [torch.tensor(v, device="cuda") for v in (count, src_start, dst_start)]
        values = torch.randn(300, device="cuda", generator=gen), torch.randn(400, device="cuda", generator=gen)
        got_values, want_values = values[1].clone(), values[1].clone()
        got = copy_row_span(src, dst.clone(), *scalars, values=(values[0], got_values))
        want = _copy_row_span_torch(src, dst.clone(), *scalars)
        _copy_row_span_torch(values[0], want_values, *scalars)
        assert torch.equal(got, want) and torch.equal(got_values, want_values), (width, count, src_start, dst_start)


def forward_keeping_input_grads(stack, x, input_grads: dict):
    """stack_forward, keeping the gradient each layer's input receives. Each has one consumer, so
    replays must equal eager bitwise; x.grad sums every layer's residual in whatever order
    autograd reaches them, which differs between one replayed node and the eager nodes."""
    hidden = x
    for index, layer in enumerate(stack):
        layer_input = hidden.clone()
        layer_input.register_hook(lambda grad, i=index: input_grads.__setitem__(i, grad.clone()))
        hidden = layer(layer_input)[0] + x
    return hidden


@pytest.mark.parametrize("live", [1, 2])
def test_graph_runner_replays_the_arena_equal_to_eager(live):
    """Every layer of the stack from the graph runner (--moe-ext-cuda-graphs): layer 0's replays open
    and free the arena's slots, the later layers are captured while a microbatch is live (their
    warm-up must not move its cursor), and replays of `live` microbatches equal eager."""
    graphed = make_stack(cuda_graphs=True, lease_slots=live, **ARENA)
    eager = make_stack(lease_slots=live, **ARENA)
    for step in range(3):  # the first step captures, then replays with new tokens and routes
        batches = [batch(600 + 10 * step + i) for i in range(live)]
        results = []
        for stack in (graphed, eager):
            for param in stack.parameters():
                param.grad = None
            xs = [x.clone().requires_grad_(True) for x, _ in batches]
            input_grads = [{} for _ in xs]
            outs = [forward_keeping_input_grads(stack, x, kept) for x, kept in zip(xs, input_grads)]
            values = [o.detach().clone() for o in outs]  # a replay's output is its slot's buffer
            for out, (_, g) in reversed(list(zip(outs, batches))):
                out.backward(g)
            results.append((values, input_grads, [x.grad for x in xs], stack_grads(stack)))
        for layer in graphed:
            assert layer._graph_runner.eager_reason is None, layer._graph_runner.eager_reason
        (got, got_in, got_x, got_w), (want, want_in, want_x, want_w) = results
        for i in range(live):
            assert torch.equal(got[i], want[i]), f"step {step} microbatch {i}: replayed output differs"
            for index in range(LAYERS):
                assert torch.equal(got_in[i][index], want_in[i][index]), \
                    f"step {step} microbatch {i}: layer {index}'s replayed input grad differs"
            torch.testing.assert_close(got_x[i], want_x[i], msg=lambda m: f"step {step} microbatch {i} x.grad\n{m}")
        for name, a, b in zip(NAMES[2:], got_w, want_w):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=lambda m, n=name: f"step {step} {n}\n{m}")
    assert not any(slot.busy for slot in graphed[0].token_dispatcher.arena_layer.arena.slots)


@pytest.mark.parametrize("experts,rows,region,valid", [
    (8, 4096, 3072, 4096),  # every expert's rows ~512: both GEMMs pick the large-tile kernel
    (64, 16384, 4096, 16000),  # 64 rows per expert below P, 192 past: the two pick different kernels
    (8, 2048, 1536, 1000),  # every valid row below P: the second GEMM's groups all empty
    (8, 2048, 2048, 2048),  # no run-on rows
])
def test_fc1_two_gemms_equal_one_bitwise(experts, rows, region, valid):
    """The arena's fc1 (moe/expert_mlp.fc1_two_gemms) on CUTLASS's grouped GEMMs: the rows below P
    and past P, each on offsets clamped to its range, equal one GEMM's valid rows bitwise (the
    arena's bitwise equality with dropless=True rests on it), including where the two GEMMs' rows per
    group pick different kernel configurations, random splits of the experts across P, empty groups."""
    from megatron_ext.moe.expert_mlp import fc1_two_gemms
    gen = torch.Generator(device="cuda").manual_seed(rows + region)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(experts, 1024, 4096, device="cuda", dtype=torch.bfloat16, generator=gen).div_(32)
    for trial in range(10):
        cuts = torch.randint(0, valid + 1, (experts - 1,), device="cuda", generator=gen)
        offsets = torch.cat([cuts.sort().values, cuts.new_tensor([valid])]).to(torch.int32)
        if trial == 0:
            offsets[: experts // 2] = 0  # the first half of the experts empty
        below, past = fc1_two_gemms(x, weight, offsets, region)
        one = torch._grouped_mm(x, weight, offs=offsets)
        assert torch.equal(torch.cat([below, past])[:valid], one[:valid]), f"trial {trial}: offsets {offsets.tolist()}"
