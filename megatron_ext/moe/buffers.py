"""Symmetric capacity buffers, shared scratch, and autograd-held leases (docs/design.md, "Buffers").

A `SymmetricBuffer` is one [C, H] tensor per EP rank plus a device int64 table of every
rank's base address, so Triton kernels can store into / load from peers directly. With one
rank (EP=1) the table holds the local buffer only and nothing is exchanged.

Allocation is collective (torch.distributed._symmetric_memory.empty + rendezvous), so it
happens once per (group, shape, role), at the first forward, in the same order on every rank.
A `SymmetricHeap` does the allocating; `TorchSymmetricHeap` is the real one, and tests run the
transport on simulated peers through another (megatron_ext.testing.threaded_peers).

The dispatch buffer feeds the up-projection, whose saved input Wgrad reads in backward: it
comes from a `LeasePool` of slots, each held from the dispatch until its backward returns it.
Running out of slots raises (it never overwrites a live payload). Expert-output and gradient
exchange buffers are scratch, shared by all layers: every phase that reads them is fenced by
a device-side barrier after its writers, and every writer runs after the previous phase's
readers (both orders follow from the per-layer barrier sequence; docs/design.md, "Ordering").

Debug poison (NaN fill of a buffer so that a stale row shows up) is itself a write into memory
that peers write too, so it is ordered like one: the owner fills, then barriers with the group,
and only then may a peer PUT into the buffer (`poison_then_fence`). Without the barrier a fast
peer's rows can land before the owner's fill and be wiped (found on two H200s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass
class SymmetricBuffer:
    local: torch.Tensor  # [C, H] this rank's buffer
    peer_table: torch.Tensor  # [M] int64 base addresses, on the device
    handle: object = None  # object with .barrier(channel=0) (None with one rank)
    values: torch.Tensor | None = None  # [C] fp32 per-row values (router probabilities), if any
    values_table: torch.Tensor | None = None  # [M] int64 base addresses of every rank's `values`
    return_ids: torch.Tensor | None = None  # [C] int32: where each row's result goes back (return_transfer="put")
    return_table: torch.Tensor | None = None  # [M] int64 base addresses of every rank's `return_ids`

    def barrier(self, timeout_ms: int = 0) -> None:
        """Device-side barrier over the EP group: all peers' prior writes are visible after it.
        With `timeout_ms` > 0 the barrier kernel traps after that long (a peer that never arrives)."""
        if self.handle is not None:
            self.handle.barrier(channel=0, timeout_ms=timeout_ms)


def poison(buffer: SymmetricBuffer) -> None:
    """NaN-fill this rank's rows and per-row values (debug: a read of an unwritten row shows)."""
    buffer.local.fill_(float("nan"))
    if buffer.values is not None:
        buffer.values.fill_(float("nan"))


def poison_then_fence(buffer: SymmetricBuffer, fence=None) -> None:
    """NaN-fill this rank's buffer, then barrier, so no peer's later PUT is wiped by the fill.
    `fence(buffer)`: the transport's barrier, bounded by its peer timeout and named to its watchdog."""
    poison(buffer)
    if fence is None:
        buffer.barrier()
    else:
        fence(buffer)


_VALUES_ALIGN = 16  # bytes: the value array starts 16-byte aligned after the rows


