"""Route map and capacity: exact agreement with a brute-force oracle of the same policy."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_ext.moe import route_map as rm
from megatron_ext.moe.capacity import rank_capacity
from tests.unit.route_map_oracle import oracle_keep, oracle_rows

NUM_CASES = 240
SCENARIOS = ("balanced", "zipf", "one_rank", "empty_experts", "overflow", "tiny_capacity",
             "invalid_ids")


def _draw_routes(rnd: random.Random, scenario: str, num_tokens: int, topk: int, m: int,
                 local: int, weights: list[float]) -> list[list[int]]:
    num_experts = m * local
    tokens = []
    for _ in range(num_tokens):
        if scenario == "one_rank":
            d = weights.index(max(weights)) // local  # same target rank on every source
            pool = list(range(d * local, (d + 1) * local))
            routes = [rnd.choice(pool) for _ in range(topk)]
        elif topk <= num_experts and rnd.random() < 0.7:
            # Megatron's top-k picks distinct experts; sample without replacement by weight.
            routes, cand, w = [], list(range(num_experts)), list(weights)
            for _ in range(topk):
                if sum(w) == 0:
                    w = [1.0] * len(cand)
                i = rnd.choices(range(len(cand)), weights=w)[0]
                routes.append(cand.pop(i))
                w.pop(i)
        else:
            routes = rnd.choices(range(num_experts), weights=weights, k=topk)
        if scenario == "invalid_ids":
            routes = [rnd.choice([-1, num_experts, num_experts + 3]) if rnd.random() < 0.2 else e
                      for e in routes]
        tokens.append(routes)
    return tokens


def _make_case(seed: int):
    rnd = random.Random(seed)
    scenario = SCENARIOS[seed % len(SCENARIOS)]
    m, local, topk = rnd.choice((1, 2, 4, 8)), rnd.choice((1, 2, 4)), rnd.choice((1, 2, 4))
    num_experts = m * local
    max_tokens = rnd.randint(1, 24)
    if scenario == "zipf" or scenario == "overflow":
        weights = [1.0 / (r + 1) ** rnd.uniform(1.0, 2.5) for r in range(num_experts)]
        rnd.shuffle(weights)
    elif scenario == "empty_experts":
        weights = [float(rnd.random() < 0.4) for _ in range(num_experts)]
        weights[rnd.randrange(num_experts)] = 1.0
    else:
        weights = [1.0] * num_experts
    if scenario == "one_rank":
        weights[rnd.randrange(num_experts)] = 2.0
    # Each simulated source rank holds its own T <= T_max (T = 0 included).
    per_rank = [_draw_routes(rnd, scenario, rnd.randint(0, max_tokens), topk, m, local, weights)
                for _ in range(m)]
    if scenario == "tiny_capacity":
        capacity = rnd.randint(0, max(1, m * local - 1))  # fewer rows than buckets
    elif scenario == "overflow":
        capacity = rnd.randint(1, max(1, max_tokens * topk // 2))
    else:
        factor = rnd.choice((0.25, 0.5, 1.0, 1.25, 2.0))
        capacity = rank_capacity(max_tokens, topk, m, factor, dropless=rnd.random() < 0.2)
    return scenario, per_rank, num_experts, capacity, topk


def _simulate(per_rank, num_experts, topk):
    """Count on every simulated source rank and stack the counts as the all-gather would."""
    tops = [torch.tensor(t, dtype=torch.int64).reshape(len(t), topk) for t in per_rank]
    requested = torch.stack([rm.count_routes(t, num_experts) for t in tops])
    return tops, requested


@pytest.mark.parametrize("chunk", range(4))
def test_matches_oracle(chunk):
    per_chunk = NUM_CASES // 4
    for seed in range(chunk * per_chunk, (chunk + 1) * per_chunk):
        scenario, per_rank, num_experts, capacity, topk = _make_case(seed)
        where = f"seed={seed} scenario={scenario} M={len(per_rank)} E={num_experts} C={capacity}"
        tops, requested = _simulate(per_rank, num_experts, topk)
        keep = rm.plan_keep(requested, capacity)
        want_keep, want = oracle_rows(per_rank, num_experts, capacity)
        assert keep.dtype == torch.int32 and keep.tolist() == want_keep, where

        m = len(per_rank)
        written = {d: [] for d in range(m)}
        for s, top in enumerate(tops):
            got = rm.build_route_map(top, requested, keep, s, capacity)
            exp = want[s]
            for name in ("dest_rank", "dest_row", "recv_counts", "recv_offsets", "row_source"):
                tensor = getattr(got, name)
                assert tensor.dtype == torch.int32, (where, name)
                assert tensor.reshape(-1).tolist() == list(_flatten(exp[name])), (where, name)
            assert got.dest_rank.shape == top.shape and got.row_source.shape == (capacity,)
            met = got.metrics
            assert met.requested_per_expert.tolist() == exp["requested_per_expert"], where
            assert met.kept_per_expert.tolist() == exp["kept_per_expert"], where
            assert int(met.dropped_routes) == exp["dropped_routes"], where
            assert met.buffer_fill.dtype == torch.float32
            assert abs(float(met.buffer_fill) - exp["buffer_fill"]) < 1e-6, where
            for d, r in zip(got.dest_rank.reshape(-1).tolist(), got.dest_row.reshape(-1).tolist()):
                if d >= 0:
                    written[d].append(r)
        # Across all sources, each destination's rows are exactly 0..valid-1, no collisions.
        for d in range(m):
            valid = want[d]["recv_offsets"][-1]
            assert sorted(written[d]) == list(range(valid)), (where, d)
            assert valid <= capacity, where


def _flatten(x):
    for item in x:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def test_scenarios_all_covered():
    seen = {_make_case(seed)[0] for seed in range(NUM_CASES)}
    assert seen == set(SCENARIOS)
    shapes = {(len(c[1]), c[2] // len(c[1]), c[4]) for c in map(_make_case, range(NUM_CASES))}
    assert {s[0] for s in shapes} == {1, 2, 4, 8}
    assert {s[1] for s in shapes} == {1, 2, 4} and {s[2] for s in shapes} == {1, 2, 4}


def _random_requested(gen: torch.Generator, m: int, local: int, high: int) -> torch.Tensor:
    req = torch.randint(0, high, (m, m * local), generator=gen, dtype=torch.int32)
    return req * (torch.rand(req.shape, generator=gen) < 0.7)  # some empty buckets


def test_keep_never_exceeds_capacity_or_request():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        m, local = [1, 2, 4, 8][trial % 4], [1, 2, 4][trial % 3]
        req = _random_requested(gen, m, local, 40)
        capacity = int(torch.randint(0, 200, (1,), generator=gen))
        keep = rm.plan_keep(req, capacity)
        assert (keep >= 0).all() and (keep <= req).all()
        per_dest = keep.reshape(m, m, local).sum((0, 2))
        asked = req.reshape(m, m, local).sum((0, 2))
        # Work-conserving: a destination is either full or keeps everything it was asked.
        assert torch.equal(per_dest, torch.minimum(asked, torch.tensor(capacity))), trial


def test_fair_under_overflow():
    """No bucket (hence no local expert) with requests is starved while another keeps rows,
    once the capacity covers one row per nonempty bucket; and shares differ by at most one
    row unless a bucket asked for less."""
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for trial in range(300):
        m, local = [2, 4, 8][trial % 3], [1, 2, 4][(trial // 3) % 3]
        req = _random_requested(gen, m, local, 60)
        buckets = req.reshape(m, m, local).permute(1, 2, 0).reshape(m, -1)  # [d, l*M+s]
        nonempty = (buckets > 0).sum(1)
        total = buckets.sum(1)
        # Capacity between the number of nonempty buckets and the total: real overflow.
        d = trial % m
        low, high = int(nonempty[d]), int(total[d]) - 1
        if high < low or low == 0:
            continue
        capacity = int(torch.randint(low, high + 1, (1,), generator=gen))
        keep = rm.plan_keep(req, capacity)
        kept = keep.reshape(m, m, local).permute(1, 2, 0).reshape(m, -1)[d]
        asked = buckets[d]
        assert ((asked > 0) <= (kept > 0)).all(), (trial, asked, kept)
        experts_kept = kept.reshape(local, m).sum(1)
        assert ((asked.reshape(local, m).sum(1) > 0) <= (experts_kept > 0)).all()
        short = kept < asked
        if short.any():
            assert kept.max() - kept[short].min() <= 1, (trial, asked, kept)
        checked += 1
    assert checked > 100


def test_not_biased_toward_low_indices():
    """Every bucket overflows: the spare rows left after the level go to each bucket (hence
    each local expert and each source rank) about equally often, not to bucket 0."""
    m, local = 4, 2
    n = m * local
    gen = torch.Generator().manual_seed(2)
    favoured = torch.zeros(n, dtype=torch.int64)
    trials = 400
    for _ in range(trials):
        req = torch.randint(10, 50, (m, m * local), generator=gen, dtype=torch.int32)
        keep = rm.plan_keep(req, capacity=3 * n + 3)  # level 3 everywhere, 3 spare rows
        buckets = keep.reshape(m, m, local).permute(1, 2, 0).reshape(m, -1)
        assert (buckets.sum(1) == 3 * n + 3).all()
        favoured += (buckets == 4).long().sum(0)
    share = favoured.float() / (trials * m)  # expected 3 / 8 each
    assert ((share > 0.3) & (share < 0.45)).all(), share


def test_small_examples():
    # One destination, three buckets of 5, 1, 9 into 8 rows: level 3 -> 3, 1, 3 with 1 spare;
    # total 15, start 15 % 3 = 0 -> bucket 0 wants more -> 4, 1, 3.
    req = torch.tensor([[5, 1, 9]], dtype=torch.int32)
    assert rm.plan_keep(req, 8).tolist() == [[4, 1, 3]]
    assert oracle_keep([[5, 1, 9]], 8) == [[4, 1, 3]]
    # Start 16 % 3 = 1: bucket 1 asked for 2 <= level 3, so the spare goes to bucket 2.
    assert rm.plan_keep(torch.tensor([[5, 2, 9]]), 9).tolist() == [[3, 2, 4]]
    assert rm.plan_keep(torch.tensor([[5, 1, 9]]), 100).tolist() == [[5, 1, 9]]
    assert rm.plan_keep(torch.tensor([[5, 1, 9]]), 0).tolist() == [[0, 0, 0]]


def test_route_single_rank_and_invalid_ids():
    top = torch.tensor([[0, 3], [3, -1], [3, 2], [7, 3]])
    got = rm.route(top, num_experts=4, capacity=2)
    # Expert 3 asked 4 routes, expert 0 and 2 one each; 2 rows: level 0, two spares
    # start at 6 % 4 = 2 -> buckets 2, 3 -> experts 2 and 3 keep one each.
    assert got.dest_row.tolist() == [[-1, 1], [-1, -1], [-1, 0], [-1, -1]]
    assert got.dest_rank.tolist() == [[-1, 0], [-1, -1], [-1, 0], [-1, -1]]
    assert got.recv_offsets.tolist() == [0, 0, 1, 2]
    assert got.row_source.tolist() == [0, 0]
    assert int(got.metrics.dropped_routes) == 6


def test_bad_input():
    with pytest.raises(ValueError, match="divisible"):
        rm.plan_keep(torch.ones(4, 6, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="capacity"):
        rm.plan_keep(torch.ones(1, 6, dtype=torch.int32), -1)


def test_no_host_sync_on_meta_device():
    """The meta device has no data: any value read (item, nonzero, mask indexing,
    value-dependent shape) raises, so finishing proves the path never syncs."""
    top = torch.empty(12, 2, dtype=torch.int64, device="meta")
    requested = torch.empty(4, 8, dtype=torch.int32, device="meta")
    keep = rm.plan_keep(requested, 32)
    got = rm.build_route_map(top, requested, keep, 2, 32)
    assert got.dest_row.shape == (12, 2) and got.row_source.shape == (32,)
    assert got.recv_offsets.shape == (2,) and got.dest_row.device.type == "meta"
    assert rm.count_routes(top, 8).shape == (8,)


def test_no_host_sync_on_cpu(monkeypatch):
    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called in the route-map hot path")
        return raise_

    for name in ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__",
                 "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    monkeypatch.setattr(torch, "nonzero", forbidden("nonzero"))
    got = rm.route(torch.randint(-1, 9, (32, 2)), num_experts=8, capacity=16)
    monkeypatch.undo()
    assert got.dest_row.shape == (32, 2)


def _gather_on_ranks(rank, world_size):
    import torch.distributed as dist

    counts = torch.arange(4, dtype=torch.int32) + 10 * rank
    gathered = rm.all_gather_counts(counts, dist.group.WORLD)
    top = torch.tensor([[rank, (rank + 1) % 4]])
    got = rm.route(top, num_experts=4, capacity=16, group=dist.group.WORLD)
    return gathered.tolist(), got.dest_row.tolist(), got.dest_rank.tolist()


def test_all_gather_counts_gloo():
    from megatron_ext.cpu_ranks import run_on_ranks

    out = run_on_ranks(_gather_on_ranks, 2)
    assert out[0][0] == out[1][0] == [[0, 1, 2, 3], [10, 11, 12, 13]]
    # Both ranks route token 0 to experts (r, r+1): rank 0 -> experts 0,1 (dest 0),
    # rank 1 -> experts 1 (dest 0, after rank 0's row of expert 1) and 2 (dest 1).
    assert out[0][1] == [[0, 1]] and out[0][2] == [[0, 0]]
    assert out[1][1] == [[2, 0]] and out[1][2] == [[0, 1]]
    single = rm.all_gather_counts(torch.arange(3, dtype=torch.int32), None)
    assert single.shape == (1, 3)


def test_capacity():
    assert rank_capacity(100, 2, 4, 1.25, dropless=False) == 256  # ceil(250) -> 256
    assert rank_capacity(8, 1, 1, 1.0, dropless=False) == 16
    assert rank_capacity(64, 2, 1, 1.0, dropless=False) == 128
    assert rank_capacity(100, 2, 4, 1.25, dropless=True) == 800
    assert rank_capacity(3, 3, 3, 1.0, dropless=True) == 32  # 27 -> 32
    assert rank_capacity(10, 1, 2, 0.01, dropless=False) == 16  # ceil(0.1) = 1 -> 16
    # a factor at or above EP is capped at the worst case (nothing could fill the rows above it)
    assert rank_capacity(100, 2, 1, 1.25, dropless=False) == rank_capacity(100, 2, 1, 1.0, dropless=True) == 208
    assert rank_capacity(100, 2, 2, 3.0, dropless=False) == rank_capacity(100, 2, 2, 1.0, dropless=True) == 400
    assert rank_capacity(100, 2, 2, 1.9, dropless=False) == 384  # below the worst case: unchanged
    assert rank_capacity(100, 2, 2, float("inf"), dropless=False) == 400  # capped, not OverflowError
    for kwargs, match in (
            (dict(capacity_factor=0.0), "capacity_factor"),
            (dict(capacity_factor=-1.0), "capacity_factor"),
            (dict(capacity_factor=float("nan")), "capacity_factor"),
            (dict(max_tokens=0), "max_tokens"),
            (dict(topk=0), "topk"),
            (dict(ep_size=0), "ep_size")):
        args = dict(max_tokens=16, topk=2, ep_size=2, capacity_factor=1.0, dropless=False)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            rank_capacity(**args)


def _torch_form_preprocess(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """RowwiseTokenDispatcher.dispatch_preprocess's torch form on a dispatcher whose transport exists
    (no process group, no Megatron config needed): -> (top_idx, top_probs)."""
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.moe.dispatcher import RowwiseTokenDispatcher

    dispatcher = RowwiseTokenDispatcher.__new__(RowwiseTokenDispatcher)
    dispatcher.transport, dispatcher.arena_layer, dispatcher.topk = object(), None, topk
    dispatcher.max_tokens, dispatcher.ext_config = routing_map.shape[0], MoEExtConfig(fused_route_map=False)
    tokens = torch.zeros(routing_map.shape[0], 1, 4)
    _, top_probs = dispatcher.dispatch_preprocess(tokens, routing_map, probs)
    return dispatcher.top_idx, top_probs


def test_torch_form_counts_only_the_selected_nonfinite_probabilities():
    """The torch form hands the route map the fused select's contract: 0 in a short token's empty
    slots and, in nonfinite_routes, the selected routes whose probability is NaN or Inf only. A
    token with NaN logits whose routes Megatron's capacity drop removed has NaN at every expert
    (NaN * 0): its empty slots carried that NaN and were counted."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts, topk = 12, 8, 2
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, torch.rand(num_tokens, num_experts, generator=gen).topk(topk, 1).indices, True)
    routing_map[2] = False  # a dropped token: no expert left
    routing_map[5, routing_map[5].nonzero()[0]] = False  # one expert left
    probs = torch.rand(num_tokens, num_experts, generator=gen)
    probs[[2, 5]] = float("nan")  # NaN logits: NaN at every expert, picked or not
    probs[7, routing_map[7].nonzero()[1]] = float("inf")  # a selected route's probability
    probs[9, (~routing_map[9]).nonzero()[0]] = float("-inf")  # an expert the token did not pick
    top_idx, top_probs = _torch_form_preprocess(routing_map, probs, topk)

    want_idx = [sorted(row.nonzero().flatten().tolist()) for row in routing_map]
    want_idx = [ids + [-1] * (topk - len(ids)) for ids in want_idx]
    assert top_idx.tolist() == want_idx
    want_probs = torch.tensor([[float(probs[t, e]) if e >= 0 else 0.0 for e in ids] for t, ids in enumerate(want_idx)])
    assert top_probs.dtype == torch.float32
    assert torch.equal(top_probs.isnan(), want_probs.isnan()), top_probs
    assert torch.equal(top_probs.nan_to_num(), want_probs.nan_to_num()), top_probs
    selected_nonfinite = int((routing_map & ~probs.isfinite()).sum())  # 1 (token 5) + 1 (token 7)
    assert selected_nonfinite == 2
    got = rm.route(top_idx, num_experts, capacity=64, probs=top_probs)
    assert int(got.metrics.nonfinite_routes) == selected_nonfinite


