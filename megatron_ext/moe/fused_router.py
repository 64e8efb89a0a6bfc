"""FusedTopKRouter: Megatron's TopKRouter whose softmax top-k routing and load-balancing loss run
in one Triton kernel each way (kernels/router_topk.py; docs/design.md, "Fused router").

It is a TopKRouter (same parameters, state dict, initialization, aux-loss logging and scaling
through Megatron's own `attach_and_log_load_balancing_loss`). The gating GEMM, the routing and the
load-balancing loss form one autograd node (`_Routing`), and instead of Megatron's [T, E]
probabilities and routing map it hands the rowwise dispatcher the top-k probabilities [T, K] and
a fused_routes.Selection (ids, counts, histograms), so the dispatcher's select kernel is skipped.
Cost removed: ~30 launches and ~15 autograd nodes per layer step (1.3-1.8 ms of host time and
~0.5 ms of device time at the reference shape, BENCHMARKS.md). Cost accepted: results equal
Megatron's to fp32 rounding, not bitwise (the backward's gating GEMMs with bf16 tokens: to one
bf16 rounding, _split_gating_grads). With bf16 tokens and an fp32 router the gating GEMMs
themselves run in the routing kernels (kernels/router_gate.py; `MoEExtConfig.router_gemms`),
so the layer step makes no cuBLAS call (up to 256 experts; `router_gemms="cublas"` keeps
cuBLAS). Configurations it does not fuse (`unfused_reasons`),
padded batches and CPU tensors run TopKRouter.forward unchanged, and the dispatcher takes either.
Installed by megatron_ext.specs for the rowwise dispatcher (`MoEExtConfig.fused_router`). Written
against megatron-core 0.19.2 (transformer/moe/router.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.moe.fused_routes import Selection
from megatron_ext.quiet import warn_once

logger = logging.getLogger(__name__)


def _gate(hidden: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
    """Router logits [T, E] in `logits_dtype` (Megatron's router dtype). bf16/fp16 operands with
    fp32 logits take one GEMM with fp32 output: the products of 16-bit values are exact in fp32,
    so this is Megatron's fp32 GEMM of the upcast operands up to the order of the fp32 sums,
    without the two casts (a [T, H] fp32 copy of the tokens)."""
    if hidden.dtype == weight.dtype == logits_dtype:
        return torch.mm(hidden, weight.t())
    if hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16) \
            and logits_dtype == torch.float32:
        return _mm_fp32(hidden, weight.t())
    return torch.mm(hidden.to(logits_dtype), weight.to(logits_dtype).t())


@dataclass(frozen=True)
class LoadBalancingLoss:
    """Megatron's switch load-balancing loss as the routing node computes it:
    `sum(P * tokens_per_expert) * scale` with P the per-expert sums of the full softmax,
    scale = E * coeff / (K * total_tokens^2) (moe_utils.switch_load_balancing_loss_func), the
    counts summed over `group` (Megatron's tp_cp group) when it has more than one rank."""

    scale: float
    group: object = None


class _Routing(torch.autograd.Function):
    """Gating GEMM, fused top-k routing and the load-balancing loss as one autograd node (one
    node instead of ~15)."""

    @staticmethod
    def forward(ctx, hidden, weight, logits_dtype: torch.dtype, topk: int, pre_softmax: bool, scale: float,
                aux: LoadBalancingLoss | None, gemms_in_kernel: bool):
        from megatron_ext.kernels.router_topk import gate_router_topk, router_topk

        ctx.input_shape = hidden.shape  # [..., H] tokens flattened here, not by a view node before the call
        hidden = hidden.reshape(-1, hidden.shape[-1])
        ctx.gate_in_kernel = gemms_in_kernel
        # The loss in the routing launch, unless its counts are summed over a group first.
        group_counts = aux is not None and aux.group is not None and aux.group.size() > 1
        sums = dict(score_sums=group_counts, aux_scale=aux.scale if aux is not None and not group_counts else None)
        if gemms_in_kernel:  # the gating GEMM inside the routing kernel (kernels/router_gate.py)
            # the kernels read row-major [T, H] and [E, H], and the backward reads what is saved
            hidden, weight = hidden.contiguous(), weight.contiguous()
            out = gate_router_topk(hidden, weight, topk, pre_softmax, scale, **sums)
            logits = out["logits"]
        else:
            logits = _gate(hidden, weight, logits_dtype)
            out = router_topk(logits, topk, pre_softmax, scale, **sums)
        tokens_per_expert = out["counts"]
        if aux is None:
            aux_loss = logits.new_zeros(0)
        elif group_counts:  # in place: the route map keeps its own counts
            tokens_per_expert = tokens_per_expert.clone()
            torch.distributed.all_reduce(tokens_per_expert, group=aux.group)
            aux_loss = torch.sum(out["score_sums"] * tokens_per_expert) * aux.scale
        else:
            aux_loss = out["aux_loss"]
        ctx.save_for_backward(hidden, weight, logits, out["routing_map"], tokens_per_expert)
        ctx.topk, ctx.pre_softmax, ctx.scale, ctx.aux = topk, pre_softmax, scale, aux
        ctx.set_materialize_grads(False)
        non_differentiable = [out[name] for name in ("routing_map", "top_idx", "counts", "hist", "nonfinite")]
        ctx.mark_non_differentiable(*non_differentiable)
        return out["top_probs"], aux_loss, *non_differentiable

    @staticmethod
    def backward(ctx, grad_top_probs, grad_aux_loss, *unused):
        from megatron_ext.kernels.router_topk import gate_router_topk_backward, router_topk_backward

        if ctx.aux is None:
            grad_aux_loss = None
        if grad_top_probs is None and grad_aux_loss is None:
            return (None,) * 8
        hidden, weight, logits, routing_map, tokens_per_expert = ctx.saved_tensors
        grad_aux = None if grad_aux_loss is None else (grad_aux_loss.float(), tokens_per_expert, ctx.aux.scale)
        if ctx.gate_in_kernel:  # both gating gradients from Triton (kernels/router_gate.py)
            grad_hidden, grad_weight = gate_router_topk_backward(logits, routing_map, grad_top_probs, grad_aux,
                                                                 ctx.topk, ctx.pre_softmax, ctx.scale, hidden, weight)
            return grad_hidden.view(ctx.input_shape), grad_weight, None, None, None, None, None, None
        split = _split_gradient(hidden, weight, logits.dtype)
        grad_logits = router_topk_backward(logits, routing_map, grad_top_probs, grad_aux, ctx.topk,
                                           ctx.pre_softmax, ctx.scale, split=split)
        if split:
            grad_hidden, grad_weight = _split_gating_grads(grad_logits, hidden, weight)
        else:  # as Megatron's RouterGatingLinearFunction.backward: GEMMs in the router dtype, then cast
            grad_hidden = torch.mm(grad_logits, weight.to(grad_logits.dtype)).to(hidden.dtype)
            grad_weight = torch.mm(grad_logits.t(), hidden.to(grad_logits.dtype)).to(weight.dtype)
        return grad_hidden.view(ctx.input_shape), grad_weight, None, None, None, None, None, None


def _gate_in_kernel(hidden: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype) -> bool:
    """Whether the gating GEMMs run inside the routing kernels: bf16 tokens and weight, fp32 logits,
    up to router_gate.MAX_EXPERTS experts."""
    from megatron_ext.kernels.router_gate import MAX_EXPERTS

    return _split_gradient(hidden, weight, logits_dtype) and weight.shape[0] <= MAX_EXPERTS


def _split_gradient(hidden: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype) -> bool:
    """bf16 tokens and weight with fp32 logits: the backward GEMMs take the logits' gradient as
    bf16 hi + lo instead of upcasting the tokens and the weight: in the routing kernels
    (kernels/router_gate.py) when _gate_in_kernel allows, else cuBLAS (_split_gating_grads)."""
    return hidden.dtype == weight.dtype == torch.bfloat16 and logits_dtype == torch.float32


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of 16-bit operands with an fp32 result (exact products, fp32 sums)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # CPU has no mm with out_dtype


def _split_gating_grads(grad_split: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor):
    """The gating GEMMs' gradients from the logits' gradient g given as [hi | lo] bf16 [T, 2E]
    (g = hi + lo to ~2^-16 relative): d hidden = [hi | lo] @ [W; W] and d W = hi^T x + lo^T x, bf16
    GEMMs with fp32 accumulation, rounded once to bf16 like Megatron's fp32 GEMMs followed by its
    casts. Cost removed: two fp32 (non-tensor-core) GEMMs and the [T, H] fp32 copy of the tokens
    (~0.2 ms at 8192 x 2048, E = 64 on an H200). Cost accepted: g carries 16 mantissa bits, not 24,
    before results that keep 8."""
    num_experts = weight.shape[0]
    grad_hidden = torch.mm(grad_split, torch.cat([weight, weight]))  # fp32 accumulation, one bf16 rounding
    halves = _mm_fp32(grad_split.t(), hidden)
    grad_weight = (halves[:num_experts] + halves[num_experts:]).to(weight.dtype)
    return grad_hidden, grad_weight


def fused_routing(hidden: torch.Tensor, weight: torch.Tensor, topk: int, logits_dtype: torch.dtype | None = None,
                  pre_softmax: bool = False, scale: float = 1.0, aux: LoadBalancingLoss | None = None,
                  gemms_in_kernel: bool = True):
    """Tokens [T, H] (or [S, B, H]) and router weight [E, H] -> (top_probs [T, K] fp32, the load-balancing loss
    (a scalar; an empty tensor without `aux`), Selection); top_probs and the loss carry gradients
    to the tokens and the weight. `gemms_in_kernel`: the gating GEMMs in Triton where they can be
    (bf16 tokens and weight, fp32 logits, up to 256 experts; kernels/router_gate.py), else cuBLAS."""
    logits_dtype = logits_dtype or hidden.dtype
    in_kernel = gemms_in_kernel and _gate_in_kernel(hidden, weight, logits_dtype)
    top_probs, aux_loss, routing_map, top_idx, counts, hist, nonfinite = _Routing.apply(
        hidden, weight, logits_dtype, topk, pre_softmax, scale, aux, in_kernel)
    return top_probs, aux_loss, Selection(routing_map, counts, hist, nonfinite, top_idx=top_idx)


def unfused_reasons(router: TopKRouter) -> list[str]:
    """Why this router's configuration runs Megatron's routing instead of the fused kernel (empty: fused)."""
    config = router.config
    checks = [
        (router.score_function != "softmax", f"moe_router_score_function={router.score_function!r}"),
        (router.routing_type in ("sinkhorn", "quantile_balancing"),
         f"moe_router_load_balancing_type={router.routing_type!r}"),
        (router.get_aux_loss_coeff("seq_aux_loss") > 0, "seq_aux_loss"),
        (router.get_aux_loss_coeff("global_aux_loss") > 0, "global_aux_loss"),
        (bool(config.moe_router_num_groups or config.moe_router_group_topk), "group-limited routing"),
        (router.enable_expert_bias, "moe_router_enable_expert_bias"),
        (bool(config.moe_z_loss_coeff), "moe_z_loss_coeff"),
        (config.moe_input_jitter_eps is not None, "moe_input_jitter_eps"),
        (bool(config.moe_router_force_load_balancing), "moe_router_force_load_balancing"),
        (getattr(config, "moe_router_force_biased", None) is not None, "moe_router_force_biased"),
        (config.moe_expert_capacity_factor is not None, "moe_expert_capacity_factor"),
        (config.moe_router_dtype == "fp64", "moe_router_dtype='fp64'"),
        (bool(config.moe_router_fusion), "moe_router_fusion (Transformer Engine's fused router)"),
        (router.router_replay is not None, "router replay"),
        (router.bias is not None, "a router bias (add_bias_linear)"),
    ]
    return [reason for failed, reason in checks if failed]


def unfused_reasons_for_args(args) -> list[str]:
    """`unfused_reasons` for Megatron's parsed arguments (the launcher's check), through a stand-in
    router with the attributes TopKRouter derives from the same settings (megatron-core 0.19.2)."""
    stand_in = SimpleNamespace(
        config=args, score_function=args.moe_router_score_function, routing_type=args.moe_router_load_balancing_type,
        enable_expert_bias=bool(args.moe_router_enable_expert_bias),
        router_replay=True if args.moe_enable_routing_replay else None, bias=True if args.add_bias_linear else None)
    stand_in.get_aux_loss_coeff = functools.partial(TopKRouter.get_aux_loss_coeff, stand_in)
    return unfused_reasons(stand_in)


class FusedTopKRouter(TopKRouter):
    """TopKRouter with the softmax top-k routing fused (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gemms_in_kernel = True  # MoEExtConfig.router_gemms == "triton"; RowwiseMoELayer sets it
        self.unfused = unfused_reasons(self)
        if self.unfused:
            warn_once(logger, "megatron_ext: the MoE routers run Megatron's own routing (not fused) for: "
                      + "; ".join(self.unfused))

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self.unfused or padding_mask is not None or not input.is_cuda:
            return super().forward(input, padding_mask)
        return self.fused_forward(input)

    def fused_forward(self, input: torch.Tensor):
        """(top-k probabilities [T, K] with the load-balancing loss attached as Megatron attaches it,
        Selection). On CPU tensors it runs only under Triton's interpreter (the unit checks)."""
        num_tokens = input.numel() // input.shape[-1]
        logits_dtype = torch.float32 if self.config.moe_router_dtype == "fp32" else input.dtype
        coeff = self.get_aux_loss_coeff("aux_loss")
        with_aux = self.training and torch.is_grad_enabled() and coeff > 0
        aux = self._load_balancing_loss(num_tokens, coeff) if with_aux else None
        top_probs, aux_loss, selection = fused_routing(
            input, self.weight, self.topk, logits_dtype, bool(self.config.moe_router_pre_softmax),
            float(self.config.moe_router_topk_scaling_factor or 1.0), aux, self.gemms_in_kernel)
        if with_aux:  # logged and scaled as Megatron's router does
            top_probs = self.attach_and_log_load_balancing_loss(top_probs, coeff, aux_loss, "load_balancing_loss",
                                                                self.tp_cp_group, valid_token_count=num_tokens)
        return top_probs, selection

    def _load_balancing_loss(self, num_tokens: int, coeff: float) -> LoadBalancingLoss:
        """Megatron's _apply_aux_loss settings: counts summed over tp_cp, T_total = T * its size."""
        total = num_tokens * self.tp_cp_group.size()
        return LoadBalancingLoss(self.config.num_moe_experts * coeff / (self.topk * total * total), self.tp_cp_group)
