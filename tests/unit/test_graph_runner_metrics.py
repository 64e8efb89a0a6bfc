"""The graph runner's warm-up steps do not count in the logged metrics (cuda_graphs/runner.py,
metrics_untouched): Megatron's MoE metrics tracker (the load-balancing loss it logs per layer)
and the layer's routing metrics read as before the warm-up. Uses Megatron's own tracker, so a
change of its internals fails here."""

import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from megatron_ext.cuda_graphs.uncounted_steps import metrics_untouched


class _Layer:
    _metrics = None


def test_warm_up_records_are_taken_back():
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    tracker.record("load_balancing_loss", torch.tensor(1.5), layer_number=2, num_layers=3)
    layer = _Layer()
    layer._metrics = torch.tensor([4, 5], dtype=torch.int64)
    with metrics_untouched(layer):
        for _ in range(2):  # two eager warm-up steps, as the runner takes
            tracker.record("load_balancing_loss", torch.tensor(1.0), layer_number=2, num_layers=3)
            tracker.record("z_loss", torch.tensor(3.0), layer_number=1, num_layers=3)
            layer._metrics += 7
    assert torch.equal(tracker.metrics["load_balancing_loss"].values, torch.tensor([0.0, 1.5, 0.0]))
    assert torch.equal(tracker.metrics["z_loss"].values, torch.zeros(3)), "an entry the warm-up created holds zero"
    assert torch.equal(layer._metrics, torch.tensor([4, 5]))
    tracker.record("load_balancing_loss", torch.tensor(2.0), layer_number=2, num_layers=3)  # training goes on
    assert torch.equal(tracker.metrics["load_balancing_loss"].values, torch.tensor([0.0, 3.5, 0.0]))
    tracker.clear()


def test_layer_metrics_first_made_by_the_warm_up_start_at_zero():
    layer = _Layer()
    with metrics_untouched(layer):
        layer._metrics = torch.tensor([3, 9], dtype=torch.int64)
    assert torch.equal(layer._metrics, torch.zeros(2, dtype=torch.int64))


def test_warm_up_forwards_do_not_count_in_the_overflow_check():
    """Under on_overflow='error' the layer's OverflowGuard sums every forward's route metrics; the
    warm-up's must not reach the next check's counts (nor a guard it first fills)."""
    from megatron_ext.moe.overflow import OverflowGuard

    layer = _Layer()
    layer._overflow = OverflowGuard()
    with metrics_untouched(layer):  # the guard's first record happens in the warm-up
        layer._overflow.sums, layer._overflow.peak_demand = torch.tensor([5, 2]), torch.tensor([9, 4])
    assert layer._overflow.sums.tolist() == [0, 0] and layer._overflow.peak_demand.tolist() == [0, 0]
    layer._overflow.sums += torch.tensor([1, 1])  # a training forward
    layer._overflow.peak_demand.copy_(torch.tensor([3, 3]))
    with metrics_untouched(layer):
        layer._overflow.sums += 10
        torch.maximum(layer._overflow.peak_demand, torch.tensor([8, 1]), out=layer._overflow.peak_demand)
    assert layer._overflow.sums.tolist() == [1, 1] and layer._overflow.peak_demand.tolist() == [3, 3]


def _router_state_rank(rank, world):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import moe_config

    layer = moe_builder(MoEExtConfig(transport="torch"))(config=moe_config(
        hidden=32, ffn=16, experts=8, topk=2, ep=1, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01))
    router = layer.router

    def step(seed):
        x = torch.randn(16, 1, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        layer(x)[0].sum().backward()

    step(0)  # a training microbatch
    before = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    with metrics_untouched(layer):
        for seed in (1, 2):  # the runner's two warm-up steps
            step(seed)
        moved = [name for name, buffer in layer.named_buffers() if not torch.equal(buffer, before[name])]
    after = {name: buffer for name, buffer in layer.named_buffers()}
    return moved, {name: torch.equal(after[name], before[name]) for name in before}, int(router.ga_steps)


def test_warm_up_steps_leave_the_routers_step_state_as_it_was():
    """What the router accumulates over a step for its end (the expert-bias update's tokens per expert,
    the global aux loss's counts and steps) must not count the warm-up's forwards (a review found them
    counted three times in the first step)."""
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    (moved, equal, ga_steps), = run_on_ranks(_router_state_rank, 1, sizes=ParallelSizes())
    assert {"router.local_tokens_per_expert", "router.global_tokens_per_expert", "router.ga_steps"} <= set(moved)
    assert all(equal.values()), equal
    assert ga_steps == 1