def test_check_route_map_names_a_kept_route_on_the_wrong_rank():
    """debug_checks: a kept route sent to a rank that does not own its expert, and a route whose rank
    and row disagree on being dropped, are each named (two simulated EP ranks, experts 0-1 on rank 0)."""
    import dataclasses

    top = torch.tensor([[0, 3], [1, 2]])
    good = rm.route(top, num_experts=4, capacity=16, gather_counts=lambda counts: torch.stack([counts, counts]),
                    ep_rank=0)
    rm.check_route_map(good, top, 4, 16, 2)
    swapped = dataclasses.replace(good, dest_rank=1 - good.dest_rank)  # every route kept, on the other rank
    with pytest.raises(RuntimeError, match="goes to a rank that does not own its expert"):
        rm.check_route_map(swapped, top, 4, 16, 2)
    half_dropped = dataclasses.replace(good, dest_rank=torch.where(top == 3, -1, good.dest_rank).int())
    with pytest.raises(RuntimeError, match="dest_rank is -1 exactly where dest_row is not"):
        rm.check_route_map(half_dropped, top, 4, 16, 2)


def test_overflow_check_names_the_busiest_load_since_the_last_check():
    """A check resets the busiest rank's demand with the route sums: a later overflow names its own
    load and the factor that load needs, not a load an earlier check reported already."""
    from megatron_ext.moe.overflow import CapacityExceeded, OverflowGuard

    def metrics(requested: list[int], kept: list[int]) -> rm.RouteMetrics:
        zero = torch.zeros((), dtype=torch.int32)
        packed = rm.pack_metrics(torch.tensor(requested), torch.tensor(kept), zero, zero, zero)
        return rm.RouteMetrics(packed, buffer_fill=torch.zeros(()))

    from megatron_ext.moe.metric_sinks import MetricSinks

    guard = OverflowGuard()  # two EP ranks of two experts each, 16 rows per rank, T * K = 16
    guard.ensure(num_experts=4, ep_size=2, device=torch.device("cpu"))
    sinks = MetricSinks(overflow=guard.sums, peak_demand=guard.peak_demand)  # what the layer hands the route
    sinks.add(metrics([30, 30, 1, 1], [8, 8, 1, 1]), ep_size=2)  # rank 0 asked for 60 rows
    with pytest.raises(CapacityExceeded, match="44 route.s. overflowed in the last 1 forward.s. .the busiest rank "
                                               "was asked for 60 rows"):
        guard.check("layer 1", 16, 16, 1.0)
    sinks.add(metrics([10, 10, 1, 1], [8, 8, 1, 1]), ep_size=2)  # 20 rows
    with pytest.raises(CapacityExceeded, match=r"4 route.s. overflowed in the last 1 forward.s. .the busiest rank "
                                               r"was asked for 20 rows.*needs >= 1\.25"):
        guard.check("layer 1", 16, 16, 1.0)


