"""Whole tiny GPT-MoE models for the checkpoint tests (crossing, resharding, interrupted saves).

Two layer kinds built from Megatron's own local decoder-block spec (3 layers: MoE, dense, MoE):
  "megatron": Megatron's MoELayer (alltoall dispatcher, dropless by default, SequentialMLP experts)
  "ours":     the same spec through `swap_moe_parts` (RowwiseMoELayer + DeviceOffsetGroupedMLP, dropless)
Both route identically (Megatron's router in both, nothing dropped), so a checkpoint of one
must give the other the same outputs and the same optimizer step, at any EP size.

The data is that of DATA_RANKS = 2 ranks: a 2-rank run gives each rank its own microbatch, a
1-rank run processes both as two microbatches (gradients accumulated, the aux-loss gradient
scaled by 1/microbatches as Megatron's schedule does), so the objective (the mean loss over the
two microbatches) and its gradient are the same at every world size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ext.config import MoEExtConfig
from megatron_ext.tiny_gpt import TinyGPTConfig, synthetic_batch, transformer_config

CFG = TinyGPTConfig(layers=3, hidden=32, heads=4, experts=4, topk=2, moe_ffn=32, vocab=32, seq_len=16,
                    micro_batch=2, seed=1234)
MOE_LAYER_FREQ = [1, 0, 1]  # MoE, dense, MoE: dense MLP keys sit between the expert keys
OURS = MoEExtConfig(transport="torch", dropless=True)
DATA_RANKS = 2
KINDS = ("megatron", "ours")


def build(kind: str, seed: int):
    """GPTModel of `kind` on this rank (EP size from parallel_state), parameters drawn from `seed`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
    from megatron_ext.moe.layer import RowwiseMoELayer
    from megatron_ext.specs import swap_moe_parts

    ep = parallel_state.get_expert_model_parallel_world_size()
    config = dataclasses.replace(transformer_config(CFG, ep), moe_layer_freq=MOE_LAYER_FREQ)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if kind == "ours":
        spec = swap_moe_parts(spec, OURS)
    elif kind != "megatron":
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = GPTModel(config, spec, vocab_size=CFG.vocab, max_sequence_length=CFG.seq_len,
                     position_embedding_type="rope")
    # The comparison is only worth something if the two kinds really are different layers.
    moe = [layer.mlp for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
    assert len(moe) == 2, [type(layer.mlp).__name__ for layer in model.decoder.layers]
    for layer in moe:
        if kind == "ours":
            assert type(layer) is RowwiseMoELayer and isinstance(layer.experts, DeviceOffsetGroupedMLP)
        else:
            assert type(layer) is MoELayer and isinstance(layer.experts, SequentialMLP)
    _draw_experts(moe, seed, config.init_method_std)
    return model


def _draw_experts(moe, seed: int, std: float) -> None:
    """Every global expert its own weights, drawn from (seed, layer, global expert index).

    Megatron's CPU initialization (use_cpu_initialization) draws the local experts of every EP
    rank from the same generator state, so expert e of rank 0 equals expert e of rank 1: a
    checkpoint that put the experts of one EP rank at the other's offsets would go unnoticed.
    """
    for layer_idx, layer in enumerate(moe):
        experts = layer.experts
        first = layer.local_expert_indices[0]
        for local in range(layer.num_local_experts):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx * 1009 + first + local)
            if hasattr(experts, "fc1_weight"):  # DeviceOffsetGroupedMLP: stacked [L, out, in]
                fc1, fc2 = experts.fc1_weight[local], experts.fc2_weight[local]
            else:  # SequentialMLP
                fc1 = experts.local_experts[local].linear_fc1.weight
                fc2 = experts.local_experts[local].linear_fc2.weight
            with torch.no_grad():
                for weight in (fc1, fc2):
                    weight.copy_(torch.randn(weight.shape, generator=gen) * std)


def moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def data_ranks(rank: int, world: int) -> list[int]:
    """The logical data ranks whose microbatches this rank processes."""
    assert DATA_RANKS % world == 0, (DATA_RANKS, world)
    return list(range(rank, DATA_RANKS, world))


def _inputs():
    position_ids = torch.arange(CFG.seq_len)[None].expand(CFG.micro_batch, -1)
    causal_mask = torch.triu(torch.ones(1, 1, CFG.seq_len, CFG.seq_len, dtype=torch.bool), diagonal=1)
    return position_ids, causal_mask


def logits(model, rank: int, world: int, step: int) -> dict[int, torch.Tensor]:
    """fp32 logits [b, s, vocab] per data rank of this rank, for the batch of `step` (eval mode)."""
    position_ids, causal_mask = _inputs()
    out = {}
    model.eval()
    with torch.no_grad():
        for data_rank in data_ranks(rank, world):
            tokens, _ = synthetic_batch(CFG, step, data_rank)
            out[data_rank] = model(tokens, position_ids, causal_mask).float().clone()
    model.train()
    return out


def losses(model, rank: int, world: int, step: int) -> dict[int, float]:
    position_ids, causal_mask = _inputs()
    out = {}
    with torch.no_grad():
        for data_rank in data_ranks(rank, world):
            tokens, labels = synthetic_batch(CFG, step, data_rank)
            out[data_rank] = float(model(tokens, position_ids, causal_mask, labels=labels).float().mean())
    return out


def mean_loss(model, rank: int, world: int, step: int) -> float:
    """The mean loss over all DATA_RANKS microbatches of `step` (the same on every rank)."""
    total = torch.tensor(sum(losses(model, rank, world, step).values()))
    if world > 1:
        dist.all_reduce(total)
    return float(total) / DATA_RANKS


def train_step(model, optimizer, rank: int, world: int, step: int) -> float:
    """One optimizer step on the mean loss over the DATA_RANKS microbatches of `step`; returns that
    mean loss (the same on every rank). Gradients: summed over each parameter's replica group
    (dense: all ranks; EP-sharded experts, `allreduce=False`: the expert-data-parallel group), then
    divided by the world size, as Megatron's DDP does."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    position_ids, causal_mask = _inputs()
    mine = data_ranks(rank, world)
    optimizer.zero_grad(set_to_none=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(mine)))
    total = torch.zeros(())
    try:
        for data_rank in mine:
            tokens, labels = synthetic_batch(CFG, step, data_rank)
            loss = model(tokens, position_ids, causal_mask, labels=labels).float().mean()
            (loss / len(mine)).backward()
            total += loss.detach()
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    if world > 1:
        expert_group = parallel_state.get_expert_data_parallel_group()
        for param in model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)  # an expert without tokens: its replicas still reduce
            dist.all_reduce(param.grad, group=None if getattr(param, "allreduce", True) else expert_group)
            param.grad /= world
        dist.all_reduce(total)
    optimizer.step()
    return float(total) / DATA_RANKS


def swap_experts(model, a: int = 0, b: int = 1) -> None:
    """Swap local experts a and b of the first MoE layer in place (a checkpoint that maps experts
    wrongly looks like this); calling it twice restores the model."""
    layer = moe_layers(model)[0]
    experts = layer.experts
    with torch.no_grad():
        if hasattr(experts, "fc1_weight"):  # DeviceOffsetGroupedMLP: stacked [L, out, in]
            pairs = [(experts.fc1_weight[a], experts.fc1_weight[b]), (experts.fc2_weight[a], experts.fc2_weight[b])]
        else:  # SequentialMLP
            ea, eb = experts.local_experts[a], experts.local_experts[b]
            pairs = [(ea.linear_fc1.weight, eb.linear_fc1.weight), (ea.linear_fc2.weight, eb.linear_fc2.weight)]
        for x, y in pairs:
            tmp = x.clone()
            x.copy_(y)
            y.copy_(tmp)


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
