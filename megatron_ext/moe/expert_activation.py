"""The experts' activation between fc1 and fc2, for every variant Megatron's experts compute.

Megatron-Core 0.19.2 (`transformer/mlp.py`, the unfused path of `MLP.forward`, which
SequentialMLP runs; TEGroupedMLP's `bias_act_func` is the same) computes, on fc1's output plus
its bias:

    gated:     x_glu, x_linear = chunk(x, 2, dim=-1)          # fc1 rows: gate first, then up
               if activation_func_clamp_value c is not None:
                   x_glu = x_glu.clamp(max=c); x_linear = x_linear.clamp(-c, c)
               y = activation_func(x_glu) * (x_linear + glu_linear_offset)
    otherwise: y = activation_func(x)
    then, with router probabilities p (per row): y = (y * p).to(y.dtype)

SwiGLU (silu, no clamp, no offset) runs in the tail-aware Triton kernel (kernels/swiglu.py),
which skips rows past the last offset. Everything else (GELU, squared ReLU, GEGLU, clamped
quick-GEGLU, any elementwise callable) runs that formula in torch, op for op, over the whole
buffer: without a host read torch cannot stop at a device row count. Tail rows of fc1's output
were never written by the GEMM and nothing reads their activations or gradients (fc2 and the
backward GEMMs stop at the last offset), so results do not depend on them; the caller zeroes
the probabilities of tail rows so their gradient is defined (zero), as the kernel's is. Cost
accepted: (cf - 1) / cf extra elementwise work on capacity buffers (none under Megatron's
dispatchers, whose buffers have no tail).
`bias_activation_fusion` picks Megatron's fused kernels, which its experts accept for SwiGLU and
quick-GEGLU. They compute the same formula with one exception: the weighted quick-GEGLU kernel
(`weighted_bias_quick_geglu_impl`) clamps its input before it adds the bias it is given. Megatron's
two expert classes then disagree when fc1 has a bias: SequentialMLP hands the kernel fc1's bias,
so it computes clamp(x) + b, while TEGroupedMLP adds the bias in its grouped GEMM and hands the
kernel none, so it computes clamp(x + b). The grouped experts follow the class Megatron's spec
would build for the config (`megatron_builds_te_grouped_experts`): SequentialMLP's order
(`clamps_before_bias`) unless it would build TEGroupedMLP.
The fused SwiGLU kernels (`weighted_bias_swiglu_impl`, and `bias_swiglu_impl` under probabilities
on the input) take no clamp: both of Megatron's expert classes ignore `activation_func_clamp_value`
for SwiGLU under `bias_activation_fusion` (a non-zero `glu_linear_offset` there is refused by
TransformerConfig). The grouped experts compute what Megatron computes, so a model trains and loads
the same under either, and say once that the clamp is not applied and how to apply it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megatron_ext.kernels.swiglu import swiglu_valid_prefix
from megatron_ext.quiet import warn_once

logger = logging.getLogger(__name__)


def megatron_builds_te_grouped_experts(config) -> bool:
    """Whether Megatron's GPT spec would build TEGroupedMLP for `config` rather than SequentialMLP:
    --moe-grouped-gemm under --transformer-impl transformer_engine with Transformer Engine's grouped
    linear layers installed (megatron-core 0.19.2: models/gpt/moe_module_specs.py, through
    TESpecProvider.grouped_mlp_modules; the local provider always builds SequentialMLP)."""
    if not (config.moe_grouped_gemm and config.transformer_impl == "transformer_engine"):
        return False
    from megatron.core.extensions.transformer_engine_spec_provider import TEColumnParallelGroupedLinear

    return TEColumnParallelGroupedLinear is not None


@dataclass(frozen=True)
class ExpertActivation:
    func: Callable[[torch.Tensor], torch.Tensor]
    gated: bool
    clamp: float | None = None
    offset: float = 0.0
    clamps_before_bias: bool = False  # Megatron's fused weighted quick-GEGLU (module docstring)

    @staticmethod
    def from_config(config) -> "ExpertActivation":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        gated, clamp = bool(config.gated_linear_unit), config.activation_func_clamp_value
        fused_glu = bool(config.bias_activation_fusion) and gated
        fused_quick_geglu = fused_glu and config.activation_func is quick_gelu
        if fused_glu and config.activation_func is F.silu and clamp is not None:
            warn_once(logger, f"megatron_ext: activation_func_clamp_value={clamp} is not applied: SwiGLU under "
                      "bias_activation_fusion runs Megatron's fused kernel, which has no clamp (megatron-core "
                      "0.19.2's experts ignore it too); set bias_activation_fusion=False (--no-bias-swiglu-fusion) "
                      "to clamp")
            clamp = None
        return ExpertActivation(func=config.activation_func, gated=gated, clamp=clamp,
                                offset=float(config.glu_linear_offset),
                                clamps_before_bias=fused_quick_geglu and clamp is not None
                                and not megatron_builds_te_grouped_experts(config))

    def clamped(self, x: torch.Tensor) -> torch.Tensor:
        """fc1's output with the gated clamp applied (gate: at most c; up: within [-c, c])."""
        return torch.cat(self._halves(x), -1)

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if self.clamp is None:
            return x_glu, x_linear
        return x_glu.clamp(min=None, max=self.clamp), x_linear.clamp(min=-self.clamp, max=self.clamp)

    @property
    def plain_swiglu(self) -> bool:
        """silu(gate) * up: the Triton kernel's formula."""
        return self.gated and self.func is F.silu and self.clamp is None and self.offset == 0.0

    @property
    def width_factor(self) -> int:
        """fc1 rows per FFN channel: 2 when gated (gate and up), else 1."""
        return 2 if self.gated else 1

    def __call__(self, h: torch.Tensor, valid_rows: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """Activation of fc1's output `h` [rows, width_factor * F] (bias already added), times
        `probs` [rows] fp32 when given; only rows < valid_rows (a device scalar) are meaningful."""
        if self.plain_swiglu:
            return swiglu_valid_prefix(h, valid_rows, probs)
        return self._torch(h, probs)

    def _torch(self, x, probs):
        if self.gated:
            x_glu, x_linear = self._halves(x)
            y = self.func(x_glu) * (x_linear + self.offset)
        else:
            y = self.func(x)
        if probs is not None:
            y = (y * probs[:, None]).to(y.dtype)
        return y
