"""RowwiseMoELayer (reference transport) on gloo ranks against the dense oracle and Megatron."""

import functools

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.specs import moe_builder
from tests.layer_check import Case, run_and_compare
from megatron_ext.testing.megatron_moe import load_weights, megatron_moe_layer, moe_config, rank_tokens
from megatron_ext.moe.capacity import rank_capacity
from megatron_ext.testing.reference import MoEWeights, assert_close, route_topk


def build_rowwise(config, **ext):
    return moe_builder(MoEExtConfig(transport="torch", **ext))(config=config)


def kept_mask(layer):
    return layer.token_dispatcher.kept_route_mask()


def _compared_layer(rank, case, ext):
    """The rowwise layer after run_and_compare checked it against the oracle on its kept routes."""
    layers = []

    def build(config):
        layers.append(build_rowwise(config, **ext))
        return layers[0]

    run_and_compare(rank, case, build, keep_of=kept_mask)
    return layers[0]


def _dropped_routes(layer) -> int:
    return int((layer.token_dispatcher.route_map.dest_row < 0).sum())  # this rank's, in the last forward


def _rowwise_rank(rank, world, case, ext):
    return _dropped_routes(_compared_layer(rank, case, ext))


LAYOUTS = [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)]


@pytest.mark.parametrize("world,ep", LAYOUTS)
def test_rowwise_dropless_matches_oracle(world, ep):
    run_on_ranks(_rowwise_rank, world, Case(experts=8, tokens=12), dict(dropless=True), sizes=ParallelSizes(ep=ep))


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4)])
def test_rowwise_with_drops_matches_oracle_on_kept_routes(world, ep):
    # cf 0.5 with skewed random routing: many routes dropped; the oracle uses the same kept set.
    dropped = run_on_ranks(_rowwise_rank, world, Case(experts=8, tokens=16, topk=2), dict(capacity_factor=0.5),
                           sizes=ParallelSizes(ep=ep))
    assert sum(dropped) > 0, "nothing dropped: the kept-routes comparison was not exercised"


def _odd_group_rank(rank, world, case, ext):
    """_rowwise_rank, and the routes the layer's metrics count as dropped since the last read."""
    layer = _compared_layer(rank, case, ext)
    return _dropped_routes(layer), layer.read_metrics()["dropped_routes"]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_odd_group_with_uneven_tokens_matches_oracle(dtype, rtol):
    """EP=3 (the layouts above are powers of two), ranks holding 16, 5 and 11 tokens (T_max 16 is agreed at
    the first forward), at cf 0.5: every rank's kept routes equal the oracle's, dropped routes add nothing
    and the metrics count them."""
    case = Case(experts=6, tokens=16, tokens_per_rank=(16, 5, 11), dtype=dtype, rtol=rtol)
    results = run_on_ranks(_odd_group_rank, 3, case, dict(capacity_factor=0.5), sizes=ParallelSizes(ep=3))
    assert all(dropped == counted for dropped, counted in results), results
    assert sum(dropped for dropped, _ in results) > 0, "nothing dropped: the kept-routes comparison was not exercised"


def _poisoned_rank(rank, world):
    seen = []

    def build(config):
        layer = build_rowwise(config, capacity_factor=2.0, debug_poison=True)
        layer.experts.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
        return layer

    run_and_compare(rank, Case(experts=4, tokens=16), build, keep_of=kept_mask)
    (rows,) = seen
    poisoned = torch.isnan(rows).all(dim=1)
    # The poison must be there to prove anything: a tail of all-NaN rows after the received ones.
    assert poisoned.any() and not torch.isnan(rows[~poisoned]).any(), poisoned
    assert poisoned[int((~poisoned).sum()):].all(), "the received rows come first, the poisoned tail after them"


def test_rowwise_poisoned_tails_change_nothing():
    run_on_ranks(_poisoned_rank, 2, sizes=ParallelSizes(ep=2))


