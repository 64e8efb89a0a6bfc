"""Dropless arena (regions and spill, moe/arena.py): one budget for the MoE layers of a microbatch.

gloo ranks, torch transport, a stack of MoE layers (each layer's input is the previous output plus
the tokens). Without overflow the arena equals dropless=True bitwise (the same rows in the same
order; spilled rows, fc1's outputs and activations copied out and back unchanged), on balanced and skewed
routing and with every layer spilling; the arena holds fewer rows than the worst case; beyond the
budget routes are dropped and counted, or the check raises with on_overflow="error".
"""

import dataclasses

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe.arena import ArenaLayout, arena_layout, attach_arenas
from megatron_ext.moe import arena as arena_module, arena_rows
from megatron_ext.moe.capacity import rank_capacity
from megatron_ext.moe.overflow import CapacityExceeded
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config, rank_tokens
from megatron_ext.testing.moe_stack import stack_forward, stack_grads, stack_step
from megatron_ext.testing.reference import MoEWeights

TOKENS, HIDDEN, FFN, EXPERTS, TOPK, LAYERS = 32, 32, 16, 8, 2, 3


MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)


def _stack(world, skew: float, recompute: bool = False, experts: int = EXPERTS, **ext):
    layers = torch.nn.ModuleList()
    for index in range(LAYERS):
        layer = moe_builder(MoEExtConfig(transport="torch", **ext))(
            config=moe_config(hidden=HIDDEN, ffn=FFN, experts=experts, topk=TOPK, ep=world,
                              **(MOE_ACT if recompute else {})))
        weights = MoEWeights.random(experts, HIDDEN, FFN, seed=20 + index)
        weights.router[0] += skew  # tokens with a positive sum prefer expert 0 (rank 0's) in every layer
        load_weights(layer, weights)
        layers.append(layer)
    return layers


def _step(layers, x, g):
    return stack_step(layers, x.view(TOKENS, 1, HIDDEN), g.view(TOKENS, 1, HIDDEN))


def _arena_rank(rank, world, skew, capacity_factor, region_factor, on_overflow="drop", poison=False,
                recompute=False, act_spill=True, layout=None):
    if layout is not None:  # this forked rank only: the arena gets exactly `layout`
        arena_module.arena_layout = lambda *args: layout
    if not act_spill:  # a mutation (this forked rank only): the activation's rows past P stay in region i+1
        move = arena_rows.move_spill
        arena_rows.move_spill = lambda arrays, *args, **kwargs: move(
            dataclasses.replace(arrays, view_act=None, shared_act=None), *args, **kwargs)
    x, g = rank_tokens(rank, TOKENS, HIDDEN)
    x = x + skew  # with the router's skew: most tokens send one route to expert 0
    arena_stack = _stack(world, skew, recompute, dropless_arena=True, capacity_factor=capacity_factor,
                         arena_region_factor=region_factor, on_overflow=on_overflow, debug_poison=poison)
    kept = [layer.experts.recompute_activation is False for layer in arena_stack]
    (arena,) = attach_arenas(arena_stack)
    got = _step(arena_stack, x, g)
    metrics = [layer.read_metrics() for layer in arena_stack]
    error = None
    if on_overflow != "drop":  # "error", or "auto" (the arena's default): the check raises
        try:
            for layer in arena_stack:
                layer.check_overflow()
        except CapacityExceeded as raised:
            error = str(raised)
    want = _step(_stack(world, skew, dropless=True), x, g)
    equal = [torch.equal(a, b) for a, b in zip(got, want)]
    received = [int(m["mean_buffer_fill"] * m["capacity"] + 0.5) for m in metrics]
    return {"equal": equal, "dropped": [m["dropped_routes"] for m in metrics], "received": received,
            "layout": arena.layout, "capacities": [layer.token_dispatcher.capacity for layer in arena_stack],
            "error": error, "slots_busy": [slot.busy for slot in arena.slots],
            "spilled_before_last": int(arena.slots[0].cursors[LAYERS - 1][rank]),
            "act_arena": arena.slots[0].act is not None and all(kept)}


