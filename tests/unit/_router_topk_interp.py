"""The fused router (moe/fused_router.py: gating GEMM + kernels/router_topk.py) against Megatron's
own gating and routing functions under Triton's CPU interpreter: the same routing map, top-k
probabilities, counts, load-balancing loss and token and weight gradients, with and without
pre-softmax, a scaling factor, top-1, expert counts that are not powers of two, token counts that
are not multiples of a block, bf16 logits, and a token whose logits hold a NaN or are all -inf
(counted as non-finite, as Megatron's routing would give NaN); ties at the top-k boundary go to the
lowest expert id; and the FusedTopKRouter module's fused path against Megatron's TopKRouter, on one
rank and on two tensor-parallel ranks (the loss's counts summed over tp_cp).

    TRITON_INTERPRET=1 python tests/unit/_router_topk_interp.py
"""

from __future__ import annotations

import math
import os
import sys

import torch


def megatron_routing(hidden, weight, topk, pre_softmax, scale, coeff, gate=None):
    """Megatron 0.19.2's gating GEMM (router dtype = the tokens' unless `gate` is given), unfused
    softmax routing and switch load-balancing loss."""
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         router_gating_linear, switch_load_balancing_loss_func,
                                                         topk_routing_with_score_function)

    num_tokens, num_experts = hidden.shape[0], weight.shape[0]
    logits = router_gating_linear(hidden, weight, None, hidden.dtype) if gate is None else gate(hidden, weight)
    probs, routing_map = topk_routing_with_score_function(logits, topk, use_pre_softmax=pre_softmax,
                                                          scaling_factor=scale, score_function="softmax")
    aux_map, aux_scores = compute_routing_scores_for_aux_loss(logits, topk, "softmax")
    aux = switch_load_balancing_loss_func(aux_scores, aux_map.sum(dim=0), num_tokens, topk, num_experts, coeff)
    return probs, routing_map, aux


def fused(hidden, weight, topk, pre_softmax, scale, coeff):
    from megatron_ext.moe.fused_router import LoadBalancingLoss, fused_routing

    num_tokens, num_experts = hidden.shape[0], weight.shape[0]
    aux = LoadBalancingLoss(num_experts * coeff / (topk * num_tokens * num_tokens))
    return fused_routing(hidden, weight, topk, None, pre_softmax, scale or 1.0, aux)


def inputs(num_tokens, num_experts, dtype, gen):
    """(hidden, router weight). bf16: logits with distinct values per row, exact in bf16 (an
    identity weight), because ties are check_ties' subject."""
    if dtype == torch.float32:
        return torch.randn(num_tokens, 24, generator=gen), torch.randn(num_experts, 24, generator=gen) * 0.4
    hidden = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]) * 0.25 - 2
    return hidden.to(dtype), torch.eye(num_experts, dtype=dtype)


