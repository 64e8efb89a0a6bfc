"""Regions and spill: one bounded-dropless arena shared by the MoE layers of a microbatch
(docs/design.md, "Dropless arena").

A bound per layer (moe/overflow.py) sizes every layer for the busiest load of any layer; the
layers of a microbatch do not peak together, so one budget shared by them needs less. But
torch._grouped_mm reads a layer's rows from row 0 of its input, so rows cannot start at a
device-side offset. Per microbatch and rank the arena is laid out as

    [ region 0 | region 1 | ... | region N-1 | shared area ]     (P rows each, then S rows)

Layer i reads its rows from its region's start (a host-known row) and may run on past P rows:
a non-last layer into region i+1 (the next layer has not written there yet in this forward),
the last layer into the shared area. A non-last layer's rows past P (its spill) are copied to
the shared area's end, growing down, once its experts have read them, and copied back before
its experts' backward (which runs after layer i+1's backward, the last reader of region i+1).
The last layer's run-on grows up from the shared area's start and stays in place. Every rank
computes every destination's spill cursor from the exchanged route counts, so the rows each
destination can take in a layer (P plus what is left of the run-on room and the shared area)
are known on the device everywhere, and the keep plan (moe/route_map.py) drops a route when
the destination's rows for the layer are spent: the microbatch's budget, or, for a layer before
the last, its region and the next one's (2P rows), whatever is left of the shared area (counted,
and an error at the next check with on_overflow="error", naming which bound to raise).

fc1's output, which the experts keep for their backward, comes from two grouped GEMMs on GPUs
(torch._grouped_mm has no out=): the rows below P stay in the first one's fresh tensor, held by
the experts' autograd node; the SwiGLU kernel stores the rows past P, as it reads them, into a
local fc1 arena of the shared area's rows (where the layer's token rows spill), and the backward
reads both parts in place (moe/arena_rows.py). The activation is written by that kernel straight
into a local activation arena of the token rows' layout (a layer's view runs on past P as its
token rows do; its spill follows fc2's forward) unless Megatron's moe_act recompute is on, in
which case it is recomputed in the backward as the per-layer path does.

Cost removed: per-layer worst cases; the arena holds N * P + S rows per microbatch for all N
layers. Cost accepted: spilled rows (token, activation) copied out and back, and the copies touch
the whole run-on room in their torch form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megatron_ext.kernels.row_span import copy_row_span
from megatron_ext.moe.arena_rows import ArenaRows
from megatron_ext.moe.buffers import SymmetricBuffer, poison, poison_then_fence, rows_with_values
from megatron_ext.moe.capacity import ROW_ALIGN, _round_up


@dataclass(frozen=True)
class ArenaLayout:
    """Rows of one microbatch's arena: `layers` regions of `region` rows, then `shared` rows."""

    layers: int
    region: int
    shared: int

    @property
    def rows(self) -> int:
        return self.layers * self.region + self.shared

    def is_last(self, index: int) -> bool:
        return index == self.layers - 1

    def run_on(self, index: int) -> int:
        """Rows layer `index` may place past its region (host bound; the device bound is tighter)."""
        return self.shared if self.is_last(index) else min(self.region, self.shared)

    def view_rows(self, index: int) -> int:
        """Rows of layer `index`'s buffer (its capacity C for the transport and the experts)."""
        return self.region + self.run_on(index)


def arena_layout(layers: int, max_tokens: int, topk: int, capacity_factor: float,
                 region_factor: float) -> ArenaLayout:
    """Regions of round_up(region_factor * T * K, 16) rows; the shared area takes the rest of
    `capacity_factor * T * K` rows per layer, summed over the `layers` layers."""
    if layers < 1:
        raise ValueError(f"the arena needs at least one MoE layer, got {layers}")
    if not 0 < region_factor <= capacity_factor:
        raise ValueError(f"arena_region_factor must be > 0 and <= capacity_factor ({capacity_factor}): the "
                         f"regions are part of the budget; got {region_factor}")
    balanced = max_tokens * topk
    region = _round_up(math.ceil(region_factor * balanced), ROW_ALIGN)
    total = _round_up(math.ceil(capacity_factor * balanced * layers), ROW_ALIGN)
    return ArenaLayout(layers, region, max(total - layers * region, 0))


