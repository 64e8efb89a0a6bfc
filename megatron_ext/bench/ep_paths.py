"""The paths the EP layer benchmark measures: the shape, each path's layer (Megatron's alltoall or
flex/DeepEP MoELayer, or RowwiseMoELayer) with the seeded global model's weights, each rank's seeded tokens and
output gradient, and a digest of the routes a layer took.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ext.bench.ep_distributed import Ranks

PATHS = ("megatron_alltoall", "megatron_alltoall_gg", "megatron_flex_deepep_gg", "rowwise_torch", "rowwise_symm",
         "rowwise_symm_put", "rowwise_symm_mxfp8", "rowwise_symm_graph", "rowwise_symm_dropless",
         "rowwise_symm_bounded")


@dataclass(frozen=True)
class Shape:
    seq_length: int
    sequences: int
    experts: int
    topk: int
    hidden: int
    ffn: int

    @property
    def tokens(self) -> int:
        return self.seq_length * self.sequences


EP8_SHAPE = Shape(seq_length=4096, sequences=4, experts=128, topk=8, hidden=4096, ffn=1536)
TINY_SHAPE = Shape(seq_length=16, sequences=4, experts=8, topk=2, hidden=64, ffn=32)


# ----------------------------------------------------------------------------- weights and inputs
def seeded_randn(shape, seed: int, device: torch.device, scale: float, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def expert_weights(expert: int, shape: Shape, seed: int, device, dtype):
    """Global expert `expert`'s (fc1 [2F, H], fc2 [H, F]), Megatron's layout, from (seed, expert)."""
    base = (seed + 1) * 1_000_003 + 2 * expert
    fc1 = seeded_randn((2 * shape.ffn, shape.hidden), base, device, shape.hidden ** -0.5, dtype)
    fc2 = seeded_randn((shape.hidden, shape.ffn), base + 1, device, shape.ffn ** -0.5, dtype)
    return fc1, fc2


@torch.no_grad()
def load_seeded_weights(layer, shape: Shape, seed: int) -> None:
    """Router and this rank's experts of the seeded global model, into any of the paths' layers."""
    from megatron_ext.testing.megatron_moe import local_expert_range

    device, dtype = layer.router.weight.device, layer.router.weight.dtype
    layer.router.weight.copy_(seeded_randn((shape.experts, shape.hidden), seed, device, shape.hidden ** -0.5, dtype))
    for i, expert in enumerate(local_expert_range(layer)):
        fc1, fc2 = expert_weights(expert, shape, seed, device, dtype)
        if hasattr(layer.experts, "local_experts"):  # Megatron SequentialMLP
            layer.experts.local_experts[i].linear_fc1.weight.copy_(fc1)
            layer.experts.local_experts[i].linear_fc2.weight.copy_(fc2)
        else:  # DeviceOffsetGroupedMLP: fc1 [L, 2F, H], fc2 [L, H, F]
            layer.experts.fc1_weight[i].copy_(fc1)
            layer.experts.fc2_weight[i].copy_(fc2)


def rank_inputs(ranks: Ranks, shape: Shape, seed: int, dtype):
    """This rank's tokens [seq, sequences, H] and output gradient, seeded by (seed, rank)."""
    size = (shape.seq_length, shape.sequences, shape.hidden)
    x = seeded_randn(size, 10_000 + seed * 1000 + 2 * ranks.rank, ranks.device, 1.0, dtype)
    grad_out = seeded_randn(size, 10_000 + seed * 1000 + 2 * ranks.rank + 1, ranks.device, 1.0, dtype)
    return x, grad_out


# ----------------------------------------------------------------------------- layers
def unavailable_reason(path: str, device: torch.device) -> str | None:
    if device.type != "cuda" and "symm" in path:
        return ("not available on cpu: the symm transport moves rows with Triton kernels over GPU "
                "symmetric memory (and graphs need CUDA)")
    if path == "megatron_flex_deepep_gg":
        from megatron.core.transformer.moe import fused_a2a

        if not fused_a2a.HAVE_DEEP_EP:
            return ("DeepEP is not installed: Megatron's flex dispatcher with the deepep backend imports "
                    "deep_ep (Buffer, utils.EventOverlap); build it from source (BENCHMARKS.md, DeepEP)")
    return None


def build_layer(path: str, shape: Shape, args, device: torch.device, dtype):
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
    from megatron_ext.specs import moe_builder
    from megatron_ext.testing.megatron_moe import megatron_moe_layer, moe_config

    # Megatron's fast path today: the flex dispatcher with the DeepEP backend
    flex = dict(dispatcher="flex", moe_flex_dispatcher_backend="deepep") if path == "megatron_flex_deepep_gg" else {}
    config = moe_config(hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts, topk=shape.topk,
                        ep=dist.get_world_size(), dtype=dtype, use_cpu_initialization=device.type != "cuda",
                        moe_router_dtype="fp32", **flex)
    if path == "megatron_alltoall":
        layer = megatron_moe_layer(config)
    elif path in ("megatron_alltoall_gg", "megatron_flex_deepep_gg"):
        layer = megatron_moe_layer(config, experts_builder=DeviceOffsetGroupedMLP)
    else:
        dropless = args.dropless or path == "rowwise_symm_dropless"  # worst-case buffers: no factor
        sizing = dict(dropless=True) if dropless else dict(capacity_factor=args.capacity_factor)
        ext = MoEExtConfig(transport="torch" if path == "rowwise_torch" else "symm", **sizing,
                           on_overflow="error" if path == "rowwise_symm_bounded" else "drop",
                           mxfp8_dispatch=path == "rowwise_symm_mxfp8", cuda_graphs=path == "rowwise_symm_graph",
                           return_transfer="put" if path == "rowwise_symm_put" else "get")
        layer = moe_builder(ext)(config=config)
    layer = layer.to(device)
    load_seeded_weights(layer, shape, args.seed)
    return layer


def routing_digest(layer, step) -> str:
    """sha1 of the router's routing map for one step (untimed; reads the device)."""
    seen = {}

    def hook(module, inputs, output):
        routing_map = getattr(output[1], "routing_map", output[1])  # FusedTopKRouter hands a Selection
        seen["map"] = routing_map.detach().to("cpu", copy=True)

    handle = layer.router.register_forward_hook(hook)
    try:
        step()
    finally:
        handle.remove()
    return hashlib.sha1(seen["map"].numpy().tobytes()).hexdigest()[:16]
