"""Block specs per pipeline stage: megatron_ext's MoE layers where Megatron puts its own, Megatron's dense
layers elsewhere, including stages that hold dense layers only or no layer at all."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig

from megatron_ext.config import MoEExtConfig
from megatron_ext.specs import _is_moe_builder, gpt_block_spec


def _config(**overrides):
    settings = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=32, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                    transformer_impl="local", persist_layer_norm=False, pipeline_dtype=torch.float32)
    return TransformerConfig(**{**settings, **overrides})


def _kinds(block_spec):
    return ["moe" if _is_moe_builder(layer.submodules.mlp) else "dense" for layer in block_spec.layer_specs]


@pytest.mark.parametrize("overrides, stages", [
    (dict(moe_layer_freq=[0, 1, 1, 1], pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
     [(0, None), (1, None)]),  # DeepSeek-style dense first layer alone on stage 0
    (dict(moe_layer_freq=[0, 0, 1, 1], pipeline_model_parallel_size=2), [(0, None), (1, None)]),
    (dict(moe_layer_freq=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     [(0, 0), (0, 1), (1, 0), (1, 1)]),
])
def test_every_pipeline_stage_builds_as_megatrons_with_our_moe_layers(overrides, stages):
    """A review found a stage with dense layers only refused ("found no MoE layer"), so these
    common MoE pipeline layouts could not be built at all."""
    config = _config(**overrides)
    seen = set()
    for pp_rank, vp_stage in stages:
        megatrons = get_gpt_decoder_block_spec(config, False, normalization=config.normalization, vp_stage=vp_stage,
                                               pp_rank=pp_rank)
        ours = gpt_block_spec(config, ext_config=MoEExtConfig(transport="torch"), vp_stage=vp_stage, pp_rank=pp_rank)
        megatron_kinds = ["moe" if "MoE" in str(getattr(layer.submodules.mlp, "func", layer.submodules.mlp)) else
                          "dense" for layer in megatrons.layer_specs]
        assert _kinds(ours) == megatron_kinds, (pp_rank, vp_stage)
        for mine, theirs in zip(ours.layer_specs, megatrons.layer_specs):
            if not _is_moe_builder(mine.submodules.mlp):  # partials compare by identity: their parts instead
                assert (mine.submodules.mlp.func, mine.submodules.mlp.keywords) == (
                    theirs.submodules.mlp.func, theirs.submodules.mlp.keywords), "dense layers stay Megatron's"
        seen.update(megatron_kinds)
        if megatron_kinds == ["dense"] * len(megatron_kinds):
            seen.add("a dense-only stage")
    assert {"moe", "dense", "a dense-only stage"} <= seen


def test_a_dense_model_is_still_refused():
    dense = _config(num_moe_experts=None, moe_ffn_hidden_size=None)
    with pytest.raises(ValueError, match="found no MoE layer in the spec"):
        gpt_block_spec(dense, ext_config=MoEExtConfig(transport="torch"), pp_rank=0)


def _layout_rank(rank, world):
    config = _config(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*4|L")
    megatrons = get_gpt_decoder_block_spec(config, False, normalization=config.normalization)
    ours = gpt_block_spec(config, ext_config=MoEExtConfig(transport="torch"))
    return len(megatrons.layer_specs), _kinds(ours)


def test_a_pipeline_layout_with_a_stage_of_no_layers_builds():
    """--pipeline-model-parallel-layout 'Et*4|L': the last stage holds the loss only (no layer)."""
    from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

    assert run_on_ranks(_layout_rank, 2, sizes=ParallelSizes(pp=2)) == [(4, ["moe"] * 4), (0, [])]


def test_the_configs_own_settings_reach_megatrons_spec():
    """qk_l2_norm and normalization come from the config (Megatron's own default spec does the same);
    a GPTModelConfig (megatron.training's --spec hook) is unwrapped; a Transformer Engine config is
    refused here for want of Transformer Engine, not built with local layers."""
    from types import SimpleNamespace

    from megatron.core.transformer.torch_norm import L2Norm

    ext = MoEExtConfig(transport="torch")
    spec = gpt_block_spec(_config(qk_l2_norm=True), ext_config=ext, pp_rank=0)
    assert spec.layer_specs[0].submodules.self_attention.submodules.q_layernorm is L2Norm
    wrapped = gpt_block_spec(SimpleNamespace(transformer=_config()), ext_config=ext, pp_rank=0)
    assert _kinds(wrapped) == ["moe"] * 4
    with pytest.raises(ImportError, match="transformer_engine is not installed"):
        gpt_block_spec(_config(transformer_impl="transformer_engine"), ext_config=ext, pp_rank=0)


def test_normalization_is_handed_to_megatrons_spec(monkeypatch):
    """Without it Megatron's local spec would pick its LayerNorm implementation for an RMSNorm model where
    Apex is installed (this machine has no Apex, so the call's arguments are checked)."""
    from megatron.core.models.gpt import gpt_layer_specs

    seen = {}
    original = gpt_layer_specs.get_gpt_decoder_block_spec

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_decoder_block_spec", spy)
    gpt_block_spec(_config(normalization="RMSNorm"), ext_config=MoEExtConfig(transport="torch"), pp_rank=0)
    assert seen["normalization"] == "RMSNorm"


def test_a_moe_layer_given_as_a_module_spec_is_swapped():
    """A user's spec may name MoELayer in a ModuleSpec rather than a partial."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_ext.moe.layer import RowwiseMoELayer
    from megatron_ext.specs import _moe_submodules_of, swap_moe_parts

    layer = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    as_module_spec = ModuleSpec(module=MoELayer, submodules=_moe_submodules_of(layer.submodules.mlp))
    layer.submodules.mlp = as_module_spec
    swapped = swap_moe_parts(layer, MoEExtConfig(transport="torch"))
    assert swapped.submodules.mlp.func is RowwiseMoELayer


def test_the_megatron_dispatcher_without_fallback_experts_refuses_clearly(monkeypatch):
    """Where the grouped experts cannot serve a config and there are no Megatron experts to fall back to,
    the grouped experts' own refusal reaches the user (not a call of None)."""
    from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
    from megatron_ext.specs import grouped_or_megatron_experts

    monkeypatch.setattr(DeviceOffsetGroupedMLP, "unsupported", staticmethod(lambda config, settings=None: ["why"]))

    def refuse(self, *args, **kwargs):
        raise ValueError("DeviceOffsetGroupedMLP cannot run with: why")

    monkeypatch.setattr(DeviceOffsetGroupedMLP, "__init__", refuse)
    with pytest.raises(ValueError, match="cannot run with: why"):
        grouped_or_megatron_experts(2, _config(), megatron_experts=None)
