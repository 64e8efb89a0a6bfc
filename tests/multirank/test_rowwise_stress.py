"""Stress of the rowwise layer on gloo ranks (torch transport): many steps, fresh routes each step.

EP=2, 20 steps per setting with new tokens (hence new routes) every step: capacity factor 1.0
(drops) and 1.25, one and two live microbatches (two: forwards of both, then backwards in
alternating order), debug poison on and off. Every microbatch's output and input gradient, and
the accumulated router and expert gradients, equal the dense oracle on the routes the layer
kept (fp32, 1e-5). The symm transport's version is tests/gpu/test_rowwise_multigpu.py; its
ordering on simulated ranks is tests/unit/test_symm_ordering.py.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import expert_grads, load_weights, local_expert_range, moe_config
from megatron_ext.testing.reference import MoEWeights, assert_close, dense_moe, route_topk

STEPS, TOKENS, HIDDEN, FFN, EXPERTS, TOPK = 20, 16, 32, 16, 4, 2


def _tokens(step, mb, rank):
    gen = torch.Generator().manual_seed(10_000 * step + 100 * mb + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    x[: TOKENS // 2] += 2.0 * torch.randn(1, HIDDEN, generator=gen)  # a shared direction: skewed routes
    return x, torch.randn(TOKENS, HIDDEN, generator=gen)


def _all_ranks(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _oracle(weights, xs, gs, keeps, rank):
    """Output and input grad of `rank`'s tokens, and router/expert grads of every rank's tokens
    (the router grad counts `rank`'s tokens only: no DP reduction ran), on the kept routes."""
    ref = weights.detached_leaves()
    result = {}
    for r, (x, g, keep) in enumerate(zip(xs, gs, keeps)):
        x = x.clone().requires_grad_(True)
        router = ref.router.detach().clone().requires_grad_(True)
        top_idx, probs = route_topk(x, router, TOPK)
        out = dense_moe(x, MoEWeights(router, ref.fc1, ref.fc2), TOPK, top_idx=top_idx, probs=probs,
                        keep=keep.gather(1, top_idx))
        (out * g).sum().backward()
        if r == rank:
            result.update(out=out.detach(), x_grad=x.grad, router_grad=router.grad)
    result.update(fc1_grad=ref.fc1.grad, fc2_grad=ref.fc2.grad)
    return result


def _stress_rank(rank, world, cf, live, poison):
    config = moe_config(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, ep=world)
    weights = MoEWeights.random(EXPERTS, HIDDEN, FFN, seed=11)
    layer = moe_builder(MoEExtConfig(transport="torch", capacity_factor=cf, debug_poison=poison))(config=config)
    load_weights(layer, weights)
    experts = local_expert_range(layer)
    poisoned_rows = []  # all-NaN rows the experts were handed (the buffers' unfilled tails)
    layer.experts.register_forward_pre_hook(
        lambda module, args: poisoned_rows.append(int(torch.isnan(args[0]).all(dim=1).sum())))
    dropped = 0
    for step in range(STEPS):
        for p in layer.parameters():
            p.grad = None
        batches = [_tokens(step, mb, rank) for mb in range(live)]
        xs = [x.clone().view(TOKENS, 1, HIDDEN).requires_grad_(True) for x, _ in batches]
        outs, keeps = [], []
        for x in xs:
            outs.append(layer(x)[0])
            keeps.append(layer.token_dispatcher.kept_route_mask())
            dropped += int((layer.token_dispatcher.route_map.dest_row < 0).sum())
        order = range(live) if step % 2 else reversed(range(live))
        for mb in order:
            outs[mb].backward(batches[mb][1].view_as(outs[mb]))
        fc1_want, fc2_want, router_want = 0, 0, 0
        for mb, (x, g) in enumerate(batches):
            want = _oracle(weights, _all_ranks(x), _all_ranks(g), _all_ranks(keeps[mb]), rank)
            where = f"rank {rank} cf {cf} live {live} poison {poison} step {step} mb {mb}"
            assert_close(outs[mb].view(TOKENS, HIDDEN), want["out"], 1e-5, f"{where}: output")
            assert_close(xs[mb].grad.view(TOKENS, HIDDEN), want["x_grad"], 1e-5, f"{where}: input grad")
            fc1_want = fc1_want + want["fc1_grad"][experts.start:experts.stop]
            fc2_want = fc2_want + want["fc2_grad"][experts.start:experts.stop]
            router_want = router_want + want["router_grad"]
        fc1_grad, fc2_grad = expert_grads(layer)
        where = f"rank {rank} cf {cf} live {live} poison {poison} step {step}"
        assert_close(layer.router.weight.grad, router_want, 1e-5, f"{where}: router grad")
        assert_close(fc1_grad, fc1_want, 2e-5, f"{where}: fc1 grad")
        assert_close(fc2_grad, fc2_want, 2e-5, f"{where}: fc2 grad")
    # With poison the tails were NaN (and changed nothing above); without it they were zeros.
    assert (sum(poisoned_rows) > 0) == poison, (poison, poisoned_rows)
    return dropped


@pytest.mark.parametrize("cf", [1.0, 1.25])
@pytest.mark.parametrize("live", [1, 2])
@pytest.mark.parametrize("poison", [False, True], ids=["no_poison", "poison"])
def test_rowwise_stress_ep2_torch_transport(cf, live, poison):
    dropped = run_on_ranks(_stress_rank, 2, cf, live, poison, sizes=ParallelSizes(ep=2))
    if cf == 1.0:
        assert sum(dropped) > 0, "no route dropped at capacity factor 1.0: the stress did not exercise drops"
