"""The work a MoE layer benchmark credits: useful-token expert FLOPs (no capacity padding), so
that TFLOP/s compare paths that pad differently on the same footing; routes a capacity-bound
path dropped are not credited (`credited_flops`)."""

from __future__ import annotations


def moe_model_flops(tokens: int, topk: int, hidden: int, ffn: int, gated: bool = True,
                    backward: bool = True) -> int:
    """Useful-token FLOPs of the expert MLPs: tokens * topk routed rows through fc1 (H -> 2F
    gated, H -> F plain) and fc2 (F -> H); forward+backward is 3x the forward."""
    fc1_out = 2 * ffn if gated else ffn
    forward = 2 * tokens * topk * (hidden * fc1_out + ffn * hidden)
    return 3 * forward if backward else forward


def credited_flops(flops: float, routes: int, dropped_routes: float) -> float:
    """`flops` (the work of `routes` routed rows, from moe_model_flops) less the share of the
    routes that were dropped: a dropped route reaches no expert, so it is no work done. Rows
    that dropped routes are credited T*K - dropped, never T*K."""
    if routes <= 0:
        raise ValueError(f"routes must be positive, got {routes}")
    if not 0 <= dropped_routes <= routes:
        raise ValueError(f"dropped routes must lie in [0, {routes}], got {dropped_routes}")
    return flops * (routes - dropped_routes) / routes
