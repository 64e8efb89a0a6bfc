"""The graph runner's bookkeeping of the dropless arena (cuda_graphs/arena_slots.py), on CPU: which
arena slot a replay uses, and what a later layer's warm-up and capture leave untouched."""

import pytest
import torch

from megatron_ext.cuda_graphs import arena_slots
from megatron_ext.moe.arena import ArenaLayer, RowArena


def _arena(slots=2, layers=3):
    arena = RowArena(layers, 1.5, 1.0, lease_slots=slots)
    arena.configure(16, 2)
    arena.allocate(None, 2, 0, 8, torch.float32, "cpu")
    return arena, [ArenaLayer(arena, i) for i in range(layers)]


def test_replays_open_and_free_the_slot_of_their_graph_slot():
    arena, (first, later, _) = _arena()
    arena_slots.acquire(first, 1)
    assert arena.current is arena.slots[1] and arena.slots[1].busy and not arena.slots[0].busy
    arena_slots.acquire(later, 1)  # the later layers find their slot current
    with pytest.raises(RuntimeError, match="out of step"):
        arena_slots.acquire(later, 0)
    arena_slots.release(later, 1)
    assert arena.slots[1].busy  # only the first layer's backward frees the microbatch
    arena_slots.release(first, 1)
    assert not arena.slots[1].busy
    arena_slots.acquire(first, 1)
    with pytest.raises(RuntimeError, match="holds a live microbatch"):
        arena_slots.acquire(first, 1)


def test_a_later_layers_warm_up_and_capture_leave_the_live_microbatch_as_it_was():
    arena, (first, later, _) = _arena()
    arena_slots.acquire(first, 0)  # microbatch 0 is live, layer 0 ran
    live = arena.slots[0]
    live.cursors[1].copy_(torch.tensor([5, 7]))  # layer 0 spilled
    live.starts[0] = 4
    with arena_slots.arena_untouched(later):
        cursor = later.begin_forward(dispatch_has_backward=True)  # an eager warm-up step moves the cursor and its start
        cursor.advance(torch.tensor([20, 20, 0, 0], dtype=torch.int32))  # 40 rows to rank 0, 8 past P
        assert live.cursors[2].tolist() == [13, 7] and int(live.starts[1]) == arena.layout.shared - 13
        with arena_slots.capturing_slot(later, 1):  # graph slot 1 is captured against arena slot 1
            assert arena.current is arena.slots[1] and arena.slots[1].busy
            later.begin_forward(dispatch_has_backward=True)
        assert arena.current is arena.slots[0] and not arena.slots[1].busy
    assert arena.current is arena.slots[0] and arena.slots[0].busy and not arena.slots[1].busy
    assert live.cursors[1].tolist() == [5, 7] and live.cursors[2].tolist() == [0, 0]
    assert live.starts.tolist() == [4, 0, 0]


def test_the_first_layer_captures_its_slots_in_order():
    arena, (first, *_) = _arena()
    with arena_slots.arena_untouched(first):
        for index in range(2):
            with arena_slots.capturing_slot(first, index):  # layer 0 opens the slots itself
                first.begin_forward(dispatch_has_backward=True)
                assert arena.current is arena.slots[index]
    assert arena.current is None and not any(slot.busy for slot in arena.slots)
    assert arena_slots.arena_of(torch.nn.Linear(1, 1)) is None
