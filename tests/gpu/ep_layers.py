"""Shared pieces of the multi-GPU layer tests: NVLink-multicast-off environment, the layer shape,
a rowwise layer on a given transport with fixed weights, and one forward+backward step."""

from __future__ import annotations

import torch

# NVLink multicast stays off on the lent machines (BENCHMARKS.md, "Multi-GPU checks")
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHAPE = dict(hidden=1024, ffn=512, topk=4)
EXPERTS_PER_RANK = 4


def ep_layer(transport: str, world: int, weights, **ext):
    """RowwiseMoELayer (bf16, on this rank's GPU) with EP = world and `weights` loaded."""
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import load_weights, moe_config

    config = moe_config(**SHAPE, experts=EXPERTS_PER_RANK * world, ep=world, dtype=torch.bfloat16,
                        use_cpu_initialization=False, moe_router_dtype="fp32")
    layer = moe_builder(MoEExtConfig(transport=transport, **ext))(config=config).cuda()
    load_weights(layer, weights)
    return layer


def ep_step(layer, x, g):
    """One forward+backward: (output, input grad, router grad, fc1 grad, fc2 grad, dest_row)."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(g)
    return (out.detach().float(), x.grad.float(), layer.router.weight.grad.float(),
            layer.experts.fc1_weight.grad.float(), layer.experts.fc2_weight.grad.float(),
            layer.token_dispatcher.route_map.dest_row.clone())
