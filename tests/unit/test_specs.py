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