def _guard_with_sinks():
    from megatron_ext.moe.metric_sinks import MetricSinks
    from megatron_ext.moe.overflow import OverflowGuard

    guard = OverflowGuard()  # two EP ranks of two experts each
    guard.ensure(num_experts=4, ep_size=2, device=torch.device("cpu"))
    return guard, MetricSinks(overflow=guard.sums, peak_demand=guard.peak_demand)


def _route_metrics(requested: list[int], kept: list[int]) -> rm.RouteMetrics:
    zero = torch.zeros((), dtype=torch.int32)
    return rm.RouteMetrics(rm.pack_metrics(torch.tensor(requested), torch.tensor(kept), zero, zero, zero),
                           buffer_fill=torch.zeros(()))


def test_one_overflowed_route_is_an_error():
    from megatron_ext.moe.overflow import CapacityExceeded

    guard, sinks = _guard_with_sinks()
    sinks.add(_route_metrics([9, 8, 1, 1], [8, 8, 1, 1]), ep_size=2)
    with pytest.raises(CapacityExceeded, match="1 route.s. overflowed"):
        guard.check("layer 1", 16, 16, 1.0)
    sinks.add(_route_metrics([8, 8, 1, 1], [8, 8, 1, 1]), ep_size=2)
    guard.check("layer 1", 16, 16, 1.0)  # none overflowed: nothing to say


