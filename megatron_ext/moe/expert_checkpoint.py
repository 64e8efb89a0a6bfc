"""Checkpoints of DeviceOffsetGroupedMLP in SequentialMLP's keys and layout, both directions.

dist_checkpointing: the stacked parameters are saved under SequentialMLP's global keys,
`{prefix}experts.linear_fc{1,2}.{weight,bias}` of global shape [E, ...] with this rank holding
experts [ep_rank*L, (ep_rank+1)*L), plus the (empty) per-expert extra states SequentialMLP's
linears write, so either module loads the other's checkpoint (TEGroupedMLP writes the same keys).
Plain torch state dicts of a SequentialMLP (`local_experts.i.linear_fc{1,2}.{weight,bias}`) are
stacked on load; TEGroupedMLP's (`linear_fc1.weight0`, ..., in Transformer Engine's layout) are
refused with what to do instead.
Written against megatron-core 0.19.2.
"""

from __future__ import annotations

import re

import torch

# (parameter of DeviceOffsetGroupedMLP, SequentialMLP linear, tensor name)
PARAMETERS = (("fc1_weight", "linear_fc1", "weight"), ("fc1_bias", "linear_fc1", "bias"),
              ("fc2_weight", "linear_fc2", "weight"), ("fc2_bias", "linear_fc2", "bias"))


def stacked(tensor: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """A flat bias (or its gradient, or an optimizer state of it) as the [L, rows] view the
    experts compute with and SequentialMLP stacks to; the 3-D weights as they are."""
    return tensor.view(num_local_experts, -1) if tensor.dim() == 1 else tensor


def sharded_state_dict(module, prefix: str = "", sharded_offsets=()):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    ep_rank, ep_size = module.ep_group.rank(), module.ep_group.size()
    expert_axis = (len(sharded_offsets), ep_rank, ep_size)
    replica_id = (0, 0, module.expert_dp_group.rank())
    experts = module.num_local_experts

    def stacked_entry(key, tensor, replica_id, flattened_range=None):
        if flattened_range is not None:
            raise ValueError(f"{key}: a flattened optimizer state (the distributed optimizer's legacy "
                             f"'fully_sharded_model_space' format) is not supported by the grouped experts; use "
                             f"Megatron's default dp_reshardable or fully_reshardable format")
        return ShardedTensor.from_rank_offsets(key, stacked(tensor, experts), *sharded_offsets, expert_axis,
                                               replica_id=replica_id, prepend_axis_num=len(sharded_offsets))

    result = {}
    for local_name, linear, kind in PARAMETERS:
        tensor = getattr(module, local_name)
        key = f"{prefix}experts.{linear}.{kind}"
        if tensor is None:
            continue
        if tensor.dim() == 1:
            # A factory, not an entry of a view: Megatron's optimizers find a parameter's entry by
            # the parameter itself and build their states' entries with their own flat tensors.
            result[f"{prefix}{local_name}"] = ShardedTensorFactory(
                key, tensor, stacked_entry, lambda loaded: loaded.reshape(-1), replica_id)
        else:
            result[f"{prefix}{local_name}"] = stacked_entry(key, tensor, replica_id)
    # SequentialMLP's linears also save an (empty) extra state per expert; write the same
    # objects so a SequentialMLP can load this checkpoint.
    for linear in ("linear_fc1", "linear_fc2"):
        for local_idx in range(module.num_local_experts):
            global_idx = ep_rank * module.num_local_experts + local_idx
            result[f"{prefix}local_experts.{local_idx}.{linear}._extra_state"] = ShardedObject(
                f"{prefix}experts.{linear}._extra_state", None,
                (*(o[2] for o in sharded_offsets), ep_size * module.num_local_experts),
                (*(o[1] for o in sharded_offsets), global_idx), replica_id=replica_id)
    return result


_SEQUENTIAL_KEY = re.compile(
    r"^local_experts\.(?P<idx>\d+)\.linear_fc(?P<fc>[12])\.(?P<kind>weight|bias|_extra_state)$")
_TE_GROUPED_KEY = re.compile(r"^linear_fc[12]\.(weight|bias|_extra_state)\d*$")  # TE's GroupedLinear


def load_sequential_mlp_layout(module, state_dict, prefix, *args, **kwargs):
    """Load-state-dict pre-hook: accept a plain (torch-format) SequentialMLP state dict by
    stacking its local_experts.i tensors, and biases stacked [L, rows] (SequentialMLP's, a
    distributed checkpoint's, this module's before its biases were stored flat) as the flat ones."""
    found: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    te_keys = [k for k in state_dict if k.startswith(prefix) and _TE_GROUPED_KEY.match(k[len(prefix):])]
    if te_keys:
        raise ValueError(f"{te_keys[0]} ...: a plain torch state dict of Megatron's TEGroupedMLP (Transformer "
                         f"Engine's grouped linears) is not converted by the grouped experts; save a distributed "
                         f"checkpoint (--ckpt-format torch_dist), which both load, or load it into SequentialMLP "
                         f"first")
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _SEQUENTIAL_KEY.match(key[len(prefix):])
        if match and match["kind"] == "_extra_state":
            state_dict.pop(key)  # local linears keep no extra state
        elif match:
            found.setdefault((match["fc"], match["kind"]), {})[int(match["idx"])] = state_dict.pop(key)
    for (fc, kind), tensors in found.items():
        if sorted(tensors) != list(range(module.num_local_experts)):
            raise ValueError(f"SequentialMLP checkpoint has experts {sorted(tensors)} for linear_fc{fc}.{kind}; "
                             f"this module holds {module.num_local_experts} local experts")
        state_dict[f"{prefix}fc{fc}_{kind}"] = torch.stack([tensors[i] for i in range(module.num_local_experts)])
    for name in ("fc1_bias", "fc2_bias"):
        bias = state_dict.get(f"{prefix}{name}")
        if isinstance(bias, torch.Tensor) and bias.dim() == 2:
            state_dict[f"{prefix}{name}"] = bias.reshape(-1)
