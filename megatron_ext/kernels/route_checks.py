"""Argument checks of the route-map kernels (route_plan.py): the kernels index the routing map,
the probabilities, the histograms and the gathered counts by raw offsets, so a tensor of another
shape would be read past its end or half read, without an error. Each check says what is wrong
and what to pass; a layout that passed once is remembered (row_checks.VALIDATED), so the
per-layer call pays a tuple lookup.
"""

from __future__ import annotations

import torch

from megatron_ext.kernels.row_checks import VALIDATED, layout, require


def _experts_of(op: str, routing_map: torch.Tensor, topk: int) -> int:
    """The routing map's expert count E, after checking the map is [T, E] and 1 <= topk <= E."""
    require(routing_map.dim() == 2, f"{op}: routing_map must be [T, E], got shape {tuple(routing_map.shape)}")
    num_experts = routing_map.shape[1]
    require(isinstance(topk, int) and 1 <= topk <= num_experts,
            f"{op}: topk must be an int in [1, {num_experts}] (the number of experts), got {topk!r}")
    return num_experts


def check_selection(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> None:
    """select_routes' arguments: a [T, E] routing map, [T, E] floating probabilities on its device,
    1 <= topk <= E."""
    key = ("select_routes", layout(routing_map), layout(probs), topk)
    if key in VALIDATED:
        return
    _experts_of("select_routes", routing_map, topk)
    require(probs.shape == routing_map.shape,
            f"select_routes: probs must have the routing map's shape {tuple(routing_map.shape)}, got "
            f"{tuple(probs.shape)} (the router's [T, E] probabilities, not its top-k values)")
    require(probs.is_floating_point(), f"select_routes: probs must be floating point, got {probs.dtype}", TypeError)
    require(probs.device == routing_map.device,
            f"select_routes: probs are on {probs.device}, the routing map on {routing_map.device}; keep both on one")
    VALIDATED.add(key)


def check_plan_inputs(routing_map: torch.Tensor, hist: torch.Tensor, nonfinite: torch.Tensor,
                      requested_all: torch.Tensor, topk: int, dest_capacity: torch.Tensor | None) -> None:
    """plan_and_place's arguments: the [T, E] routing map, its int32 block histograms (one per
    BLOCK_TOKENS tokens) and [] int32 non-finite count (select_routes' outputs), the gathered
    [M, E] integer counts, [M] dest_capacity if given, all on the routing map's device."""
    key = ("plan_and_place", layout(routing_map), layout(hist), layout(nonfinite), layout(requested_all), topk,
           layout(dest_capacity))
    if key in VALIDATED:
        return
    from megatron_ext.kernels.route_plan import BLOCK_TOKENS  # the kernels' module imports this one

    num_experts = _experts_of("plan_and_place", routing_map, topk)
    blocks = -(-routing_map.shape[0] // BLOCK_TOKENS)
    require(hist.dtype == torch.int32 and hist.shape == (blocks, num_experts),
            f"plan_and_place: hist must be select_routes' int32 [{blocks}, {num_experts}] block histograms, got "
            f"{hist.dtype} {tuple(hist.shape)}")
    require(nonfinite.dtype == torch.int32 and nonfinite.numel() == 1,
            f"plan_and_place: nonfinite must be select_routes' int32 count (one element), got {nonfinite.dtype} "
            f"of {nonfinite.numel()} elements")
    require(requested_all.dim() == 2 and requested_all.shape[1] == num_experts and requested_all.shape[0] >= 1
            and not requested_all.is_floating_point(),
            f"plan_and_place: requested_all must be the EP group's integer [M, {num_experts}] counts, got "
            f"{requested_all.dtype} {tuple(requested_all.shape)}")
    ranks = requested_all.shape[0]
    if dest_capacity is not None:
        require(dest_capacity.shape == (ranks,) and not dest_capacity.is_floating_point(),
                f"plan_and_place: dest_capacity must be integer rows per destination, [{ranks}], got "
                f"{dest_capacity.dtype} {tuple(dest_capacity.shape)}")
    tables = {"hist": hist, "nonfinite": nonfinite, "requested_all": requested_all, "dest_capacity": dest_capacity}
    for name, t in tables.items():
        if t is not None:
            require(t.device == routing_map.device,
                    f"plan_and_place: {name} is on {t.device}, the routing map on {routing_map.device}; keep all "
                    f"on one device")
    VALIDATED.add(key)