def test_arena_overflow_blames_the_view_only_when_the_load_exceeds_it():
    """At a peak equal to the layer's view the view held it: the budget was spent by earlier layers."""
    from megatron_ext.moe.overflow import CapacityExceeded

    guard, sinks = _guard_with_sinks()
    sinks.add(_route_metrics([12, 12, 1, 1], [8, 8, 1, 1]), ep_size=2)  # rank 0 asked for 24 rows
    with pytest.raises(CapacityExceeded, match="Earlier layers' spill used the budget"):
        guard.check("layer 2", 16, 16, 1.0, arena_view=(24, "--moe-ext-arena-region-factor"))
    sinks.add(_route_metrics([12, 12, 1, 1], [8, 8, 1, 1]), ep_size=2)
    with pytest.raises(CapacityExceeded, match="at most 23 rows in this layer .* raise --moe-ext-arena-region-factor"):
        guard.check("layer 2", 16, 16, 1.0, arena_view=(23, "--moe-ext-arena-region-factor"))


def test_overflow_counters_are_made_once():
    """The layer asks again when it builds other sinks (evaluation): the training sinks must keep
    adding into the tensors `check` reads."""
    guard, sinks = _guard_with_sinks()
    sums, peak = guard.sums, guard.peak_demand
    sinks.add(_route_metrics([9, 8, 1, 1], [8, 8, 1, 1]), ep_size=2)
    guard.ensure(num_experts=4, ep_size=2, device=torch.device("cpu"))
    assert guard.sums is sums and guard.peak_demand is peak and int(guard.peak_demand.max()) == 17


