"""Pure-math rank enumeration of an ordered mesh (no process groups, no torch).

Rule (Megatron 0.19.2's RankGenerator, re-derived here): the order lists the axes fastest
first; a rank is sum(coordinate * stride) where an axis' stride is the product of the sizes of
the axes before it. A group of kind "tp-ep" holds the ranks that differ only in their tp and
ep coordinates. Cost: none at run time; results are cached per (axes, kind), so planning a
1024-rank layout stays cheap.
"""

from __future__ import annotations

import functools

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

AxisSizes = tuple[tuple[str, int], ...]


def _offsets(axes: AxisSizes, strides: dict[str, int]) -> list[int]:
    """Every sum(coordinate * stride) over `axes`, the first axis varying fastest."""
    offsets = [0]
    for name, size in axes:
        offsets = [o + c * strides[name] for c in range(size) for o in offsets]
    return offsets


@functools.lru_cache(maxsize=256)
def _rank_groups(axis_sizes: AxisSizes, varying: frozenset[str]) -> tuple[tuple[int, ...], ...]:
    strides, stride = {}, 1
    for name, size in axis_sizes:
        strides[name] = stride
        stride *= size
    inside = tuple((n, s) for n, s in axis_sizes if n in varying)
    across = tuple((n, s) for n, s in axis_sizes if n not in varying)
    members = _offsets(inside, strides)
    return tuple(tuple(base + m for m in members) for base in _offsets(across, strides))


def rank_groups(axis_sizes: AxisSizes, varying: tuple[str, ...] | frozenset[str]) -> list[list[int]]:
    """Rank groups of an ordered mesh: ranks that differ only along the `varying` axes.

    Groups are listed with the other axes' coordinates varying first-axis-fastest and members
    likewise, which is the order of Megatron's RankGenerator.get_ranks.
    """
    names = [n for n, _ in axis_sizes]
    unknown = set(varying) - set(names)
    if unknown:
        raise ValueError(f"axes {sorted(unknown)} are not in the mesh axes {names}")
    return [list(g) for g in _rank_groups(tuple(axis_sizes), frozenset(varying))]


def rank_coordinates(axis_sizes: AxisSizes, rank: int) -> dict[str, int]:
    """The coordinate of `rank` on each axis (mixed radix, first axis fastest)."""
    coords = {}
    for name, size in axis_sizes:
        coords[name] = rank % size
        rank //= size
    return coords


def axis_stride(axis_sizes: AxisSizes, axis: str) -> int:
    """Stride of `axis`: the product of the sizes of the axes listed before it."""
    stride = 1
    for name, size in axis_sizes:
        if name == axis:
            return stride
        stride *= size
    return stride
