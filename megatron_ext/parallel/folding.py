"""Parallel Folding meshes: attention TP x CP x DP x PP and experts ETP x EP x EDP x PP.

Both meshes cover the same world and share their pipeline (PP) groups. Inside one pipeline
stage the attention ranks TP x CP x DP are refolded as ETP x EP x EDP for the expert layers:

    world = TP * CP * DP * PP = ETP * EP * EDP * PP,  so  TP * CP * DP = ETP * EP * EDP
    (with ETP = TP this is D * C = M_E * D_E (docs/design.md, "Parallel Folding and DDP buckets"))

EP is the EP_MP axis (ranks holding different expert shards, exchanging token rows) and EDP
the EP_DP axis (replicas of one expert shard, reducing its gradients).

This module holds the FoldingMesh dataclass and its validation. The idea-sized pieces live in
  rank_groups.py      pure-math rank enumeration (Megatron's RankGenerator rule);
  megatron_groups.py  create / adopt Megatron's process groups (FoldingGroups);
  render.py           rank tables and the summary.
FoldingMesh's methods delegate to them.

Written against megatron-core 0.19.2: `parallel_state.initialize_model_parallel`,
`RankGenerator` and the group getters. Not modelled: the GTP weight-rematerialization axes
(gtp_remat_size, expert_gtp_remat_size must be 1), hierarchical / hybrid context parallelism,
rank_offset and local_world_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_ext.parallel.rank_groups import (  # noqa: F401  (re-exported)
    ATTENTION_KINDS,
    AXES,
    DEFAULT_ORDER,
    EXPERT_KIND_ALIASES,
    EXPERT_KINDS,
    axis_stride,
    rank_coordinates,
    rank_groups,
)
from megatron_ext.parallel.render import text_table  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from megatron_ext.parallel.megatron_groups import FoldingGroups

_AXIS_LABELS = {
    "attention": {"tp": "TP", "cp": "CP", "ep": "EP", "dp": "DP", "pp": "PP"},
    "expert": {"tp": "ETP", "cp": "CP", "ep": "EP", "dp": "EDP", "pp": "PP"},
}


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
    if "tp" not in tokens:
        raise ValueError(
            f"order {order!r} does not name 'tp': Megatron 0.19.2 inserts its gtp_remat axis into the order, then "
            f"finds 'tp' inside 'gtp_remat' and never adds the missing axis, so it cannot build the groups; name it "
            f"(e.g. {'tp-' + order!r}; at size 1 it changes no group)")
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
                f"(stride {axis_stride(self._attention_axes(), "pp")}) and experts "
                f"(stride {axis_stride(self._expert_axes(), "pp")}); both meshes must share PP groups "
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

    # ------------------------------------------------------------ delegates

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of parallel_state.initialize_model_parallel for this mesh."""
        from megatron_ext.parallel.megatron_groups import megatron_kwargs

        return megatron_kwargs(self)

    def create_groups(self, **initialize_kwargs) -> FoldingGroups:
        """Create Megatron's process groups for this mesh, or adopt matching existing ones
        (see megatron_groups.create_groups)."""
        from megatron_ext.parallel.megatron_groups import create_groups

        return create_groups(self, **initialize_kwargs)

    def describe(self) -> str:
        """One line per mesh with the sizes."""
        return (
            f"attention TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp}; "
            f"experts ETP {self.etp} x EP {self.ep} x EDP {self.edp} x PP {self.pp}; "
            f"world {self.world_size}, order {self.order}")

    def render_summary(self, gpus_per_node: int | None = None) -> str:
        """Sizes, the folding identity and each group kind (see render.render_summary)."""
        from megatron_ext.parallel.render import render_summary

        return render_summary(self, gpus_per_node)

    def render(self, stages: list[int] | None = None, gpus_per_node: int | None = None) -> str:
        """Both meshes as per-stage rank tables (see render.render_rank_tables)."""
        from megatron_ext.parallel.render import render_rank_tables

        return render_rank_tables(self, stages, gpus_per_node)


def __getattr__(name: str):
    """FoldingGroups moved to megatron_groups.py; keep `from ...folding import FoldingGroups`."""
    if name == "FoldingGroups":
        from megatron_ext.parallel.megatron_groups import FoldingGroups

        return FoldingGroups
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
