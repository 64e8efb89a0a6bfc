"""Bounded dropless (on_overflow="error"): capacity from the capacity factor, never a silent drop.

gloo ranks, torch transport. Without overflow the layer equals dropless=True bitwise (same rows in
the same places, a shorter tail); with overflow it raises CapacityExceeded at the check, naming the
layer, the count and the capacity factor needed; buffers are sized by the bound, not the worst case.
"""

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe.capacity import rank_capacity
from megatron_ext.moe.overflow import CapacityExceeded
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights, route_topk

TOKENS, HIDDEN, EXPERTS, TOPK = 16, 32, 8, 2


def _layer(world, **ext):
    layer = moe_builder(MoEExtConfig(transport="torch", **ext))(
        config=moe_config(hidden=HIDDEN, ffn=16, experts=EXPERTS, topk=TOPK, ep=world))
    load_weights(layer, MoEWeights.random(EXPERTS, HIDDEN, 16, seed=8))
    return layer


def _step(layer, x, g):
    x = x.clone().view(TOKENS, 1, HIDDEN).requires_grad_(True)
    out, _ = layer(x)
    out.backward(g.view_as(out))
    return out.detach(), x.grad, layer.experts.fc1_weight.grad


def _bounded_rank(rank, world, capacity_factor):
    x, g = rank_tokens(rank, TOKENS, HIDDEN)
    bounded = _layer(world, capacity_factor=capacity_factor, on_overflow="error")
    got = _step(bounded, x, g)
    try:
        bounded.check_overflow()
        overflowed = None
    except CapacityExceeded as error:
        overflowed = str(error)
    want = _step(_layer(world, dropless=True), x, g)
    equal = all(torch.equal(a, b) for a, b in zip(got, want))
    return overflowed, equal, bounded.token_dispatcher.capacity


@pytest.mark.parametrize("world", [2, 4])
def test_no_overflow_equals_dropless_with_bounded_buffers(world):
    results = run_on_ranks(_bounded_rank, world, 1.5, sizes=ParallelSizes(ep=world))
    for overflowed, equal, capacity in results:
        assert overflowed is None and equal
        worst = rank_capacity(TOKENS, TOPK, world, 1.0, dropless=True)
        assert capacity == rank_capacity(TOKENS, TOPK, world, 1.5, dropless=False) < worst


def test_overflow_is_an_error_naming_layer_and_factor():
    results = run_on_ranks(_bounded_rank, 2, 0.5, sizes=ParallelSizes(ep=2))
    for overflowed, equal, capacity in results:
        assert overflowed is not None and not equal
        # the test's layer is built alone (no TransformerBlock, no layer number): said so, not "layer None"
        assert "this MoE layer (built without a layer number)" in overflowed, overflowed
        assert f"capacity of {capacity} rows" in overflowed
        assert "route(s) overflowed" in overflowed and "--moe-ext-capacity-factor (now 0.5" in overflowed


def _demand_per_rank(x, world):
    """Oracle: routes asked of each EP rank by every rank's tokens (top-k of the logits, from the definition)."""
    parts = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(parts, x)
    top_idx, _ = route_topk(torch.cat(parts), MoEWeights.random(EXPERTS, HIDDEN, 16, seed=8).router, TOPK)
    return torch.bincount(top_idx.reshape(-1), minlength=EXPERTS).view(world, -1).sum(1)


def _overflow_numbers_rank(rank, world):
    layer = _layer(world, capacity_factor=0.5, on_overflow="error")
    demands = []
    for seed in (110, 100):  # two forwards; the first one's busiest rank is asked for more
        x, _ = rank_tokens(rank, TOKENS, HIDDEN, seed=seed)
        layer(x.view(TOKENS, 1, HIDDEN))
        demands.append(_demand_per_rank(x, world))
    with pytest.raises(CapacityExceeded) as raised:
        layer.check_overflow()
    layer.check_overflow()  # the check resets the counters: nothing overflowed since
    return str(raised.value), demands, layer.token_dispatcher.capacity


def test_overflow_error_counts_routes_and_names_the_factor_needed():
    """The numbers in the message against the oracle's demand over two forwards: routes overflowed
    (a work-conserving keep holds min(asked, C) rows per rank), the busiest rank's largest demand
    over both forwards (not the last), and that demand over T * K, the rows at capacity factor 1."""
    world = 2
    for message, demands, capacity in run_on_ranks(_overflow_numbers_rank, world, sizes=ParallelSizes(ep=world)):
        assert capacity == rank_capacity(TOKENS, TOPK, world, 0.5, dropless=False)
        peaks = [int(d.max()) for d in demands]
        assert peaks[0] > peaks[1] > capacity, (peaks, capacity)  # the peak is not the last forward's
        overflowed = sum(int((d - capacity).clamp(min=0).sum()) for d in demands)
        assert f"{overflowed} route(s) overflowed in the last 2 forward(s)" in message, (overflowed, message)
        assert f"the busiest rank was asked for {peaks[0]} rows" in message, (peaks, message)
        assert f"needs >= {peaks[0] / (TOKENS * TOPK):.2f})" in message, (peaks, message)