@pytest.mark.parametrize("world,budget", [(2, (1.5, 0.75)), (4, (2.0, 1.0))])
@pytest.mark.parametrize("skew", [0.0, 0.25])
def test_arena_equals_dropless_and_holds_fewer_rows(world, budget, skew):
    # Regions below the busiest loads: layers run on and the first two spill. (A non-last layer
    # takes at most two regions: at EP=4 the skewed rank 0 needs regions of the balanced load.)
    results = run_on_ranks(_arena_rank, world, skew, *budget, sizes=ParallelSizes(ep=world))
    worst = rank_capacity(TOKENS, TOPK, world, 1.0, dropless=True)
    for result in results:
        assert all(result["equal"]), result["equal"]
        assert result["dropped"] == [0] * LAYERS
        layout = result["layout"]
        assert layout == arena_layout(LAYERS, TOKENS, TOPK, *budget)
        assert layout.rows < LAYERS * worst  # the worst case is what dropless=True holds per layer
        assert result["slots_busy"] == [False]  # the first layer's dispatch backward freed the microbatch
    busiest = max(max(r["received"]) for r in results)
    assert busiest > layout.region  # the case ran on past a region (not a test of regions alone)


@pytest.mark.parametrize("recompute", [False, True], ids=["activation_kept", "moe_act"])
def test_poisoned_arena_changes_nothing(recompute):
    # debug_poison: the arena is NaN at every open and free, so a read of a row no one wrote (or
    # a spill read back from the wrong place) would show as NaN against dropless=True. The
    # activation lives in the arena unless Megatron's moe_act recompute is on (and then nowhere).
    results = run_on_ranks(_arena_rank, 2, 0.25, 1.5, 0.75, "drop", True, recompute, sizes=ParallelSizes(ep=2))
    for result in results:
        assert all(result["equal"]) and result["dropped"] == [0] * LAYERS, result
        assert result["act_arena"] is not recompute
    assert max(max(r["received"]) for r in results) > results[0]["layout"].region  # the layers ran on


def test_the_activation_spill_is_what_keeps_it():
    # The mutation: the spill leaves the activation out, so a spilling layer's rows past P are overwritten by
    # the next layer's activation and its fc2 weight gradient reads poison or stale rows.
    results = run_on_ranks(_arena_rank, 2, 0.25, 1.5, 0.75, "drop", True, False, False, sizes=ParallelSizes(ep=2))
    assert any(not all(result["equal"]) for result in results), "the activation's spill is not checked"


def test_skew_needs_the_shared_area_across_layers():
    # Budget 1.5 x balanced per layer: the skewed layers' loads above P share the area.
    results = run_on_ranks(_arena_rank, 2, 0.5, 1.5, 1.0, sizes=ParallelSizes(ep=2))
    for result in results:
        assert all(result["equal"]) and result["dropped"] == [0] * LAYERS
    rank0 = results[0]
    assert sum(rank0["received"]) > LAYERS * rank0["layout"].region


# Which bound a layer hit decides what helps: a layer before the last takes at most its region and the next
# one's (2P rows; less where the shared area is smaller), whatever is left of the budget.
OVERFLOWS = {
    "view_of_two_regions": ((0.5, 0.75, 0.5), "at most 64 rows in this layer",
                            "raise --moe-ext-arena-region-factor (now 0.5"),
    "view_cut_by_the_shared_area": ((0.5, 1.0, 1.0), "at most 64 rows in this layer",
                                    "raise --moe-ext-capacity-factor (now 1.0; it sizes the shared area)"),
    "budget_spent_by_earlier_spill": ((0.25, 1.0, 0.75), "Earlier layers' spill used the budget",
                                      "raise --moe-ext-capacity-factor (now 1.0; the largest load"),
}


