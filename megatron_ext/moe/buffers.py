"""Symmetric capacity buffers, shared scratch, and autograd-held leases (DESIGN 3.6).

A `SymmetricBuffer` is one [C, H] tensor per EP rank plus a device int64 table of every
rank's base address, so Triton kernels can store into / load from peers directly. With one
rank (EP=1) the table holds the local buffer only and nothing is exchanged.

Allocation is collective (torch.distributed._symmetric_memory.empty + rendezvous), so it
happens once per (group, shape, role), at the first forward, in the same order on every rank.
The dispatch buffer feeds the up-projection, whose saved input Wgrad reads in backward: it
comes from a `LeasePool` of slots, each held from the dispatch until its backward returns it.
Running out of slots raises (it never overwrites a live payload). Expert-output and gradient
exchange buffers are scratch, shared by all layers: every phase that reads them is fenced by
a device-side barrier after its writers, and every writer runs after the previous phase's
readers (both orders follow from the per-layer barrier sequence, see transport/symm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class SymmetricBuffer:
    local: torch.Tensor  # [C, H] this rank's buffer
    peer_table: torch.Tensor  # [M] int64 base addresses, on the device
    handle: object = None  # torch symmetric-memory handle (None with one rank)

    def barrier(self) -> None:
        """Device-side barrier over the EP group: all peers' prior writes are visible after it."""
        if self.handle is not None:
            self.handle.barrier(channel=0)


def allocate_symmetric(shape, dtype: torch.dtype, device: torch.device, group) -> SymmetricBuffer:
    """Collective on `group` (same order on every rank). Init time only: it synchronizes the host."""
    if group is None or dist.get_world_size(group) == 1:
        local = torch.empty(shape, dtype=dtype, device=device)
        return SymmetricBuffer(local, torch.tensor([local.data_ptr()], dtype=torch.int64, device=device))
    from torch.distributed import _symmetric_memory as symm_mem

    local = symm_mem.empty(*shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, group.group_name)
    table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    return SymmetricBuffer(local, table, handle)


_scratch: dict[tuple, SymmetricBuffer] = {}


def shared_scratch(role: str, shape, dtype, device, group) -> SymmetricBuffer:
    """One scratch buffer per (role, group, shape, dtype), shared by every layer."""
    key = (role, id(group), tuple(shape), dtype, str(device))
    if key not in _scratch:
        _scratch[key] = allocate_symmetric(shape, dtype, device, group)
    return _scratch[key]


@dataclass
class Lease:
    pool: "LeasePool"
    slot: int
    released: bool = False

    @property
    def buffer(self) -> SymmetricBuffer:
        return self.pool.slots[self.slot]

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._free(self.slot)


@dataclass
class LeasePool:
    """`num_slots` dispatch buffers of one layer; a slot is live from dispatch to its backward."""

    slots: list[SymmetricBuffer]
    poison: bool = False
    busy: list[bool] = field(default_factory=list)

    def __post_init__(self):
        self.busy = [False] * len(self.slots)

    def acquire(self) -> Lease:
        for slot, taken in enumerate(self.busy):
            if not taken:
                self.busy[slot] = True
                if self.poison:
                    self.slots[slot].local.fill_(float("nan"))  # unwritten rows must never be read
                return Lease(self, slot)
        raise RuntimeError(
            f"all {len(self.slots)} dispatch-buffer slot(s) of this MoE layer hold live microbatches "
            f"(forward ran again before the previous backward); raise --moe-ext-lease-slots "
            f"(MoEExtConfig.lease_slots) to the number of microbatches in flight per layer")

    def _free(self, slot: int) -> None:
        self.busy[slot] = False
        if self.poison:
            self.slots[slot].local.fill_(float("nan"))

    @property
    def live(self) -> int:
        return sum(self.busy)
