"""deepep_layout: DeepEP's send/receive orders mapped onto the rowwise buffer layout (pure torch).

Several seeded routes with drops on M simulated ranks in one process. DeepEP V1's intranode
semantics are written out here independently of the stand-in module: a destination receives
source 0's tokens first, each source's in its send order; combine returns each received row
to its source token. Through them, the adapter's maps must reproduce the reference transport's
layout exactly: route (t, k) at row dest_row of rank dest_rank, tails unwritten, dropped routes
exactly zero on the way back.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.moe import route_map as rm
from megatron_ext.moe.transport.deepep import DeepEPRowTransport
from megatron_ext.moe.transport.deepep_layout import (
    build_layout, place_received, returned_routes, rows_to_return, send_rows)
from megatron_ext.moe.transport.torch_ref import TorchRowTransport

# (seed, ranks M, local experts L, tokens T, topk K, capacity C): dropless, mild and heavy drops.
CASES = [(0, 2, 2, 12, 2, 48), (1, 2, 4, 16, 3, 24), (2, 4, 2, 10, 2, 16), (3, 4, 1, 9, 4, 8),
         (4, 4, 2, 14, 3, 32), (5, 2, 1, 7, 2, 3), (6, 1, 4, 11, 3, 16), (7, 4, 4, 16, 4, 80)]
HIDDEN = 8


def _routes(seed, m, local, tokens, topk, capacity):
    """Skewed random top-k (distinct experts per token, a few invalid ids) -> every rank's route map."""
    gen = torch.Generator().manual_seed(seed)
    experts = m * local
    skew = torch.rand(experts, generator=gen) ** 3 + 0.05
    top = []
    for _ in range(m):
        scores = torch.rand(tokens, experts, generator=gen) * skew
        idx = torch.topk(scores, min(topk, experts), dim=1).indices
        invalid = torch.rand(idx.shape, generator=gen) < 0.1
        top.append(torch.where(invalid, -1, idx))
    requested = torch.stack([rm.count_routes(t, experts) for t in top])
    keep = rm.plan_keep(requested, capacity)
    return top, [rm.build_route_map(top[s], requested, keep, s, capacity) for s in range(m)]


def _deepep_dispatch(sends, dests, m, capacity):
    """DeepEP V1 intranode dispatch with num_worst_tokens = capacity: per destination, the rows
    of source 0, then source 1, ..., each in its send order; unwritten tail = NaN (garbage)."""
    out = []
    for d in range(m):
        rows = torch.cat([send[dest[:, 0] == d] for send, dest in zip(sends, dests)])
        assert rows.shape[0] <= capacity, "a rank must never receive more than C routes"
        out.append(torch.cat([rows, rows.new_full((capacity - rows.shape[0], rows.shape[1]), float("nan"))]))
    return out


def _deepep_combine(returns, dests, m):
    """DeepEP V1 combine: row j of destination d goes back to the source token it came from."""
    outs = [torch.zeros(dest.shape[0], returns[0].shape[1]) for dest in dests]
    for d in range(m):
        offset = 0
        for s, dest in enumerate(dests):
            mask = dest[:, 0] == d
            n = int(mask.sum())
            outs[s][mask] += returns[d][offset:offset + n]
            offset += n
    return outs


def _reference_buffers(tokens, routes, m, capacity):
    """The reference layout: tokens[t] at row dest_row[t, k] of rank dest_rank[t, k]; zero tail."""
    buffers = [torch.zeros(capacity, HIDDEN) for _ in range(m)]
    for x, route in zip(tokens, routes):
        kept = route.dest_row >= 0
        t = torch.arange(x.shape[0])[:, None].expand_as(kept)
        for d in range(m):
            here = kept & (route.dest_rank == d)
            buffers[d][route.dest_row[here].long()] = x[t[here]]
    return buffers


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-M{c[1]}" for c in CASES])
def test_layout_reproduces_reference_buffers_and_gathers(case):
    seed, m, local, num_tokens, topk, capacity = case
    top, routes = _routes(*case)
    layouts = [build_layout(route, m, capacity) for route in routes]
    gen = torch.Generator().manual_seed(100 + seed)
    tokens = [torch.randn(num_tokens, HIDDEN, generator=gen) for _ in range(m)]

    for route, layout in zip(routes, layouts):
        n = route.dest_row.numel()
        kept = (route.dest_row >= 0).reshape(-1)
        assert torch.equal(torch.sort(layout.send_route).values, torch.arange(n))
        assert torch.equal(torch.sort(layout.row_of_recv).values, torch.arange(capacity))
        assert torch.equal(layout.row_of_recv[layout.recv_of_row], torch.arange(capacity))
        assert torch.equal(layout.send_route[layout.route_send_pos.reshape(-1)], torch.arange(n))
        sent_to = layout.send_rank[:, 0]
        assert torch.equal(sent_to, torch.where(kept, route.dest_rank.reshape(-1).long(), -1)[layout.send_route])
        assert bool((sent_to[:int(kept.sum())] >= 0).all()), "kept routes lead the send list"
        assert torch.equal(layout.row_written, route.row_source >= 0)
        for d in range(m):  # per destination, a source sends in ascending destination row
            rows = route.dest_row.reshape(-1)[layout.send_route][sent_to == d]
            assert torch.equal(rows, torch.sort(rows).values)

    sends = [send_rows(x, layout) for x, layout in zip(tokens, layouts)]
    dests = [layout.send_rank for layout in layouts]
    received = _deepep_dispatch(sends, dests, m, capacity)
    reference = _reference_buffers(tokens, routes, m, capacity)
    for d in range(m):
        got = place_received(received[d], layouts[d])
        assert torch.equal(got, reference[d]), f"rank {d}: buffer differs from the reference layout"
        poisoned = place_received(received[d], layouts[d], tail_value=float("nan"))
        written = layouts[d].row_written
        assert torch.equal(poisoned[written], reference[d][written]) and bool(poisoned[~written].isnan().all())
        fill = int(written.sum())
        assert fill == int(routes[d].recv_offsets[-1]) and bool(written[:fill].all())

    # Way back: every route fetches its row of its owner's buffer; unwritten rows never leak.
    expert_out = [torch.randn(capacity, HIDDEN, generator=gen) for _ in range(m)]
    expert_out = [torch.where(layout.row_written[:, None], e, float("nan")) for e, layout in zip(expert_out, layouts)]
    returns = [rows_to_return(e, layout) for e, layout in zip(expert_out, layouts)]
    combined = _deepep_combine(returns, dests, m)
    for s, (route, layout) in enumerate(zip(routes, layouts)):
        gathered = returned_routes(combined[s], layout)
        kept = route.dest_row >= 0
        expected = torch.zeros(num_tokens, top[s].shape[1], HIDDEN)
        for d in range(m):
            here = kept & (route.dest_rank == d)
            expected[here] = expert_out[d][route.dest_row[here].long()]
        assert torch.equal(gathered, expected), f"rank {s}: returned routes differ"
        assert bool((gathered[~kept] == 0).all()), "dropped routes must come back exactly zero"


