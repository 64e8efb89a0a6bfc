"""FusedTopKRouter: its kernels against Megatron's routing (Triton interpreter, in a subprocess),
and where the specs install it."""

import functools

import torch

from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext import specs
from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.fused_router import FusedTopKRouter
from tests.unit.interpreter import run_under_interpreter


def test_fused_router_kernels_equal_megatrons_routing_under_interpreter():
    stdout = run_under_interpreter("_router_topk_interp.py")
    assert "all fused-router checks passed" in stdout
    assert sum(line.startswith("ok ") for line in stdout.splitlines()) == 26  # every case ran


def _router_of(builder: functools.partial):
    return builder.keywords["submodules"].router


def test_rowwise_layers_get_the_fused_router_unless_turned_off():
    assert _router_of(specs.moe_builder(MoEExtConfig())) is FusedTopKRouter
    assert _router_of(specs.moe_builder(MoEExtConfig(fused_router=False))) is TopKRouter
    assert _router_of(specs.moe_builder(MoEExtConfig(fused_route_map=False))) is TopKRouter  # it feeds that
    assert _router_of(specs.moe_builder(MoEExtConfig(dispatcher="megatron"))) is TopKRouter  # [T, E] consumers


def _router_gemms_rank(rank, world):
    from megatron_ext.testing.megatron_moe import moe_config

    built = {}
    for setting in ("triton", "cublas"):
        layer = specs.moe_builder(MoEExtConfig(transport="torch", router_gemms=setting))(config=moe_config(experts=4))
        built[setting] = (type(layer.router).__name__, layer.router.gemms_in_kernel)
    return built


def test_the_router_gemms_setting_reaches_the_fused_router():
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    [built] = run_on_ranks(_router_gemms_rank, 1, sizes=ParallelSizes())
    assert built == {"triton": ("FusedTopKRouter", True), "cublas": ("FusedTopKRouter", False)}


def test_a_users_own_router_class_is_kept():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.spec_utils import get_submodules

    class MyRouter(TopKRouter):
        pass

    base = get_submodules(get_gpt_layer_local_submodules(num_experts=2).mlp)
    base.router = MyRouter
    assert _router_of(specs.moe_builder(MoEExtConfig(), base)) is MyRouter


# Every Megatron router setting the fused kernel does not implement (plain softmax top-k with the
# switch load-balancing loss is all it computes), with the reason the router must give for it. A
# setting missing from FusedTopKRouter.unfused would be silently ignored on the GPU: other routes,
# probabilities or losses than Megatron's, with no error.
NOT_FUSED = [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(moe_router_load_balancing_type="seq_aux_loss"), "seq_aux_loss"),
    (dict(moe_router_load_balancing_type="global_aux_loss"), "global_aux_loss"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "group-limited routing"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"), "moe_router_enable_expert_bias"),
    (dict(moe_z_loss_coeff=1e-3), "moe_z_loss_coeff"),
    (dict(moe_input_jitter_eps=0.1), "moe_input_jitter_eps"),
    (dict(moe_router_force_load_balancing=True), "moe_router_force_load_balancing"),
    (dict(moe_router_force_biased=0.5), "moe_router_force_biased"),
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_dtype="fp64"), "moe_router_dtype='fp64'"),
    (dict(moe_enable_routing_replay=True), "router replay"),
    (dict(add_bias_linear=True), "a router bias (add_bias_linear)"),
    (dict(moe_router_fusion=True), "moe_router_fusion (Transformer Engine's fused router)"),
]


def _unfused_rank(rank, world):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_ext.testing.megatron_moe import moe_config

    found = []
    for overrides, _ in NOT_FUSED:
        settings = {**dict(hidden=16, experts=8, topk=2, moe_router_load_balancing_type="aux_loss",
                           moe_aux_loss_coeff=1e-2), **overrides}
        found.append(FusedTopKRouter(config=moe_config(**settings), pg_collection=get_default_pg_collection()).unfused)
    return found


def test_each_setting_the_kernel_does_not_compute_runs_megatrons_routing():
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    (found,) = run_on_ranks(_unfused_rank, 1, sizes=ParallelSizes())
    for (overrides, reason), unfused in zip(NOT_FUSED, found):
        assert reason in unfused, f"{overrides}: fused anyway (unfused={unfused})"


def test_the_hi_lo_gating_gradients_round_as_fp32_gemms_would():
    """The cuBLAS backward (router_gemms='cublas', or more than 256 experts) takes the logits'
    gradient as bf16 [hi | lo]; both halves must count: the token and weight gradients then equal
    the exact products rounded once to bf16 except at rounding ties (hi alone: ~40% of them differ)."""
    from megatron_ext.moe.fused_router import _split_gating_grads

    gen = torch.Generator().manual_seed(0)
    grad_logits = torch.randn(512, 16, generator=gen)
    tokens = torch.randn(512, 64, generator=gen).bfloat16()
    weight = torch.randn(16, 64, generator=gen).bfloat16()
    hi = grad_logits.bfloat16()
    lo = (grad_logits - hi.float()).bfloat16()
    grad_tokens, grad_weight = _split_gating_grads(torch.cat([hi, lo], 1), tokens, weight)
    exact = grad_logits.double()
    for name, got, want, scale in (("token", grad_tokens, exact @ weight.double(), exact.abs() @ weight.double().abs()),
                                   ("weight", grad_weight, exact.t() @ tokens.double(),
                                    exact.abs().t() @ tokens.double().abs())):
        assert got.dtype == torch.bfloat16 and (got != want.bfloat16()).float().mean() < 0.02, name
        # one bf16 step of the result, plus hi + lo's own error (2^-16 of each product): hi alone is 2^-9
        bound = torch.finfo(torch.bfloat16).eps * want.abs() + 2.0 ** -14 * scale
        assert ((got.double() - want).abs() <= bound).all(), f"{name} gradient more than one bf16 step off"