@pytest.mark.parametrize("case", list(OVERFLOWS))
@pytest.mark.parametrize("on_overflow", ["error", "auto"])
def test_beyond_the_budget_routes_are_counted_and_raise(on_overflow, case):
    (skew, capacity_factor, region_factor), bound, remedy = OVERFLOWS[case]
    results = run_on_ranks(_arena_rank, 2, skew, capacity_factor, region_factor, on_overflow,
                           sizes=ParallelSizes(ep=2))
    dropped = sum(sum(r["dropped"]) for r in results)
    assert dropped > 0
    errors = [r["error"] for r in results if r["error"] is not None]
    assert len(errors) == 2, "every rank raises at the same check"
    assert "overflowed" in errors[0] and "dropless arena: 3 layers share" in errors[0]
    assert bound in errors[0] and remedy in errors[0] and "needs >=" not in errors[0], errors[0]
    for result in results:
        assert result["layout"] == arena_layout(LAYERS, TOKENS, TOPK, capacity_factor, region_factor)


def test_layout_and_settings_are_checked():
    layout = arena_layout(4, 128, 2, 1.1, 1.0)
    assert layout == ArenaLayout(4, 256, 1136 - 1024)
    assert layout.view_rows(0) == 256 + 112 and layout.view_rows(3) == 256 + 112
    two = arena_layout(2, 128, 2, 1.5, 0.5)
    assert two.view_rows(0) == 256 and two.view_rows(1) == 640
    # A region off 16 rows is rounded up (region 270 -> 272), the budget too (1125 -> 1136), the
    # shared area takes the rest: 1136 - 3 * 272.
    assert arena_layout(3, 100, 3, 1.25, 0.9) == ArenaLayout(3, 272, 320)
    with pytest.raises(ValueError, match="at most capacity_factor"):
        MoEExtConfig(dropless_arena=True, capacity_factor=1.1, arena_region_factor=1.2)
    with pytest.raises(ValueError, match="choose one"):
        MoEExtConfig(dropless_arena=True, dropless=True)
    assert MoEExtConfig(dropless_arena=True, cuda_graphs=True).cuda_graphs  # the graph runner drives the arena
    with pytest.raises(ValueError, match="mxfp8_dispatch"):
        MoEExtConfig(dropless_arena=True, mxfp8_dispatch=True)


def _evaluation_rank(rank, world):
    x, _ = rank_tokens(rank, TOKENS, HIDDEN)
    x = x.view(TOKENS, 1, HIDDEN)
    arena_stack = _stack(world, 0.25, dropless_arena=True, capacity_factor=1.5, arena_region_factor=0.75)
    (arena,) = attach_arenas(arena_stack)
    dropless = _stack(world, 0.25, dropless=True)
    with torch.no_grad():  # evaluation: no backward frees the microbatch, the last layer's combine does
        outs = [(stack_forward(arena_stack, x), stack_forward(dropless, x)) for _ in range(2)]
    busy_after_eval = [slot.busy for slot in arena.slots]
    got = _step(arena_stack, x, x)  # training still runs after evaluation
    want = _step(dropless, x, x)
    return [torch.equal(a, b) for a, b in outs], busy_after_eval, all(torch.equal(a, b) for a, b in zip(got, want))


def test_evaluation_forwards_free_the_arena_and_equal_dropless():
    for outs_equal, busy, trained_equal in run_on_ranks(_evaluation_rank, 2, sizes=ParallelSizes(ep=2)):
        assert outs_equal == [True, True] and busy == [False] and trained_equal


def test_layer_recompute_and_megatron_graphs_are_refused_with_the_arena():
    from types import SimpleNamespace

    from megatron_ext.rules import graph_runner_clash

    arena = MoEExtConfig(dropless_arena=True)
    recompute = SimpleNamespace(recompute_granularity="selective", recompute_modules=["moe"])
    (problem,) = graph_runner_clash(recompute, arena)
    assert "--recompute-modules moe with --moe-ext-dropless-arena" in problem
    (problem,) = graph_runner_clash(SimpleNamespace(cuda_graph_impl="local"), arena)
    assert "--cuda-graph-impl local with --moe-ext-dropless-arena" in problem
    assert graph_runner_clash(recompute, MoEExtConfig()) == []  # without the arena nothing clashes