def test_layout_is_static_and_host_free_on_meta():
    """Built from meta tensors: no host reads of device values, no value-dependent shapes."""
    _, routes = _routes(3, 4, 2, 10, 3, 12)
    route = routes[1]
    meta = rm.RouteMap(*(t.to("meta") for t in (route.dest_rank, route.dest_row, route.recv_counts,
                                                route.recv_offsets, route.row_source)), route.metrics)
    layout = build_layout(meta, 4, 12)
    assert layout.send_route.shape == (30,) and layout.send_rank.shape == (30, 1)
    assert layout.row_of_recv.shape == (12,) and layout.route_send_pos.shape == (10, 3)
    x = torch.empty(10, HIDDEN, device="meta")
    assert send_rows(x, layout).shape == (30, HIDDEN)
    assert place_received(torch.empty(12, HIDDEN, device="meta"), layout).shape == (12, HIDDEN)
    assert returned_routes(torch.empty(30, HIDDEN, device="meta"), layout).shape == (10, 3, HIDDEN)


@pytest.mark.parametrize("capacity,tokens", [(4, 12), (16, 12), (48, 12), (8, 0)])  # 0: a rank holding no token
def test_single_rank_transport_equals_torch_transport(capacity, tokens):
    """EP=1 (no DeepEP call at all): all four transfers equal the reference transport's, bitwise."""
    top, routes = _routes(9, 1, 4, tokens, 2, capacity)
    route = routes[0]
    gen = torch.Generator().manual_seed(5)
    x, grad_out = torch.randn(tokens, HIDDEN, generator=gen), torch.randn(tokens, HIDDEN, generator=gen)
    probs = torch.rand(tokens, 2, generator=gen)
    expert_out, grad_buffer = torch.randn(capacity, HIDDEN, generator=gen), torch.randn(capacity, HIDDEN, generator=gen)
    grad_row_probs = torch.randn(capacity, generator=gen)
    ours, ref = DeepEPRowTransport(None, capacity), TorchRowTransport(None, capacity)
    for a, b in zip(ours.dispatch(x, probs, route)[:2], ref.dispatch(x, probs, route)[:2]):
        assert torch.equal(a, b)
    assert torch.equal(ours.combine(expert_out, route), ref.combine(expert_out, route))
    assert torch.equal(ours.combine_backward(grad_out, route), ref.combine_backward(grad_out, route))
    for a, b in zip(ours.dispatch_backward(grad_buffer, grad_row_probs, route),
                    ref.dispatch_backward(grad_buffer, grad_row_probs, route)):
        assert torch.equal(a, b)


def test_routes_outside_the_buffers_travel_nowhere():
    """A corrupted route map (a row past C, a rank past M) sends nothing, as the torch transport and
    the symm kernels do: DeepEP would write past the receiver's num_worst_tokens rows."""
    top, routes = _routes(3, 2, 2, 6, 2, 8)
    route = routes[0]
    dest_row, dest_rank = route.dest_row.clone(), route.dest_rank.clone()
    dest_row[0, 0], dest_rank[1, 1] = 8, 2  # one row past C = 8, one rank past M = 2
    bad = dataclasses.replace(route, dest_row=dest_row, dest_rank=dest_rank)
    layout = build_layout(bad, 2, 8)
    sent = layout.send_rank[:, 0][layout.route_send_pos]  # each route's DeepEP destination
    assert sent[0, 0] == -1 and sent[1, 1] == -1 and not layout.route_kept[0, 0] and not layout.route_kept[1, 1]
    untouched = build_layout(route, 2, 8).send_rank[:, 0][build_layout(route, 2, 8).route_send_pos]
    others = torch.ones_like(sent, dtype=torch.bool)
    others[0, 0] = others[1, 1] = False
    assert torch.equal(sent[others], untouched[others])
