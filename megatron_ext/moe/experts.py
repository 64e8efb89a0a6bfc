"""DeviceOffsetGroupedMLP: all local experts as two grouped GEMMs on device int32 offsets.

Megatron-Core 0.19.2 without Transformer Engine runs experts as SequentialMLP: a Python loop
over experts that needs per-expert token counts on the host (`.tolist()`), i.e. one device to
host sync per layer plus E small GEMMs. Here fc1 -> SwiGLU -> fc2 is `torch._grouped_mm` on
cumulative int32 end offsets that stay on the device (bf16 on sm90/sm100: a CUTLASS kernel
reads them on the GPU; other dtypes and CPU fall back to torch's per-group loop, which is
fine for tests). Cost accepted: none on the fast path beyond the int32 cumsum of the counts.

Input may be a capacity buffer [C, H]: only rows < offsets[-1] are read, SwiGLU runs on the
valid prefix only (kernels/swiglu.py), and outputs and gradients never depend on the tail.

Weights use Megatron's per-expert nn.Linear layout, stacked: fc1 [L, 2F, H] (gate rows then
up rows), fc2 [L, H, F]. The GEMMs take transposed views (free), and checkpoints interchange
with SequentialMLP / TEGroupedMLP without copies (`sharded_state_dict` uses their keys).
Written against megatron-core 0.19.2.
"""

from __future__ import annotations

import contextlib
import re

import torch

