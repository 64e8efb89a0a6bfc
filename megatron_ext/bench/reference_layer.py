"""The host benchmarks' layer: one eager forward+backward step of the rowwise layer (symm
transport, fused router, load-balancing loss on) at issue 17's reference shape, on random weights
and tokens seeded alike in every tool (bench_host_affinity, bench_host_cold), in a one-rank
Megatron process, warmed up."""

from __future__ import annotations

import torch

from megatron_ext.bench.measurement import make_step
from megatron_ext.testing.megatron_moe import load_weights, moe_config
from megatron_ext.testing.reference import MoEWeights
from megatron_ext.testing.single_rank import init_single_rank_megatron

HIDDEN, FFN, EXPERTS, TOPK = 2048, 1024, 64, 8


def rowwise_layer_step(tokens: int = 8192, warmup: int = 5):
    """Start one-rank Megatron, build a fresh rowwise layer on CUDA -> `step()`, one forward+backward
    of it, already run `warmup` times (which also starts PyTorch's autograd thread)."""
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder

    init_single_rank_megatron()
    config = moe_config(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, dtype=torch.bfloat16,
                        use_cpu_initialization=False, moe_router_dtype="fp32",
                        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    layer = moe_builder(MoEExtConfig(transport="symm"))(config=config).cuda()
    load_weights(layer, MoEWeights.random(EXPERTS, HIDDEN, FFN, seed=0, dtype=torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 1, HIDDEN, device="cuda", generator=gen).bfloat16()
    step = make_step(layer, x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16())  # holds the layer
    for _ in range(warmup):
        step()
    return step
