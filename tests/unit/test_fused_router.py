"""FusedTopKRouter: its kernels against Megatron's routing (Triton interpreter, in a subprocess),
and where the specs install it."""

import functools

from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext import specs
from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.fused_router import FusedTopKRouter
from tests.unit.interpreter import run_under_interpreter


def test_fused_router_kernels_equal_megatrons_routing_under_interpreter():
    stdout = run_under_interpreter("_router_topk_interp.py")
    assert "all fused-router checks passed" in stdout
    assert sum(line.startswith("ok ") for line in stdout.splitlines()) == 18  # every case ran


def _router_of(builder: functools.partial):
    return builder.keywords["submodules"].router


def test_rowwise_layers_get_the_fused_router_unless_turned_off():
    assert _router_of(specs.moe_builder(MoEExtConfig())) is FusedTopKRouter
    assert _router_of(specs.moe_builder(MoEExtConfig(fused_router=False))) is TopKRouter
    assert _router_of(specs.moe_builder(MoEExtConfig(fused_route_map=False))) is TopKRouter  # it feeds that
    assert _router_of(specs.moe_builder(MoEExtConfig(dispatcher="megatron"))) is TopKRouter  # [T, E] consumers


def test_a_users_own_router_class_is_kept():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.spec_utils import get_submodules

    class MyRouter(TopKRouter):
        pass

    base = get_submodules(get_gpt_layer_local_submodules(num_experts=2).mlp)
    base.router = MyRouter
    assert _router_of(specs.moe_builder(MoEExtConfig(), base)) is MyRouter
