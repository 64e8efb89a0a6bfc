"""NaN/Inf hidden states and NaN router weights through the rowwise layer (torch transport, EP=2):
no error, no out-of-range access, other tokens' outputs unchanged (dropless: no capacity
competition), and the problem visible in the routing metrics (nonfinite_prob_routes)."""

import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights

TOKENS, HIDDEN, TOPK = 12, 32, 2
BAD = {3: float("nan"), 5: float("inf"), 7: float("-inf")}


def _layer(world):
    layer = moe_builder(MoEExtConfig(transport="torch", dropless=True))(
        config=moe_config(hidden=HIDDEN, ffn=16, experts=4, topk=TOPK, ep=world))
    load_weights(layer, MoEWeights.random(4, HIDDEN, 16, seed=6))
    return layer


def _forward(layer, x):
    out, _ = layer(x.view(TOKENS, 1, HIDDEN))
    return out.detach().view(TOKENS, HIDDEN), layer.read_metrics()


def _hostile_rank(rank, world):
    x, _ = rank_tokens(rank, TOKENS, HIDDEN)
    clean_out, clean_metrics = _forward(_layer(world), x)
    bad_x = x.clone()
    for token, value in BAD.items():
        bad_x[token] = value
    bad_out, bad_metrics = _forward(_layer(world), bad_x)
    others = [t for t in range(TOKENS) if t not in BAD]
    assert torch.equal(bad_out[others], clean_out[others]), f"rank {rank}: clean tokens changed"
    assert clean_metrics["nonfinite_prob_routes"] == 0
    assert bad_metrics["nonfinite_prob_routes"] == TOPK * len(BAD), bad_metrics
    # NaN router weights: every probability is NaN; the layer still runs and says so.
    layer = _layer(world)
    with torch.no_grad():
        layer.router.weight[0, 0] = float("nan")
    out, metrics = _forward(layer, x)
    assert metrics["nonfinite_prob_routes"] == TOKENS * TOPK and metrics["dropped_routes"] == 0
    assert torch.isnan(out).all()
    return True


def test_nan_inf_hidden_states_and_nan_router_weights():
    run_on_ranks(_hostile_rank, 2, sizes=ParallelSizes(ep=2))
