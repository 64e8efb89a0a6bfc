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


class _Model(torch.nn.Module):
    """What Megatron's inference helpers take: a module with .config holding the MoE layers."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.config = layer, layer.config


def _decode_padding_rank(rank, world):
    import megatron.core.inference.utils as inference_utils
    from megatron_ext.testing.megatron_moe import load_weights
    from megatron_ext.testing.reference import MoEWeights

    with pytest.raises(ValueError, match=r"moe_pad_experts_for_cuda_graph_inference=True "
                                         r"\(--moe-pad-experts-for-cuda-graph-inference\): .*more than top-k"):
        build(moe_config(experts=4, topk=2, moe_pad_experts_for_cuda_graph_inference=True))
    weights = MoEWeights.random(4, 32, 16, seed=5)
    layer, reference = (build(moe_config(experts=4, topk=2, ffn=16), dropless=True).eval() for _ in range(2))
    for each in (layer, reference):
        load_weights(each, weights)
    x = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(3))
    # Megatron's inference engine turns decode padding on in the live config of a built model: its
    # router would then hand the layer every expert with a capacity mask (a review's case: outputs
    # off by 0.76, no error). The layer refuses the changed config at its next forward.
    inference_utils.moe_layer_cache = None
    try:
        inference_utils.set_decode_expert_padding(_Model(layer), True, capacity_factor=2.0)
        with pytest.raises(ValueError, match=r"changed after the layer was built(.|\n)*"
                                             r"moe_expert_capacity_factor=2.0 \(--moe-expert-capacity-factor 2.0\)"):
            layer(x)
        inference_utils.set_decode_expert_padding(_Model(layer), False)
        with torch.no_grad():
            assert torch.equal(layer(x)[0], reference(x)[0])
    finally:
        inference_utils.moe_layer_cache = None


def test_decode_padding_is_refused_at_build_and_when_switched_on_later():
    run_on_ranks(_decode_padding_rank, 1, sizes=ParallelSizes())


def _host_names_rank(rank, world, same_host):
    import torch.distributed as dist

    from megatron_ext.moe import transport

    transport.socket.gethostname = lambda: "node0" if same_host else f"node{rank}"
    group = dist.group.WORLD
    one_host = transport.group_in_one_host(group)
    auto = transport.resolve_transport("auto", group, torch.device("cuda"))
    try:
        transport.resolve_transport("symm", group, torch.device("cuda"))
        refused = None
    except ValueError as error:
        refused = str(error)
    return one_host, auto, refused


@pytest.mark.parametrize("same_host", [True, False], ids=["one_host", "two_hosts"])
def test_symm_is_chosen_only_for_a_group_inside_one_host(same_host):
    """Host names are exchanged once: ranks on two hosts get the torch transport under 'auto', and an
    explicit symm transport is refused there (its kernels write peers' memory over NVLink)."""
    for one_host, auto, refused in run_on_ranks(_host_names_rank, 2, same_host):
        assert one_host is same_host
        assert auto == ("symm" if same_host else "torch")
        assert (refused is None) if same_host else ("this group spans hosts" in refused)