def _vs_megatron_rank(rank, world, router_overrides=None):
    """Dropless rowwise vs Megatron's own alltoall MoELayer (SequentialMLP) on the same weights."""
    case = Case(experts=8, tokens=10)
    config = moe_config(hidden=case.hidden, ffn=case.ffn, experts=case.experts, topk=case.topk, ep=world,
                        **(router_overrides or {}))
    weights = MoEWeights.random(case.experts, case.hidden, case.ffn, seed=5)
    x, grad_out = rank_tokens(rank, case.tokens, case.hidden)
    results = []
    for layer in (megatron_moe_layer(config), build_rowwise(config, dropless=True)):
        load_weights(layer, weights)
        x_in = x.clone().view(case.tokens, 1, case.hidden).requires_grad_(True)
        out, _ = layer(x_in)
        out.backward(grad_out.view_as(out))
        results.append((out.detach(), x_in.grad, layer.router.weight.grad))
    for name, a, b in zip(("output", "input grad", "router grad"), *results):
        assert_close(b, a, 1e-5, f"rank {rank} rowwise vs Megatron alltoall {name}")


ROUTERS = {
    "softmax": {},
    "sigmoid_aux_loss": dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=1e-2),
    "pre_softmax_seq_aux_loss": dict(moe_router_pre_softmax=True, moe_router_load_balancing_type="seq_aux_loss",
                                     moe_aux_loss_coeff=1e-2, moe_router_topk_scaling_factor=2.0),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_rowwise_dropless_equals_megatron_alltoall_layer(router):
    """Megatron's router (score function, aux losses and their gradients) is used unchanged."""
    run_on_ranks(_vs_megatron_rank, 2, ROUTERS[router], sizes=ParallelSizes(ep=2))


def _keep_agreement_rank(rank, world):
    from megatron.core import parallel_state

    config = moe_config(hidden=16, ffn=8, experts=8, topk=4, ep=world)
    layer = build_rowwise(config, capacity_factor=0.3)
    x, _ = rank_tokens(rank, 24, 16)
    layer(x.view(24, 1, 16))
    route = layer.token_dispatcher.route_map
    # The keep decision is replicated: everyone's kept_per_expert must be bitwise identical.
    kept = route.metrics.kept_per_expert
    gathered = [torch.empty_like(kept) for _ in range(world)]
    torch.distributed.all_gather(gathered, kept, group=parallel_state.get_expert_model_parallel_group())
    assert all(torch.equal(g, kept) for g in gathered), f"ranks disagree on the keep decision: {gathered}"
    assert int(route.metrics.dropped_routes) > 0, "capacity 0.3 should drop routes in this case"
    metrics = layer.read_metrics() if layer.training else None
    return int(route.metrics.dropped_routes), metrics


def test_all_ranks_agree_bitwise_on_keep_decision():
    results = run_on_ranks(_keep_agreement_rank, 4, sizes=ParallelSizes(ep=4))
    assert all(dropped > 0 for dropped, _ in results)
    metrics = results[0][1]
    assert metrics["steps"] == 1 and metrics["dropped_routes"] == results[0][0]
    assert 0 < metrics["mean_buffer_fill"] <= 1.0


def _metrics_rank(rank, world, steps=2, tokens=16, hidden=16, experts=8, topk=2):
    """read_metrics after `steps` training forwards with drops (capacity factor 0.5), and the oracle's
    requests per expert from every rank's tokens (top-k of the logits, from the definition)."""
    weights = MoEWeights.random(experts, hidden, 8, seed=5)
    layer = build_rowwise(moe_config(hidden=hidden, ffn=8, experts=experts, topk=topk, ep=world), capacity_factor=0.5)
    load_weights(layer, weights)
    requested = []
    for step in range(steps):
        x, _ = rank_tokens(rank, tokens, hidden, seed=100 + 10 * step)
        layer(x.view(tokens, 1, hidden))
        parts = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(parts, x)
        top_idx, _ = route_topk(torch.cat(parts), weights.router, topk)
        requested.append(torch.bincount(top_idx.reshape(-1), minlength=experts))
    return layer.read_metrics(), requested