def _unattached_rank(rank, world):
    layer = moe_builder(MoEExtConfig(transport="torch", dropless_arena=True))(
        config=moe_config(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, ep=world))
    try:
        layer(rank_tokens(rank, TOKENS, HIDDEN)[0].view(TOKENS, 1, HIDDEN))
    except RuntimeError as error:
        return str(error)
    return None


def test_a_layer_without_its_arena_says_how_to_attach_it():
    for message in run_on_ranks(_unattached_rank, 2, sizes=ParallelSizes(ep=2)):
        assert message is not None and "attach_arenas(model)" in message


def _refused_experts_rank(rank, world):
    import torch.nn.functional as F

    messages = []
    for overrides in (dict(activation_func=F.gelu),
                      dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True)):
        topk = overrides.pop("moe_router_topk", TOPK)
        try:
            moe_builder(MoEExtConfig(transport="torch", dropless_arena=True))(
                config=moe_config(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=topk, ep=world, **overrides))
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_experts_the_arena_cannot_hold_are_refused_at_construction():
    for messages in run_on_ranks(_refused_experts_rank, 2, sizes=ParallelSizes(ep=2)):
        assert len(messages) == 2, messages
        assert "dropless_arena: the experts cannot keep their rows in the arena" in messages[0]
        assert "fast path" in messages[0]
        assert "moe_apply_probs_on_input" in messages[1]


def _frozen_first_layer_rank(rank, world, router_frozen):
    """An input without gradients, layer 0's router frozen or training. Frozen (expert-only
    training): autograd would skip layer 0's dispatch backward, which frees the microbatch's arena
    slot. Training: the router's gradient comes through the probabilities, which must not be cut off
    from it. Two steps train as dropless=True does, and the slot is free after each."""
    x, g = rank_tokens(rank, TOKENS, HIDDEN)
    got, busy = [], []
    for ext in (dict(dropless_arena=True, capacity_factor=1.5), dict(dropless=True)):
        layers = _stack(world, 0.0, **ext)
        arena = attach_arenas(layers)
        for param in layers[0].router.parameters():
            param.requires_grad_(not router_frozen)
        for _ in range(2):
            out = stack_forward(layers, x.view(TOKENS, 1, HIDDEN))
            out.backward(g.view(TOKENS, 1, HIDDEN))
            busy += [slot.busy for a in arena for slot in a.slots]
        got.append([p.grad for p in layers.parameters() if p.requires_grad])
    grads_equal = all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(*got))
    first_router_grad = [p.grad for p in layers[0].router.parameters()]
    return grads_equal, busy, first_router_grad


@pytest.mark.parametrize("router_frozen", [True, False], ids=["router_frozen", "router_training"])
def test_a_first_layer_whose_input_is_frozen_trains_and_frees_its_slot(router_frozen):
    for equal, busy, first_router_grad in run_on_ranks(_frozen_first_layer_rank, 2, router_frozen,
                                                       sizes=ParallelSizes(ep=2)):
        assert equal, "a gradient differs from dropless=True's (or is missing)"
        assert busy == [False, False], "the first layer's dispatch backward did not free the microbatch's slot"
        if not router_frozen:
            assert all(grad is not None and grad.abs().sum() > 0 for grad in first_router_grad), \
                "layer 0's router got no gradient through its probabilities"


def test_a_layer_before_the_last_is_held_to_its_view():
    """A large budget with small regions (cf 3.0, regions 0.5): a skewed layer before the last may
    run on past its region only as far as its view; the routes beyond are counted, never written past it."""
    results = run_on_ranks(_arena_rank, 2, 0.5, 3.0, 0.5, "error", sizes=ParallelSizes(ep=2))
    for result in results:
        assert all(got <= view for got, view in zip(result["received"], result["capacities"])), result
        assert result["dropped"][0] > 0 and result["error"] is not None, result
    assert max(results[0]["received"][:-1]) == results[0]["capacities"][0]  # the case reaches the view


