"""The dense MoE oracle every layer test compares against.

Written straight from the definition: router logits x @ W_r^T, top-k, softmax over the
selected logits (Megatron's default post-softmax top-k), and for each token the sum over its
kept routes of prob * SwiGLU-MLP_e(x). Expert weights use Megatron's layout:
fc1 [2F, H] (gate rows first, then up rows), fc2 [H, F].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H]
    fc1: torch.Tensor  # [E, 2F, H]
    fc2: torch.Tensor  # [E, H, F]

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    @staticmethod
    def random(num_experts: int, hidden: int, ffn: int, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> "MoEWeights":
        gen = torch.Generator().manual_seed(seed)
        def rand(*shape, scale):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype)
        return MoEWeights(router=rand(num_experts, hidden, scale=hidden ** -0.5),
                          fc1=rand(num_experts, 2 * ffn, hidden, scale=hidden ** -0.5),
                          fc2=rand(num_experts, hidden, ffn, scale=ffn ** -0.5))

    def detached_leaves(self) -> "MoEWeights":
        return MoEWeights(*(t.detach().clone().requires_grad_(True) for t in (self.router, self.fc1, self.fc2)))


def swiglu_expert(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """One expert: fc2(silu(gate) * up), with fc1 [2F, H] and fc2 [H, F]."""
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def route_topk(x: torch.Tensor, router: torch.Tensor, topk: int):
    """Megatron's default routing: top-k of the logits, softmax over the selected k."""
    logits = x.float() @ router.float().t()
    top_logits, top_idx = logits.topk(topk, dim=-1)
    return top_idx, torch.softmax(top_logits, dim=-1)


def dense_moe(x: torch.Tensor, weights: MoEWeights, topk: int, *, top_idx=None, probs=None,
              keep=None) -> torch.Tensor:
    """sum over kept routes (t, k) of probs[t, k] * expert_{top_idx[t, k]}(x[t]).

    `top_idx`/`probs` default to `route_topk`; `keep` [T, K] bool selects kept routes
    (default: all). Loops over experts: it is an oracle, not a fast path.
    """
    if top_idx is None:
        top_idx, probs = route_topk(x, weights.router, topk)
    if keep is None:
        keep = torch.ones_like(top_idx, dtype=torch.bool)
    out = torch.zeros(x.shape[0], weights.fc2.shape[1], dtype=torch.float32)
    for expert in range(weights.num_experts):
        token, slot = torch.where((top_idx == expert) & keep)
        if token.numel() == 0:
            continue
        y = swiglu_expert(x[token], weights.fc1[expert], weights.fc2[expert])
        out = out.index_add(0, token, y.float() * probs[token, slot, None].float())
    return out.to(x.dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str,
                 atol: float | None = None) -> None:
    """Relative check scaled by the reference's magnitude, with a message naming `what`."""
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max()
    limit = rtol * scale if atol is None else atol + rtol * scale
    assert err <= limit, f"{what}: max abs error {err:.3e} > {limit:.3e} (ref max {scale:.3e})"
