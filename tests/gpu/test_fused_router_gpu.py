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


def make_layer(weights, fused_router: bool, **config_overrides):
    config = moe_config(hidden=weights.fc1.shape[2], ffn=weights.fc2.shape[2], experts=weights.fc1.shape[0],
                        dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32",
                        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, **config_overrides)
    layer = moe_builder(MoEExtConfig(transport="symm", dropless=True, fused_router=fused_router))(config=config)
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


def test_fused_router_without_aux_loss_in_eval():
    weights = MoEWeights.random(16, 256, 128, seed=6, dtype=torch.bfloat16)
    x = torch.randn(512, 1, 256, device="cuda").bfloat16()
    fused_layer, megatron_layer = make_layer(weights, True, moe_router_topk=4), make_layer(weights, False,
                                                                                           moe_router_topk=4)
    with torch.no_grad():
        fused_layer.eval()
        megatron_layer.eval()
        assert_close(fused_layer(x)[0].float(), megatron_layer(x)[0].float(), 2e-2, "eval output")