@dataclass
class _Slot:
    """One live microbatch's storage: token rows and their probabilities (symmetric with the symm
    transport), fc1's rows past the regions (local, the shared area's rows) and the activations
    (local, the token rows' layout; only without moe_act recompute), both allocated at the
    experts' first forward, and the spill cursor."""

    rows: SymmetricBuffer
    cursors: torch.Tensor  # [N + 1, M] int64: row i, shared-area rows spilled at each destination before layer i
    starts: torch.Tensor  # [N] int64: layer i's spill start in this rank's shared area
    fc1: torch.Tensor | None = None
    act: torch.Tensor | None = None
    busy: bool = False
    next_layer: int = 0  # the layer whose forward comes next in this microbatch (RowArena.step_to)
    views: dict = field(default_factory=dict)  # layer index -> its SymmetricBuffer view of `rows` (RowArena.allocate)
    act_views: dict = field(default_factory=dict)  # layer index -> its [C, F] view of `act`
    spills: dict = field(default_factory=dict)  # (layer index, act kept) -> kernels/arena_spill.SpillArrays

    def __post_init__(self):  # views made once: indexing is a host call per use
        self.cursor_rows, self.start_views = self.cursors.unbind(0), self.starts.unbind(0)


class RowArena:
    """The arena of the MoE layers of one model chunk, `lease_slots` microbatches at a time.

    The first layer (index 0) opens a slot at its dispatch and frees it at its dispatch backward
    (the last of the microbatch), or at its combine when no backward runs; the other layers use
    the slot opened last. Every rank opens and frees in the same order.
    """

    def __init__(self, layers: int, capacity_factor: float, region_factor: float, lease_slots: int = 1,
                 poison: bool = False):
        self.layers, self.capacity_factor, self.region_factor = layers, capacity_factor, region_factor
        self.lease_slots, self.poison = lease_slots, poison
        self.layout: ArenaLayout | None = None
        self.slots: list[_Slot] = []
        self.current: _Slot | None = None
        self.world = self.rank = None
        self.fence = None  # set by allocate
        self.order_checked = True  # off while the graph runner warms up and captures (cuda_graphs/arena_slots.py)

    def configure(self, max_tokens: int, topk: int) -> None:
        """Size the layout from a layer's T_max and K (at its first forward; all layers must agree)."""
        layout = arena_layout(self.layers, max_tokens, topk, self.capacity_factor, self.region_factor)
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise ValueError(f"the MoE layers sharing an arena must have the same tokens per rank and top-k: "
                             f"{max_tokens} x {topk} sizes {layout}, the arena was sized {self.layout}")

    def allocate(self, heap, world: int, rank: int, width: int, dtype: torch.dtype, device,
                 return_ids: bool = False, fence=None) -> None:
        """Collective with `heap` (None: local tensors, for transports that own no symmetric memory).
        `return_ids`: each row's return id too (the symm transport's return_transfer="put").
        `fence`: the transport's barrier after a debug poison fill (buffers.poison_then_fence)."""
        if self.slots:
            rows = self.slots[0].rows.local
            if rows.shape[1] != width or rows.dtype != dtype:
                raise ValueError(f"the MoE arena holds rows of {rows.shape[1]} {rows.dtype}, a layer dispatched "
                                 f"{width} {dtype}: every layer sharing it must move the same rows")
            return
        self.world, self.rank, self.fence = world, rank, fence
        for _ in range(self.lease_slots):
            if heap is None:
                local = torch.empty(self.layout.rows, width, dtype=dtype, device=device)
                values = torch.empty(self.layout.rows, dtype=torch.float32, device=device)
                rows = SymmetricBuffer(local, _address_table(local), values=values, values_table=_address_table(values))
            else:
                rows = rows_with_values(heap, self.layout.rows, width, dtype, device, return_ids=return_ids)
            self.slots.append(_Slot(rows, torch.zeros(self.layers + 1, world, dtype=torch.int64, device=device),
                                    torch.zeros(self.layers, dtype=torch.int64, device=device),
                                    views={index: self._layer_view(rows, index) for index in range(self.layers)}))

    def _layer_view(self, rows: SymmetricBuffer, index: int) -> SymmetricBuffer:
        """Layer `index`'s view of a slot's rows (its region, then its run-on), made with the slot:
        the views' address tables are device adds, which a first use inside a CUDA-graph capture
        would leave unwritten until a replay (and for good, had the capture failed)."""
        start, count = index * self.layout.region, self.layout.view_rows(index)
        row_bytes = rows.local.shape[1] * rows.local.element_size()
        view = SymmetricBuffer(rows.local[start:start + count], rows.peer_table + start * row_bytes, rows.handle,
                               rows.values[start:start + count], rows.values_table + start * 4)
        if rows.return_ids is not None:
            view.return_ids = rows.return_ids[start:start + count]
            view.return_table = rows.return_table + start * 4
        return view

    def open(self) -> _Slot:
        free = [slot for slot in self.slots if not slot.busy]
        if not free:
            raise RuntimeError(f"all {len(self.slots)} MoE arena slot(s) hold a live microbatch (a forward ran "
                               f"again before the previous backward); raise --moe-ext-lease-slots "
                               f"(MoEExtConfig.lease_slots) to the number of microbatches in flight")
        slot = self.current = free[0]
        slot.busy, slot.next_layer = True, 0
        slot.cursor_rows[0].zero_()
        if self.poison:  # unwritten rows must never be read; fenced before peers PUT
            poison_then_fence(slot.rows, self.fence)
        return slot

    def step_to(self, slot: _Slot, index: int) -> None:
        """Layer `index` runs its forward in `slot`'s microbatch. A layer's cursor row is the one the
        layer before it wrote in this microbatch: a layer run out of order, twice or after a skipped
        one would read a stale cursor and place its rows over another layer's (host-side check)."""
        if self.order_checked and slot.next_layer != index:
            ran = f"after all {self.layers} layers had run" if slot.next_layer == self.layers else \
                f"where layer {slot.next_layer} was next"
            raise RuntimeError(f"MoE layer {index} of the dropless arena ran {ran} in this microbatch: the layers "
                               f"sharing an arena must each run once per microbatch, in model order (a model that "
                               f"skips, repeats or reorders its MoE layers cannot share one: turn off "
                               f"--moe-ext-dropless-arena)")
        slot.next_layer = index + 1

    def free(self, slot: _Slot) -> None:
        if slot.busy:
            slot.busy = False
            if self.poison:
                poison(slot.rows)
                for local in (slot.fc1, slot.act):
                    if local is not None:
                        local.fill_(float("nan"))


