"""One layer forward's rows in the dropless arena (moe/arena.py; docs/design.md, "Dropless arena"):
what the experts call to keep their inputs, fc1's output and the activation there and to read
them back.

fc1's rows are kept in the local fc1 arena, written by the SwiGLU kernel as it reads them on GPUs
(`fc1_place`: rows past P go straight to where the layer's spill goes) or copied on CPU
(`keep_fc1`, `restore_fc1`). Unless Megatron's moe_act recompute is on, the activation is written
straight into the local activation arena's view of the layer (`act_view`: its region, running on
as the token rows do). After the experts' forward a non-last layer's token rows past its region P,
their probabilities, their return ids (return_transfer="put") and its activation rows past P
move to the shared area in one launch (`spill`, kernels/arena_spill.py) and come back before the
experts' backward (`restore`). Every span is device-sized: no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.kernels.arena_spill import SpillArrays, move_spill
from megatron_ext.kernels.row_span import copy_row_span
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

    def _local_arena(self, kind: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot's local arena of `kind` ("fc1" or "act"; allocated at the experts' first forward
        that needs it), laid out as the token rows."""
        slot = self.slot
        arena = getattr(slot, kind)
        if arena is None:
            arena = torch.empty(self.layer.layout.rows, width, dtype=dtype, device=slot.rows.local.device)
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
            slot.act_views[index] = self._local_arena("act", width, dtype)[start:start + self.layer.capacity]
        return slot.act_views[index]

    def keep_fc1(self, fc1_out: torch.Tensor, valid_rows: torch.Tensor) -> None:
        """fc1's output [C, F'] -> the local fc1 arena (same layout as the rows): rows below P to
        the layer's region, the rest where its spill goes (the torch form of the SwiGLU kernel's
        `save_to`)."""
        slot = self.slot
        self._local_arena("fc1", fc1_out.shape[1], fc1_out.dtype)
        region = self.region
        copy_row_span(fc1_out[:region], slot.fc1[self._region_rows], valid_rows)
        copy_row_span(fc1_out[region:], slot.fc1[self.shared], valid_rows - region, dst_start=self.start)

    def fc1_place(self, width: int, dtype: torch.dtype) -> RowPlace:
        """Where this layer's fc1 rows live in the fc1 arena, for the SwiGLU kernels to write and read
        in place (CUDA; kernels/swiglu.py)."""
        layout = self.layer.layout
        fc1 = self._local_arena("fc1", width, dtype)
        return RowPlace(fc1, self.layer.index * self.region, self.region, self.start, layout.layers * layout.region)

    def restore_fc1(self, valid_rows: torch.Tensor) -> torch.Tensor:
        """A fresh [C, F'] fc1 output, valid below the layer's received rows."""
        fc1, region = self.slot.fc1, self.region
        out = fc1.new_empty(self.layer.capacity, fc1.shape[1])
        copy_row_span(fc1[self._region_rows], out[:region], valid_rows)
        copy_row_span(fc1[self.shared], out[region:], valid_rows - region, src_start=self.start)
        return out

    @property
    def region(self) -> int:
        return self.layer.layout.region

    @property
    def shared(self) -> slice:
        layout = self.layer.layout
        return slice(layout.layers * layout.region, layout.rows)

    @property
    def _region_rows(self) -> slice:
        return slice(self.layer.index * self.region, (self.layer.index + 1) * self.region)
