"""Megatron's DistributedDataParallel with replica groups from the folding mesh and one fixed
launch order (written against megatron-core 0.19.2).

Megatron 0.19.2 already keeps expert parameters (`allreduce=False`) in separate buffers whose
bucket groups reduce over `intra_expt_dp_group`, and dense ones over `intra_dp_cp_group`. What
it does not guarantee:
  * that those groups are the folding mesh's EP_DP and DP x CP (they come from parallel_state
    or a pg_collection that may have been built for another layout);
  * one launch order across the two lists: dense and expert bucket groups each launch when
    their own parameters are ready, so two ranks whose hooks fire in a different order issue
    collectives on two overlapping communicators in a different order.

`install_folding_ddp(ddp, groups)` (the documented module hook) fixes both on a constructed
Megatron DDP: it verifies each bucket group's collective group against the mesh (a group of
the same size over other ranks is replaced by the mesh's, with a warning: the model's MoE layers
must use the same mesh, or expert gradients of different shards are summed), checks the gradient scaling factors
against the averaging rule of megatron_ext.ddp.buckets, and makes every bucket group launch in
one order (bucket groups sorted by the backward position of their parameters) shared by
`register_grad_ready`, `start_grad_sync` and `finish_grad_sync`. `FoldingDistributedDataParallel`
is the same as a subclass. Megatron 0.19.2's training loop wraps models in two places:
`get_model` (a `model_provider_func`) reads the module global `megatron.training.training.DDP`,
which a script may set to `FoldingDistributedDataParallel` before `setup_model_and_optimizer`;
the model-config builder path that `pretrain_gpt.py` and megatron_ext.launch take
(`megatron.training.models.dist_utils._ddp_wrap`) picks `DistributedDataParallel` itself, so
`--moe-ext-ddp-buckets` applies `install_folding_ddp` to the constructed chunks instead, before
the first train_step (megatron_ext.training_hooks.install_ddp_buckets).

Private Megatron names relied on are all listed in `check_megatron_ddp_internals()`
(megatron_internals.py, re-exported here), which raises MegatronInternalsChanged naming each
changed one (a CPU test calls it on every run).
Host cost: bookkeeping only; launches and waits are Megatron's own (async collectives,
stream waits on CUDA).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import torch.distributed as dist

from megatron_ext.ddp.megatron_internals import (MEGATRON_VERSION, MegatronInternalsChanged,  # noqa: F401
                                                 check_megatron_ddp_internals)
from megatron_ext.ddp.plan import DENSE, EXPERT

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- replica groups


def _collective_group(bucket_group, ddp_config):
    if ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_group
    return bucket_group.data_parallel_group


def _set_collective_group(ddp, bucket_group, group) -> None:
    if hasattr(bucket_group, "data_parallel_group"):
        bucket_group.data_parallel_group = group
    if hasattr(bucket_group, "intra_distributed_optimizer_instance_group"):
        bucket_group.intra_distributed_optimizer_instance_group = group
        bucket_group.intra_distributed_optimizer_instance_rank = group.rank()
    mine = {id(b) for b in bucket_group.buckets}
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if any(id(b) in mine for b in buffer.buckets):
            buffer.data_parallel_group = group


def install_replica_groups(ddp, dense_group, expert_group) -> list[str]:
    """Make dense bucket groups reduce over `dense_group` (DP x CP) and expert ones over
    `expert_group` (EP_DP); return one line per bucket group saying what was found.

    Same ranks: kept (verified). Same size, other ranks: the mesh's group replaces Megatron's
    (bucket layout unchanged; refused under the distributed optimizer, whose shards follow each
    rank's index in the old group). Other size: ValueError, since buffers were padded and scaled for
    Megatron's size; build the DDP with `pg_collection=ddp_pg_collection(...)` instead.
    Also checks each bucket's gradient scaling equals 1 / |dense_group| (the averaging rule).
    """
    config = ddp.ddp_config
    refuse_partial_distributed_optimizer(config)
    report = []
    for label, group, bucket_groups in ((DENSE, dense_group, ddp.bucket_groups),
                                        (EXPERT, expert_group, ddp.expert_parallel_bucket_groups)):
        want = sorted(dist.get_process_group_ranks(group))
        for i, bucket_group in enumerate(bucket_groups):
            current = _collective_group(bucket_group, config)
            have = sorted(dist.get_process_group_ranks(current))
            if have == want:
                report.append(f"{label} bucket group {i}: Megatron already reduces over ranks {want}")
                continue
            if len(have) != len(want):
                raise ValueError(
                    f"Megatron's {label} bucket group {i} reduces over {len(have)} ranks {have}, the "
                    f"folding mesh's {label} replica group has {len(want)} ranks {want}; its buffers "
                    f"were laid out for the other size. Build DistributedDataParallel with "
                    f"pg_collection=ddp_pg_collection(folding_groups) or from FoldingMesh.create_groups().")
            if config.use_distributed_optimizer:
                raise ValueError(
                    f"Megatron's {label} bucket group {i} reduces over ranks {have}, the folding mesh's {label} "
                    f"replica group is {want}: under the distributed optimizer each rank's shard follows its index "
                    f"in the group the DDP was built with, so the group cannot be swapped afterwards. Build "
                    f"DistributedDataParallel with pg_collection=ddp_pg_collection(folding_groups) or from "
                    f"FoldingMesh.create_groups().")
            _set_collective_group(ddp, bucket_group, group)
            report.append(f"{label} bucket group {i}: replaced ranks {have} with the mesh's {want}")
            logger.warning("megatron_ext: Megatron's DDP reduced %s bucket group %d over ranks %s; it now reduces over "
                           "the folding mesh's %s. Right only if the model's layers were built from the same mesh "
                           "(otherwise build the DDP with pg_collection=ddp_pg_collection(folding_groups))",
                           label, i, have, want)
    _check_scaling(ddp, dist.get_world_size(dense_group))
    return report


def _check_scaling(ddp, dense_size: int) -> None:
    config = ddp.ddp_config
    expected = 1.0 if ddp.config.calculate_per_token_loss else 1.0 / dense_size
    for label, bucket_groups in ((DENSE, ddp.bucket_groups), (EXPERT, ddp.expert_parallel_bucket_groups)):
        for i, bucket_group in enumerate(bucket_groups):
            size = dist.get_world_size(_collective_group(bucket_group, config))
            for bucket in bucket_group.buckets:
                effective = bucket.gradient_scaling_factor / (size if config.average_in_collective else 1)
                if abs(effective - expected) > 1e-12 * expected:
                    raise ValueError(
                        f"{label} bucket group {i} scales gradients by {effective:.6g}, the averaging rule "
                        f"wants {expected:.6g} (mean over the {dense_size} DP x CP ranks)")


def refuse_partial_distributed_optimizer(ddp_config) -> None:
    """Megatron's partial distributed optimizer (--num-distributed-optimizer-instances > 1) needs its
    intra- and inter-instance groups, which the folding DDP paths do not build."""
    instances = ddp_config.num_distributed_optimizer_instances
    if instances != 1:
        raise NotImplementedError(f"megatron_ext's folding DDP supports num_distributed_optimizer_instances == 1 "
                                  f"only (--num-distributed-optimizer-instances), got {instances}: it does not build "
                                  f"the intra- and inter-instance groups a partial distributed optimizer needs")


def ddp_pg_collection(folding_groups):
    """A ProcessGroupCollection for DistributedDataParallel(pg_collection=...) from the folding
    mesh's groups: dense buffers over DP x CP, expert buffers over EP_DP."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.dp, pgs.dp_cp, pgs.expt_dp = folding_groups.dp_group, folding_groups.dp_cp_group, folding_groups.ep_dp_group
    pgs.tp, pgs.pp, pgs.ep = folding_groups.tp_group, folding_groups.pp_group, folding_groups.ep_mp_group
    return pgs


# ---------------------------------------------------------------- one launch order


class _OrderedLauncher:
    """Launch bucket groups strictly in `order`; a request for a later one waits for the earlier.

    Re-entrant: Megatron's start_grad_sync may itself ask for another group's launch (with
    reduce_scatter_with_fp32_accumulation it drains its predecessor, whose first-batch
    finish_grad_sync calls start_grad_sync again, 0.19.2). Such a request is recorded and served
    by the loop already running, after the launch in progress: never a launch inside a launch.
    """

    def __init__(self, order: list, originals: dict):
        self.order = order
        self.position = {id(bg): i for i, bg in enumerate(order)}
        self.originals = originals
        self.last_log: list[int] = []  # positions in `order`, as launched in the last finished step
        self.reset()

    def reset(self) -> None:
        self.requested: dict[int, Any] = {}
        self.next = 0
        self.log: list[int] = []
        self.launching = False

    def request(self, bucket_group, force_all_reduce: bool | None = False) -> None:
        position = self.position[id(bucket_group)]
        if position < self.next:
            return  # launched already this step (a successor draining it asks again: Megatron's no-op)
        self.requested[position] = force_all_reduce
        if self.launching:
            return
        self.launching = True
        try:
            while self.next < len(self.order) and self.next in self.requested:
                position, self.next = self.next, self.next + 1
                self.log.append(position)
                self.originals[id(self.order[position])](force_all_reduce=self.requested[position])
        finally:
            self.launching = False


def launch_order(ddp) -> list:
    """Every bucket group (dense and expert), sorted by when backward completes it: backward reaches
    parameters about in reverse registration order, so a group is complete at its first-registered
    parameter, and the group whose first parameter comes latest goes first. Same on every rank."""
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
    return sorted(groups, key=lambda bg: -min(index[id(p)] for b in bg.buckets for p in b.params_list))


def install_fixed_launch_order(ddp) -> _OrderedLauncher:
    """Route every grad-sync launch of `ddp` (hooks, start_grad_sync, finish_grad_sync) through one
    ordered launcher. A bucket group that is still incomplete at finish_grad_sync (a parameter
    without a gradient this step) is launched there, in order, with the zeros of its slots."""
    if getattr(ddp, "grad_launcher", None) is not None:
        return ddp.grad_launcher  # already installed: wrapping twice would nest the launchers
    order = launch_order(ddp)
    originals = {id(bg): bg.start_grad_sync for bg in order}
    launcher = _OrderedLauncher(order, originals)
    for bucket_group in order:
        bucket_group.start_grad_sync = functools.partial(launcher.request, bucket_group)
    overlap = ddp.ddp_config.overlap_grad_reduce

    def start_grad_sync(*unused):
        for bucket_group in order:
            if launcher.position[id(bucket_group)] >= launcher.next:
                launcher.request(bucket_group)

    def finish_grad_sync(force_all_reduce: bool | None = False):
        for bucket_group in order:
            pending = bucket_group.grad_reduce_handle is None and not bucket_group.grad_reduce_finished
            if overlap and not bucket_group.is_first_batch and pending:
                launcher.request(bucket_group, force_all_reduce)
            bucket_group.finish_grad_sync(force_all_reduce=force_all_reduce)
        launcher.last_log = list(launcher.log)
        launcher.reset()

    ddp.start_grad_sync = start_grad_sync
    ddp.finish_grad_sync = finish_grad_sync
    ddp.grad_launcher = launcher
    return launcher


# ---------------------------------------------------------------- entry points


def install_folding_ddp(ddp, groups: Mapping[str, Any] | None = None, *, fixed_launch_order: bool = True) -> list[str]:
    """The module hook: apply to a constructed Megatron DistributedDataParallel.

    `groups` = {"dense": DP x CP, "expert": EP_DP} (see buckets.groups_from_folding); default:
    Megatron's parallel_state groups. Returns install_replica_groups' report.
    """
    from megatron_ext.ddp.buckets import groups_from_parallel_state

    check_megatron_ddp_internals()
    groups = dict(groups) if groups is not None else groups_from_parallel_state()
    report = install_replica_groups(ddp, groups[DENSE], groups[EXPERT])
    if fixed_launch_order:
        install_fixed_launch_order(ddp)
    return report


def _ddp_base():
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


class FoldingDistributedDataParallel(_ddp_base()):
    """Megatron's DistributedDataParallel with `install_folding_ddp` applied.

    Extra arguments: `folding_groups` (FoldingMesh.create_groups(); default parallel_state) and
    `fixed_launch_order`. With folding_groups and no pg_collection, Megatron's DDP is built from
    the mesh's groups (`ddp_pg_collection`).
    """

    def __init__(self, config, ddp_config, module, disable_bucketing: bool = False, pg_collection=None,
                 full_param_layout=None, *, folding_groups=None, fixed_launch_order: bool = True):
        from megatron_ext.ddp.buckets import groups_from_folding

        check_megatron_ddp_internals()
        refuse_partial_distributed_optimizer(ddp_config)
        if pg_collection is None and folding_groups is not None:
            pg_collection = ddp_pg_collection(folding_groups)
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                         pg_collection=pg_collection, full_param_layout=full_param_layout)
        groups = groups_from_folding(folding_groups) if folding_groups is not None else None
        self.replica_report = install_folding_ddp(self, groups, fixed_launch_order=fixed_launch_order)