def check_case(num_tokens, num_experts, topk, pre_softmax, scale, dtype, seed, nan_token=None) -> None:
    from megatron_ext.testing.reference import assert_close

    gen = torch.Generator().manual_seed(seed)
    hidden, weight = inputs(num_tokens, num_experts, dtype, gen)
    if nan_token is not None:  # a NaN in a token's hidden state: all its logits are NaN
        hidden[nan_token, 1] = float("nan")
    d_probs = torch.randn(num_tokens, num_experts, generator=gen)  # d loss / d probs
    coeff = 0.01
    case = f"T={num_tokens} E={num_experts} K={topk} pre_softmax={pre_softmax} scale={scale} {dtype}"

    leaves_ref = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    probs_ref, map_ref, aux_ref = megatron_routing(*leaves_ref, topk, pre_softmax, scale, coeff)
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    top_probs, aux, selection = fused(*leaves, topk, pre_softmax, scale, coeff)

    finite = torch.ones(num_tokens, dtype=torch.bool)
    if nan_token is not None:  # which K experts an all-NaN row gets is arbitrary; K of them, counted
        finite[nan_token] = False
        assert int(selection.routing_map[nan_token].sum()) == topk, f"{case}: routes of the NaN token"
        assert int(selection.nonfinite) == topk, f"{case}: non-finite count"
    assert torch.equal(selection.routing_map[finite], map_ref[finite]), f"{case}: routing map"
    ids = selection.top_idx.long()
    assert torch.equal(ids, ids.sort(dim=1).values), f"{case}: ids not ascending"
    assert torch.equal(selection.routing_map.gather(1, ids), torch.ones_like(ids, dtype=torch.bool)), \
        f"{case}: ids vs map"
    assert torch.equal(selection.counts.long(), selection.routing_map.sum(0)), f"{case}: counts"
    assert torch.equal(selection.block_hist.sum(0).long(), selection.routing_map.sum(0)), f"{case}: block histograms"
    want_probs = probs_ref.gather(1, ids).float()
    rtol = 1e-6 if dtype == torch.float32 else 2 ** -8  # bf16: one rounding step of the probs at most
    torch.testing.assert_close(top_probs.detach()[finite], want_probs.detach()[finite], rtol=rtol, atol=1e-7,
                               msg=lambda m: f"{case}: top-k probs\n{m}")
    if dtype == torch.bfloat16:  # rounded as a GPU rounds (to nearest even): few sums end on the other side
        differ = int((top_probs.detach()[finite] != want_probs.detach()[finite]).sum())
        assert differ <= max(2, want_probs[finite].numel() // 50), f"{case}: {differ} bf16 probs off by a step"
    if nan_token is None:
        torch.testing.assert_close(aux.detach(), aux_ref.detach().float(), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{case}: aux loss\n{m}")
        (probs_ref.float() * d_probs).sum().add(aux_ref).backward()
        (top_probs * d_probs.gather(1, ids)).sum().add(aux).backward()
        for name, got, want in zip(("hidden", "weight"), leaves, leaves_ref):
            if dtype == torch.float32:
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{case}: {name} gradient\n{m}")
            else:  # bf16 GEMMs over gradients that differ by bf16 ulps: relative to the largest entry
                assert_close(got.grad, want.grad, 2e-2, f"{case}: {name} gradient")
    print(f"ok {case}")


def check_without_aux() -> None:
    """No load-balancing loss: the gradient comes from the probs alone, and no score sums are made;
    [S, B, H] tokens give [S * B, K] probabilities and an [S, B, H] gradient."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear, topk_routing_with_score_function

    from megatron_ext.moe.fused_router import fused_routing

    gen = torch.Generator().manual_seed(7)
    hidden, weight = inputs(40, 12, torch.float32, gen)
    d_probs = torch.randn(40, 12, generator=gen)
    ref = hidden.clone().requires_grad_(True)
    probs_ref, _ = topk_routing_with_score_function(router_gating_linear(ref, weight, None, torch.float32), 3,
                                                    score_function="softmax")
    (probs_ref * d_probs).sum().backward()
    got = hidden.clone().view(20, 2, 24).requires_grad_(True)  # Megatron's [S, B, H] tokens
    top_probs, aux_loss, selection = fused_routing(got, weight, 3)
    assert aux_loss.numel() == 0 and top_probs.shape == (40, 3)
    (top_probs * d_probs.gather(1, selection.top_idx.long())).sum().backward()
    assert got.grad.shape == (20, 2, 24)
    torch.testing.assert_close(got.grad.view(40, 24), ref.grad, rtol=1e-5, atol=1e-7)
    print("ok without aux loss")


def check_split_gradients() -> None:
    """bf16 tokens and weight with fp32 logits (Megatron's fp32 router under --bf16): the backward
    GEMMs take the logits' gradient as bf16 hi + lo. The token and weight gradients equal
    Megatron's (fp32 GEMMs, then a cast to bf16) to one bf16 rounding step."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    gen = torch.Generator().manual_seed(11)
    num_tokens, num_experts, topk, coeff = 96, 64, 8, 0.01
    hidden = torch.randn(num_tokens, 48, generator=gen).bfloat16()
    weight = (torch.randn(num_experts, 48, generator=gen) * 0.2).bfloat16()
    d_probs = torch.randn(num_tokens, num_experts, generator=gen)
    leaves_ref = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    probs_ref, _, aux_ref = megatron_routing(*leaves_ref, topk, False, None, coeff,
                                             gate=lambda h, w: router_gating_linear(h, w, None, torch.float32))
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    from megatron_ext.moe.fused_router import LoadBalancingLoss, fused_routing

    aux = LoadBalancingLoss(num_experts * coeff / (topk * num_tokens * num_tokens))
    top_probs, aux_loss, selection = fused_routing(*leaves, topk, torch.float32, aux=aux)
    ids = selection.top_idx.long()
    (probs_ref.float() * d_probs).sum().add(aux_ref).backward()
    (top_probs * d_probs.gather(1, ids)).sum().add(aux_loss).backward()
    for name, got, want in zip(("hidden", "weight"), leaves, leaves_ref):
        assert got.grad.dtype == want.grad.dtype == torch.bfloat16, f"split: {name} gradient dtype"
        scale = want.grad.float().abs().max()
        torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=2 ** -7, atol=1e-4 * float(scale),
                                   msg=lambda m: f"split: {name} gradient\n{m}")
    print("ok split gating gradients")


def check_gate_in_kernel() -> None:
    """The gating GEMMs inside the routing kernels (bf16 tokens and weight, fp32 logits) against
    their torch form: logits against the fp32 product, the same routes as routing those logits,
    and token and weight gradients against _split_gating_grads to one bf16 rounding. Shapes with
    ragged token blocks, hidden sizes that are not multiples of the GEMM tile, fewer experts than
    tl.dot's 16, several token splits of the weight gradient, and no tokens at all; twice each,
    bitwise equal (the splits are summed in a fixed order). The load-balancing loss formed in the
    routing launch (both kernels) against the torch form of the score sums and counts."""
    from megatron_ext.kernels.router_topk import (gate_router_topk, gate_router_topk_backward, router_topk,
                                                  router_topk_backward)
    from megatron_ext.moe.fused_router import _split_gating_grads

    gen = torch.Generator().manual_seed(5)
    for num_tokens, num_experts, hidden_size, topk, pre_softmax in [(45, 6, 48, 2, False), (300, 64, 200, 8, False),
                                                                    (70, 20, 136, 3, True), (0, 8, 64, 2, False)]:
        case = f"gate T={num_tokens} E={num_experts} H={hidden_size} K={topk} pre_softmax={pre_softmax}"
        hidden = torch.randn(num_tokens, hidden_size, generator=gen).bfloat16()
        weight = (torch.randn(num_experts, hidden_size, generator=gen) * 0.2).bfloat16()
        grad_top = torch.randn(num_tokens, topk, generator=gen)
        grad_aux = (torch.tensor(0.7), torch.randint(0, 9, (num_experts,), generator=gen).int(), 0.01)
        out = gate_router_topk(hidden, weight, topk, pre_softmax, 1.5, score_sums=True)
        want_logits = hidden.float() @ weight.float().t()
        torch.testing.assert_close(out["logits"], want_logits, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{case}: logits\n{m}")
        ref = router_topk(out["logits"], topk, pre_softmax, 1.5, score_sums=True)
        for name in ("routing_map", "top_idx", "counts", "hist", "nonfinite"):
            assert torch.equal(out[name], ref[name]), f"{case}: {name}"
        for name in ("top_probs", "score_sums"):  # on a GPU the softmax's sums run in another order
            torch.testing.assert_close(out[name], ref[name], rtol=4e-7, atol=0, msg=lambda m: f"{case}: {name}\n{m}")
        for fused_loss in (gate_router_topk(hidden, weight, topk, pre_softmax, 1.5, aux_scale=0.3)["aux_loss"],
                           router_topk(out["logits"], topk, pre_softmax, 1.5, aux_scale=0.3)["aux_loss"]):
            want_loss = (ref["score_sums"] * ref["counts"]).sum() * 0.3  # the loss formed by torch before
            torch.testing.assert_close(fused_loss, want_loss, rtol=1e-6, atol=0, msg=lambda m: f"{case}: aux\n{m}")
        grads = [gate_router_topk_backward(out["logits"], out["routing_map"], grad_top, grad_aux, topk, pre_softmax,
                                           1.5, hidden, weight) for _ in range(2)]
        for first, again in zip(*grads):
            assert torch.equal(first, again), f"{case}: not bitwise equal run to run"
        split = router_topk_backward(out["logits"], out["routing_map"], grad_top, grad_aux, topk, pre_softmax, 1.5,
                                     split=True)
        for name, got, want in zip(("tokens", "weight"), grads[0], _split_gating_grads(split, hidden, weight)):
            assert got.dtype == torch.bfloat16 and got.shape == want.shape, f"{case}: {name} gradient's dtype, shape"
            scale = float(want.float().abs().max()) if want.numel() else 0.0
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -8 * scale,
                                       msg=lambda m: f"{case}: {name} gradient\n{m}")
        if num_tokens == 0:
            assert not grads[0][1].any(), f"{case}: the weight gradient of no tokens is zero"
        print(f"ok {case}")


def check_strided_tokens() -> None:
    """Tokens that are a view with strides (a column slice of a wider tensor, a transpose) take the
    Triton gating GEMMs to the same routes, probabilities and gradients as the cuBLAS form."""
    from megatron_ext.moe.fused_router import LoadBalancingLoss, fused_routing

    gen = torch.Generator().manual_seed(13)
    num_tokens, hidden_size, num_experts, topk = 70, 40, 16, 4
    wide = torch.randn(num_tokens, 2 * hidden_size, generator=gen).bfloat16()
    tall = torch.randn(hidden_size, num_tokens, generator=gen).bfloat16()
    weight = (torch.randn(num_experts, hidden_size, generator=gen) * 0.2).bfloat16()
    d_probs = torch.randn(num_tokens, topk, generator=gen)
    aux = LoadBalancingLoss(0.01)
    views = (("column slice", wide, lambda t: t[:, :hidden_size]), ("transpose", tall, lambda t: t.t()))
    for name, base, view in views:
        grads, outs = [], []
        for in_kernel in (True, False):
            leaf = base.clone().requires_grad_(True)
            weight_leaf = weight.clone().requires_grad_(True)
            tokens = view(leaf)
            assert not tokens.is_contiguous()
            top_probs, loss, selection = fused_routing(tokens, weight_leaf, topk, torch.float32, aux=aux,
                                                       gemms_in_kernel=in_kernel)
            (top_probs * d_probs).sum().add(loss).backward()
            outs.append((selection.top_idx, top_probs.detach(), loss.detach()))
            grads.append((leaf.grad.float(), weight_leaf.grad.float()))
        assert torch.equal(outs[0][0], outs[1][0]), f"{name}: routes"
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-6, atol=0, msg=lambda m: f"{name}: probs\n{m}")
        torch.testing.assert_close(outs[0][2], outs[1][2], rtol=1e-6, atol=0, msg=lambda m: f"{name}: loss\n{m}")
        for what, got, want in zip(("tokens", "weight"), *grads):
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -8 * scale,
                                       msg=lambda m: f"{name}: {what} gradient\n{m}")
        print(f"ok strided tokens: {name}")


