"""Megatron-Core MoE layers for comparisons: a TransformerConfig for one MoE layer (tiny
defaults), Megatron's own MoELayer from the local spec, and the dense oracle's weights
(reference.MoEWeights) copied into any MoE layer (Megatron's SequentialMLP or megatron_ext's
grouped experts), with the expert gradients read back in the oracle's layout.

Used by the layer tests and by the benchmarks, which build the layers they time with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext.testing.reference import MoEWeights


def moe_config(*, hidden=32, ffn=16, experts=4, topk=2, dispatcher="alltoall", tp=1, ep=1, etp=None,
               dtype=torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=4 * hidden,
        moe_ffn_hidden_size=ffn, num_moe_experts=experts, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, gradient_accumulation_fusion=False, perform_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def megatron_moe_layer(config, experts_builder=None):
    """Megatron's own MoELayer from the local spec (SequentialMLP experts unless given)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    submodules = get_submodules(get_gpt_layer_local_submodules(num_experts=config.num_moe_experts).mlp)
    if experts_builder is not None:
        submodules.experts = experts_builder
    return MoELayer(config, submodules)


def local_expert_range(layer) -> range:
    first = layer.local_expert_indices[0]
    return range(first, first + layer.num_local_experts)


@torch.no_grad()
def load_weights(layer, weights: MoEWeights) -> None:
    """Copy the oracle's router and this rank's expert slices into a MoE layer."""
    layer.router.weight.copy_(weights.router)
    experts = local_expert_range(layer)
    if hasattr(layer.experts, "local_experts"):  # Megatron SequentialMLP
        for i, e in enumerate(experts):
            layer.experts.local_experts[i].linear_fc1.weight.copy_(weights.fc1[e])
            layer.experts.local_experts[i].linear_fc2.weight.copy_(weights.fc2[e])
    else:  # megatron_ext grouped experts: fc1 [L, 2F, H], fc2 [L, H, F]
        layer.experts.fc1_weight.copy_(weights.fc1[experts.start:experts.stop])
        layer.experts.fc2_weight.copy_(weights.fc2[experts.start:experts.stop])


def expert_grads(layer):
    """This rank's expert weight gradients in the oracle's layout: (fc1 [L,2F,H], fc2 [L,H,F])."""
    if hasattr(layer.experts, "local_experts"):
        fc1 = torch.stack([m.linear_fc1.weight.grad for m in layer.experts.local_experts])
        fc2 = torch.stack([m.linear_fc2.weight.grad for m in layer.experts.local_experts])
        return fc1, fc2
    return layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad


def rank_tokens(rank: int, tokens: int, hidden: int, dtype=torch.float32, seed: int = 100):
    """Seeded, rank-specific input and output-gradient tensors (never zeros)."""
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    grad_out = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, grad_out


def megatron_ddp(module, grad_reduce_in_fp32: bool = True):
    """`module` in Megatron's DistributedDataParallel as its training builds it: on a side stream, so
    the gradient accumulators DDP keeps are not tied to the legacy default stream (CUDA-graph
    capture would fail on them), with fp32 main_grad (bf16 training accumulates in fp32)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    stream = torch.cuda.Stream() if torch.cuda.is_available() else None
    if stream is None:
        return DistributedDataParallel(module.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32), module)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32), module)
    torch.cuda.current_stream().wait_stream(stream)
    return ddp
