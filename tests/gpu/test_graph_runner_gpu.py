"""Graph runner on one H200: replay equals eager for 1, 2 and 4 live microbatches; one shared
slot would corrupt two live microbatches, the runner's slots do not."""

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.specs import moe_builder
from tests.megatron_moe import load_weights, moe_config
from tests.reference import MoEWeights

pytestmark = pytest.mark.gpu
SHAPE = dict(hidden=1024, ffn=512, experts=16, topk=4)


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    from tools.bench_common import init_single_rank_megatron

    init_single_rank_megatron()


@pytest.fixture(scope="module")
def weights():
    return MoEWeights.random(SHAPE["experts"], SHAPE["hidden"], SHAPE["ffn"], seed=3, dtype=torch.bfloat16)


def make_layer(weights, **ext):
    config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32")
    layer = moe_builder(MoEExtConfig(transport="symm", **ext))(config=config).cuda()
    load_weights(layer, weights)
    return layer


def microbatch(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1024, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
    return x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16()


def run_pipelined(layer, batches):
    """All forwards, then the backwards in reverse (the worst case for live slots)."""
    for p in layer.parameters():
        p.grad = None
    xs = [x.clone().requires_grad_(True) for x, _ in batches]
    outs = [layer(x)[0] for x in xs]
    for out, (_, g) in reversed(list(zip(outs, batches))):
        out.backward(g)
    return ([o.detach().float() for o in outs], [x.grad.float() for x in xs],
            layer.experts.fc1_weight.grad.float().clone())


@pytest.mark.parametrize("live", [1, 2, 4])
def test_replay_equals_eager_with_live_microbatches(weights, live):
    eager_layer = make_layer(weights, lease_slots=live)
    graphed_layer = make_layer(weights, lease_slots=live, cuda_graphs=True)
    for step in range(3):  # new inputs and routes every step
        batches = [microbatch(100 * step + i) for i in range(live)]
        eager = run_pipelined(eager_layer, batches)
        graphed = run_pipelined(graphed_layer, batches)
        assert graphed_layer._graph_runner.eager_reason is None, graphed_layer._graph_runner.eager_reason
        for i in range(live):
            assert torch.equal(graphed[0][i], eager[0][i]), f"step {step} microbatch {i} output"
            assert torch.equal(graphed[1][i], eager[1][i]), f"step {step} microbatch {i} input grad"
        torch.testing.assert_close(graphed[2], eager[2], rtol=1e-2, atol=1e-2)  # summed over microbatches


def test_one_shared_slot_corrupts_two_live_microbatches(weights):
    """What the report saw under pipeline parallelism: one graph per layer, two microbatches."""
    from megatron_ext.cuda_graphs.runner import _ReplaySlot

    shared = make_layer(weights, lease_slots=2, cuda_graphs=True)
    batches = [microbatch(7), microbatch(8)]
    run_pipelined(shared, batches[:1])  # captures 2 slots
    runner = shared._graph_runner
    first_slot = runner.slots[0]
    runner._acquire = lambda hidden: first_slot  # force both microbatches into one slot
    xs = [x.clone().requires_grad_(True) for x, _ in batches]
    outs = [_ReplaySlot.apply(x, runner, first_slot, *runner.params) for x in xs]
    first_output = outs[0].clone()
    eager = run_pipelined(make_layer(weights, lease_slots=2), batches)
    assert not torch.equal(first_output.float(), eager[0][0]), "the shared slot should have been overwritten"