def rows_with_values(heap: "SymmetricHeap", capacity: int, width: int, dtype: torch.dtype, device,
                     scratch_role: str | None = None, return_ids: bool = False) -> SymmetricBuffer:
    """[C, width] rows of `dtype` and, in the same symmetric allocation after them, [C] fp32
    per-row values: the router probability of each dispatched row, or its gradient; with
    `return_ids`, then [C] int32 return ids (each row's source route, return_transfer="put").

    Cost removed: a second allocation, peer table and barrier for the values; a PUT or a copy
    that writes both is ordered for peers by the one barrier that orders the rows. Cost
    accepted: the rows are a view into a byte allocation (no storage of their own dtype).
    `scratch_role`: the heap's shared scratch of that role instead of a new allocation."""
    row_bytes = capacity * width * torch.empty((), dtype=dtype).element_size()
    values_at = -(-row_bytes // _VALUES_ALIGN) * _VALUES_ALIGN
    returns_at = values_at + -(-4 * capacity // _VALUES_ALIGN) * _VALUES_ALIGN
    shape = ((returns_at + 4 * capacity) if return_ids else (values_at + 4 * capacity),)
    raw = (heap.allocate(shape, torch.uint8, device) if scratch_role is None
           else heap.scratch(scratch_role, shape, torch.uint8, device))
    rows = raw.local[:row_bytes].view(dtype).view(capacity, width)
    values = raw.local[values_at:values_at + 4 * capacity].view(torch.float32)
    buffer = SymmetricBuffer(rows, raw.peer_table, raw.handle, values, raw.peer_table + values_at)
    if return_ids:
        buffer.return_ids = raw.local[returns_at:].view(torch.int32)
        buffer.return_table = raw.peer_table + returns_at
    return buffer


class SymmetricHeap(Protocol):
    """Collective allocator of one EP group: every rank calls in the same order."""

    def allocate(self, shape, dtype: torch.dtype, device: torch.device) -> SymmetricBuffer: ...

    def scratch(self, role: str, shape, dtype: torch.dtype, device: torch.device) -> SymmetricBuffer: ...


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


@dataclass(frozen=True)
class TorchSymmetricHeap:
    """torch symmetric memory over `group` (None: one rank, plain local tensors)."""

    group: object = None

    def allocate(self, shape, dtype, device) -> SymmetricBuffer:
        return allocate_symmetric(shape, dtype, device, self.group)

    def scratch(self, role, shape, dtype, device) -> SymmetricBuffer:
        return shared_scratch(role, shape, dtype, device, self.group)


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
    """`num_slots` dispatch buffers of one layer; a slot is live from dispatch to its backward.

    Every rank acquires and frees in the same order (one schedule per EP group), so slot i of
    one rank pairs with slot i of its peers. A peer's PUT into slot i of the next microbatch is
    ordered after this rank's last read of slot i by the dispatch-backward barrier.
    """

    slots: list[SymmetricBuffer]
    poison: bool = False
    busy: list[bool] = field(default_factory=list)
    fence: object = None  # the poison fill's barrier (poison_then_fence)

    def __post_init__(self):
        self.busy = [False] * len(self.slots)

    def acquire(self, slot: int | None = None) -> Lease:
        """The first free slot (or `slot`, which must be free). With poison: fill, then fence."""
        free = [i for i, taken in enumerate(self.busy) if not taken]
        if slot is None and free:
            slot = free[0]
        if slot is None or slot not in free:
            what = (f"dispatch-buffer slot {slot} of this MoE layer holds" if slot is not None
                    else f"all {len(self.slots)} dispatch-buffer slot(s) of this MoE layer hold")
            raise RuntimeError(
                f"{what} a live microbatch (forward ran again before the previous backward); raise "
                f"--moe-ext-lease-slots (MoEExtConfig.lease_slots) to the number of microbatches in flight per layer")
        self.busy[slot] = True
        if self.poison:
            poison_then_fence(self.slots[slot], self.fence)  # unwritten rows must never be read
        return Lease(self, slot)

    def _free(self, slot: int) -> None:
        # The next acquire of this slot poisons (and fences) again before any peer writes it.
        # Filling here as well marks rows read after their release; it cannot wipe a peer's
        # next rows: they follow the peer's acquire fence, which this rank reaches after this.
        self.busy[slot] = False
        if self.poison:
            poison(self.slots[slot])

    def release_all(self) -> None:
        """Free every slot: only when no microbatch is live (after a failed graph capture)."""
        for slot, taken in enumerate(self.busy):
            if taken:
                self._free(slot)

    @property
    def live(self) -> int:
        return sum(self.busy)
