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
    with pytest.raises(RuntimeError, match="graph slot 1 of MoE layer 1 replays while another arena slot is current"):
        arena_slots.acquire(later, 1)  # the microbatch's slot is current but free: layer 0 did not open one
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
    with pytest.raises(RuntimeError, match="MoE layer 2 of the dropless arena ran where layer 1 was next"):
        arena_slots.acquire(ArenaLayer(arena, 2), 0)  # the order check is back on after the capture


def test_the_first_layer_captures_its_slots_in_order():
    arena, (first, *_) = _arena()
    with arena_slots.arena_untouched(first):
        for index in range(2):
            with arena_slots.capturing_slot(first, index):  # layer 0 opens the slots itself
                first.begin_forward(dispatch_has_backward=True)
                assert arena.current is arena.slots[index]
    assert arena.current is None and not any(slot.busy for slot in arena.slots)
    assert arena_slots.arena_of(torch.nn.Linear(1, 1)) is None


@pytest.mark.parametrize("order,message", [
    ((0, 2), "MoE layer 2 of the dropless arena ran where layer 1 was next"),
    ((0, 1, 1), "MoE layer 1 of the dropless arena ran where layer 2 was next"),
    ((0, 1, 2, 2), "MoE layer 2 of the dropless arena ran after all 3 layers had run")])
def test_layers_out_of_model_order_are_refused(order, message):
    """A layer's spill cursor is the row the layer before it wrote in this microbatch: a skipped,
    repeated or reordered layer would read a stale one (every rank alike) and place rows over
    another layer's. Eagerly and in replays, it stops at that layer's forward instead."""
    for replay in (False, True):
        arena, layers = _arena()
        *ran, wrong = order
        for index in ran:
            arena_slots.acquire(layers[index], 0) if replay else layers[index].begin_forward(True)
        with pytest.raises(RuntimeError, match=message):
            arena_slots.acquire(layers[wrong], 0) if replay else layers[wrong].begin_forward(True)
    arena, layers = _arena()
    for index in range(3):  # in order: accepted; a new microbatch starts at layer 0 again
        layers[index].begin_forward(True)
    arena.free(arena.current)
    layers[0].begin_forward(True)
    assert arena.current.next_layer == 1


def test_a_first_layer_forward_whose_dispatch_needs_no_gradient_is_refused():
    """The slot is freed in layer 0's dispatch backward; a forward that autograd would skip it in
    must not open one (the rowwise dispatcher gives such a dispatch a gradient first)."""
    arena, (first, *_) = _arena()
    with pytest.raises(RuntimeError, match="autograd would skip it"):
        first.begin_forward(dispatch_has_backward=False)
    assert not any(slot.busy for slot in arena.slots)
    with torch.no_grad():
        first.begin_forward(dispatch_has_backward=False)  # evaluation: freed at the last layer's combine
    assert arena.current.busy


def test_every_layers_view_of_every_slot_is_made_at_allocation():
    """The views' address tables are device adds: made lazily, a slot's first use inside a CUDA-graph
    capture left them unwritten until a replay, and for good when the capture failed and the layer
    went on eagerly (a review found it). They are made with the slots, eagerly, and a lease reads them."""
    arena, layers = _arena(slots=2, layers=3)
    layout, row_bytes = arena.layout, 8 * 4
    for slot in arena.slots:
        assert sorted(slot.views) == [0, 1, 2]
        for index, view in slot.views.items():
            start = index * layout.region
            assert view.local.data_ptr() == slot.rows.local[start].data_ptr()
            assert len(view.local) == layers[index].capacity == layout.view_rows(index)
            assert int(view.peer_table[0]) == int(slot.rows.peer_table[0]) + start * row_bytes
            assert int(view.values_table[0]) == slot.rows.values[start].data_ptr()
    arena_slots.acquire(layers[0], 1)
    assert layers[0].lease().buffer is arena.slots[1].views[0]


def test_arena_layout_never_has_a_negative_shared_area():
    """Regions round up to 16 rows each; a budget that rounds up once over all layers can be smaller
    than the regions together: the shared area is then empty, not negative."""
    from megatron_ext.moe.arena import ArenaLayout, arena_layout

    assert arena_layout(2, 1, 1, 1.0, 1.0) == ArenaLayout(2, 16, 0)


def test_layers_of_another_shape_cannot_share_an_arena():
    arena = RowArena(2, 2.0, 1.0)
    arena.configure(64, 2)
    arena.configure(64, 2)  # the same shape again: fine
    with pytest.raises(ValueError, match="must have the same tokens per rank and top-k"):
        arena.configure(32, 2)
