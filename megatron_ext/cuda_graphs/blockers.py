"""Why a MoE layer cannot be captured in a CUDA graph: asked by the graph runner before capture
(`capture_blockers`, the same answer on every rank) and after warm-up (`transport_blocker`, once
the transport exists). A layer with a blocker stays eager and the runner logs the reason.

The blockers are host syncs inside the layer (Megatron's dispatchers, debug checks, router replay's
host lists) and NCCL work inside it (load-balancing all-reduces, quantile balancing's gather, the
torch transport at EP > 1): a graph holding NCCL work keeps destroy_process_group from returning
(pytorch/pytorch#115388). Router attributes read here are megatron-core 0.19.2's.
"""

from __future__ import annotations

import torch


def capture_blockers(layer, hidden: torch.Tensor) -> list[str]:
    """Reasons this layer cannot be captured here (empty: capturable). The same on every rank."""
    reasons = []
    if not hidden.is_cuda:
        reasons.append(f"the input is on {hidden.device}, CUDA graphs need a GPU")
    ext = getattr(layer, "ext_config", None)
    if ext is None or ext.dispatcher != "rowwise":
        reasons.append("only the rowwise MoE layer is synchronization-free; Megatron's dispatchers wait on the host")
    elif ext.debug_checks:
        reasons.append("debug_checks reads device values on the host (a sync) inside the layer")
    if getattr(getattr(layer, "router", None), "router_replay", None) is not None:
        reasons.append("Megatron's router replay (--moe-enable-routing-replay) feeds the top-k from host-side "
                       "lists that change every step; a graph would replay the capture step's routes")
    if _aux_loss_all_reduce(getattr(layer, "router", None)):
        reasons.append("the router's load-balancing loss all-reduces its counts over TP x CP (NCCL; TP x DP x CP for "
                       "the global aux loss) inside the "
                       "layer, and a graph holding NCCL work keeps destroy_process_group from returning "
                       "(pytorch/pytorch#115388)")
    if _quantile_gather(getattr(layer, "router", None)):
        reasons.append("Megatron's quantile-balancing routing (--moe-router-load-balancing-type quantile_balancing) "
                       "all-gathers the router logits over TP x CP (NCCL) inside the layer, and a graph holding NCCL "
                       "work keeps destroy_process_group from returning (pytorch/pytorch#115388)")
    return reasons


def _aux_loss_all_reduce(router) -> bool:
    """Megatron's router (and the fused one) all-reduce the tokens per expert for its load-balancing
    losses: over TP x CP (aux_loss, seq_aux_loss), over TP x DP x CP (global_aux_loss), when that
    group has more than one rank (0.19.2)."""
    if not hasattr(router, "get_aux_loss_coeff"):
        return False

    def reduces(kinds, group) -> bool:
        return group is not None and group.size() > 1 and any(router.get_aux_loss_coeff(k) > 0 for k in kinds)
    return reduces(("aux_loss", "seq_aux_loss"), getattr(router, "tp_cp_group", None)) or \
        reduces(("global_aux_loss",), getattr(router, "tp_dp_cp_group", None))


def _quantile_gather(router) -> bool:
    """Megatron's quantile-balancing routing all-gathers the logits over TP x CP in its forward, when
    that group has more than one rank (0.19.2, TopKRouter.quantile_balancing)."""
    group = getattr(router, "tp_cp_group", None)
    return getattr(router, "routing_type", None) == "quantile_balancing" and group is not None and group.size() > 1


def transport_blocker(layer) -> str | None:
    """After warm-up (the transport exists): refuse transports that would put NCCL in the graph."""
    dispatcher = getattr(layer, "token_dispatcher", None)
    transport = getattr(dispatcher, "transport", None)
    if getattr(dispatcher, "ep_size", 1) > 1 and not hasattr(transport, "gather_counts"):
        return (f"the {type(transport).__name__} runs NCCL collectives inside the layer; a CUDA graph holding "
                f"them keeps destroy_process_group from returning (pytorch/pytorch#115388): use "
                f"--moe-ext-transport symm for graphs at EP > 1")
    return None
