"""Megatron's own MoELayer on gloo ranks against the dense oracle: proof the harness works."""

import pytest

from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, run_on_ranks
from tests.layer_check import Case, run_and_compare
from megatron_ext.testing.megatron_moe import megatron_moe_layer

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]  # (world size, EP)


def _megatron_layer_rank(rank, world, dispatcher, perturb_rank=None):
    return run_and_compare(rank, Case(), megatron_moe_layer, perturb_rank=perturb_rank,
                           config_overrides=dict(moe_token_dispatcher_type=dispatcher))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("world,ep", LAYOUTS)
def test_megatron_moe_layer_matches_oracle(world, ep, dispatcher):
    results = run_on_ranks(_megatron_layer_rank, world, dispatcher, sizes=ParallelSizes(ep=ep))
    assert [r["ep"] for r in results] == [ep] * world
    # Every global expert is owned by exactly one rank of each EP group.
    owned = sorted(e for r in results[:ep] for e in r["experts"])
    assert owned == list(range(4))


def test_oracle_comparison_detects_a_perturbed_expert_weight():
    # Rank 1's experts serve both ranks' tokens, so either rank may report first.
    with pytest.raises(RankFailure, match=r"rank [01] (output|input grad|fc1 grads): max abs error"):
        run_on_ranks(_megatron_layer_rank, 2, "alltoall", perturb_rank=1, sizes=ParallelSizes(ep=2))


def _megatron_topk_rank(rank, world, topk):
    return run_and_compare(rank, Case(topk=topk, experts=6), megatron_moe_layer)


@pytest.mark.parametrize("topk", [3, 4])
def test_megatron_moe_layer_matches_oracle_at_other_topk(topk):
    """The oracle's top-k and softmax against Megatron's beyond k=2 (k=1 needs Megatron's pre-softmax
    router, which the oracle does not model)."""
    run_on_ranks(_megatron_topk_rank, 2, topk, sizes=ParallelSizes(ep=2))
