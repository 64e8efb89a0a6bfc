"""FusedTopKRouter on one H200: the rowwise layer with the fused router against the same layer
with Megatron's own TopKRouter, same weights and tokens. Outputs, input and weight gradients and
the logged load-balancing loss agree to fp32 rounding of the router; the top-k choice is equal."""

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.fused_router import FusedTopKRouter
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import expert_grads, load_weights, moe_config
from megatron_ext.testing.reference import MoEWeights, assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()


def make_layer(weights, fused_router: bool, router_gemms: str = "triton", **config_overrides):
    config = moe_config(hidden=weights.fc1.shape[2], ffn=weights.fc2.shape[2], experts=weights.fc1.shape[0],
                        dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32",
                        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, **config_overrides)
    layer = moe_builder(MoEExtConfig(transport="symm", dropless=True, fused_router=fused_router,
                                     router_gemms=router_gemms))(config=config)
    layer = layer.cuda()
    layer.set_layer_number(1)
    load_weights(layer, weights)
    return layer


def step(layer, x, grad_out):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    for param in layer.parameters():
        param.grad = None
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad_out)
    aux = tracker.metrics["load_balancing_loss"].values[0].clone()
    return {"output": out.detach().float(), "input grad": x.grad.float(),
            "router grad": layer.router.weight.grad.float(), "fc1 grad": expert_grads(layer)[0].float(),
            "load balancing loss": aux, "routes": layer.token_dispatcher.top_idx.long()}


@pytest.mark.parametrize("experts,topk,overrides", [
    (64, 8, {}),
    (12, 3, {"moe_router_pre_softmax": True}),
    (16, 2, {"moe_router_topk_scaling_factor": 2.0}),
])
def test_fused_router_equals_megatron_router(experts, topk, overrides):
    weights = MoEWeights.random(experts, 512, 256, seed=5, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 1, 512, device="cuda", generator=gen).bfloat16()
    grad_out = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    fused_layer = make_layer(weights, True, moe_router_topk=topk, **overrides)
    megatron_layer = make_layer(weights, False, moe_router_topk=topk, **overrides)
    assert isinstance(fused_layer.router, FusedTopKRouter) and not fused_layer.router.unfused
    assert type(megatron_layer.router).__name__ == "TopKRouter"
    got, want = step(fused_layer, x, grad_out), step(megatron_layer, x, grad_out)
    assert torch.equal(got.pop("routes"), want.pop("routes")), "top-k experts differ"
    for name in got:
        rtol = 1e-4 if name == "load balancing loss" else 2e-2  # bf16 layer, fp32 router
        assert_close(got[name], want[name], rtol, f"fused router vs Megatron's: {name}")


def test_router_gemms_setting_reaches_the_router_and_both_places_agree():
    """MoEExtConfig.router_gemms: the layer hands it to its router; the gating GEMMs in Triton and in
    cuBLAS give the same routes, and outputs and gradients to fp32 rounding of the logits."""
    weights = MoEWeights.random(64, 1024, 256, seed=8, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4096, 1, 1024, device="cuda", generator=gen).bfloat16()
    grad_out = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    in_kernel, cublas = make_layer(weights, True), make_layer(weights, True, router_gemms="cublas")
    assert in_kernel.router.gemms_in_kernel and not cublas.router.gemms_in_kernel
    got, want = step(in_kernel, x, grad_out), step(cublas, x, grad_out)
    assert torch.equal(got.pop("routes"), want.pop("routes")), "top-k experts differ"
    for name in got:
        rtol = 1e-5 if name == "load balancing loss" else 1e-2
        assert_close(got[name], want[name], rtol, f"router GEMMs in Triton vs cuBLAS: {name}")


