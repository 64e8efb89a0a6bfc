"""Run a MoE layer on this rank and compare it with the dense oracle (inside a gloo rank).

Per rank: output and input gradient for its own tokens, router gradient from its own tokens
(the router is replicated; no DP reduction has run), and this rank's expert-weight gradients,
which collect the tokens of every rank in its expert-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ext.testing.megatron_moe import expert_grads, load_weights, local_expert_range, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights, assert_close, dense_moe, route_topk


@dataclass
class Case:
    tokens: int = 8
    hidden: int = 32
    ffn: int = 16
    experts: int = 4
    topk: int = 2
    dtype: torch.dtype = torch.float32
    rtol: float = 1e-5
    tokens_per_rank: tuple[int, ...] | None = None  # EP ranks may hold fewer than T_max tokens (None: `tokens`)

    def tokens_of(self, rank: int) -> int:
        return self.tokens if self.tokens_per_rank is None else self.tokens_per_rank[rank]


def _ep_group_ranks():
    from megatron.core import parallel_state

    return dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())


def _gather_keep(keep_te: torch.Tensor | None, group_ranks):
    """All ranks' [T, E] keep masks of this rank's EP group (None: every route kept)."""
    if keep_te is None:
        return {r: None for r in group_ranks}
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    parts = [None] * len(group_ranks)  # objects: ranks may hold different token counts
    dist.all_gather_object(parts, keep_te.cpu(), group=group)
    return {r: p.to(keep_te.device) for r, p in zip(group_ranks, parts)}


def run_and_compare(rank: int, case: Case, build_layer: Callable, *, keep_of: Callable | None = None,
                    perturb_rank: int | None = None, config_overrides: dict | None = None) -> dict:
    """Build the layer with `build_layer(config)`, run forward+backward, assert against the oracle.

    `keep_of(layer)` returns this rank's [T, E] kept-route mask for layers that may drop routes.
    `perturb_rank` adds noise to one local expert weight on that rank after loading (to show
    the comparison can fail).
    """
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    config = moe_config(hidden=case.hidden, ffn=case.ffn, experts=case.experts, topk=case.topk,
                        ep=ep, dtype=case.dtype, **(config_overrides or {}))
    weights = MoEWeights.random(case.experts, case.hidden, case.ffn, seed=7, dtype=case.dtype)
    layer = build_layer(config)
    load_weights(layer, weights)
    if perturb_rank == rank:
        with torch.no_grad():
            (next(iter(layer.experts.parameters()))).add_(0.05)

    tokens = case.tokens_of(rank)
    x, grad_out = rank_tokens(rank, tokens, case.hidden, case.dtype)
    x_in = x.clone().view(tokens, 1, case.hidden).requires_grad_(True)
    out, _ = layer(x_in)
    out.backward(grad_out.view_as(out))

    group_ranks = _ep_group_ranks()
    keeps = _gather_keep(keep_of(layer) if keep_of else None, group_ranks)
    ref = weights.detached_leaves()
    fp32 = MoEWeights(ref.router.float(), ref.fc1.detach().float().requires_grad_(True),
                      ref.fc2.detach().float().requires_grad_(True))
    mine = {}
    for r in group_ranks:
        xr, gr = rank_tokens(r, case.tokens_of(r), case.hidden, case.dtype)
        xr = xr.float().requires_grad_(True)
        router_r = fp32.router.detach().clone().requires_grad_(True)
        top_idx, probs = route_topk(xr, router_r, case.topk)
        keep = None if keeps[r] is None else keeps[r].gather(1, top_idx)
        out_r = dense_moe(xr, MoEWeights(router_r, fp32.fc1, fp32.fc2), case.topk,
                          top_idx=top_idx, probs=probs, keep=keep)
        (out_r * gr.float()).sum().backward()
        if r == rank:
            mine = dict(out=out_r.detach(), x_grad=xr.grad, router_grad=router_r.grad)

    rtol = case.rtol
    assert_close(out.view(tokens, case.hidden), mine["out"], rtol, f"rank {rank} output")
    assert_close(x_in.grad.view(tokens, case.hidden), mine["x_grad"], rtol, f"rank {rank} input grad")
    assert_close(layer.router.weight.grad, mine["router_grad"], rtol, f"rank {rank} router grad")
    experts = local_expert_range(layer)
    fc1_grad, fc2_grad = expert_grads(layer)
    # Weight grads sum many rows: allow twice the tolerance of the activations.
    assert_close(fc1_grad, fp32.fc1.grad[experts.start:experts.stop], 2 * rtol, f"rank {rank} fc1 grads")
    assert_close(fc2_grad, fp32.fc2.grad[experts.start:experts.stop], 2 * rtol, f"rank {rank} fc2 grads")
    return {"ep": ep, "experts": list(experts)}
