"""The graph runner's side of the dropless arena (moe/arena.py; docs/design.md, "Dropless arena").

A replay runs no Python, so the arena's host-side state (which slot is open, which is current)
is kept by the runner: graph slot k of every layer reads and writes arena slot k (layer 0's
captured forward opened it, its captured backward freed it). Layer 0's replay marks slot k open
and current, its backward replay marks it free; the other layers check that the current slot is
theirs. Every layer after the first is warmed up and captured while a microbatch is live in the
arena (at the first training forward): its eager warm-up would move that microbatch's spill
cursor, so the arena's slots, current slot and cursors are saved before and put back after,
and each graph slot k is captured with arena slot k current.
"""

from __future__ import annotations

import contextlib


def arena_of(layer):
    """The layer's moe/arena.ArenaLayer, or None."""
    return getattr(getattr(layer, "token_dispatcher", None), "arena_layer", None)


@contextlib.contextmanager
def arena_untouched(arena_layer):
    """Warm-up and capture: the arena's slots, current slot and cursors as before, afterwards."""
    if arena_layer is None or not arena_layer.arena.slots:
        yield
        return
    arena = arena_layer.arena
    current, busy = arena.current, [(slot.busy, slot.next_layer) for slot in arena.slots]
    cursors = [(slot.cursors.clone(), slot.starts.clone()) for slot in arena.slots]
    arena.order_checked = False  # warm-up repeats the layer's forward; capture runs it in other slots
    try:
        yield
    finally:
        arena.current, arena.order_checked = current, True
        for slot, (was_busy, next_layer), (cursor, starts) in zip(arena.slots, busy, cursors):
            slot.busy, slot.next_layer = was_busy, next_layer
            slot.cursors.copy_(cursor)
            slot.starts.copy_(starts)


@contextlib.contextmanager
def capturing_slot(arena_layer, index: int):
    """Capture graph slot `index` of a layer after the first with arena slot `index` current
    (layer 0's capture opens the slots itself, in order)."""
    if arena_layer is None or arena_layer.index == 0:
        yield
        return
    arena = arena_layer.arena
    slot = arena.slots[index]
    current, busy = arena.current, slot.busy
    arena.current, slot.busy = slot, True
    try:
        yield
    finally:
        arena.current, slot.busy = current, busy


def acquire(arena_layer, index: int) -> None:
    """Before graph slot `index`'s forward replay."""
    if arena_layer is None:
        return
    arena = arena_layer.arena
    slot = arena.slots[index]
    if arena_layer.index == 0:
        if slot.busy:
            raise RuntimeError(f"arena slot {index} holds a live microbatch, but graph slot {index} of the first MoE "
                               f"layer is free: the arena and the layer's graphs went out of step (an eager forward "
                               f"of the arena's layers whose backward has not run, e.g. evaluation with gradients "
                               f"on: run it under torch.no_grad(), or finish its backward before the next step)")
        slot.busy, slot.next_layer, arena.current = True, 0, slot
    elif arena.current is not slot or not slot.busy:
        raise RuntimeError(f"graph slot {index} of MoE layer {arena_layer.index} replays while another arena slot is "
                           f"current: the layers' graph slots went out of step (every layer must run every "
                           f"microbatch, in model order: a model that skips or reorders MoE layers cannot share "
                           f"one arena under --moe-ext-cuda-graphs)")
    arena.step_to(slot, arena_layer.index)


def release(arena_layer, index: int) -> None:
    """After graph slot `index`'s backward replay (layer 0's frees the microbatch's slot)."""
    if arena_layer is not None and arena_layer.index == 0:
        arena_layer.arena.slots[index].busy = False
