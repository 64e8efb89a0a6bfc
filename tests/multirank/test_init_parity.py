"""Initialization: a GPTModel built with megatron_ext's MoE parts draws the same weights as Megatron's
own (SequentialMLP experts) from the same seed, experts and everything after them, at EP 1 and 2.

The grouped experts draw as SequentialMLP does (expert by expert, fc1 then fc2; under
use_cpu_initialization an fp32 master from the global RNG): a review found them drawn fc1-all
then fc2-all from the expert tracker, which also shifted the global stream, so every later
layer's attention, router and the output layer differed from Megatron's for the same seed.
"""

import dataclasses

import pytest
import torch

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.testing.expert_variants import expert_params_of
from megatron_ext.tiny_gpt import TinyGPTConfig, transformer_config

CFG = TinyGPTConfig(layers=3, hidden=32, heads=4, experts=4, topk=2, moe_ffn=32, vocab=32, seq_len=16,
                    micro_batch=2, seed=1234)


def _uniform_init(tensor):
    return torch.nn.init.uniform_(tensor, -0.05, 0.05)


def _build(kind: str, ep: int, seed: int = 7, bf16_uniform: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.specs import swap_moe_parts

    config = dataclasses.replace(transformer_config(CFG, ep), moe_layer_freq=[1, 0, 1],
                                 moe_shared_expert_intermediate_size=32)
    if bf16_uniform:  # a uniform draw into bf16 differs from an fp32 master's cast: the master must be kept
        config = dataclasses.replace(config, params_dtype=torch.bfloat16, bf16=True, init_method=_uniform_init,
                                     output_layer_init_method=_uniform_init)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if kind == "ours":
        spec = swap_moe_parts(spec, MoEExtConfig(transport="torch", dropless=True))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return GPTModel(config, spec, vocab_size=CFG.vocab, max_sequence_length=CFG.seq_len, position_embedding_type="rope")


def _init_rank(rank, world, bf16_uniform=False):
    models = {kind: _build(kind, world, bf16_uniform=bf16_uniform) for kind in ("megatron", "ours")}
    others = {kind: {name: p.detach() for name, p in model.named_parameters() if ".experts." not in name}
              for kind, model in models.items()}
    assert others["megatron"].keys() == others["ours"].keys()
    differ = [name for name in others["megatron"] if not torch.equal(others["megatron"][name], others["ours"][name])]
    experts = [[expert_params_of(layer.mlp.experts) for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]
               for model in models.values()]
    for layer, (theirs, mine) in enumerate(zip(*experts)):
        differ += [f"layer {layer} {name}" for name in theirs if not torch.equal(theirs[name], mine[name])]
    return differ, len(others["ours"])


@pytest.mark.parametrize("world,bf16_uniform", [(1, False), (2, False), (1, True)])
def test_the_same_seed_draws_megatrons_weights(world, bf16_uniform):
    for differ, compared in run_on_ranks(_init_rank, world, bf16_uniform, sizes=ParallelSizes(ep=world)):
        assert compared > 10 and differ == [], differ
