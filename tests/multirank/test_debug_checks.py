"""--moe-ext-debug-checks does what it says: the route map is validated and the experts check
their offsets (host reads, debug only), and a corrupted route map is caught with its reason."""

import dataclasses

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe import dispatcher as dispatcher_module
from megatron_ext.moe.route_map import check_route_map, route
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights


def _layer(world, **ext):
    config = moe_config(hidden=32, ffn=16, experts=4, topk=2, ep=world)
    layer = moe_builder(MoEExtConfig(transport="torch", **ext))(config=config)
    load_weights(layer, MoEWeights.random(4, 32, 16, seed=2))
    return layer


def _debug_rank(rank, world):
    x, grad = rank_tokens(rank, 12, 32)
    checked = _layer(world, debug_checks=True)
    plain = _layer(world)
    assert checked.experts.debug_checks and not plain.experts.debug_checks
    outs = []
    for layer in (checked, plain):
        out, _ = layer(x.clone().view(12, 1, 32).requires_grad_(True))
        out.backward(grad.view_as(out))
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1]), "debug checks changed the numbers"

    def broken_route(*args, **kwargs):  # two kept routes on one destination row
        good = route(*args, **kwargs)
        dest_row = good.dest_row.clone()
        dest_row[1, 0] = dest_row[0, 0]
        dest_rank = good.dest_rank.clone()
        dest_rank[1, 0] = dest_rank[0, 0]
        return dataclasses.replace(good, dest_row=dest_row, dest_rank=dest_rank)

    dispatcher_module.route = broken_route
    with pytest.raises(RuntimeError, match="two kept routes share a destination row"):
        checked(x.clone().view(12, 1, 32))
    return True


def test_debug_checks_validate_the_route_map_and_reach_the_experts():
    run_on_ranks(_debug_rank, 2, sizes=ParallelSizes(ep=2))


def test_check_route_map_names_each_broken_invariant():
    top_idx = torch.tensor([[0, 1], [2, 3], [0, 2]])
    good = route(top_idx, num_experts=4, capacity=16)
    check_route_map(good, top_idx, 4, 16, 1)
    bad_row = dataclasses.replace(good, dest_row=torch.full_like(good.dest_row, 16))
    with pytest.raises(RuntimeError, match="outside 1 ranks x 16 rows"):
        check_route_map(bad_row, top_idx, 4, 16, 1)
    bad_offsets = dataclasses.replace(good, recv_offsets=good.recv_offsets.flip(0))
    with pytest.raises(RuntimeError, match="receive offsets"):
        check_route_map(bad_offsets, top_idx, 4, 16, 1)