def test_metric_sinks_refuse_counters_the_route_launch_would_write_out_of_bounds():
    from megatron_ext.moe.metric_sinks import MetricSinks

    cpu = torch.device("cpu")
    good = torch.zeros(12, dtype=torch.int64)  # 2E + 4 for E = 4
    MetricSinks(running=good, overflow=good.clone(), peak_demand=torch.zeros(2, dtype=torch.int64)).check(4, 2, cpu)
    with pytest.raises(ValueError, match=r"MetricSinks.running must be a contiguous int64 tensor of shape \(12,\)"):
        MetricSinks(running=good.int()).check(4, 2, cpu)
    with pytest.raises(ValueError, match=r"MetricSinks.peak_demand .* shape \(2,\)"):
        MetricSinks(overflow=good, peak_demand=torch.zeros(3, dtype=torch.int64)).check(4, 2, cpu)
    with pytest.raises(ValueError, match="go together"):
        MetricSinks(overflow=good).check(4, 2, cpu)
    with pytest.raises(ValueError, match="on cpu .* on meta"):  # another device: the launch cannot write there
        MetricSinks(running=torch.zeros(12, dtype=torch.int64, device="meta")).check(4, 2, cpu)

def test_metric_sinks_refuse_a_strided_view_of_the_right_shape():
    """The route launch writes 2E + 4 consecutive int64s: a strided view of the right shape, dtype and
    device (every other element of a [24] tensor) would have them land on the wrong elements."""
    from megatron_ext.moe.metric_sinks import MetricSinks

    strided = torch.zeros(24, dtype=torch.int64)[::2]  # shape (12,), int64, cpu, stride 2
    assert tuple(strided.shape) == (12,) and not strided.is_contiguous()
    with pytest.raises(ValueError, match=r"MetricSinks.running must be a contiguous int64 tensor of shape \(12,\)"):
        MetricSinks(running=strided).check(4, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"MetricSinks.peak_demand must be a contiguous"):
        MetricSinks(overflow=torch.zeros(12, dtype=torch.int64),
                    peak_demand=torch.zeros(4, dtype=torch.int64)[::2]).check(4, 2, torch.device("cpu"))