def test_more_experts_than_the_tiles_hold_keep_cublas():
    """Above router_gate.MAX_EXPERTS the gating GEMMs stay in cuBLAS (the Triton tiles would not fit
    in shared memory): the routing runs and its gradients match the cuBLAS form asked for outright."""
    from megatron_ext.kernels.router_gate import MAX_EXPERTS
    from megatron_ext.moe.fused_router import fused_routing

    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(512, 256, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(MAX_EXPERTS + 64, 256, device="cuda", generator=gen) * 0.05).bfloat16()
    grads = []
    for gemms_in_kernel in (True, False):
        leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        top_probs, _, selection = fused_routing(*leaves, 8, torch.float32, gemms_in_kernel=gemms_in_kernel)
        top_probs.square().sum().backward()
        grads.append([selection.top_idx, top_probs.detach()] + [leaf.grad for leaf in leaves])
    for got, want in zip(*grads):
        assert torch.equal(got, want), "more than MAX_EXPERTS experts must take the cuBLAS path either way"


def test_fused_router_without_aux_loss_in_eval():
    weights = MoEWeights.random(16, 256, 128, seed=6, dtype=torch.bfloat16)
    x = torch.randn(512, 1, 256, device="cuda").bfloat16()
    fused_layer, megatron_layer = make_layer(weights, True, moe_router_topk=4), make_layer(weights, False,
                                                                                           moe_router_topk=4)
    with torch.no_grad():
        fused_layer.eval()
        megatron_layer.eval()
        assert_close(fused_layer(x)[0].float(), megatron_layer(x)[0].float(), 2e-2, "eval output")


@pytest.mark.parametrize("tokens,experts,hidden,topk", [(8192, 64, 2048, 8), (1000, 20, 200, 3), (4096, 128, 4096, 8),
                                                        (2048, 256, 1024, 8), (300, 8, 96, 2)])
def test_gating_gemms_in_the_routing_kernels_equal_their_torch_form(tokens, experts, hidden, topk):
    """kernels/router_gate.py on the GPU against cuBLAS: logits against the fp32-output GEMM; the
    routes of those logits (probabilities, score sums and the load-balancing loss to fp32 rounding:
    the softmax reduces the logits in the GEMM's register layout, in another order); the token and weight gradients
    against _split_gating_grads to one bf16 rounding; three backward calls bitwise equal (the
    weight gradient's splits are summed in a fixed order, and its arrival counters are cleared by
    every call, on reused allocator memory)."""
    from megatron_ext.kernels.router_topk import (gate_router_topk, gate_router_topk_backward, router_topk,
                                                  router_topk_backward)
    from megatron_ext.moe.fused_router import _mm_fp32, _split_gating_grads

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(experts, hidden, device="cuda", generator=gen) * 0.05).bfloat16()
    grad_top = torch.randn(tokens, topk, device="cuda", generator=gen)
    grad_aux = (torch.tensor(0.3, device="cuda"), torch.randint(0, 50, (experts,), device="cuda").int(), 1e-3)
    out = gate_router_topk(x, weight, topk, score_sums=True)
    torch.testing.assert_close(out["logits"], _mm_fp32(x, weight.t()), rtol=1e-5, atol=1e-4)
    ref = router_topk(out["logits"], topk, score_sums=True)
    for name in ("routing_map", "top_idx", "counts", "hist", "nonfinite"):
        assert torch.equal(out[name], ref[name]), name
    for name in ("top_probs", "score_sums"):
        torch.testing.assert_close(out[name], ref[name], rtol=4e-7, atol=0, msg=lambda m: f"{name}\n{m}")
    for _ in range(3):  # the load-balancing loss formed by the block that arrives last, against torch's form
        fused_loss = gate_router_topk(x, weight, topk, aux_scale=1e-3)["aux_loss"]
        torch.testing.assert_close(fused_loss, (ref["score_sums"] * ref["counts"]).sum() * 1e-3, rtol=2e-6, atol=0)
    runs = [gate_router_topk_backward(out["logits"], out["routing_map"], grad_top, grad_aux, topk, False, 1.0,
                                      x, weight) for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run)), "not bitwise equal run to run"
    split = router_topk_backward(out["logits"], out["routing_map"], grad_top, grad_aux, topk, False, 1.0, split=True)
    for name, got, want in zip(("tokens", "weight"), runs[0], _split_gating_grads(split, x, weight)):
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -8 * scale,
                                   msg=lambda m: f"{name} gradient\n{m}")
