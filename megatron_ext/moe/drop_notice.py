"""Saying, once per process, that the rowwise layers may drop routes Megatron's layer would keep.

With `on_overflow='drop'` and a capacity factor below EP, or the dropless arena's budget spent,
routes are dropped and counted (`RowwiseMoELayer.read_metrics`). Under megatron.training the
launcher says so at start-up in its flags' words and the training hook prints the count at each
logging interval; a layer built for a training loop of one's own says so when it is built, in
the config's words, so that the drops are never silent. All three share the wording
(`what_is_held`, `how_to_drop_none`). Once per process: a model has many MoE layers, and the
launcher's notice counts.
"""

from __future__ import annotations

import logging

import torch

_given = False


def drops_beyond_capacity(ext_config, ep_size: int) -> bool:
    """Routes may be dropped: the per-layer capacity is below the worst case (a factor of EP or more
    is dropless: moe/capacity.py), or the dropless arena's budget drops instead of stopping."""
    return ext_config.drops_routes and (ext_config.dropless_arena or ext_config.capacity_factor < ep_size)


def config_words(field: str, value=None) -> str:
    """A setting as the Python API spells it: `capacity_factor=1.25`, or the field alone."""
    return field if value is None else f"{field}={value!r}"


def what_is_held(ext_config, spell=config_words, ep_size: int | None = None) -> str:
    """What bounds the rows a layer keeps, with each setting spelled by `spell(field, value)`."""
    factor = spell("capacity_factor", ext_config.capacity_factor)
    if ext_config.dropless_arena:
        return (f"their dropless arena holds {factor} x the balanced load per MoE layer, summed over a microbatch's "
                f"layers, and with {spell('on_overflow', 'drop')} drops the routes beyond it")
    ep = f" (EP {ep_size})" if ep_size else ""
    return f"their buffers hold {factor} x the balanced load per destination rank{ep} and drop the routes beyond it"


def how_to_drop_none(ext_config, spell=config_words) -> str:
    """The settings that stop the drops (not the arena to a run already on it)."""
    if ext_config.dropless_arena:
        return (f"To stop with an error instead: {spell('on_overflow', 'error')} (the arena's default). To drop none "
                f"at any load: {spell('dropless', True)} in place of the arena (worst-case buffers)")
    arena = spell("dropless_arena", True)
    if ext_config.on_overflow == "drop":  # the arena would keep this policy and drop beyond its budget
        arena += f" with {spell('on_overflow', 'auto')}"
    return (f"To drop none: {arena} (bounded; stops with an error if its budget is exceeded) or "
            f"{spell('dropless', True)} (worst-case buffers). To drop fewer: raise {spell('capacity_factor')}")


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
        "megatron_ext: the rowwise MoE layers may drop routes Megatron's own layer would keep: %s; "
        "layer.read_metrics()['dropped_routes'] counts them. %s", what_is_held(ext_config, ep_size=ep_size),
        how_to_drop_none(ext_config))
