"""A tiny GPT-MoE on Megatron-Core for CPU ranks: the README's main job and the training tests.

Synthetic, learnable data: each sequence follows a fixed random successor table
(next = successor[current]), so the loss must fall if forward, backward, routing and gradient
reduction are right. Gradients are reduced by megatron_ext.ddp's MultiGroupGradBuckets (it runs
over gloo): dense parameters summed over DP x CP, expert parameters (allreduce=False) over
expert data parallel, both divided by the DP x CP size so the objective is the mean loss over
all ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.config import MoEExtConfig
from megatron_ext.training_hooks import check_overflows


@dataclass(frozen=True)
class TinyGPTConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    experts: int = 4
    topk: int = 2
    moe_ffn: int = 64
    vocab: int = 64
    seq_len: int = 32
    micro_batch: int = 4
    lr: float = 3e-3
    seed: int = 1234


def transformer_config(cfg: TinyGPTConfig, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        ffn_hidden_size=4 * cfg.hidden, moe_ffn_hidden_size=cfg.moe_ffn, num_moe_experts=cfg.experts,
        moe_router_topk=cfg.topk, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, expert_model_parallel_size=ep, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False,
    )


def build_model(cfg: TinyGPTConfig, ext_config: MoEExtConfig | None, spec_kind: str = "block"):
    """GPTModel on this rank; `ext_config=None` keeps Megatron's own MoE layer (baseline).

    spec_kind "block": Megatron's decoder-block spec with the MoE parts swapped;
    "layer": Megatron's single local layer spec (as a custom model would pass) swapped.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from megatron_ext import specs

    config = transformer_config(cfg, parallel_state.get_expert_model_parallel_world_size())
    if spec_kind == "block":
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.experts, normalization="RMSNorm")
    if ext_config is not None:
        spec = specs.swap_moe_parts(spec, ext_config)
    torch.manual_seed(cfg.seed)
    return GPTModel(config, spec, vocab_size=cfg.vocab, max_sequence_length=cfg.seq_len,
                    position_embedding_type="rope")


def synthetic_batch(cfg: TinyGPTConfig, step: int, rank: int):
    successor = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(cfg.seed))
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + step * 104729 + rank)
    start = torch.randint(0, cfg.vocab, (cfg.micro_batch,), generator=gen)
    tokens = [start]
    for _ in range(cfg.seq_len):
        tokens.append(successor[tokens[-1]])
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def reduce_gradients(buckets) -> None:
    """Finish the bucketed reduction that backward hooks started (megatron_ext.ddp): dense
    parameters summed over DP x CP, expert parameters (allreduce=False) over EP_DP, both divided
    by the DP x CP size so the objective is the mean loss over all ranks. Parameters that got no
    gradient (an expert without tokens) contribute zeros."""
    buckets.finish_grad_sync()


def moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def train(rank: int, world: int, cfg: TinyGPTConfig, ext_config: MoEExtConfig | None, steps: int,
          log=None, spec_kind: str = "block") -> list[dict]:
    """Train `steps` steps on this rank; returns per-step records (loss, tokens/s, routing)."""
    from megatron_ext.sync_audit import count_host_syncs

    from megatron_ext.ddp.buckets import MultiGroupGradBuckets, groups_from_parallel_state

    if ext_config is not None and ext_config.max_tokens_per_rank is None:  # the loop's static shape, known here:
        ext_config = replace(ext_config, max_tokens_per_rank=cfg.seq_len * cfg.micro_batch)  # no agreement needed
    model = build_model(cfg, ext_config, spec_kind)
    if ext_config is not None and ext_config.dropless_arena:
        from megatron_ext.moe.arena import attach_arenas

        attach_arenas(model)
    buckets = MultiGroupGradBuckets(model, groups_from_parallel_state())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    position_ids = torch.arange(cfg.seq_len)[None].expand(cfg.micro_batch, -1)
    causal_mask = torch.triu(torch.ones(1, 1, cfg.seq_len, cfg.seq_len, dtype=torch.bool), diagonal=1)
    records = []
    for step in range(steps):
        tokens, labels = synthetic_batch(cfg, step, rank)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with count_host_syncs() as audit:
            _audit_only_moe(model, audit)
            loss = model(tokens, position_ids, causal_mask, labels=labels).float().mean()
            loss.backward()
        reduce_gradients(buckets)
        optimizer.step()
        elapsed = time.perf_counter() - start
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)
        record = {"step": step + 1, "loss": float(loss_value) / world,
                  "tokens_per_s": world * cfg.micro_batch * cfg.seq_len / elapsed,
                  "moe_host_syncs": audit.count}
        record.update(_routing_summary(model))
        records.append(record)
        if log is not None and rank == 0:
            log(record)
        if ext_config is not None and ext_config.overflow_policy == "error":
            check_overflows(model)  # bounded dropless: one host read per step here
    return records


def _audit_only_moe(model, audit) -> None:
    """Count syncs inside MoE layers only, forward and backward (the rest of the model is not ours
    to audit). The backward's window opens when the layer output's gradient arrives and closes
    when its input's gradient is complete (tensor hooks: the autograd graph is unchanged)."""
    audit.active = False
    for layer in moe_layers(model):
        if not getattr(layer, "_audit_hooks", None):
            layer._audit_hooks = True
            layer.register_forward_pre_hook(_open_forward_audit)
            layer.register_forward_hook(_close_forward_audit)
        layer._audit = audit


def _set_active(audit, active: bool):
    def hook(grad):
        audit.active = active
    return hook


def _open_forward_audit(module, args):
    module._audit.active = True
    hidden = args[0]
    if hidden.requires_grad:  # its gradient is complete once the layer's backward has run
        hidden.register_hook(_set_active(module._audit, False))


def _close_forward_audit(module, args, output):
    module._audit.active = False
    out = output[0] if isinstance(output, tuple) else output
    if out.requires_grad:
        out.register_hook(_set_active(module._audit, True))


def _routing_summary(model) -> dict:
    summary = {"dropped_routes": 0, "capacity_fill": None, "routes_per_expert": None}
    fills = []
    for layer in moe_layers(model):
        metrics = layer.read_metrics() if hasattr(layer, "read_metrics") else None
        if metrics is None:
            continue
        summary["dropped_routes"] += metrics["dropped_routes"]
        fills.append(metrics["mean_buffer_fill"])
        counts = metrics["requested_per_expert"]
        summary["routes_per_expert"] = counts if summary["routes_per_expert"] is None else [
            a + b for a, b in zip(summary["routes_per_expert"], counts)]
    if fills:
        summary["capacity_fill"] = sum(fills) / len(fills)
    return summary