def test_plan_keep_refuses_per_destination_capacities_for_unevenly_sharded_experts():
    """The arena's [M] capacities skip the host capacity check, not the sharding one."""
    with pytest.raises(ValueError, match="divisible"):
        rm.plan_keep(torch.ones(4, 6, dtype=torch.int32), torch.full((4,), 16))


def test_route_keeps_per_destination_capacities():
    """route(dest_capacity=[M]): destination d keeps what the oracle keeps at capacity dest_capacity[d]
    (the buffer's `capacity` only sizes row_source). Two simulated ranks, 4 experts."""
    per_rank = [[[0, 1], [0, 2], [1, 3], [0, 1], [2, 3]], [[0, 3], [1, 0], [2, 3], [3, 2], [0, 1]]]
    tops, requested = _simulate(per_rank, 4, 2)
    dest_capacity = torch.tensor([3, 5])
    # the oracle at each destination's capacity, for that destination's experts 2d, 2d + 1
    by_cap = [oracle_keep(requested.tolist(), cap) for cap in dest_capacity.tolist()]
    keep = torch.tensor([[by_cap[e // 2][s][e] for e in range(4)] for s in range(2)])
    assert rm.plan_keep(requested, dest_capacity).tolist() == keep.tolist()
    assert keep.sum().item() == 8  # both destinations overflow (11 and 9 routes asked): 3 + 5 rows
    for s, top in enumerate(tops):
        got = rm.route(top, 4, capacity=16, gather_counts=lambda counts: requested, ep_rank=s,
                       dest_capacity=dest_capacity)
        seen, want_rank, want_row = [0] * 4, [], []
        for token in per_rank[s]:  # brute force: each expert's routes in token order, the first keep[s, e] kept
            for e in token:
                kept = seen[e] < keep[s, e]
                base = int(keep[:, (e // 2) * 2:e].sum() + keep[:s, e].sum())  # earlier local experts, sources
                want_rank.append(e // 2 if kept else -1)
                want_row.append(base + seen[e] if kept else -1)
                seen[e] += 1
        assert got.dest_rank.reshape(-1).tolist() == want_rank and got.dest_row.reshape(-1).tolist() == want_row, s
        assert got.recv_offsets.tolist()[-1] == dest_capacity[s] and got.row_source.shape == (16,)


def test_check_route_map_names_shared_rows_and_offsets_past_the_capacity():
    """debug_checks: two kept routes on one row of one rank, and receive offsets that are the
    cumulative counts but end past the capacity, are each named."""
    import dataclasses

    top = torch.tensor([[0, 1], [1, 0]])
    good = rm.route(top, num_experts=2, capacity=4)
    rm.check_route_map(good, top, 2, 4, 1)
    shared = dataclasses.replace(good, dest_row=torch.tensor([[0, 2], [2, 1]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="two kept routes share a destination row"):
        rm.check_route_map(shared, top, 2, 4, 1)
    too_many = dataclasses.replace(good, recv_counts=torch.tensor([3, 2], dtype=torch.int32),
                                   recv_offsets=torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="receive offsets .* within capacity 4"):
        rm.check_route_map(too_many, top, 2, 4, 1)
    edge = dataclasses.replace(good, dest_row=torch.where(good.dest_row == 3, 4, good.dest_row))
    with pytest.raises(RuntimeError, match="outside 1 ranks x 4 rows"):  # row C itself is outside
        rm.check_route_map(edge, top, 2, 4, 1)


def test_overflow_check_before_the_first_forward_is_silent():
    """A logging step can come before the layer's first forward: no counters yet, nothing to check."""
    from megatron_ext.moe.overflow import OverflowGuard

    OverflowGuard().check("layer 1", 16, 16, 1.0)


def test_overflow_counts_requested_minus_kept_whatever_was_dropped():
    """The overflow is the routes requested of all ranks less those kept; this rank's dropped counter
    (which includes its invalid and empty slots) does not enter it."""
    from megatron_ext.moe.overflow import CapacityExceeded

    guard, sinks = _guard_with_sinks()
    dropped = torch.tensor(3, dtype=torch.int32)
    packed = rm.pack_metrics(torch.tensor([9, 8, 1, 1]), torch.tensor([8, 8, 1, 1]), dropped, dropped * 0, dropped * 0)
    sinks.add(rm.RouteMetrics(packed, buffer_fill=torch.zeros(())), ep_size=2)
    with pytest.raises(CapacityExceeded, match=r"1 route\(s\) overflowed"):
        guard.check("layer 1", 16, 16, 1.0)


def test_arena_overflow_names_the_load_as_a_factor_of_the_balanced_rows():
    """Both arena messages give the busiest load over a layer's balanced rows (24 / 16 = 1.50x)."""
    from megatron_ext.moe.overflow import CapacityExceeded

    guard, sinks = _guard_with_sinks()
    for view_rows in (24, 23):
        sinks.add(_route_metrics([12, 12, 1, 1], [8, 8, 1, 1]), ep_size=2)  # rank 0 asked for 24 rows
        with pytest.raises(CapacityExceeded, match=r"the largest load seen was 1\.50x a layer's balanced rows"):
            guard.check("layer 2", 16, 16, 1.0, arena_view=(view_rows, "--moe-ext-arena-region-factor"))