from megatron_ext.kernels.swiglu import swiglu_valid_prefix
from megatron_ext.moe.mxfp8_dispatch import MXFP8Rows, payload_fc1
from megatron_ext.rules import ExpertSettings, expert_problems


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

    forward(hidden [rows, H], tokens_per_expert [L] counts, permuted_probs [rows] | None)
    returns (output [rows, H], None). Probabilities, when given, scale the SwiGLU output per
    row as Megatron's experts do; the rowwise dispatcher passes None and weights in combine.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: str | None = None, debug_checks: bool = False):
        super().__init__()
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        self._check_config(config)
        self.config = config
        self.num_local_experts = num_local_experts
        self.debug_checks = debug_checks
        pg_collection = pg_collection or get_default_pg_collection()
        self.ep_group = pg_collection.ep
        self.expert_dp_group = pg_collection.expt_dp
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.fc1_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * ffn, hidden, dtype=config.params_dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, dtype=config.params_dtype, device=device))
        self._init_weights(pg_collection)
        self._register_load_state_dict_pre_hook(_load_sequential_mlp_layout, with_module=True)

    @staticmethod
    def _check_config(config) -> None:
        problems = expert_problems(ExpertSettings.from_config(config))
        if problems:
            raise ValueError("DeviceOffsetGroupedMLP cannot run with:\n  - " + "\n  - ".join(problems))

    def _init_weights(self, pg_collection) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        # Megatron marks expert params allreduce=False when they are sharded over EP (or ETP
        # differs from TP) so its DDP puts them in the expert buffers, reduced over expert-DP.
        sharded = self.ep_group.size() > 1 or (self.config.expert_tensor_parallel_size or 1) != (
            self.config.tensor_model_parallel_size)
        for weight, init in ((self.fc1_weight, self.config.init_method),
                             (self.fc2_weight, self.config.output_layer_init_method)):
            weight.allreduce = not sharded
            weight.tensor_model_parallel = False
            weight.partition_dim = -1
            weight.partition_stride = 1
            if not self.config.perform_initialization:
                continue
            tracker = get_cuda_rng_tracker()
            name = get_expert_parallel_rng_tracker_name()
            context = tracker.fork(name) if tracker.is_initialized() and name in tracker.get_states() else contextlib.nullcontext()
            with context:
                for expert_weight in weight.data:
                    init(expert_weight)

    def forward(self, hidden: torch.Tensor, tokens_per_expert, permuted_probs=None, **unused_kwargs):
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ValueError(f"expected hidden [rows, {self.config.hidden_size}], got {tuple(hidden.shape)}")
        if hidden.dtype != self.fc1_weight.dtype:
            raise TypeError(f"hidden dtype {hidden.dtype} differs from expert weights {self.fc1_weight.dtype}; "
                            f"cast the input or build the experts with params_dtype={hidden.dtype}")
        payload = None
        if isinstance(tokens_per_expert, MXFP8Rows):  # rowwise MXFP8 dispatch: fc1 reads the payload
            tokens_per_expert, payload = tokens_per_expert.counts, tokens_per_expert.payload
        offsets = counts_to_offsets(tokens_per_expert, hidden.device)
        return self.forward_offsets(hidden, offsets, permuted_probs, payload), None

    def forward_offsets(self, hidden: torch.Tensor, offsets: torch.Tensor,
                        probs: torch.Tensor | None = None, payload=None) -> torch.Tensor:
        """Experts on device int32 end offsets [L]; rows >= offsets[-1] are never read.
        `payload` (an MXFP8Payload) replaces `hidden`'s values in fc1; `hidden` keeps the gradient edge."""
        self._check_offsets(offsets, hidden)
        if probs is not None:
            if self.config.moe_apply_probs_on_input:
                hidden = hidden * probs[:, None].to(hidden.dtype)
                probs = None
            else:
                probs = probs.reshape(-1).float()
        if payload is not None:
            fc1_out = payload_fc1(hidden, self.fc1_weight, offsets, payload)
        else:
            fc1_out = torch._grouped_mm(hidden, self.fc1_weight.transpose(1, 2), offs=offsets)
        act = swiglu_valid_prefix(fc1_out, offsets[-1], probs)
        return torch._grouped_mm(act, self.fc2_weight.transpose(1, 2), offs=offsets)

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
        """Same global keys and shapes as SequentialMLP's: `{prefix}experts.linear_fc{1,2}.weight`
        of global shape [E, out, in], this rank holding experts [ep_rank*L, (ep_rank+1)*L)."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        expert_axis = (len(sharded_offsets), ep_rank, ep_size)
        replica_id = (0, 0, self.expert_dp_group.rank())
        result = {}
        for local_name, global_name in (("fc1_weight", "linear_fc1"), ("fc2_weight", "linear_fc2")):
            result[f"{prefix}{local_name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{global_name}.weight", getattr(self, local_name), *sharded_offsets,
                expert_axis, replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
            # SequentialMLP's linears also save an (empty) extra state per expert; write the same
            # objects so a SequentialMLP can load this checkpoint.
            for local_idx in range(self.num_local_experts):
                global_idx = ep_rank * self.num_local_experts + local_idx
                result[f"{prefix}local_experts.{local_idx}.{global_name}._extra_state"] = ShardedObject(
                    f"{prefix}experts.{global_name}._extra_state", None,
                    (*(o[2] for o in sharded_offsets), ep_size * self.num_local_experts),
                    (*(o[1] for o in sharded_offsets), global_idx), replica_id=replica_id)
        return result


_SEQUENTIAL_KEY = re.compile(r"^local_experts\.(?P<idx>\d+)\.linear_fc(?P<fc>[12])\.(?P<kind>weight|_extra_state)$")


def _load_sequential_mlp_layout(module, state_dict, prefix, *args, **kwargs):
    """Accept a plain (torch-format) SequentialMLP state dict: stack local_experts.i weights."""
    found: dict[str, dict[int, torch.Tensor]] = {"1": {}, "2": {}}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _SEQUENTIAL_KEY.match(key[len(prefix):])
        if match and match["kind"] == "_extra_state":
            state_dict.pop(key)  # local linears keep no extra state
        elif match:
            found[match["fc"]][int(match["idx"])] = state_dict.pop(key)
    for fc, tensors in found.items():
        if not tensors:
            continue
        if sorted(tensors) != list(range(module.num_local_experts)):
            raise ValueError(f"SequentialMLP checkpoint has experts {sorted(tensors)} for linear_fc{fc}; "
                             f"this module holds {module.num_local_experts} local experts")
        state_dict[f"{prefix}fc{fc}_weight"] = torch.stack([tensors[i] for i in range(module.num_local_experts)])