def test_routing_metrics_equal_the_oracles_counts():
    """read_metrics over two steps with drops: requests per expert as the oracle counts them, kept rows
    per rank min(asked, C) (the keep is work-conserving), each rank's received rows averaged over the
    steps, the routes dropped and the bytes moved per step summed over ranks from those counts."""
    world, steps, tokens, hidden, topk = 2, 2, 16, 16, 2
    results = run_on_ranks(_metrics_rank, world, sizes=ParallelSizes(ep=world))
    capacity = rank_capacity(tokens, topk, world, 0.5, dropless=False)
    requested = results[0][1]
    per_rank = [r.view(world, -1).sum(1) for r in requested]  # rows each rank was asked for, per step
    kept = [d.clamp(max=capacity) for d in per_rank]
    assert any(bool((d > capacity).any()) for d in per_rank), "nothing overflowed: the drops are not exercised"
    total_kept = int(sum(k.sum() for k in kept))
    for rank, (metrics, _) in enumerate(results):
        assert metrics["steps"] == steps and metrics["capacity"] == capacity
        assert metrics["requested_per_expert"] == sum(requested).tolist(), metrics
        kept_per_rank = torch.tensor(metrics["kept_per_expert"]).view(world, -1).sum(1)
        assert kept_per_rank.tolist() == sum(kept).tolist(), (metrics, kept)
        fill = sum(int(k[rank]) for k in kept) / capacity / steps
        assert abs(metrics["mean_buffer_fill"] - fill) < 1e-9, (metrics["mean_buffer_fill"], fill)
        assert metrics["dispatch_row_bytes"] == hidden * 4 and metrics["dispatch_buffer_bytes"] == capacity * hidden * 4
    assert sum(m["dropped_routes"] for m, _ in results) == int(sum(r.sum() for r in requested)) - total_kept
    moved = sum(m["dispatched_bytes_per_step"] for m, _ in results)
    assert moved * steps == total_kept * hidden * 4, (moved, total_kept)


def _shared_experts_rank(rank, world):
    """Shared experts keep working: rowwise (dropless) equals Megatron's layer with the same shared MLP."""
    case = Case(experts=4, tokens=10)
    config = moe_config(hidden=case.hidden, ffn=case.ffn, experts=case.experts, topk=case.topk, ep=world,
                        moe_shared_expert_intermediate_size=24)
    weights = MoEWeights.random(case.experts, case.hidden, case.ffn, seed=6)
    x, grad_out = rank_tokens(rank, case.tokens, case.hidden)
    megatron_layer, rowwise_layer = megatron_moe_layer(config), build_rowwise(config, dropless=True)
    rowwise_layer.shared_experts.load_state_dict(megatron_layer.shared_experts.state_dict())
    results = []
    for layer in (megatron_layer, rowwise_layer):
        load_weights(layer, weights)
        x_in = x.clone().view(case.tokens, 1, case.hidden).requires_grad_(True)
        out, _ = layer(x_in)
        out.backward(grad_out.view_as(out))
        shared_grad = next(layer.shared_experts.parameters()).grad
        results.append((out.detach(), x_in.grad, shared_grad))
    for name, a, b in zip(("output", "input grad", "shared expert grad"), *results):
        assert_close(b, a, 1e-5, f"rank {rank} rowwise vs Megatron with shared experts: {name}")
    assert results[1][2].abs().sum() > 0, "the shared expert got no gradient"


def test_shared_experts_keep_working():
    run_on_ranks(_shared_experts_rank, 2, sizes=ParallelSizes(ep=2))


