"""Parallel Folding meshes: attention TP x CP x DP x PP and experts ETP x EP x EDP x PP.

Both meshes cover the same world and share their pipeline (PP) groups. Inside one pipeline
stage the attention ranks TP x CP x DP are refolded as ETP x EP x EDP for the expert layers:

    world = TP * CP * DP * PP = ETP * EP * EDP * PP,  so  TP * CP * DP = ETP * EP * EDP
    (with ETP = TP this is D * C = M_E * D_E of DESIGN.md section 3.1)

EP is the EP_MP axis (ranks holding different expert shards, exchanging token rows) and EDP
the EP_DP axis (replicas of one expert shard, reducing its gradients).

Rank enumeration (Megatron's RankGenerator rule, re-derived here without process groups):
the order string lists the axes fastest first; a rank is sum(coordinate * stride) where an
axis' stride is the product of the sizes of the axes before it. A group of kind "tp-ep" holds
the ranks that differ only in their tp and ep coordinates.

Written against megatron-core 0.19.2: `parallel_state.initialize_model_parallel`,
`RankGenerator` and the group getters. Not modelled: the GTP weight-rematerialization axes
(gtp_remat_size, expert_gtp_remat_size must be 1), hierarchical / hybrid context parallelism,
rank_offset and local_world_size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

MEGATRON_VERSION = "0.19.2"
AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"

# Group kinds: name -> the order axes that vary inside one group.
# Attention mesh axes are (tp, cp, dp, pp); ep has size 1 there.
ATTENTION_KINDS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("dp", "cp"),
    "tp_cp": ("tp", "cp"),
    "pp": ("pp",),
    "tp_pp": ("tp", "pp"),  # Megatron's model-parallel group
    "tp_dp_cp": ("tp", "dp", "cp"),
}
# Expert mesh axes are (tp=ETP, ep=EP, dp=EDP, pp); cp has size 1 there.
EXPERT_KINDS: dict[str, tuple[str, ...]] = {
    "etp": ("tp",),
    "ep": ("ep",),  # EP_MP
    "edp": ("dp",),  # EP_DP
    "etp_ep": ("tp", "ep"),
    "etp_ep_pp": ("tp", "ep", "pp"),
    "pp": ("pp",),
}
EXPERT_KIND_ALIASES = {"ep_mp": "ep", "ep_dp": "edp"}


# ---------------------------------------------------------------- pure rank enumeration


def _offsets(axes: tuple[tuple[str, int], ...], strides: dict[str, int]) -> list[int]:
    """Every sum(coordinate * stride) over `axes`, the first axis varying fastest."""
    offsets = [0]
    for name, size in axes:
        offsets = [o + c * strides[name] for c in range(size) for o in offsets]
    return offsets


@functools.lru_cache(maxsize=256)
def _rank_groups(axis_sizes: tuple[tuple[str, int], ...], varying: frozenset[str]) -> tuple[tuple[int, ...], ...]:
    strides, stride = {}, 1
    for name, size in axis_sizes:
        strides[name] = stride
        stride *= size
    inside = tuple((n, s) for n, s in axis_sizes if n in varying)
    across = tuple((n, s) for n, s in axis_sizes if n not in varying)
    members = _offsets(inside, strides)
    return tuple(tuple(base + m for m in members) for base in _offsets(across, strides))


def rank_groups(axis_sizes: tuple[tuple[str, int], ...], varying: tuple[str, ...] | frozenset[str]) -> list[list[int]]:
    """Rank groups of an ordered mesh: ranks that differ only along the `varying` axes.

    Rule: rank = sum(coord[a] * stride[a]) with stride[a] the product of the sizes of the axes
    listed before `a` (first axis fastest). Groups are listed with the other axes' coordinates
    varying first-axis-fastest and members likewise, which is the order of Megatron's
    RankGenerator.get_ranks.
    """
    names = [n for n, _ in axis_sizes]
    unknown = set(varying) - set(names)
    if unknown:
        raise ValueError(f"axes {sorted(unknown)} are not in the mesh axes {names}")
    return [list(g) for g in _rank_groups(tuple(axis_sizes), frozenset(varying))]


def rank_coordinates(axis_sizes: tuple[tuple[str, int], ...], rank: int) -> dict[str, int]:
    """The coordinate of `rank` on each axis (mixed radix, first axis fastest)."""
    coords = {}
    for name, size in axis_sizes:
        coords[name] = rank % size
        rank //= size
    return coords


# ---------------------------------------------------------------- the mesh


def _parse_order(order: Any) -> tuple[str, ...]:
    """Order rule (RankGenerator): lowercase axis names from tp, cp, ep, dp, pp joined by '-',
    each at most once."""
    if not isinstance(order, str) or not order:
        raise ValueError(f"order must be a non-empty string like {DEFAULT_ORDER!r}, got {order!r}")
    if order != order.lower():
        raise ValueError(
            f"order {order!r} must be lowercase ({order.lower()!r}): Megatron checks "
            f"order.endswith('pp') case-sensitively")
    tokens = tuple(order.split("-"))
    if "" in tokens:
        raise ValueError(f"order {order!r} has an empty axis name; join names with single '-'")
    if "gtp_remat" in tokens:
        raise ValueError(
            f"order {order!r} names gtp_remat: the GTP weight-rematerialization axis is not "
            f"modelled by FoldingMesh (Megatron inserts it itself when gtp_remat_size > 1)")
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(f"order {order!r} has unknown axis names {unknown}; allowed: {list(AXES)}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {order!r} names {repeated} more than once")
    return tokens


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class FoldingMesh:
    """Attention TP x CP x DP x PP and MoE ETP x EP x EDP x PP over `world_size` ranks.

    Validation mirrors every size check of Megatron 0.19.2's initialize_model_parallel and
    RankGenerator, raising ValueError naming the rule and the numbers:
      * every size >= 1;
      * world_size % (TP*CP*PP) == 0                      (DP = world / (TP*CP*PP));
      * (world/PP) % (ETP*EP) == 0                         (EDP = world / (ETP*EP*PP));
      * order: lowercase names of tp, cp, ep, dp, pp, each once; an axis missing from the
        order must have size 1 in both meshes;
      * EDP == DP unless PP == 1 or the order ends with pp;
      * the attention and expert meshes have identical PP groups;
      * VPP needs PP > 1;
      * (DP*CP) % dist_opt_instances == 0 and EDP % dist_opt_instances == 0.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # defaults to tp, as in Megatron
    order: str = DEFAULT_ORDER
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)
    dist_opt_instances: int = 1  # Megatron's num_distributed_optimizer_instances
    _order_axes: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("world_size", "tp", "cp", "pp", "ep", "etp", "dist_opt_instances"):
            _require_positive_int(name, getattr(self, name))
        if self.vpp is not None:
            _require_positive_int("vpp", self.vpp)
        tokens = _parse_order(self.order)
        object.__setattr__(self, "_order_axes", tokens + tuple(a for a in AXES if a not in tokens))

        attention_model = self.tp * self.cp * self.pp
        if self.world_size % attention_model:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by TP*CP*PP = {attention_model} "
                f"(TP {self.tp}, CP {self.cp}, PP {self.pp})")
        per_stage = self.world_size // self.pp
        expert_model = self.etp * self.ep
        if per_stage % expert_model:
            raise ValueError(
                f"(world/PP) = {per_stage} is not divisible by ETP*EP = {expert_model} "
                f"(ETP {self.etp}, EP {self.ep}); each pipeline stage's ranks must refold as "
                f"ETP x EP x EDP")

        for axis in AXES:
            if axis in tokens:
                continue
            sizes = {"attention": self._attention_size(axis), "expert": self._expert_size(axis)}
            for mesh_name, size in sizes.items():
                if size != 1:
                    label = _AXIS_LABELS[mesh_name][axis]
                    raise ValueError(
                        f"order {self.order!r} does not name {axis!r} but {label} = {size} in the "
                        f"{mesh_name} mesh; every axis of size > 1 must appear in the order")

        if not (self.pp == 1 or self.order.endswith("pp") or self.edp == self.dp):
            raise ValueError(
                f"EDP = {self.edp} must equal DP = {self.dp} when PP = {self.pp} > 1 and the order "
                f"{self.order!r} does not end with 'pp' (Megatron's rule for non-pp-last orders)")
        if self.attention_groups("pp") != self.expert_groups("pp"):
            raise ValueError(
                f"order {self.order!r} gives different PP groups for attention "
                f"(stride {self._pp_stride(self._attention_axes())}) and experts "
                f"(stride {self._pp_stride(self._expert_axes())}); both meshes must share PP groups "
                f"(put pp after every axis whose size differs between the meshes, e.g. last)")
        if self.vpp is not None and self.pp == 1:
            raise ValueError(f"VPP = {self.vpp} needs PP > 1 (interleaved schedule), got PP = 1")
        if (self.dp * self.cp) % self.dist_opt_instances:
            raise ValueError(
                f"DP*CP = {self.dp * self.cp} is not divisible by dist_opt_instances = "
                f"{self.dist_opt_instances} (partial distributed optimizer)")
        if self.edp % self.dist_opt_instances:
            raise ValueError(
                f"EDP = {self.edp} is not divisible by dist_opt_instances = "
                f"{self.dist_opt_instances} (partial distributed optimizer)")

    # ------------------------------------------------------------ derived sizes

    @property
    def dp(self) -> int:
        """Attention data-parallel size: world / (TP*CP*PP)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size (EP_DP): world / (ETP*EP*PP) = TP*CP*DP / (ETP*EP)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def ranks_per_stage(self) -> int:
        return self.world_size // self.pp

    def _attention_size(self, axis: str) -> int:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}[axis]

    def _expert_size(self, axis: str) -> int:
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}[axis]

    def _attention_axes(self) -> tuple[tuple[str, int], ...]:
        return tuple((a, self._attention_size(a)) for a in self._order_axes)

    def _expert_axes(self) -> tuple[tuple[str, int], ...]:
        return tuple((a, self._expert_size(a)) for a in self._order_axes)

    @staticmethod
    def _pp_stride(axes) -> int:
        stride = 1
        for name, size in axes:
            if name == "pp":
                return stride
            stride *= size
        return stride

    # ------------------------------------------------------------ pure-math groups

    def attention_groups(self, kind: str) -> list[list[int]]:
        """Rank groups of the attention mesh; kind in ATTENTION_KINDS (tp, cp, dp, dp_cp, pp, ...)."""
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention group kind {kind!r}; known: {sorted(ATTENTION_KINDS)}")
        return rank_groups(self._attention_axes(), ATTENTION_KINDS[kind])

    def expert_groups(self, kind: str) -> list[list[int]]:
        """Rank groups of the expert mesh; kind in EXPERT_KINDS (etp, ep = EP_MP, edp = EP_DP, pp, ...)."""
        kind = EXPERT_KIND_ALIASES.get(kind, kind)
        if kind not in EXPERT_KINDS:
            raise ValueError(
                f"unknown expert group kind {kind!r}; known: {sorted(EXPERT_KINDS) + sorted(EXPERT_KIND_ALIASES)}")
        return rank_groups(self._expert_axes(), EXPERT_KINDS[kind])

    def group_of(self, rank: int, kind: str, mesh: str = "attention") -> list[int]:
        """The `kind` group (attention or expert mesh) that contains `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        if mesh not in ("attention", "expert"):
            raise ValueError(f"mesh must be 'attention' or 'expert', got {mesh!r}")
        groups = self.attention_groups(kind) if mesh == "attention" else self.expert_groups(kind)
        return next(g for g in groups if rank in g)

    def attention_coordinates(self, rank: int) -> dict[str, int]:
        """{tp, cp, dp, pp} coordinates of `rank` in the attention mesh."""
        c = rank_coordinates(self._attention_axes(), rank)
        return {"tp": c["tp"], "cp": c["cp"], "dp": c["dp"], "pp": c["pp"]}

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """{etp, ep, edp, pp} coordinates of `rank` in the expert mesh."""
        c = rank_coordinates(self._expert_axes(), rank)
        return {"etp": c["tp"], "ep": c["ep"], "edp": c["dp"], "pp": c["pp"]}

    def stage_ranks(self, stage: int) -> list[int]:
        """Ranks of pipeline stage `stage`, ascending."""
        return sorted(g[stage] for g in self.attention_groups("pp"))

    # ------------------------------------------------------------ Megatron process groups

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of parallel_state.initialize_model_parallel for this mesh."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            num_distributed_optimizer_instances=self.dist_opt_instances,
            order=self.order,
        )

    def create_groups(self, **initialize_kwargs) -> "FoldingGroups":
        """Create Megatron's process groups for this mesh, or adopt the existing ones.

        If Megatron's parallel_state is not initialized, calls
        initialize_model_parallel(**megatron_kwargs(), **initialize_kwargs) (extra kwargs such as
        create_gloo_process_groups or distributed_timeout_minutes pass through). If it is,
        checks that this rank's groups equal the mesh's and raises RuntimeError naming every
        group that differs. torch.distributed must be initialized with world_size ranks.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"mesh world_size {self.world_size} != torch.distributed world size {dist.get_world_size()}")
        adopted = parallel_state.model_parallel_is_initialized()
        if not adopted:
            parallel_state.initialize_model_parallel(**self.megatron_kwargs(), **initialize_kwargs)
        groups = _megatron_groups_of_this_rank(self, adopted)
        mismatches = _compare_with_mesh(self, groups, dist.get_rank())
        if mismatches:
            what = "was initialized with a different layout" if adopted else "disagrees with the mesh"
            raise RuntimeError(f"Megatron's parallel state {what} ({self.describe()}): " + "; ".join(mismatches))
        return groups

    # ------------------------------------------------------------ rendering

    def describe(self) -> str:
        """One line per mesh with the sizes."""
        return (
            f"attention TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp}; "
            f"experts ETP {self.etp} x EP {self.ep} x EDP {self.edp} x PP {self.pp}; "
            f"world {self.world_size}, order {self.order}")

    def render_summary(self, gpus_per_node: int | None = None) -> str:
        """Sizes, the folding identity, and each group kind: count, size, the group of rank 0,
        and (with gpus_per_node) whether every group stays inside one node."""
        lines = [
            f"Parallel Folding mesh: world {self.world_size} ranks, order {self.order}"
            + (f", {self.world_size // gpus_per_node} nodes x {gpus_per_node} GPUs" if gpus_per_node else ""),
            f"  attention  TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp}",
            f"  experts    ETP {self.etp} x EP {self.ep} x EDP {self.edp} x PP {self.pp}",
            f"  per stage  TP*CP*DP = {self.tp * self.cp * self.dp} = ETP*EP*EDP = "
            f"{self.etp * self.ep * self.edp} ranks"
            + (f"; VPP {self.vpp}" if self.vpp else ""),
        ]
        rows = []
        for mesh, kinds, getter in (("attention", ("tp", "cp", "dp", "dp_cp", "pp"), self.attention_groups),
                                    ("expert", ("etp", "ep", "edp", "pp"), self.expert_groups)):
            for kind in kinds:
                if mesh == "expert" and kind == "pp":
                    continue  # identical to the attention PP groups (validated)
                groups = getter(kind)
                label = {"ep": "ep (EP_MP)", "edp": "edp (EP_DP)"}.get(kind, kind)
                row = [mesh, label, str(len(groups)), str(len(groups[0])), _short_list(groups[0])]
                if gpus_per_node:
                    row.append("yes" if all(len({r // gpus_per_node for r in g}) == 1 for g in groups) else "no")
                rows.append(row)
        headers = ["mesh", "group", "count", "size", "group of rank 0"]
        if gpus_per_node:
            headers.append("in one node")
        lines.append(text_table(headers, rows, indent="  ", left=(0, 1, 4)))
        return "\n".join(lines)

    def render(self, stages: list[int] | None = None, gpus_per_node: int | None = None) -> str:
        """Both meshes as rank tables: per pipeline stage, each rank's attention coordinates
        (tp, cp, dp) and expert coordinates (etp, ep, edp). `stages` limits the stages shown."""
        stages = list(range(self.pp)) if stages is None else stages
        out = [self.render_summary(gpus_per_node)]
        for stage in stages:
            ranks = self.stage_ranks(stage)
            out.append(f"\nPP stage {stage} ({len(ranks)} ranks)")
            headers = ["rank"] + (["node"] if gpus_per_node else []) + ["tp", "cp", "dp", "|", "etp", "ep", "edp"]
            rows = []
            for rank in ranks:
                a, e = self.attention_coordinates(rank), self.expert_coordinates(rank)
                node = [str(rank // gpus_per_node)] if gpus_per_node else []
                rows.append([str(rank)] + node + [str(a["tp"]), str(a["cp"]), str(a["dp"]), "|",
                                                  str(e["etp"]), str(e["ep"]), str(e["edp"])])
            out.append(text_table(headers, rows, indent="  "))
        return "\n".join(out)


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


_AXIS_LABELS = {
    "attention": {"tp": "TP", "cp": "CP", "ep": "EP", "dp": "DP", "pp": "PP"},
    "expert": {"tp": "ETP", "cp": "CP", "ep": "EP", "dp": "EDP", "pp": "PP"},
}

# FoldingGroups field -> (mesh, kind) of the pure-math group it must equal.
_GROUP_FIELDS = {
    "tp_group": ("attention", "tp"),
    "cp_group": ("attention", "cp"),
    "dp_group": ("attention", "dp"),
    "dp_cp_group": ("attention", "dp_cp"),
    "pp_group": ("attention", "pp"),
    "etp_group": ("expert", "etp"),
    "ep_mp_group": ("expert", "ep"),
    "ep_dp_group": ("expert", "edp"),
}


def _megatron_groups_of_this_rank(mesh: FoldingMesh, adopted: bool) -> FoldingGroups:
    """Read this rank's groups through Megatron 0.19.2's getters. The replica groups use
    with_gtp_remat=False (the gradient replica groups; identical to the default when the GTP
    axes are 1, which the adopt check below enforces)."""
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


def _compare_with_mesh(mesh: FoldingMesh, groups: FoldingGroups, rank: int) -> list[str]:
    """Each group whose ranks differ from the mesh's pure-math group of `rank`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mismatches = []
    for name, (which, kind) in _GROUP_FIELDS.items():
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


def _short_list(ranks: list[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] (step {step})"
    return "[" + ", ".join(map(str, ranks[:limit - 1])) + f", ..., {ranks[-1]}]"


def text_table(headers: list[str], rows: list[list[str]], indent: str = "", left: tuple[int, ...] = ()) -> str:
    """Text table; columns are right-aligned except the indices in `left`."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return indent + "  ".join(c.ljust(w) if i in left else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join(line(cells).rstrip() for cells in [headers] + rows)
