"""Create or adopt Megatron's process groups for a FoldingMesh, and check them against the mesh.

Written against megatron-core 0.19.2: `parallel_state.initialize_model_parallel` and the group
getters. The replica groups are read with with_gtp_remat=False (the gradient replica groups;
identical to the default when the GTP axes are 1, which is enforced here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_ext.parallel.folding import FoldingMesh


@dataclass(frozen=True)
class FoldingGroups:
    """This rank's process groups for a FoldingMesh, as Megatron's getters return them."""

    mesh: FoldingMesh
    adopted: bool  # True when Megatron's groups existed already and matched the mesh
    tp_group: Any
    cp_group: Any
    dp_group: Any  # attention DP (without CP)
    dp_cp_group: Any  # dense gradient replicas: DP x CP
    pp_group: Any
    etp_group: Any
    ep_mp_group: Any  # get_expert_model_parallel_group
    ep_dp_group: Any  # get_expert_data_parallel_group(with_gtp_remat=False): expert gradient replicas


# FoldingGroups field -> (mesh, kind) of the pure-math group it must equal.
GROUP_FIELDS = {
    "tp_group": ("attention", "tp"),
    "cp_group": ("attention", "cp"),
    "dp_group": ("attention", "dp"),
    "dp_cp_group": ("attention", "dp_cp"),
    "pp_group": ("attention", "pp"),
    "etp_group": ("expert", "etp"),
    "ep_mp_group": ("expert", "ep"),
    "ep_dp_group": ("expert", "edp"),
}


def megatron_kwargs(mesh: FoldingMesh) -> dict[str, Any]:
    """Keyword arguments of parallel_state.initialize_model_parallel for `mesh`."""
    return dict(
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        virtual_pipeline_model_parallel_size=mesh.vpp,
        context_parallel_size=mesh.cp,
        expert_model_parallel_size=mesh.ep,
        expert_tensor_parallel_size=mesh.etp,
        num_distributed_optimizer_instances=mesh.dist_opt_instances,
        order=mesh.order,
    )


def create_groups(mesh: FoldingMesh, **initialize_kwargs) -> FoldingGroups:
    """Create Megatron's process groups for `mesh`, or adopt the existing ones.

    If Megatron's parallel_state is not initialized, calls
    initialize_model_parallel(**megatron_kwargs(mesh), **initialize_kwargs) (extra kwargs such
    as create_gloo_process_groups or distributed_timeout_minutes pass through). If it is, checks
    that this rank's groups equal the mesh's and raises RuntimeError naming every group that
    differs. torch.distributed must be initialized with mesh.world_size ranks.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    if dist.get_world_size() != mesh.world_size:
        raise RuntimeError(
            f"mesh world_size {mesh.world_size} != torch.distributed world size {dist.get_world_size()}")
    adopted = parallel_state.model_parallel_is_initialized()
    if not adopted:
        parallel_state.initialize_model_parallel(**megatron_kwargs(mesh), **initialize_kwargs)
    groups = megatron_groups_of_this_rank(mesh, adopted)
    mismatches = compare_with_mesh(mesh, groups, dist.get_rank())
    if mismatches:
        what = "was initialized with a different layout" if adopted else "disagrees with the mesh"
        raise RuntimeError(f"Megatron's parallel state {what} ({mesh.describe()}): " + "; ".join(mismatches))
    return groups


def megatron_groups_of_this_rank(mesh: FoldingMesh, adopted: bool) -> FoldingGroups:
    """Read this rank's groups through Megatron 0.19.2's getters."""
    from megatron.core import parallel_state as ps

    for getter in ("get_gtp_weight_remat_world_size", "get_expert_gtp_weight_remat_world_size"):
        size = getattr(ps, getter)()
        if size not in (0, 1):
            raise RuntimeError(f"Megatron's {getter}() = {size}; FoldingMesh does not model GTP remat axes")
    return FoldingGroups(
        mesh=mesh,
        adopted=adopted,
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(with_context_parallel=False, with_gtp_remat=False),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False),
        pp_group=ps.get_pipeline_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        ep_mp_group=ps.get_expert_model_parallel_group(),
        ep_dp_group=ps.get_expert_data_parallel_group(with_gtp_remat=False),
    )


def compare_with_mesh(mesh: FoldingMesh, groups: FoldingGroups, rank: int) -> list[str]:
    """Each group whose ranks differ from the mesh's pure-math group of `rank`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mismatches = []
    for name, (which, kind) in GROUP_FIELDS.items():
        found = list(dist.get_process_group_ranks(getattr(groups, name)))
        expected = mesh.group_of(rank, kind, mesh=which)
        if sorted(found) != expected:  # torch sorts a new group's ranks; the mesh's are ascending
            mismatches.append(f"rank {rank} {name} is {found}, the mesh expects {expected}")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp != mesh.vpp:
        mismatches.append(f"Megatron's VPP is {vpp}, the mesh has {mesh.vpp}")
    partial = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True,
                                         with_gtp_remat=False)
    if partial.size() * mesh.dist_opt_instances != mesh.dp * mesh.cp:
        mismatches.append(f"Megatron's partial DP*CP group has {partial.size()} ranks, the mesh "
                          f"expects DP*CP / dist_opt_instances = {mesh.dp * mesh.cp // mesh.dist_opt_instances}")
    return mismatches
