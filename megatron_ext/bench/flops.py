"""The work a MoE layer benchmark credits: useful-token expert FLOPs (no capacity padding), so
that TFLOP/s compare paths that pad differently on the same footing."""

from __future__ import annotations


def moe_model_flops(tokens: int, topk: int, hidden: int, ffn: int, gated: bool = True,
                    backward: bool = True) -> int:
    """Useful-token FLOPs of the expert MLPs: tokens * topk routed rows through fc1 (H -> 2F
    gated, H -> F plain) and fc2 (F -> H); forward+backward is 3x the forward."""
    fc1_out = 2 * ffn if gated else ffn
    forward = 2 * tokens * topk * (hidden * fc1_out + ffn * hidden)
    return 3 * forward if backward else forward
