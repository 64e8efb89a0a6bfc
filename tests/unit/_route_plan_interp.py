"""The fused route map (Triton select and route kernels) against the torch form, under
Triton's CPU interpreter: equal top-k ids and probabilities, equal route maps and metrics, equal
probability gradients, for several EP sizes (the other ranks' counts made up), expert counts
that are not powers of two, top-k 1..8, token counts that are not multiples of a block, balanced
and skewed routing, with and without drops, a rank with no tokens. A token with fewer than K selected experts gets -1
routes, counted as dropped. NaN/Inf probabilities: only the selected routes' are counted, as in the torch form.

    TRITON_INTERPRET=1 python tests/unit/_route_plan_interp.py
"""

from __future__ import annotations

import math
import os
import sys

import torch


def routing(num_tokens, num_experts, topk, skew, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, : max(1, num_experts // 4)] += skew
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits, dim=1) * routing_map
    return routing_map, probs.requires_grad_(True)


def others_counts(counts, world, rank, seed):
    """[M, E]: this rank's counts in row `rank`, made-up counts of the same scale elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, int(counts.max()) * 2 + 2, counts.shape, generator=gen, dtype=torch.int32)
            for _ in range(world)]
    rows[rank] = counts.to(torch.int32)
    return torch.stack(rows)


def check_case(num_tokens, num_experts, topk, world, rank, capacity, skew, seed, per_dest=False) -> None:
    from megatron_ext.moe import fused_routes
    from megatron_ext.moe.dispatcher import routing_map_to_topk
    from megatron_ext.moe.metric_sinks import MetricSinks
    from megatron_ext.moe.route_map import count_routes, route

    routing_map, probs = routing(num_tokens, num_experts, topk, skew, seed)
    top_idx = routing_map_to_topk(routing_map, topk)
    want_probs = probs.gather(1, top_idx).float()
    table = others_counts(count_routes(top_idx, num_experts), world, rank, seed + 1)
    gather = lambda counts: table  # noqa: E731 - the exchange is made up here
    # per destination (the dropless arena's): what is left differs by rank, some below the loads
    dest_capacity = (torch.arange(world) * 7 % (capacity // 2 + 1) + capacity // 2) if per_dest else None
    want = route(top_idx, num_experts, capacity, gather_counts=gather, ep_rank=rank, probs=want_probs,
                 dest_capacity=dest_capacity)

    probs_fused = probs.detach().clone().requires_grad_(True)
    got_idx, got_probs, selection = fused_routes.select(routing_map, probs_fused, topk)
    assert torch.equal(got_idx.long(), top_idx), "top-k ids"
    assert torch.equal(got_probs, want_probs), "top-k probabilities"
    assert torch.equal(selection.counts, count_routes(top_idx, num_experts)), "counts"
    got = fused_routes.route(selection, topk, capacity, gather_counts=gather, ep_rank=rank,
                             dest_capacity=dest_capacity)
    case = f"T={num_tokens} E={num_experts} K={topk} M={world} rank={rank} C={capacity} skew={skew} per_dest={per_dest}"
    for name in ("dest_rank", "dest_row", "recv_counts", "recv_offsets", "row_source"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.long(), b.long()), f"{case}: {name} differs:\n{a}\n{b}"
    for name in ("requested_per_expert", "kept_per_expert", "dropped_routes", "buffer_fill", "nonfinite_routes"):
        a, b = getattr(got.metrics, name), getattr(want.metrics, name)
        assert torch.equal(a.double(), b.double()), f"{case}: metric {name} differs: {a} vs {b}"
    assert torch.equal(got.metrics.packed, want.metrics.packed), f"{case}: packed metrics differ"
    # The launch adds the metrics into the layer's sinks as MetricSinks.add does: two forwards on top
    # of what was there, the running sums alone and with the overflow guard's counters.
    for guard in (False, True):
        sums = [torch.arange(2 * num_experts + 4, dtype=torch.int64) * 3 for _ in range(2)]
        peaks = [torch.arange(world, dtype=torch.int64) * 5 for _ in range(2)]
        fused_sinks, torch_sinks = (MetricSinks(s, s + 1 if guard else None, p if guard else None)
                                    for s, p in zip(sums, peaks))
        for _ in range(2):
            fused_routes.route(selection, topk, capacity, gather_counts=gather, ep_rank=rank,
                               dest_capacity=dest_capacity, sinks=fused_sinks)
            torch_sinks.add(want.metrics, world)
        for name in ("running", "overflow", "peak_demand"):
            a, b = getattr(fused_sinks, name), getattr(torch_sinks, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{case}: sink {name} {a} vs {b}"
        if guard:  # the made-up loads of other ranks exceed the starting peaks: the max must have moved
            assert not torch.equal(peaks[1], torch.arange(world) * 5), f"{case}: the peak demand did not move"
    grad = torch.randn(num_tokens, topk, generator=torch.Generator().manual_seed(seed + 2))
    (want_probs * grad).sum().backward()
    (got_probs * grad).sum().backward()
    assert torch.equal(probs_fused.grad, probs.grad), f"{case}: probability gradients differ"
    print(f"ok {case} dropped={int(want.metrics.dropped_routes)}")


def check_arena_case(num_tokens, num_experts, topk, world, rank, skew, seed, spills: bool) -> None:
    """The dropless arena's cursor (moe/arena.ArenaCursor): the fused kernel plans with the
    capacities it reads from the cursor and writes the cursor after the layer and this rank's
    spill start, equal to the torch form (capacities, route, advance)."""
    from megatron_ext.moe import fused_routes
    from megatron_ext.moe.arena import ArenaCursor
    from megatron_ext.moe.dispatcher import routing_map_to_topk
    from megatron_ext.moe.metric_sinks import MetricSinks
    from megatron_ext.moe.route_map import count_routes, route

    routing_map, probs = routing(num_tokens, num_experts, topk, skew, seed)
    top_idx = routing_map_to_topk(routing_map, topk)
    table = others_counts(count_routes(top_idx, num_experts), world, rank, seed + 1)
    gather = lambda counts: table  # noqa: E731 - the exchange is made up here
    balanced = max(num_tokens, 16) * topk  # a rank without tokens still receives its peers' rows
    region, shared = balanced // 2, balanced  # loads above P; some destinations' areas nearly spent
    run_on = region if spills else shared
    before = torch.arange(world, dtype=torch.int64) * (shared // world) % (shared + 1)
    cursors = [ArenaCursor(before.clone(), torch.full((world,), -7, dtype=torch.int64),
                           torch.tensor(-7, dtype=torch.int64), region, shared, run_on, spills, rank, world)
               for _ in range(2)]
    capacity = region + run_on
    torch_form, fused = cursors
    want = route(top_idx, num_experts, capacity, gather_counts=gather, ep_rank=rank,
                 dest_capacity=torch_form.capacities())
    torch_form.advance(want.metrics.kept_per_expert)
    # the arena runs under the overflow guard: the launch adds into its counters too
    sums, peaks = torch.arange(2 * num_experts + 4, dtype=torch.int64) * 3, torch.arange(world, dtype=torch.int64) * 5
    fused_sinks = MetricSinks(sums.clone(), sums + 1, peaks.clone())
    torch_sinks = MetricSinks(sums.clone(), sums + 1, peaks.clone())
    torch_sinks.add(want.metrics, world)
    _, _, selection = fused_routes.select(routing_map, probs.detach(), topk)
    got = fused_routes.route(selection, topk, capacity, gather_counts=gather, ep_rank=rank, arena=fused,
                             sinks=fused_sinks)
    case = f"arena T={num_tokens} E={num_experts} K={topk} M={world} rank={rank} skew={skew} spills={spills}"
    for name in ("dest_rank", "dest_row", "recv_counts", "recv_offsets"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.long(), b.long()), f"{case}: {name} differs:\n{a}\n{b}"
    assert torch.equal(got.metrics.packed, want.metrics.packed), f"{case}: packed metrics differ"
    for name in ("running", "overflow", "peak_demand"):
        a, b = getattr(fused_sinks, name), getattr(torch_sinks, name)
        assert torch.equal(a, b), f"{case}: sink {name} {a} vs {b}"
    assert torch.equal(fused.before, before), f"{case}: the cursor before the layer was written"
    assert torch.equal(fused.after, torch_form.after), f"{case}: cursor after {fused.after} vs {torch_form.after}"
    assert torch.equal(fused.start, torch_form.start), f"{case}: start {fused.start} vs {torch_form.start}"
    moved = bool((torch_form.after > before).any())
    expect = "should" if spills else "should not"
    assert moved == spills or num_tokens == 0, f"{case}: a case that {expect} move the cursor"
    print(f"ok {case} dropped={int(want.metrics.dropped_routes)} after={torch_form.after.tolist()}")


def check_short_token() -> None:
    """A token with fewer than K experts selected: its empty slots are -1 and counted as dropped."""
    from megatron_ext.moe import fused_routes

    routing_map, probs = routing(40, 8, 2, 0.0, 5)
    routing_map[3] = False
    routing_map[3, 6] = True  # one expert instead of two
    top_idx, top_probs, selection = fused_routes.select(routing_map, probs, 2)
    assert top_idx[3].tolist() == [6, -1] and float(top_probs[3, 1].detach()) == 0.0, top_idx[3]
    got = fused_routes.route(selection, 2, capacity=1000)
    assert got.dest_row[3, 1] == -1 and got.dest_rank[3, 1] == -1 and got.dest_row[3, 0] >= 0
    assert int(got.metrics.dropped_routes) == 1
    # The torch form agrees: no phantom route to an expert the token did not pick (a review's case:
    # a token with none selected took two rows and pushed another token's routes past the capacity).
    from megatron_ext.moe.dispatcher import routing_map_to_topk
    from megatron_ext.moe.route_map import route

    routing_map[5] = False  # and one with no expert at all
    torch_idx = routing_map_to_topk(routing_map, 2)
    fused_idx, _, selection = fused_routes.select(routing_map, probs, 2)
    assert torch.equal(torch_idx, fused_idx.long()), (torch_idx[3], torch_idx[5], fused_idx[3], fused_idx[5])
    want, have = fused_routes.route(selection, 2, capacity=12), route(torch_idx, 8, 12)
    assert torch.equal(want.dest_row, have.dest_row) and torch.equal(want.recv_counts, have.recv_counts)
    print("ok short token")


def check_nonfinite_probabilities() -> None:
    """NaN and Inf probabilities: the fused select counts the selected routes' only (not a NaN at an
    expert a short token did not pick, which Megatron's token drop leaves as NaN * 0) and writes the
    same top-k probabilities as the torch form (dispatcher.topk_probs), 0 in empty slots."""
    from megatron_ext.moe import fused_routes
    from megatron_ext.moe.dispatcher import routing_map_to_topk, topk_probs
    from megatron_ext.moe.route_map import route

    routing_map, probs = routing(40, 8, 2, 0.0, 6)
    probs = probs.detach()
    routing_map[3] = False
    routing_map[3, 6] = True  # one expert left
    probs[3] = float("nan")  # NaN logits: NaN at every expert
    probs[9, routing_map[9].nonzero()[1]] = float("inf")  # a selected route
    probs[11, (~routing_map[11]).nonzero()[0]] = float("-inf")  # an expert the token did not pick
    fused_idx, fused_probs, selection = fused_routes.select(routing_map, probs, 2)
    torch_idx = routing_map_to_topk(routing_map, 2)
    torch_probs = topk_probs(probs, torch_idx)
    assert torch.equal(fused_idx.long(), torch_idx)
    assert torch.equal(fused_probs.isnan(), torch_probs.isnan()), (fused_probs[3], torch_probs[3])
    assert torch.equal(fused_probs.nan_to_num(), torch_probs.nan_to_num())
    assert int(selection.nonfinite) == 2, int(selection.nonfinite)  # token 3's one route, token 9's Inf
    fused = fused_routes.route(selection, 2, capacity=1000).metrics.nonfinite_routes
    assert int(fused) == int(route(torch_idx, 8, 1000, probs=torch_probs).metrics.nonfinite_routes) == 2
    print("ok non-finite probabilities")


def check_select_against_loops() -> None:
    """The select kernel against Python loops over each token's selected experts: a token with more
    than K selected keeps its K lowest ids (the rest are not routes: not counted, no gradient, not
    routed) and one with fewer gets -1 slots; the non-finite count is the selected routes' NaN, +Inf
    and -Inf probabilities, whatever the unselected experts hold. Three blocks of tokens."""
    from megatron_ext.kernels.route_plan import BLOCK_TOKENS
    from megatron_ext.moe import fused_routes
    from megatron_ext.moe.route_map import route

    num_tokens, num_experts, topk = 70, 12, 3
    gen = torch.Generator().manual_seed(41)
    routing_map, probs = routing(num_tokens, num_experts, topk, 0.0, 41)
    probs = probs.detach()
    for token, extra in ((4, 1), (31, 2), (32, 1), (50, 1)):  # over-full: two at a block's last and first token
        free = (~routing_map[token]).nonzero()[:, 0]
        routing_map[token, free[torch.randperm(len(free), generator=gen)[:extra]]] = True
    routing_map[10, routing_map[10].nonzero()[0, 0]] = False  # one short token
    specials = (float("nan"), float("inf"), float("-inf"))
    for token in range(num_tokens):  # a non-finite value at a random expert, selected or not
        probs[token, int(torch.randint(0, num_experts, (), generator=gen))] = specials[token % 3]
    top_idx, top_probs, selection = fused_routes.select(routing_map, probs, topk)

    want_idx = torch.full((num_tokens, topk), -1, dtype=torch.long)
    want_probs = torch.zeros(num_tokens, topk)
    want_counts = [0] * num_experts
    want_hist = [[0] * num_experts for _ in range((num_tokens + BLOCK_TOKENS - 1) // BLOCK_TOKENS)]
    want_nonfinite = 0
    for t in range(num_tokens):
        chosen = [e for e in range(num_experts) if routing_map[t, e]][:topk]
        for k, e in enumerate(chosen):
            want_idx[t, k], want_probs[t, k] = e, probs[t, e]
            want_counts[e] += 1
            want_hist[t // BLOCK_TOKENS][e] += 1
            want_nonfinite += not math.isfinite(float(probs[t, e]))
    assert torch.equal(top_idx.long(), want_idx), "top-k ids of over-full or short tokens"
    assert torch.equal(top_probs.nan_to_num(7.0, 8.0, 9.0), want_probs.nan_to_num(7.0, 8.0, 9.0)), "top-k probs"
    assert selection.counts.tolist() == want_counts, (selection.counts.tolist(), want_counts)
    assert selection.block_hist.tolist() == want_hist, "block histograms"
    assert int(selection.nonfinite) == want_nonfinite, (int(selection.nonfinite), want_nonfinite)
    selected_minus_inf = (routing_map & (probs == float("-inf"))).any(dim=1).sum()
    assert selected_minus_inf >= 3, "too few selected -Inf probabilities to test"

    grad_top = torch.randn(num_tokens, topk, generator=gen)
    leaf = probs.clone().requires_grad_(True)
    _, got_probs, _ = fused_routes.select(routing_map, leaf, topk)
    (got_probs * grad_top).sum().backward()
    want_grad = torch.zeros(num_tokens, num_experts)
    for t in range(num_tokens):
        for k in range(topk):
            if want_idx[t, k] >= 0:
                want_grad[t, want_idx[t, k]] = grad_top[t, k]
    assert torch.equal(leaf.grad, want_grad), "gradient at an unrouted selected expert"

    got = fused_routes.route(selection, topk, 14, gather_counts=lambda counts: counts[None], ep_rank=0)
    want = route(want_idx, num_experts, 14, ep_rank=0, probs=want_probs)
    for name in ("dest_rank", "dest_row", "recv_counts", "recv_offsets"):
        assert torch.equal(getattr(got, name).long(), getattr(want, name).long()), f"over-full tokens: {name}"
    assert torch.equal(got.metrics.packed, want.metrics.packed), "over-full tokens: metrics"
    print("ok select against loops (over-full and short tokens, +-Inf and NaN probabilities)")


def main() -> int:
    from tests.unit.interpreter import interpreter_ready

    if not interpreter_ready():
        return 2
    cases = [  # T, E, K, M, rank, capacity, skew
        (70, 8, 2, 1, 0, 1000, 0.0),     # no drops, EP 1
        (70, 8, 2, 1, 0, 96, 2.0),       # drops, skewed
        (100, 12, 3, 3, 1, 48, 1.0),     # E, K, M not powers of two, drops
        (64, 16, 4, 4, 3, 40, 3.0),      # last rank, heavy skew
        (33, 6, 1, 2, 0, 20, 0.0),       # top-1
        (96, 64, 8, 8, 5, 160, 1.5),     # many buckets per destination
        (50, 10, 2, 5, 4, 5000, 0.0),    # nothing dropped at EP 5
    ]
    for seed, case in enumerate(cases):
        check_case(*case, seed=10 * seed)
    for seed, case in enumerate(cases[2:6]):  # capacities per destination, below and above the loads
        check_case(*case, seed=10 * seed + 5, per_dest=True)
    for seed, case in enumerate(cases[2:6]):  # the dropless arena's cursor, before and at the last layer
        for spills in (True, False):
            check_arena_case(*case[:5], skew=case[6], seed=10 * seed + 7, spills=spills)
    check_short_token()
    check_nonfinite_probabilities()
    check_select_against_loops()
    # A rank with no tokens: one program still writes the plan, the metrics and the cursor.
    check_case(0, 8, 2, 2, 1, 20, 0.0, seed=91)
    check_arena_case(0, 8, 2, 2, 1, 0.0, seed=93, spills=True)
    print("all route-plan checks passed")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
