"""RowwiseMoELayer rejects bad input with messages that say what to change."""

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import moe_config


def build(config, **ext):
    return moe_builder(MoEExtConfig(transport="torch", **ext))(config=config)


def _errors_rank(rank, world):
    from megatron_ext.moe.layer import RowwiseMoELayer

    with pytest.raises(ValueError, match=r"num_moe_experts=3 \(--num-experts 3\) is not divisible by the "
                                         r"expert-parallel size \(--expert-model-parallel-size 2\)"):
        build(moe_config(experts=3, topk=2, ep=2))
    with pytest.raises(ValueError, match=r"moe_router_topk=5 \(--moe-router-topk 5\) exceeds num_moe_experts=4"):
        build(moe_config(experts=4, topk=5, ep=2))
    with pytest.raises(ValueError, match=r"moe_expert_capacity_factor=1.0 \(--moe-expert-capacity-factor 1.0\): "
                       r"Megatron's per-expert capacity drops tokens on its host path; use --moe-ext-capacity-factor"):
        build(moe_config(experts=4, ep=2, moe_expert_capacity_factor=1.0))
    with pytest.raises(ValueError, match="expert-tensor-parallel-size 1"):
        build(moe_config(experts=4, ep=2, etp=2))
    with pytest.raises(ValueError, match=r"--cuda-graph-impl local with --moe-ext-cuda-graphs: .* twice"):
        build(moe_config(experts=4, ep=2, cuda_graph_impl="local"), cuda_graphs=True)
    # What still cannot run names the setting to change (every activation, bias, dtype and size runs: issue 21).
    with pytest.raises(ValueError, match=r"moe_mlp_glu_interleave_size=8 \(--moe-mlp-glu-interleave-size 8\)"):
        build(moe_config(experts=4, ep=2, moe_mlp_glu_interleave_size=8))
    with pytest.raises(ValueError, match=r"moe_apply_probs_on_input \(--moe-apply-probs-on-input\) needs "
                                         r"moe_router_topk=1 \(--moe-router-topk 1\)"):
        build(moe_config(experts=4, ep=2, moe_apply_probs_on_input=True))
    for variant in (dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu, add_bias_linear=True),
                    dict(add_bias_linear=True, hidden=12, ffn=5, dtype=torch.float16)):
        build(moe_config(experts=4, ep=2, **variant))  # Megatron's GELU default with biases; odd sizes in fp16
    with pytest.raises(ValueError, match="unknown row transport"):
        MoEExtConfig(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="Use --moe-ext-transport torch on CPU"):
        moe_builder(MoEExtConfig(transport="symm"))(config=moe_config(experts=4, ep=2))(torch.randn(4, 1, 32))
    with pytest.raises(ImportError, match="build DeepEP from source"):
        moe_builder(MoEExtConfig(transport="deepep"))(config=moe_config(experts=4, ep=2))(torch.randn(4, 1, 32))
    with pytest.raises(TypeError, match="megatron_ext.specs"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
        from megatron.core.transformer.spec_utils import get_submodules

        RowwiseMoELayer(moe_config(experts=4, ep=2), get_submodules(get_gpt_layer_local_submodules(num_experts=4).mlp))

    layer = build(moe_config(experts=4, ep=2), max_tokens_per_rank=8)
    layer(torch.randn(8, 1, 32))  # at the limit: fine
    with pytest.raises(ValueError, match="max_tokens_per_rank=8; raise --moe-ext-max-tokens-per-rank"):
        layer(torch.randn(9, 1, 32))


def test_bad_input_errors():
    run_on_ranks(_errors_rank, 2, sizes=ParallelSizes(ep=2))
