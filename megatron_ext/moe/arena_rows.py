"""One layer forward's rows in the dropless arena (moe/arena.py; docs/design.md, "Dropless arena"):
what the experts call to keep their inputs, fc1's output and the activation there and to read
them back.

A non-last layer's token rows past its region P (and their probabilities, and with
return_transfer="put" their return ids) are spilled to the shared area after fc1's GEMM read them
and restored before the experts' backward; fc1's rows are kept in the local fc1 arena, written by
the SwiGLU kernel as it reads them on GPUs (`fc1_place`) or copied on CPU (`keep_fc1`,
`restore_fc1`). Unless Megatron's moe_act recompute is on, the activation is written straight
into the local activation arena's view of the layer (`act_view`: its region, running on as the
token rows do), its rows past P spilled after fc2's GEMM read them (`keep_act`) and restored
before fc2's backward (`restore_act`). Every span is a device-sized `copy_row_span`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.kernels.row_span import copy_row_span
from megatron_ext.kernels.swiglu import RowPlace


@dataclass
class ArenaRows:
    """One layer forward's rows in the arena, handed to the experts (moe/expert_rows.RowGroups)."""

    layer: object  # moe/arena.ArenaLayer
    slot: object  # its microbatch's storage (moe/arena._Slot)
    start: torch.Tensor  # [] int64, the shared-area row of this layer's row P
    _fc1_spill: torch.Tensor | None = None  # [] int64, the fc1 arena's row of this layer's row P

    def keep_inputs(self, valid_rows: torch.Tensor) -> None:
        """After the experts' first read: a non-last layer's rows past P (and their probabilities)
        move to the shared area before the next layer's dispatch reuses region i+1."""
        if self.layer.layout.is_last(self.layer.index):
            return
        view, rows, region, shared = self.slot.views[self.layer.index], self.slot.rows, self.region, self.shared
        copy_row_span(view.local[region:], rows.local[shared], valid_rows - region, dst_start=self.start,
                      values=(view.values[region:], rows.values[shared]))
        if rows.return_ids is not None:  # return_transfer="put": the dispatch backward sends these rows back
            copy_row_span(view.return_ids[region:], rows.return_ids[shared], valid_rows - region, dst_start=self.start)

    def restore_inputs(self, valid_rows: torch.Tensor) -> None:
        """Before the experts' backward: the spilled rows and probabilities back after row P."""
        if self.layer.layout.is_last(self.layer.index):
            return
        view, rows, region, shared = self.slot.views[self.layer.index], self.slot.rows, self.region, self.shared
        copy_row_span(rows.local[shared], view.local[region:], valid_rows - region, src_start=self.start,
                      values=(rows.values[shared], view.values[region:]))
        if rows.return_ids is not None:
            copy_row_span(rows.return_ids[shared], view.return_ids[region:], valid_rows - region, src_start=self.start)

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
        start = self.layer.index * self.region
        return self._local_arena("act", width, dtype)[start:start + self.layer.capacity]

    def keep_act(self, valid_rows: torch.Tensor) -> None:
        """After fc2's forward GEMM read the activation: a non-last layer's rows past P to the
        activation arena's shared area (where its token rows spill), before the next layer writes
        its own activation over region i+1."""
        if self.layer.layout.is_last(self.layer.index):
            return
        act, region = self.slot.act, self.region
        view = self.act_view(act.shape[1], act.dtype)
        copy_row_span(view[region:], act[self.shared], valid_rows - region, dst_start=self.start)

    def restore_act(self, valid_rows: torch.Tensor) -> torch.Tensor:
        """Before fc2's backward GEMMs (after layer i+1's backward, the last reader of region i+1):
        the spilled activation rows back after row P; returns the layer's view."""
        act, region = self.slot.act, self.region
        view = self.act_view(act.shape[1], act.dtype)
        if not self.layer.layout.is_last(self.layer.index):
            copy_row_span(act[self.shared], view[region:], valid_rows - region, src_start=self.start)
        return view

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
        slot, layout = self.slot, self.layer.layout
        self._local_arena("fc1", width, dtype)
        if self._fc1_spill is None:
            self._fc1_spill = self.start + layout.layers * layout.region
        return RowPlace(slot.fc1, self.layer.index * self.region, self.region, self._fc1_spill)

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
