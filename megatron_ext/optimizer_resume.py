"""A start-up notice for a fault of Megatron 0.19.2 that users without Apex or Transformer Engine
meet when they resume: the distributed optimizer loading torch's Adam.

Without Apex/TE, Megatron's optimizer is torch's Adam, which keeps a `step` tensor per parameter.
0.19.2's `DistributedOptimizer.load_state_dict` sets every parameter's step to one shared tensor,
which torch's foreach Adam then advances once per parameter (wrong bias corrections from the first
step after a dp_reshardable load, silently), and its fully_reshardable load asks for a `step` its
entries leave out (KeyError). Both are Megatron's, for any layer. megatron_ext does not patch
Megatron's optimizer; the launcher says so once where a run saves or loads checkpoints with it
(tests/gpu/test_expert_checkpoint_gpu.py shows the fault and what a per-parameter step changes).
"""

from __future__ import annotations


def torch_adam_resume_notice(args) -> str | None:
    """The notice for these parsed arguments, or None where the fault cannot occur."""
    if not getattr(args, "use_distributed_optimizer", False) or getattr(args, "optimizer", "adam") != "adam":
        return None
    if getattr(args, "optimizer_cpu_offload", False):  # HybridDeviceOptimizer: Megatron handles its step
        return None
    if not (getattr(args, "load", None) or getattr(args, "save", None)):
        return None
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # FusedAdam keeps the step per parameter group
        return None
    return ("megatron_ext: notice: without Apex or Transformer Engine, Megatron's --use-distributed-optimizer "
            "runs torch's Adam, whose step megatron-core 0.19.2 does not resume right (not megatron_ext's doing): "
            "after --load of dp_reshardable optimizer state every parameter shares one step tensor, so Adam's "
            "bias corrections are wrong from then on; fully_reshardable state stops the load with KeyError "
            "'step'. Install Transformer Engine or Apex, or resume with --no-load-optim (fresh optimizer state)")