@dataclass(frozen=True)
class ArenaCursor:
    """A layer forward's place in its microbatch's spill cursor: what its keep plan reads (the
    rows each destination can take) and moves (every destination's spill, this rank's start).
    The fused route kernel does both in its launch (kernels/route_plan.py, ARENA); `capacities`
    and `advance` are the torch form around moe/route_map.route. The cursor before and after a
    layer are different rows of one array, so no reader of one sees the other's writes."""

    before: torch.Tensor  # [M] int64, shared-area rows spilled at each destination before this layer
    after: torch.Tensor  # [M] int64, the same after it (written by the plan)
    start: torch.Tensor  # [] int64, this layer's spill start in this rank's shared area (written by the plan)
    region: int  # P
    shared: int  # S
    run_on: int  # rows past P a layer may take at most: P before the last layer, S for it
    spills: bool  # rows past P move to the shared area (every layer but the last)
    rank: int
    world: int

    def capacities(self) -> torch.Tensor:
        """[M] rows each destination can take: P plus what is left of the run-on room and the area."""
        return (self.shared - self.before).clamp_(max=self.run_on).add_(self.region)

    def advance(self, kept_per_expert: torch.Tensor) -> None:
        """After the plan: the cursor moved by every destination's rows past P (from the kept rows
        per expert, [E], identical on every rank), and this rank's spill start."""
        if not self.spills:  # the last layer's run-on grows up from the area's start and stays
            self.after.copy_(self.before)
            self.start.zero_()
            return
        received = kept_per_expert.view(self.world, -1).sum(1, dtype=torch.int64)
        torch.add(self.before, (received - self.region).clamp_(min=0), out=self.after)
        self.start.copy_(self.shared - self.after[self.rank])


def _address_table(tensor: torch.Tensor) -> torch.Tensor:
    return torch.tensor([tensor.data_ptr()], dtype=torch.int64, device=tensor.device)


