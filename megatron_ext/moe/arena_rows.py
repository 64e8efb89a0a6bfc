"""One layer forward's rows in the dropless arena (moe/arena.py; docs/design.md, "Dropless arena"):
what the experts call to keep their inputs, fc1's output and the activation there and to read
them back.

fc1's rows below P stay in the fresh tensor its first grouped GEMM wrote (moe/expert_mlp.py), the
rows past P go to the local fc1 arena's shared area, where the layer's spill goes, stored by the
SwiGLU kernel as it reads them (`fc1_kept`: the two parts as one RowPlace). Unless Megatron's
moe_act recompute is on, the activation is written straight into the local activation arena's
view of the layer (`act_view`: its region, running on as the token rows do). After the experts'
forward a non-last layer's token rows past its region P, their probabilities, their return ids
(return_transfer="put") and its activation rows past P move to the shared area in one launch
(`spill`, kernels/arena_spill.py) and come back before the experts' backward (`restore`). Every
span is device-sized: no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.kernels.arena_spill import SpillArrays, move_spill
from megatron_ext.kernels.swiglu import RowPlace


@dataclass
class ArenaRows:
    """One layer forward's rows in the arena, handed to the experts (moe/expert_rows.RowGroups)."""

    layer: object  # moe/arena.ArenaLayer
    slot: object  # its microbatch's storage (moe/arena._Slot)
    start: torch.Tensor  # [] int64, the shared-area row of this layer's row P

    def spill(self, valid_rows: torch.Tensor) -> None:
        """After the experts' forward (fc1 read the rows, fc2 the activation): a non-last layer's
        rows past P, their probabilities, return ids (return_transfer="put") and kept activations
        move to the shared area, before the next layer's dispatch and experts reuse region i+1."""
        if not self.layer.layout.is_last(self.layer.index):
            move_spill(self._spill_arrays(), valid_rows, self.region, self.start)

    def restore(self, valid_rows: torch.Tensor) -> None:
        """Before the experts' backward (after layer i+1's, the last reader of region i+1): what
        `spill` moved, back after row P."""
        if not self.layer.layout.is_last(self.layer.index):
            move_spill(self._spill_arrays(), valid_rows, self.region, self.start, restore=True)

    def _spill_arrays(self) -> SpillArrays:
        """This layer's views and the shared area's rows, built once per slot and layer."""
        slot, index = self.slot, self.layer.index
        key = (index, slot.act is not None)
        if key not in slot.spills:
            view, rows, shared = slot.views[index], slot.rows, self.shared
            act = None if slot.act is None else self.act_view(slot.act.shape[1], slot.act.dtype)
            ids = rows.return_ids is not None  # return_transfer="put": the dispatch backward sends these rows back
            slot.spills[key] = SpillArrays(view.local, rows.local[shared], view.values, rows.values[shared],
                                           view.return_ids if ids else None, rows.return_ids[shared] if ids else None,
                                           act, None if act is None else slot.act[shared])
        return slot.spills[key]

    def _local_arena(self, kind: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot's local arena of `kind` ("fc1": the shared area's rows; "act": the token rows'
        layout), allocated at the experts' first forward that needs it."""
        slot = self.slot
        arena = getattr(slot, kind)
        if arena is None:
            arena = torch.empty(rows, width, dtype=dtype, device=slot.rows.local.device)
            setattr(slot, kind, arena)
        elif arena.shape[1] != width or arena.dtype != dtype:
            raise ValueError(f"the MoE arena keeps {kind} rows of {arena.shape[1]} {arena.dtype}, a layer made "
                             f"{width} {dtype}: the arena's layers must share expert sizes")
        return arena

    def act_view(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This layer's [C, F] activation rows in the activation arena: its region, then the run-on
        (region i+1, or the shared area's start for the last layer), as the token rows' view."""
        slot, index = self.slot, self.layer.index
        if index not in slot.act_views:
            start = index * self.region
            act = self._local_arena("act", self.layer.layout.rows, width, dtype)
            slot.act_views[index] = act[start:start + self.layer.capacity]
        return slot.act_views[index]

    def fc1_kept(self, region_rows: torch.Tensor) -> RowPlace:
        """Where this layer's fc1 rows are kept: below P in `region_rows` (the fresh [P, F'] output of
        fc1's first GEMM, held by the experts' autograd node), past P in the fc1 arena's shared area
        from the layer's spill start on."""
        layout = self.layer.layout
        shared = self._local_arena("fc1", layout.shared, region_rows.shape[1], region_rows.dtype)
        return RowPlace(region_rows, shared, self.start)

    @property
    def region(self) -> int:
        return self.layer.layout.region

    @property
    def shared(self) -> slice:
        layout = self.layer.layout
        return slice(layout.layers * layout.region, layout.rows)
