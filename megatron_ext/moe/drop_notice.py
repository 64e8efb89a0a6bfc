"""Saying, once per process, that the rowwise layers may drop routes Megatron's layer would keep.

With `on_overflow='drop'` and a capacity factor below EP, routes beyond a rank's capacity are
dropped and counted (`RowwiseMoELayer.read_metrics`). Under megatron.training the launcher says so
at start-up in its flags' words and prints the count at each logging interval; a layer built for a
training loop of one's own says so when it is built, in the config's words, so that the drops are
never silent. Once per process: a model has many MoE layers, and the launcher's notice counts.
"""

from __future__ import annotations

import logging

import torch

_given = False


def drops_beyond_capacity(ext_config, ep_size: int) -> bool:
    """The capacity is below the worst case (a factor of EP or more is dropless: moe/capacity.py)."""
    return ext_config.drops_routes and ext_config.capacity_factor < ep_size


def mark_given() -> None:
    """The launcher printed its own notice."""
    global _given
    _given = True


def give_for_layer(ext_config, ep_size: int) -> None:
    """A WARNING on global rank 0, at the first such layer built in this process."""
    global _given
    if _given or not drops_beyond_capacity(ext_config, ep_size):
        return
    _given = True
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    logging.getLogger("megatron_ext").warning(
        "megatron_ext: the rowwise MoE layers hold capacity_factor %g x the balanced load per destination rank "
        "(EP %d) and drop the routes beyond it (Megatron's own layer would keep them); "
        "layer.read_metrics()['dropped_routes'] counts them. To drop none: MoEExtConfig(dropless_arena=True) "
        "(bounded) or MoEExtConfig(dropless=True) (worst-case buffers)", ext_config.capacity_factor, ep_size)