def test_config_refuses_conflicting_overflow_settings():
    with pytest.raises(ValueError, match="choose one"):
        MoEExtConfig(dropless=True, on_overflow="error")
    with pytest.raises(ValueError, match="unknown on_overflow"):
        MoEExtConfig(on_overflow="spill")


class _OverflowedLayer(torch.nn.Module):
    def __init__(self, overflowed: bool):
        super().__init__()
        self.overflowed = overflowed

    def check_overflow(self):
        if self.overflowed:
            raise CapacityExceeded("layer 3 overflowed")


def _agreement_rank(rank, world):
    from megatron_ext.training_hooks import check_overflows

    try:
        check_overflows(torch.nn.ModuleList([_OverflowedLayer(rank == 0)]))
    except CapacityExceeded as error:
        return str(error)
    return None


def test_every_rank_stops_when_one_rank_overflowed():
    # Rank 1's layers did not overflow; it must stop too, or it would wait in its next collective.
    first, second = run_on_ranks(_agreement_rank, 2)
    assert first == "layer 3 overflowed" and second is not None and "another rank's MoE layer" in second


def _megatron_graph_warm_up_rank(rank, world):
    """Two steps inside Megatron's CUDA-graph warm-up (its flag set as create_fwd_graph sets it), then
    the same step for real: only the real one is counted and checked."""
    from megatron.core.transformer import cuda_graphs

    layer = _layer(world, capacity_factor=0.5, on_overflow="error")
    x, g = rank_tokens(rank, TOKENS, HIDDEN)
    cuda_graphs._set_warmup_start()
    try:
        warm = [_step(layer, x, g) for _ in range(2)]
    finally:
        cuda_graphs._set_warmup_end()
    layer.check_overflow()  # the warm-up's overflows are no training step's
    counted_in_warm_up = layer.read_metrics(reset=False)
    real = _step(layer, x, g)
    with pytest.raises(CapacityExceeded, match="overflowed in the last 1 forward"):
        layer.check_overflow()
    same = all(torch.equal(a, b) for a, b in zip(warm[0][:2], real[:2]))  # same kernels, same results
    return counted_in_warm_up, layer.read_metrics()["steps"], same


def test_megatrons_graph_warm_up_steps_are_not_counted():
    """--cuda-graph-impl local runs eager steps before its capture; a review found them counted as
    training steps (a false CapacityExceeded from the warm-up's routes)."""
    for counted_in_warm_up, steps, same in run_on_ranks(_megatron_graph_warm_up_rank, 2, sizes=ParallelSizes(ep=2)):
        assert counted_in_warm_up is None and steps == 1 and same


def _evaluation_rank(rank, world):
    """An evaluation forward (autograd on, as Megatron's evaluate may leave it) overflowing under
    on_overflow='error': it is checked as a training step is, and counted in no training metric."""
    layer = _layer(world, capacity_factor=0.5, on_overflow="error")
    x, _ = rank_tokens(rank, TOKENS, HIDDEN)
    layer.eval()
    layer(x.view(TOKENS, 1, HIDDEN).requires_grad_(True))
    try:
        layer.check_overflow()
        error = None
    except CapacityExceeded as raised:
        error = str(raised)
    return error, layer.read_metrics()


def test_an_evaluation_forward_that_overflows_is_an_error_too():
    for error, metrics in run_on_ranks(_evaluation_rank, 2, sizes=ParallelSizes(ep=2)):
        assert error is not None and "route(s) overflowed" in error, error
        assert metrics is None  # no training step counted


def _two_reads_rank(rank, world):
    """Two training steps with a read between: each read covers the steps since the one before."""
    layer = _layer(world, capacity_factor=0.5)
    x, g = rank_tokens(rank, TOKENS, HIDDEN)
    _step(layer, x, g)
    first = layer.read_metrics()
    _step(layer, x, g)
    return first, layer.read_metrics(), layer.read_metrics()


def test_reading_the_metrics_starts_the_next_interval():
    for first, second, third in run_on_ranks(_two_reads_rank, 2, sizes=ParallelSizes(ep=2)):
        assert first["steps"] == second["steps"] == 1 and first["dropped_routes"] > 0
        assert second["dropped_routes"] == first["dropped_routes"]  # the same step again, not the sum of two
        assert second["kept_per_expert"] == first["kept_per_expert"]
        assert third is None  # nothing since the last read
