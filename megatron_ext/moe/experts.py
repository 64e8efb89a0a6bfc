"""DeviceOffsetGroupedMLP: all local experts as two grouped GEMMs on device int32 offsets.

Megatron-Core 0.19.2 without Transformer Engine runs experts as SequentialMLP: a Python loop
over experts that needs per-expert token counts on the host (`.tolist()`), i.e. one device to
host sync per layer plus E small GEMMs. Here fc1 -> activation -> fc2 is `torch._grouped_mm` on
cumulative int32 end offsets that stay on the device (bf16 on sm90/sm100: a CUTLASS kernel
reads them on the GPU; fp16/fp32 and CPU fall back to torch's per-group loop, which reads the
offsets on the host). Cost accepted: none on the fast path beyond the int32 cumsum of the counts.

Input may be a capacity buffer [C, H]: the GEMMs read only rows < offsets[-1], the SwiGLU kernel
skips the rest, and outputs and gradients never depend on the tail.

Variants (docs/design.md, "Experts"): every `activation_func` Megatron's experts take, gated or
not, with `activation_func_clamp_value`/`glu_linear_offset` (moe/expert_activation.py); fc1 and
fc2 biases (`add_bias_linear`), the fc2 bias weighted by the router probability like
SequentialMLP's; `moe_apply_probs_on_input`; bf16, fp16 and fp32; any hidden and FFN size
(moe/expert_padding.py). The fast path (SwiGLU, no biases, 16-byte aligned sizes) is the
original three kernels and nothing else.

Weights use Megatron's per-expert nn.Linear layout, stacked: fc1 [L, gF, H] (gated: gate rows
then up rows, g = 2), fc2 [L, H, F]. Biases are stored flat, [L * gF] and [L * H], and used as
[L, gF] / [L, H] views (`stacked_biases`): Megatron's optimizer picks biases by one dimension (no
weight decay; Adam under Muon; no MuP matrix scaling), which a stacked 2-D bias would miss. The
GEMMs take transposed views (free), and distributed checkpoints interchange with SequentialMLP /
TEGroupedMLP, plain torch state dicts with SequentialMLP's (moe/expert_checkpoint.py).
Written against megatron-core 0.19.2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from megatron_ext.kernels.swiglu import swiglu_valid_prefix
from megatron_ext.moe.expert_activation import ExpertActivation
from megatron_ext.moe.expert_checkpoint import load_sequential_mlp_layout, sharded_state_dict, stacked
from megatron_ext.moe.expert_mlp import swiglu_grouped_mlp
from megatron_ext.moe.expert_padding import GemmPadding
from megatron_ext.moe.expert_recompute import activation_then_fc2
from megatron_ext.moe.expert_wgrad import grouped_linear
from megatron_ext.moe.expert_rows import RowGroups, row_bias, row_experts, valid_row_mask
from megatron_ext.moe.mxfp8_dispatch import payload_fc1
from megatron_ext.quiet import warn_once
from megatron_ext.rules import (ARENA_NEEDS_FAST_PATH, ARENA_PROBS_ON_INPUT, MXFP8_PROBS_ON_INPUT, ExpertSettings,
                                expert_problems, moe_problems)

logger = logging.getLogger(__name__)

PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def counts_to_offsets(tokens_per_expert, device: torch.device) -> torch.Tensor:
    """Per-expert counts (host list/tensor or device tensor) -> device int32 end offsets.

    A host tensor is copied to the device once (non-blocking H2D, no sync); a device tensor
    stays there.
    """
    if not torch.is_tensor(tokens_per_expert):
        tokens_per_expert = torch.tensor(tokens_per_expert, dtype=torch.int64)
    counts = tokens_per_expert.to(device=device, non_blocking=True)
    return torch.cumsum(counts, 0, dtype=torch.int32)


class DeviceOffsetGroupedMLP(torch.nn.Module):
    """Megatron experts module (ExpertsInterface) on `torch._grouped_mm` with device offsets.

    forward(hidden [rows, H], tokens_per_expert [L] counts or the rowwise dispatcher's RowGroups,
    permuted_probs [rows] | None) returns (output [rows, H], None). Probabilities, when given,
    scale the activation output and the fc2 bias per row as Megatron's experts do (or the input
    rows, with moe_apply_probs_on_input); the rowwise dispatcher passes each buffer row's
    probability.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: str | None = None, debug_checks: bool = False, wgrad_fusion: bool = True):
        super().__init__()
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        settings = self._check_config(config)
        self.config = config
        self.num_local_experts = num_local_experts
        self.debug_checks = debug_checks
        pg_collection = pg_collection or get_default_pg_collection()
        self.ep_group = pg_collection.ep
        self.expert_dp_group = pg_collection.expt_dp
        # Megatron's experts read and write moe_latent_size columns when it is set (MLP, is_expert).
        self.hidden_size = hidden = config.moe_latent_size or config.hidden_size
        ffn = config.moe_ffn_hidden_size
        self.activation = ExpertActivation.from_config(config)
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()

        def parameter(*shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=device))

        fc1_rows, bias = self.activation.width_factor * ffn, config.add_bias_linear
        self.fc1_weight = parameter(num_local_experts, fc1_rows, hidden)
        self.fc2_weight = parameter(num_local_experts, hidden, ffn)
        # flat, one dimension: how Megatron's optimizer rules recognise a bias (module docstring)
        self.register_parameter("fc1_bias", parameter(num_local_experts * fc1_rows) if bias else None)
        self.register_parameter("fc2_bias", parameter(num_local_experts * hidden) if bias else None)
        self.padding = GemmPadding.needed(hidden, ffn, config.params_dtype, self.activation.gated)
        self.fast_path = self.activation.plain_swiglu and not bias and self.padding is None
        # Megatron's --recompute-granularity selective --recompute-modules moe_act
        self.recompute_activation = settings.recompute_activation
        # Under Megatron's DDP the weight gradients go to main_grad in the GEMM (moe/expert_wgrad.py),
        # except where the GEMMs run on zero-padded copies of the weights (sizes off 16 bytes).
        self.wgrad_fusion = wgrad_fusion and self.padding is None
        if config.gradient_accumulation_fusion and config.params_dtype != torch.float32 and not self.wgrad_fusion:
            why = ("--moe-ext-no-expert-wgrad-fusion is set" if not wgrad_fusion else
                   "hidden and FFN sizes that are not 16-byte multiples run on zero-padded copies of the weights")
            warn_once(logger, f"megatron_ext: gradient_accumulation_fusion is on, but the grouped experts' weight "
                      f"gradients reach main_grad through DDP's add, rounded once to the parameters' dtype per "
                      f"microbatch ({why})")
        if getattr(config, "use_te_activation_func", False):
            warn_once(logger, "megatron_ext: use_te_activation_func is ignored by the grouped experts: they apply "
                      "activation_func (with its clamp and linear offset) as Megatron's SequentialMLP does, where "
                      "Transformer Engine's activation modules differ (tanh GELU, no clamp or offset)")
        self._init_weights(pg_collection)
        self._register_load_state_dict_pre_hook(load_sequential_mlp_layout, with_module=True)

    @staticmethod
    def unsupported(config, settings: ExpertSettings | None = None) -> list[str]:
        """Why these experts cannot serve `config` where Megatron's experts can (empty: they can).
        With dispatcher="megatron" the MoE layer builds Megatron's experts instead (specs.moe_builder).
        `settings`: ExpertSettings.from_config(config) where the caller has them already."""
        problems = expert_problems(settings or ExpertSettings.from_config(config))
        if config.params_dtype not in PARAM_DTYPES:
            problems.append(f"params_dtype={config.params_dtype}: the grouped experts run bf16 (--bf16), fp16 "
                            f"(--fp16) or fp32 (neither flag) parameters")
        return problems

    @staticmethod
    def _check_config(config) -> ExpertSettings:
        """The settings these experts run with; raises with every problem at once."""
        settings = ExpertSettings.from_config(config)
        problems = moe_problems(settings) + DeviceOffsetGroupedMLP.unsupported(config, settings)
        if problems:
            raise ValueError("DeviceOffsetGroupedMLP cannot run with:\n  - " + "\n  - ".join(problems))
        return settings

    def _init_weights(self, pg_collection) -> None:
        """As Megatron's SequentialMLP draws them (megatron-core 0.19.2, tensor_parallel/layers.py): expert
        by expert, fc1 then fc2; with use_cpu_initialization an fp32 master weight from the global torch
        RNG, cast to the parameters' dtype (`_initialize_affine_weight_cpu`), else in place under the
        expert-parallel RNG tracker (`_initialize_affine_weight_gpu`). The same seed gives the same
        weights and leaves the RNG streams where Megatron's experts leave them, so the model's later
        parameters match too. Biases start at zero (no draw)."""
        # Megatron marks expert params allreduce=False when they are sharded over EP (or ETP
        # differs from TP) so its DDP puts them in the expert buffers, reduced over expert-DP.
        sharded = self.ep_group.size() > 1 or (self.config.expert_tensor_parallel_size or 1) != (
            self.config.tensor_model_parallel_size)
        for param in (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias):
            if param is not None:
                param.allreduce = not sharded
                param.tensor_model_parallel = False
                param.partition_dim = -1
                param.partition_stride = 1
        if not self.config.perform_initialization:
            return
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                torch.nn.init.zeros_(bias.data)
        weights = ((self.fc1_weight, self.config.init_method), (self.fc2_weight, self.config.output_layer_init_method))
        with self._expert_rng():
            for expert in range(self.num_local_experts):
                for weight, init in weights:
                    if self.config.use_cpu_initialization:
                        master = torch.empty(weight.shape[1:], dtype=torch.float32)
                        init(master)
                        weight.data[expert].copy_(master)
                    else:
                        init(weight.data[expert])

    def _expert_rng(self):
        """GPU initialization draws under the expert-parallel RNG tracker (each EP rank its own experts);
        CPU initialization from the global RNG, as Megatron's does."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        if self.config.use_cpu_initialization:
            return contextlib.nullcontext()
        tracker, name = get_cuda_rng_tracker(), get_expert_parallel_rng_tracker_name()
        forked = tracker.is_initialized() and name in tracker.get_states()
        return tracker.fork(name) if forked else contextlib.nullcontext()

    def stacked_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The fc1 and fc2 biases as [L, gF] and [L, H] views of their flat parameters (None without biases)."""
        return tuple(None if bias is None else stacked(bias, self.num_local_experts)
                     for bias in (self.fc1_bias, self.fc2_bias))

    def forward(self, hidden: torch.Tensor, tokens_per_expert, permuted_probs=None, **unused_kwargs):
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"expected hidden [rows, {self.hidden_size}], got {tuple(hidden.shape)}")
        if hidden.dtype != self.fc1_weight.dtype:
            raise TypeError(f"hidden dtype {hidden.dtype} differs from expert weights {self.fc1_weight.dtype}; "
                            f"cast the input or build the experts with params_dtype={hidden.dtype}")
        arena = None
        if isinstance(tokens_per_expert, RowGroups):  # the rowwise dispatcher: offsets (and payload) given
            offsets, payload, arena = tokens_per_expert.offsets, tokens_per_expert.payload, tokens_per_expert.arena
        else:  # Megatron's dispatchers: counts
            offsets, payload = counts_to_offsets(tokens_per_expert, hidden.device), None
        return self.forward_offsets(hidden, offsets, permuted_probs, payload, arena), None

    def arena_problems(self) -> list[str]:
        """Why these experts cannot keep their rows in a dropless arena (moe/arena.py; empty: they can)."""
        problems = []
        if not self.fast_path:
            problems.append(ARENA_NEEDS_FAST_PATH)
        if self.config.moe_apply_probs_on_input:
            problems.append(ARENA_PROBS_ON_INPUT)
        return problems

    def forward_offsets(self, hidden: torch.Tensor, offsets: torch.Tensor,
                        probs: torch.Tensor | None = None, payload=None, arena=None) -> torch.Tensor:
        """Experts on device int32 end offsets [L]; rows >= offsets[-1] are never read.
        `payload` (an MXFP8Payload) replaces `hidden`'s values in fc1; `hidden` keeps the gradient edge.
        `arena` (moe/arena_rows.ArenaRows): the rows and probabilities are a dropless arena's view."""
        self._check_offsets(offsets, hidden)
        if arena is not None:  # RowwiseMoELayer refused arena_problems() at construction: only a backstop here
            if not self.fast_path or self.config.moe_apply_probs_on_input or payload is not None or probs is None:
                problems = self.arena_problems() or [
                    "the arena's rows come with their probabilities and without an MXFP8 payload"]
                raise ValueError("the grouped experts cannot keep these rows in the dropless arena:\n  - "
                                 + "\n  - ".join(problems))
            return swiglu_grouped_mlp(hidden, self.fc1_weight, self.fc2_weight, offsets, probs.reshape(-1),
                                      self.recompute_activation, arena, self.wgrad_fusion)
        if probs is not None:
            if self.config.moe_apply_probs_on_input:  # as SequentialMLP: (p * x).to(x.dtype), then p = 1
                if payload is not None:  # fc1 reads the payload, not these rows (RowwiseMoELayer refuses it first)
                    raise ValueError(MXFP8_PROBS_ON_INPUT)
                hidden = (probs.reshape(-1, 1) * hidden).to(hidden.dtype)
                probs = None
            else:
                probs = probs.reshape(-1).float()
        if not self.fast_path:
            return self._forward_any(hidden, offsets, probs, payload)
        if payload is None:  # one autograd node (moe/expert_mlp.py)
            return swiglu_grouped_mlp(hidden, self.fc1_weight, self.fc2_weight, offsets, probs,
                                      self.recompute_activation, wgrad_fusion=self.wgrad_fusion)
        fc1_out = payload_fc1(hidden, self.fc1_weight, offsets, payload, self.wgrad_fusion)
        return self._fc2(swiglu_valid_prefix, (fc1_out, offsets[-1], probs), self.fc2_weight, offsets)

    def _fc2(self, activation, inputs: tuple, fc2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """fc2's grouped GEMM on activation(*inputs) (inputs: h, valid rows, probs), the activation
        recomputed in the backward when Megatron's moe_act recompute is on (moe/expert_recompute.py)."""
        if self.recompute_activation and torch.is_grad_enabled():
            return activation_then_fc2(activation, *inputs, fc2, offsets, self.wgrad_fusion)
        return grouped_linear(activation(*inputs), fc2, offsets, self.wgrad_fusion)

    def _forward_any(self, hidden, offsets, probs, payload):
        """Every other variant: padding for odd sizes, biases, any activation (module docstring)."""
        fc1, fc2, (fc1_bias, fc2_bias) = self.fc1_weight, self.fc2_weight, self.stacked_biases()
        if self.padding is not None:
            hidden, fc1, fc2, fc1_bias, fc2_bias = self.padding.pad(hidden, fc1, fc2, fc1_bias, fc2_bias)
        if payload is not None:
            h = payload_fc1(hidden, fc1, offsets, payload, self.wgrad_fusion)
        else:
            h = grouped_linear(hidden, fc1, offsets, self.wgrad_fusion)
        valid_rows, rows = offsets[-1], h.shape[0]
        if probs is not None:  # tail probabilities (never read) get a defined, zero gradient
            probs = torch.where(valid_row_mask(valid_rows, rows), probs, 0)
        activation = self.activation
        if fc1_bias is not None:  # add_bias_linear: fc1 and fc2 biases come together
            experts = row_experts(offsets, rows)
            if activation.clamps_before_bias:  # SequentialMLP's fused kernel (probabilities or ones): clamp(x) + b
                h, activation = activation.clamped(h), dataclasses.replace(activation, clamp=None)
            h = h + row_bias(fc1_bias, offsets, experts)
        out = self._fc2(activation, (h, valid_rows, probs), fc2, offsets)
        if fc2_bias is not None:  # as SequentialMLP's MLP.forward: output += bias * per_token_scale
            bias = row_bias(fc2_bias, offsets, experts)
            if probs is not None:
                bias = bias * probs[:, None]
            out = (out + bias).to(out.dtype)
        return out if self.padding is None else self.padding.unpad_rows(out)

    def _check_offsets(self, offsets: torch.Tensor, hidden: torch.Tensor) -> None:
        if offsets.dtype != torch.int32:
            raise TypeError(f"expert offsets must be int32 (torch._grouped_mm), got {offsets.dtype}")
        if offsets.device != hidden.device:
            raise ValueError(f"expert offsets are on device {offsets.device} but hidden is on {hidden.device}; "
                             f"build the offsets on the input's device")
        if offsets.shape != (self.num_local_experts,):
            raise ValueError(f"expected {self.num_local_experts} end offsets (one per local expert), "
                             f"got shape {tuple(offsets.shape)}")
        if self.debug_checks:  # host sync: debug only
            steps = torch.diff(offsets, prepend=offsets.new_zeros(1))
            if bool((steps < 0).any()) or int(offsets[-1]) > hidden.shape[0]:
                raise ValueError(f"expert offsets must be non-decreasing and <= rows ({hidden.shape[0]}); "
                                 f"got {offsets.tolist()}")

    def backward_dw(self) -> None:
        """Weight gradients are computed in the main backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """SequentialMLP's global keys and shapes (moe/expert_checkpoint.py). Megatron's
        `singleton_local_shards` layout (one key per expert, fc1 split into gate and up; megatron.training
        0.19.2 never asks for it) is refused rather than written in the other layout."""
        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError("the grouped experts write SequentialMLP's stacked expert layout; a "
                                      "checkpoint with metadata singleton_local_shards=True (one key per expert) "
                                      "is not supported: save with singleton_local_shards=False")
        return sharded_state_dict(self, prefix, sharded_offsets)
