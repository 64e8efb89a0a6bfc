"""FoldingMesh.create_groups on gloo ranks: Megatron's getters equal the mesh's pure-math groups."""

import pytest
import torch.distributed as dist

from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, run_on_ranks
from megatron_ext.parallel.folding import FoldingMesh

# (world, mesh kwargs)
LAYOUTS = [
    (8, dict(tp=2, ep=4)),
    (8, dict(tp=2, cp=2, ep=2, etp=1)),
    (8, dict(pp=2, ep=2)),
    (8, dict(tp=2, pp=2, ep=4, etp=1)),
    (8, dict(tp=2, cp=2, pp=2, ep=4, etp=1)),  # TP2 CP2 EP4 with PP2: EDP 1
    (4, dict(ep=2, etp=2)),
    (4, dict(cp=2, ep=4, etp=1)),
]


def _groups_rank(rank, world, mesh_kwargs):
    from megatron.core import parallel_state as ps

    mesh = FoldingMesh(world, **mesh_kwargs)
    groups = mesh.create_groups(create_gloo_process_groups=False)
    ranks = dist.get_process_group_ranks
    found = {
        "tp": ranks(ps.get_tensor_model_parallel_group()),
        "cp": ranks(ps.get_context_parallel_group()),
        "dp": ranks(ps.get_data_parallel_group()),
        "dp_cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "pp": ranks(ps.get_pipeline_model_parallel_group()),
        "etp": ranks(ps.get_expert_tensor_parallel_group()),
        "ep": ranks(ps.get_expert_model_parallel_group()),
        "edp": ranks(ps.get_expert_data_parallel_group(with_gtp_remat=False)),
    }
    expected = {kind: mesh.group_of(rank, kind) for kind in ("tp", "cp", "dp", "dp_cp", "pp")}
    expected.update({kind: mesh.group_of(rank, kind, mesh="expert") for kind in ("etp", "ep", "edp")})
    assert found == expected, (rank, found, expected)
    assert ranks(groups.ep_mp_group) == expected["ep"] and ranks(groups.ep_dp_group) == expected["edp"]
    assert not groups.adopted
    # Megatron's rank getters agree with the mesh coordinates.
    assert ps.get_expert_model_parallel_rank() == mesh.expert_coordinates(rank)["ep"]
    assert ps.get_tensor_model_parallel_rank() == mesh.attention_coordinates(rank)["tp"]
    assert ps.get_pipeline_model_parallel_rank() == mesh.attention_coordinates(rank)["pp"]
    return found


@pytest.mark.parametrize("world,mesh_kwargs", LAYOUTS, ids=[f"w{w}-" + "-".join(f"{k}{v}" for k, v in kw.items())
                                                            for w, kw in LAYOUTS])
def test_megatron_getters_equal_mesh_groups(world, mesh_kwargs):
    results = run_on_ranks(_groups_rank, world, mesh_kwargs)
    assert len(results) == world


def _adopt_rank(rank, world, mesh_kwargs):
    groups = FoldingMesh(world, **mesh_kwargs).create_groups()
    assert groups.adopted
    return dist.get_process_group_ranks(groups.ep_dp_group)


def test_adopts_matching_megatron_groups():
    # The harness initializes Megatron first (TP2 CP2 EP2 ETP1); the mesh adopts those groups.
    results = run_on_ranks(_adopt_rank, 8, dict(tp=2, cp=2, ep=2, etp=1),
                           sizes=ParallelSizes(tp=2, cp=2, ep=2, etp=1))
    mesh = FoldingMesh(8, tp=2, cp=2, ep=2, etp=1)
    assert results == [mesh.group_of(r, "edp", mesh="expert") for r in range(8)]


def test_refuses_megatron_groups_of_another_layout():
    with pytest.raises(RankFailure, match="initialized with a different layout.*ep_mp_group is"):
        run_on_ranks(_adopt_rank, 4, dict(ep=4), sizes=ParallelSizes(ep=2))


def _vpp_rank(rank, world):
    from megatron.core import parallel_state as ps

    groups = FoldingMesh(world, pp=2, vpp=2).create_groups(create_gloo_process_groups=False)
    assert not groups.adopted
    return ps.get_virtual_pipeline_model_parallel_world_size()


def test_created_groups_carry_the_mesh_vpp():
    # PP2 VPP2 on 4 ranks: Megatron must be initialized with the interleaved schedule's VPP
    # (dist_opt_instances > 1 is not created here: Megatron's hierarchical groups need einops)
    assert run_on_ranks(_vpp_rank, 4) == [2] * 4


def _refused_rank(rank, world, mesh_world, mesh_kwargs, gtp_remat=None):
    from megatron.core import parallel_state as ps

    if gtp_remat is not None:
        # as Megatron reports a GTP weight-rematerialization group (this forked rank's module only)
        ps.get_gtp_weight_remat_world_size = lambda: gtp_remat
    FoldingMesh(mesh_world, **mesh_kwargs).create_groups(create_gloo_process_groups=False)


# (id, mesh world, mesh kwargs, Megatron initialized first with, GTP remat size Megatron reports, message)
REFUSALS = [
    ("world", 8, dict(ep=2), None, None, r"mesh world_size 8 != torch.distributed world size 4"),
    # a mesh smaller than the job is refused too, not only a larger one
    ("world-smaller", 2, dict(), None, None, r"mesh world_size 2 != torch.distributed world size 4"),
    ("gtp-remat", 4, dict(), None, 2,
     r"get_gtp_weight_remat_world_size\(\) = 2; FoldingMesh does not model GTP remat axes"),
    # same groups as the mesh, but Megatron was initialized without VPP / with one optimizer instance
    ("vpp", 4, dict(pp=2, vpp=2), ParallelSizes(pp=2), None,
     r"different layout .*: Megatron's VPP is None, the mesh has 2"),
    ("instances", 4, dict(dist_opt_instances=2), ParallelSizes(), None,
     r"different layout .*: Megatron's partial DP\*CP group has 4 ranks, the mesh expects "
     r"DP\*CP / dist_opt_instances = 2"),
]


@pytest.mark.parametrize("mesh_world,mesh_kwargs,sizes,gtp_remat,message", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_create_groups_refuses_what_the_mesh_does_not_describe(mesh_world, mesh_kwargs, sizes, gtp_remat, message):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_refused_rank, 4, mesh_world, mesh_kwargs, gtp_remat=gtp_remat, sizes=sizes)


def _other_order_rank(rank, world):
    from megatron_ext.parallel import megatron_groups

    kwargs_of = megatron_groups.megatron_kwargs  # this forked rank only: Megatron gets another order
    megatron_groups.megatron_kwargs = lambda mesh: {**kwargs_of(mesh), "order": "tp-cp-ep-pp-dp"}
    FoldingMesh(world, pp=2).create_groups(create_gloo_process_groups=False)


def test_groups_created_for_another_layout_are_refused_as_created():
    """Groups this call created (not adopted) that differ from the mesh: PP2 on 4 ranks with pp before dp
    gives data-parallel groups [0, 2] and [1, 3]; the mesh's (pp last) are [0, 1] and [2, 3]. Every rank
    fails; whichever is reported names its dp_group first."""
    with pytest.raises(RankFailure, match=r"disagrees with the mesh \(.*\): rank \d dp_group is \[(0, 2|1, 3)\], "
                                          r"the mesh expects \[(0, 1|2, 3)\]"):
        run_on_ranks(_other_order_rank, 4)