def check_token_with_all_logits_minus_inf() -> None:
    """A token whose logits all overflow to -inf: Megatron's softmax gives it NaN probabilities and a
    NaN load-balancing loss; so does the fused router, which counts its K routes as non-finite (they
    are not routed at probability 0). Both softmax orders; the gating GEMM in torch (fp32) and in
    the routing kernel (bf16 tokens, fp32 logits)."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    from megatron_ext.moe.fused_router import LoadBalancingLoss, fused_routing

    gen = torch.Generator().manual_seed(17)
    num_tokens, num_experts, topk, bad = 20, 8, 2, 3
    for pre_softmax in (False, True):
        for dtype, logits_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32)):
            case = f"-inf token pre_softmax={pre_softmax} {dtype}"
            hidden = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
            hidden[bad] = -3e38  # times 2 overflows to -inf; times 0 (the other experts) stays -0
            weight = (2 * torch.eye(num_experts)).to(dtype)
            gate = lambda h, w: router_gating_linear(h, w, None, logits_dtype or dtype)  # noqa: E731
            probs_ref, map_ref, aux_ref = megatron_routing(hidden, weight, topk, pre_softmax, None, 0.01, gate=gate)
            aux = LoadBalancingLoss(num_experts * 0.01 / (topk * num_tokens * num_tokens))
            top_probs, loss, selection = fused_routing(hidden, weight, topk, logits_dtype, pre_softmax, aux=aux)
            assert probs_ref[bad][map_ref[bad]].isnan().all() and aux_ref.isnan(), f"{case}: Megatron's NaNs"
            assert top_probs[bad].isnan().all() and loss.isnan(), f"{case}: {top_probs[bad]}, loss {loss}"
            assert int(selection.nonfinite) == topk and int(selection.routing_map[bad].sum()) == topk, case
            good = torch.arange(num_tokens) != bad
            assert torch.equal(selection.routing_map[good], map_ref[good]), f"{case}: routes of the other tokens"
            want = probs_ref.gather(1, selection.top_idx.long()).float()[good]
            torch.testing.assert_close(top_probs[good], want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{case}\n{m}")
    print("ok token with every logit -inf")


def _router_step(router, fused_path, tokens, d_probs):
    """One training forward and backward of a router, Megatron's [T, E] outputs or the fused path's
    top-k ones scattered to [T, E]: ((routes, probabilities, logged loss, token and weight
    gradients), the fused path's Selection or None)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    router.set_layer_number(1)
    router.train()
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    leaf = tokens.clone().requires_grad_(True)
    selection = None
    if fused_path:
        probs, selection = router.fused_forward(leaf)
        ids = selection.top_idx.long()
        routing_map = selection.routing_map.bool()
        full = torch.zeros(d_probs.shape).scatter(1, ids, probs.detach().float())
        (probs * d_probs.gather(1, ids)).sum().backward()
    else:
        full, routing_map = router(leaf)
        (full.float() * d_probs).sum().backward()
    loss = tracker.metrics["load_balancing_loss"].values.clone()
    return (routing_map, full.detach().float(), loss, leaf.grad.float(), router.weight.grad.float()), selection


def check_router_module() -> None:
    """FusedTopKRouter.fused_forward (what the layer runs on a GPU) against Megatron's TopKRouter on the
    same weights and tokens, in training with the switch load-balancing loss: routes, probabilities,
    the loss Megatron's tracker logs, and the token and weight gradients with the loss's gradient
    attached by Megatron's autoscaler; fp32 and an fp32 router under bf16 tokens (the gating GEMMs
    in the kernel). A CPU forward still takes Megatron's own path."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.moe.fused_router import FusedTopKRouter
    from megatron_ext.testing.megatron_moe import moe_config
    from megatron_ext.testing.reference import assert_close
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()
    gen = torch.Generator().manual_seed(23)
    for dtype, router_dtype, pre_softmax, scale in ((torch.float32, None, False, None),
                                                    (torch.bfloat16, "fp32", False, None),
                                                    (torch.float32, None, True, None),
                                                    (torch.float32, None, False, 2.5)):
        case = f"router module {dtype} router dtype {router_dtype} pre_softmax={pre_softmax} topk scale {scale}"
        config = moe_config(hidden=48, experts=16, topk=4, dtype=dtype, moe_router_load_balancing_type="aux_loss",
                            moe_aux_loss_coeff=0.01, moe_router_dtype=router_dtype, moe_router_pre_softmax=pre_softmax,
                            moe_router_topk_scaling_factor=scale)
        routers = [cls(config=config, pg_collection=get_default_pg_collection()) for cls in (TopKRouter,
                                                                                             FusedTopKRouter)]
        with torch.no_grad():
            routers[1].weight.copy_(routers[0].weight)
        tokens = torch.randn(10, 3, 48, generator=gen).to(dtype)
        d_probs = torch.randn(30, 16, generator=gen)
        assert not routers[1].unfused, routers[1].unfused
        (reference, _), (fused, selection) = [_router_step(router, fused, tokens, d_probs)
                                              for router, fused in zip(routers, (False, True))]
        ids = selection.top_idx.long()
        (map_ref, probs_ref, loss_ref, *grads_ref), (map_got, probs_got, loss_got, *grads_got) = reference, fused
        assert torch.equal(map_got, map_ref), f"{case}: routes"
        torch.testing.assert_close(probs_got, probs_ref, rtol=1e-6 if dtype == torch.float32 else 2 ** -8, atol=1e-7,
                                   msg=lambda m: f"{case}: probabilities\n{m}")
        torch.testing.assert_close(loss_got, loss_ref, rtol=1e-5, atol=0, msg=lambda m: f"{case}: logged loss\n{m}")
        for name, got, want in zip(("token", "weight"), grads_got, grads_ref):
            assert_close(got, want, 1e-5 if dtype == torch.float32 else 2e-2, f"{case}: {name} gradient")
        cpu_probs, cpu_map = routers[1](tokens)  # CPU tensors: Megatron's path, its [T, E] outputs
        assert cpu_probs.shape == (30, 16) and torch.equal(cpu_map, map_ref), f"{case}: CPU path"
        routers[1].eval()  # evaluation with autograd on (Megatron's router attaches no loss then)
        tracker = get_moe_metrics_tracker()
        tracker.clear()
        eval_probs, _ = routers[1].fused_forward(tokens.clone().requires_grad_(True))
        assert torch.equal(eval_probs.detach().float(), probs_got.gather(1, ids)), f"{case}: eval probabilities"
        assert tracker.metrics["load_balancing_loss"].values.abs().sum() == 0, f"{case}: eval logged an aux loss"
        print(f"ok {case}")


def _router_module_tp_rank(rank, world):
    """One tensor-parallel rank: Megatron's TopKRouter and FusedTopKRouter on the same weights and this
    rank's tokens (as under sequence parallelism: each rank routes its own). The load-balancing loss
    sums the counts over the tp_cp group and divides by every rank's tokens; the route map must still
    plan from this rank's own counts."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.moe.fused_router import FusedTopKRouter
    from megatron_ext.testing.megatron_moe import moe_config

    config = moe_config(hidden=48, experts=16, topk=4, tp=2, moe_router_load_balancing_type="aux_loss",
                        moe_aux_loss_coeff=0.01)
    routers = [cls(config=config, pg_collection=get_default_pg_collection()) for cls in (TopKRouter, FusedTopKRouter)]
    with torch.no_grad():
        routers[0].weight.copy_(torch.randn(16, 48, generator=torch.Generator().manual_seed(5)))
        routers[1].weight.copy_(routers[0].weight)
    tokens = torch.randn(24, 48, generator=torch.Generator().manual_seed(40 + rank))
    d_probs = torch.randn(24, 16, generator=torch.Generator().manual_seed(60 + rank))
    (reference, _), (fused, selection) = [_router_step(router, fused, tokens, d_probs)
                                          for router, fused in zip(routers, (False, True))]
    own_counts = torch.equal(selection.counts.long(), selection.routing_map.long().sum(0))
    (map_ref, probs_ref, loss_ref, *grads_ref), (map_got, probs_got, loss_got, *grads_got) = reference, fused
    problems = [name for name, ok in (
        ("routes", torch.equal(map_got, map_ref)),
        ("probabilities", torch.allclose(probs_got, probs_ref, rtol=1e-6, atol=1e-7)),
        ("logged loss", torch.allclose(loss_got, loss_ref, rtol=1e-5, atol=0)),
        # fp32 sums in another order: within 1e-5 of the gradient's largest entry (testing.reference.assert_close)
        ("token gradient", (grads_got[0] - grads_ref[0]).abs().max() <= 1e-5 * grads_ref[0].abs().max()),
        ("weight gradient", (grads_got[1] - grads_ref[1]).abs().max() <= 1e-5 * grads_ref[1].abs().max()),
        ("the route map's counts are this rank's own", own_counts)) if not ok]
    return problems


def check_router_module_tensor_parallel() -> None:
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    for rank, problems in enumerate(run_on_ranks(_router_module_tp_rank, 2, sizes=ParallelSizes(tp=2))):
        assert not problems, f"router module at TP=2, rank {rank}: {', '.join(problems)}"
    print("ok router module at TP=2 (counts summed over tp_cp, the route map's own)")


def check_ties() -> None:
    """Equal logits at the top-k boundary: the lowest expert id wins (torch.topk leaves the order
    of ties unspecified; on bf16 logits they happen)."""
    from megatron_ext.moe.fused_router import fused_routing

    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0],
                           [3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
                           [-30.0, -30.0, 1.0, -30.0, -30.0, -30.0]])
    _, _, selection = fused_routing(logits, torch.eye(6), 2)
    assert selection.top_idx.tolist() == [[1, 3], [0, 1], [0, 2]], selection.top_idx.tolist()
    print("ok ties")