def _fused_router_rank(rank, world):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.moe.fused_router import FusedTopKRouter

    def build(cls, **overrides):
        config = moe_config(hidden=16, experts=8, topk=2, moe_router_load_balancing_type="aux_loss",
                            moe_aux_loss_coeff=1e-2, **overrides)
        torch.manual_seed(3)
        return cls(config=config, pg_collection=get_default_pg_collection())

    import logging

    assert build(FusedTopKRouter).unfused == []
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("megatron_ext.moe.fused_router").addHandler(handler)
    sigmoid = build(FusedTopKRouter, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    build(FusedTopKRouter, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    assert sigmoid.unfused == ["moe_router_score_function='sigmoid'", "moe_router_enable_expert_bias"]
    assert seen == ["megatron_ext: the MoE routers run Megatron's own routing (not fused) for: "
                    "moe_router_score_function='sigmoid'; moe_router_enable_expert_bias"], seen  # once
    assert build(FusedTopKRouter, moe_z_loss_coeff=1e-3).unfused == ["moe_z_loss_coeff"]
    # CPU tensors (and unfused configurations) run Megatron's own routing: [T, E] outputs, equal
    fused, megatron = build(FusedTopKRouter), build(TopKRouter)
    assert torch.equal(fused.weight, megatron.weight)
    x = torch.randn(6, 1, 16)
    for got, want in zip(fused(x), megatron(x)):
        assert torch.equal(got, want)


def test_fused_router_names_what_it_does_not_fuse_and_falls_back_on_cpu():
    run_on_ranks(_fused_router_rank, 1, sizes=ParallelSizes())


def _host_phases_rank(rank, world):
    """bench_moe_layer --host-phases on a CPU layer: every MoELayer phase is timed, the layer's
    own methods are back afterwards, and the backward nodes of our autograd Functions are listed."""
    from megatron_ext.bench.host_phases import FORWARD_PHASES, backward_nodes, forward_phase_ms
    from megatron_ext.bench.measurement import make_step

    config = moe_config(hidden=16, experts=4, topk=2)
    layer = build_rowwise(config, dropless=True)
    x, grad_out = rank_tokens(rank, 12, 16)
    x, grad_out = x.view(12, 1, 16), grad_out.view(12, 1, 16)
    phases = forward_phase_ms(layer, x, grad_out, iters=2)
    assert set(phases) == {*FORWARD_PHASES, "forward", "backward"}, phases
    assert all(ms > 0 for ms in phases.values()), phases
    assert sum(phases[name] for name in FORWARD_PHASES) <= phases["forward"], phases  # parts of the forward
    assert not set(FORWARD_PHASES) & set(vars(layer)), "the timing wrappers must be removed"
    nodes = {row["node"] for row in backward_nodes(make_step(layer, x, grad_out), iters=2)}
    assert {"_DispatchRowsBackward", "_CombineRowsBackward"} <= nodes, nodes


def test_host_phase_tool_times_every_moe_layer_phase():
    run_on_ranks(_host_phases_rank, 1, sizes=ParallelSizes())


def _pinned_rank(rank, world, case):
    import os
    import threading

    from megatron_ext.host_affinity import choose_core

    allowed = os.sched_getaffinity(0)
    run_and_compare(rank, case, functools.partial(build_rowwise, dropless=True, pin_host_threads=True),
                    keep_of=kept_mask)
    pinned = os.sched_getaffinity(threading.get_native_id())
    assert pinned == {choose_core(allowed, rank, world)} and (pinned != allowed or len(allowed) == 1)


def test_pinned_host_threads_change_no_result():
    """pin_host_threads: the layer's results are the oracle's, and the thread that ran it is on one core."""
    run_on_ranks(_pinned_rank, 2, Case(experts=4, tokens=12), sizes=ParallelSizes(ep=2))


def _uneven_first_microbatch_rank(rank, world):
    """Rank r's first microbatch has 16 >> r tokens: T_max is agreed at the first forward (one
    all-reduce), so every rank sizes the same capacity, exactly as with max_tokens_per_rank=16."""
    from megatron_ext.sync_audit import count_host_syncs

    results = []
    for ext in ({}, {"max_tokens_per_rank": 16}):
        layer = build_rowwise(moe_config(hidden=16, ffn=8, experts=4, topk=2, ep=world), **ext)
        load_weights(layer, MoEWeights.random(4, 16, 8, seed=5))
        outs = []
        for step, tokens in enumerate((16 >> rank, 16 >> (world - 1 - rank))):
            x = torch.randn(tokens, 1, 16, generator=torch.Generator().manual_seed(10 * step + rank),
                            requires_grad=True)
            with count_host_syncs() as audit:  # forward and backward
                out = layer(x)[0]
                out.square().sum().backward()
            outs.append((out.detach(), x.grad, audit.count))
        results.append((layer.token_dispatcher.capacity, outs))
    return results


def test_ranks_whose_first_microbatches_differ_agree_on_the_capacity():
    """Before, each rank sized its buffers from its own first microbatch, and the first exchange
    failed (gloo: a collective size mismatch) or, on GPUs, peers' rows would not fit."""
    for (agreed, got), (fixed, want) in run_on_ranks(_uneven_first_microbatch_rank, 2, sizes=ParallelSizes(ep=2)):
        assert agreed == fixed
        for (out, grad, syncs), (want_out, want_grad, want_syncs) in zip(got, want):
            assert torch.equal(out, want_out) and torch.equal(grad, want_grad)
        assert [s for *_, s in got] == [1, 0] and [s for *_, s in want] == [0, 0], "one agreement, at the first forward"


def _varying_microbatches_rank(rank, world, token_counts=(16, 4)):
    """Training forwards of `token_counts` tokens, then an evaluation forward of 2 (not counted), dropless."""
    layer = build_rowwise(moe_config(hidden=16, ffn=8, experts=4, topk=2, ep=world), dropless=True)
    load_weights(layer, MoEWeights.random(4, 16, 8, seed=5))
    for tokens in token_counts:
        layer(rank_tokens(rank, tokens, 16)[0].view(tokens, 1, 16))
    layer.eval()
    with torch.no_grad():
        layer(rank_tokens(rank, 2, 16)[0].view(2, 1, 16))
    return layer.read_metrics()


def test_dispatched_bytes_count_each_microbatchs_own_routes():
    """Microbatches below T_max (allowed: a rank holds at most T_max tokens) and an evaluation forward
    between: the bytes moved per step are the training forwards' kept routes, not the last forward's
    route count times the steps (which read 4 * 2 routes per step here instead of (16 + 4) * 2 / 2)."""
    for metrics in run_on_ranks(_varying_microbatches_rank, 2, sizes=ParallelSizes(ep=2)):
        assert metrics["steps"] == 2 and metrics["dropped_routes"] == 0, metrics
        assert metrics["dispatched_bytes_per_step"] == (16 + 4) * 2 * 16 * 4 // 2, metrics


def _failed_first_forward_rank(rank, world):
    """A first training forward that fails after its route (the sums count it), then read_metrics."""
    from unittest import mock

    layer = build_rowwise(moe_config(hidden=16, ffn=8, experts=4, topk=2, ep=world), dropless=True)
    load_weights(layer, MoEWeights.random(4, 16, 8, seed=5))
    with mock.patch("megatron_ext.moe.dispatcher.dispatch_rows", side_effect=RuntimeError("injected")):
        with pytest.raises(RuntimeError, match="injected"):
            layer(rank_tokens(rank, 16, 16)[0].view(16, 1, 16))
    return layer.read_metrics()


def test_metrics_count_a_first_forward_that_failed_after_its_route():
    """The route's kernel added the failed forward's metrics before the exception: read_metrics reports
    them (it raised a TypeError, the first forward's route count never having been taken)."""
    for metrics in run_on_ranks(_failed_first_forward_rank, 2, sizes=ParallelSizes(ep=2)):
        assert metrics["steps"] == 1 and metrics["dropped_routes"] == 0, metrics
        assert metrics["dispatched_bytes_per_step"] == 16 * 2 * 16 * 4, metrics


def _drop_notice_rank(rank, world, ext):
    """The WARNING lines logged while two rowwise layers are built with `ext`."""
    import logging

    from megatron_ext.moe import drop_notice

    drop_notice._given = False  # a fork of a process that may have given it
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_ext").addHandler(handler)
    try:
        for _ in range(2):
            build_rowwise(moe_config(hidden=16, ffn=8, experts=4, topk=2, ep=world), **ext)
    finally:
        logging.getLogger("megatron_ext").removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("ext,says", [
    (dict(capacity_factor=1.25), True),
    (dict(capacity_factor=2.0), False),  # cf >= EP: the worst case, dropless
    (dict(dropless=True), False),
    (dict(capacity_factor=1.25, on_overflow="error"), False),
    (dict(dropless_arena=True), False),  # beyond its budget: an error at the next check
    (dict(dropless_arena=True, on_overflow="drop"), True)])
def test_layers_that_may_drop_say_so_once_when_built_outside_the_launcher(ext, says):
    """A training loop of one's own gets the launcher's start-up notice from the layers: global rank 0,
    once for the model, in the config's words."""
    logged = run_on_ranks(_drop_notice_rank, 2, ext, sizes=ParallelSizes(ep=2))
    assert logged[1] == [], logged
    if says:
        assert len(logged[0]) == 1, logged
        assert "capacity_factor=1.25" in logged[0][0] and "read_metrics()['dropped_routes']" in logged[0][0]
        advice = "on_overflow='error'" if ext.get("dropless_arena") else "dropless_arena=True"
        assert advice in logged[0][0], logged
    else:
        assert logged[0] == [], logged