class ArenaLayer:
    """Layer `index`'s part of a RowArena: its capacities, its buffer, its spill."""

    def __init__(self, arena: RowArena, index: int):
        if not 0 <= index < arena.layers:
            raise ValueError(f"MoE layer index {index} is outside the arena's {arena.layers} layers")
        self.arena, self.index = arena, index
        self.forward_only = False  # set by each forward's begin_forward

    @property
    def layout(self) -> ArenaLayout:
        return self.arena.layout

    @property
    def capacity(self) -> int:
        return self.layout.view_rows(self.index)

    def begin_forward(self, dispatch_has_backward: bool) -> "ArenaCursor":
        """This forward's place in the cursor (no device work); layer 0 opens a slot first.
        `dispatch_has_backward`: the dispatched tokens or their router probabilities need gradients
        (layer 0's dispatch backward, which frees the slot, will run)."""
        arena = self.arena
        if self.index == 0:
            if torch.is_grad_enabled() and not dispatch_has_backward:
                raise RuntimeError(
                    "the dropless arena frees a microbatch's rows in the backward of the first MoE layer's "
                    "dispatch, and autograd would skip it: the dispatch needs no gradient. Give it one (the "
                    "rowwise dispatcher does, moe/dispatcher.py) or run this forward under torch.no_grad()")
            arena.open()
        slot, layout = arena.current, self.layout
        if slot is None or not slot.busy:
            raise RuntimeError(f"MoE layer {self.index} of the arena ran before layer 0 opened it for this "
                               f"microbatch: the arena's layers must run in their model order")
        arena.step_to(slot, self.index)
        # Whether a backward will follow, read here: the transport leases inside the dispatch node's
        # forward, where autograd has turned gradients off.
        self.forward_only = not torch.is_grad_enabled()
        return ArenaCursor(slot.cursor_rows[self.index], slot.cursor_rows[self.index + 1],
                           slot.start_views[self.index], layout.region, layout.shared, self.layout.run_on(self.index),
                           not layout.is_last(self.index), arena.rank, arena.world)

    def rows(self, cursor: "ArenaCursor") -> ArenaRows:
        """After the keep plan moved `cursor`: where this layer's rows past P live from now on."""
        return ArenaRows(self, self.arena.current, cursor.start)

    def lease(self) -> "ArenaLease":
        """The transport's slot: this layer's view of the open microbatch's rows."""
        return ArenaLease(self, self.arena.current, forward_only=self.forward_only)


@dataclass
class ArenaLease:
    """What a transport's dispatch holds (as a LeasePool lease). With a backward to come, layer 0's
    release (its dispatch backward, the microbatch's last) frees the slot; in a forward without
    one (evaluation), each layer releases at its combine and the last layer's frees it."""

    layer: ArenaLayer
    slot: _Slot
    forward_only: bool = False

    @property
    def buffer(self) -> SymmetricBuffer:
        return self.slot.views[self.layer.index]

    def release(self) -> None:
        last = self.layer.layout.is_last(self.layer.index)
        if (last if self.forward_only else self.layer.index == 0):
            self.layer.arena.free(self.slot)

    def place(self, rows: torch.Tensor, values: torch.Tensor, valid_rows: torch.Tensor) -> None:
        """Rows a transport received into a fresh [C, W] buffer -> this layer's arena view (the
        valid ones only: the last layer's view reaches into the shared area, where spills live)."""
        view = self.buffer
        copy_row_span(rows, view.local, valid_rows, values=(values, view.values))


def attach_arenas(model) -> list[RowArena]:
    """Give the rowwise MoE layers of `model` (a module or Megatron's list of model chunks) that run
    with dropless_arena one arena per model chunk, in module order (their forward order in a
    TransformerBlock). Idempotent: layers attached already keep their arena. Returns the new arenas."""
    arenas = []
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        dispatchers = [m.token_dispatcher for m in chunk.modules()
                       if getattr(getattr(m, "token_dispatcher", None), "ext_config", None) is not None
                       and m.token_dispatcher.ext_config.dropless_arena]
        if not dispatchers or all(d.arena_layer is not None for d in dispatchers):
            continue
        if any(d.arena_layer is not None or d.transport is not None for d in dispatchers):
            raise RuntimeError("attach_arenas: some MoE layers of this model ran or were attached already; attach "
                               "the arena once, before the first forward")
        config = dispatchers[0].ext_config
        if any(d.ext_config != config for d in dispatchers):
            raise ValueError("attach_arenas: the MoE layers sharing an arena must share their MoEExtConfig")
        arena = RowArena(len(dispatchers), config.capacity_factor, config.arena_region_factor,
                         config.lease_slots, config.debug_poison)
        for index, dispatcher in enumerate(dispatchers):
            dispatcher.arena_layer = ArenaLayer(arena, index)
        arenas.append(arena)
    return arenas