def check_topk_against_loops() -> None:
    """router_topk on logits full of ties (multiples of 0.5) and with one NaN logit in some tokens,
    against Python loops: K rounds of the largest logit, NaN ranking above every number (as in
    torch.topk), the lowest expert id on ties; probabilities as a float64 softmax over the selected
    logits (or, pre-softmax, over all) times the scale; a token whose selection holds a NaN gets NaN
    probabilities, its K routes counted as non-finite."""
    from megatron_ext.kernels.route_plan import BLOCK_TOKENS
    from megatron_ext.kernels.router_topk import router_topk

    num_tokens, num_experts, topk, scale = 45, 10, 3, 1.5
    gen = torch.Generator().manual_seed(31)
    logits = torch.randint(-4, 5, (num_tokens, num_experts), generator=gen).float() * 0.5
    nan_tokens = (2, 17, 40)
    for token in nan_tokens:  # one NaN at a random expert: it must be picked first
        logits[token, int(torch.randint(0, num_experts, (), generator=gen))] = float("nan")
    for pre_softmax in (False, True):
        out = router_topk(logits, topk, pre_softmax, scale)
        case = f"top-k against loops pre_softmax={pre_softmax}"
        want_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        want_probs = torch.zeros(num_tokens, topk, dtype=torch.float64)
        want_hist = torch.zeros(-(-num_tokens // BLOCK_TOKENS), num_experts, dtype=torch.int32)
        for t in range(num_tokens):
            row = [float(v) for v in logits[t]]
            order = sorted(range(num_experts), key=lambda e: (not math.isnan(row[e]), -row[e] if row[e] == row[e]
                                                              else 0.0, e))
            chosen = sorted(order[:topk])
            want_map[t, chosen] = True
            want_hist[t // BLOCK_TOKENS, chosen] += 1
            pool = range(num_experts) if pre_softmax else chosen
            if t not in nan_tokens:
                top = max(row[e] for e in pool)
                total = sum(math.exp(row[e] - top) for e in pool)
                want_probs[t] = torch.tensor([math.exp(row[e] - top) / total * scale for e in chosen])
        assert torch.equal(out["routing_map"], want_map), f"{case}: routing map (ties, NaN first)"
        assert torch.equal(out["top_idx"].long(), want_map.nonzero()[:, 1].view(num_tokens, topk)), f"{case}: ids"
        assert torch.equal(out["counts"], want_map.sum(0).int()), f"{case}: counts"
        assert torch.equal(out["hist"], want_hist), f"{case}: block histograms"
        assert int(out["nonfinite"]) == topk * len(nan_tokens), f"{case}: non-finite count {int(out['nonfinite'])}"
        finite = torch.tensor([t not in nan_tokens for t in range(num_tokens)])
        assert out["top_probs"][~finite].isnan().all(), f"{case}: probabilities of a token with a NaN logit"
        torch.testing.assert_close(out["top_probs"][finite].double(), want_probs[finite], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{case}: probabilities\n{m}")
    print("ok top-k against loops (ties, NaN logits, scale)")


def main() -> int:
    from tests.unit.interpreter import fix_interpreter_bf16_dot, interpreter_ready

    if not interpreter_ready():
        return 2
    fix_interpreter_bf16_dot()
    cases = [  # T, E, K, pre_softmax, scale, dtype
        (70, 8, 2, False, None, torch.float32),
        (45, 6, 2, False, None, torch.float32),      # E not a power of two, T not a multiple of 32
        (96, 64, 8, False, None, torch.float32),     # the reference shape's E and K
        (33, 12, 3, True, None, torch.float32),      # pre-softmax
        (40, 16, 4, False, 2.5, torch.float32),      # scaling factor
        (50, 10, 1, False, None, torch.float32),     # top-1
        (64, 16, 2, False, None, torch.bfloat16),    # bf16 logits (router dtype bf16)
        (45, 6, 2, False, None, torch.bfloat16),     # bf16 with few experts, T not a multiple of 32
        (40, 12, 3, True, 2.5, torch.bfloat16),     # bf16 with a scaling factor: scaled, then rounded
    ]
    for seed, case in enumerate(cases):
        check_case(*case, seed=10 * seed)
    check_case(40, 8, 2, False, None, torch.float32, seed=99, nan_token=5)
    check_without_aux()
    check_split_gradients()
    check_gate_in_kernel()
    check_strided_tokens()
    check_token_with_all_logits_minus_inf()
    check_router_module_tensor_parallel()  # forks its ranks: before this process starts its own group
    check_router_module()
    check_ties()
    check_topk_against_loops()
    print("all fused-router checks passed")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