@pytest.mark.parametrize("world,budget", [(2, (1.5, 0.75)), (4, (2.0, 1.0))])
def test_a_shared_area_used_to_its_last_row(world, budget):
    """The shared area cut to exactly what the busiest destination needs (its earlier layers' spill,
    growing down from the end, meets the last layer's run-on, growing up from the start): every
    row is still where dropless=True has it (poisoned arena, bitwise), and one row fewer drops a
    route. A spill start off by one row either way overlaps the run-on or leaves the arena."""
    first = run_on_ranks(_arena_rank, world, 0.25, *budget, sizes=ParallelSizes(ep=world))
    layout = first[0]["layout"]
    need = [r["spilled_before_last"] + max(r["received"][-1] - layout.region, 0) for r in first]
    busiest = max(range(world), key=need.__getitem__)
    assert first[busiest]["spilled_before_last"] > 0 and first[busiest]["received"][-1] > layout.region
    exact = dataclasses.replace(layout, shared=need[busiest])
    for result in run_on_ranks(_arena_rank, world, 0.25, *budget, "drop", True, layout=exact,
                               sizes=ParallelSizes(ep=world)):
        assert all(result["equal"]) and result["dropped"] == [0] * LAYERS, result
        assert result["layout"] == exact
    short = dataclasses.replace(layout, shared=need[busiest] - 1)
    dropped = run_on_ranks(_arena_rank, world, 0.25, *budget, layout=short, sizes=ParallelSizes(ep=world))
    assert sum(sum(r["dropped"]) for r in dropped) > 0


def _in_flight_rank(rank, world, schedule):
    """Microbatches of 32 and 20 tokens run alone, then both live at once (lease_slots=2) in `schedule`."""
    data = [(x + 0.5, g) for x, g in (rank_tokens(rank, tokens, HIDDEN, seed=seed) for tokens, seed in ((TOKENS, 100),
                                                                                                   (20, 200)))]
    layers = _stack(world, 0.5, experts=6, dropless_arena=True, lease_slots=2, capacity_factor=1.0,
                    arena_region_factor=0.5, on_overflow="drop")
    (arena,) = attach_arenas(layers)
    alone = [stack_step(layers, x.view(-1, 1, HIDDEN), g.view(-1, 1, HIDDEN)) for x, g in data]
    dropped = sum(layer.read_metrics()["dropped_routes"] for layer in layers)
    for param in layers.parameters():
        param.grad = None
    inputs = [x.view(-1, 1, HIDDEN).clone().requires_grad_(True) for x, _ in data]
    live = {}
    for event in schedule.split():
        mb = int(event[1])
        if event[0] == "F":
            live[mb] = stack_forward(layers, inputs[mb])
        else:
            live[mb].backward(data[mb][1].view(-1, 1, HIDDEN))
    equal = [torch.equal(live[mb].detach(), alone[mb][0]) and torch.equal(inputs[mb].grad, alone[mb][1])
             for mb in range(2)]
    summed = [a + b for a, b in zip(alone[0][2:], alone[1][2:])]
    grads_equal = all(torch.equal(got, want) for got, want in zip(stack_grads(layers), summed))
    return equal, grads_equal, dropped, [slot.busy for slot in arena.slots]


@pytest.mark.parametrize("schedule", ["F0 F1 B1 B0", "F0 F1 B0 B1"])
def test_two_microbatches_in_flight_at_ep3_equal_each_alone(schedule):
    """EP=3 (an odd group), two microbatches of different sizes live at once in the arena's two slots, with
    routes dropped (on_overflow="drop"): each one's output and input gradient are bitwise those of running it
    alone, the weight gradients their sum, and both slots are free after the backwards."""
    for equal, grads_equal, dropped, busy in run_on_ranks(_in_flight_rank, 3, schedule, sizes=ParallelSizes(ep=3)):
        assert equal == [True, True] and grads_equal, (equal, grads_equal)
        assert dropped > 0, "nothing dropped: the fair policy's cuts were not exercised"
        assert busy == [False, False]
