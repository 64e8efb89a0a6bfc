"""Multi-group gradient buckets (dense over DP x CP, experts over EP_DP) and a replica checker.

  plan.py           the bucket plan (pure) and the averaging rule
  buckets.py        MultiGroupGradBuckets: flat buffers, backward hooks, ordered async all-reduce
  replica_check.py  check_replicas / maybe_check_replicas: parameter checksums per replica group
  megatron_hook.py  Megatron DistributedDataParallel integration (imports Megatron; not re-exported)
  megatron_internals.py  the hook's guard: the Megatron DDP internals it relies on, checked
"""

from megatron_ext.ddp.buckets import MultiGroupGradBuckets, groups_from_folding, groups_from_parallel_state
from megatron_ext.ddp.plan import DENSE, EXPERT, BucketPlan, ParamInfo, expert_or_dense, plan_buckets
from megatron_ext.ddp.replica_check import ReplicaMismatch, check_replicas, maybe_check_replicas

__all__ = [
    "DENSE", "EXPERT", "BucketPlan", "MultiGroupGradBuckets", "ParamInfo", "ReplicaMismatch",
    "check_replicas", "expert_or_dense", "groups_from_folding", "groups_from_parallel_state",
    "maybe_check_replicas", "plan_buckets",
]
