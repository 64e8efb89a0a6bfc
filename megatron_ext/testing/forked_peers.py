"""Simulated EP ranks as forked processes sharing one CPU pool as "symmetric memory".

`threaded_peers` runs the transport's kernels on threads of one process, which cannot hold
separate Megatron parallel states: it tests the transport, not the layer. Here every rank is a
real gloo process (megatron_ext.cpu_ranks.run_on_ranks) with its own Megatron state, so the
whole RowwiseMoELayer (router, dispatcher, autograd, experts) runs over the symm transport at
EP > 1, its Triton kernels under TRITON_INTERPRET=1 storing into peers for real.

How: the parent allocates one shared-memory pool (`share_memory_`, mapped MAP_SHARED) before
it forks the ranks, so every child sees every rank's region at the same address. A rank's
heap hands out its region's bytes by call order (every rank allocates in the same order, as
with torch symmetric memory; a shared ledger checks that they agree), and a peer table holds
the same offset in every rank's region. The pool starts as 0xFF bytes (NaN in float rows, -1 in
integer ones), not zeros: symmetric memory on GPUs starts uninitialized, and a row no one wrote
must not pass for a dropped route's zero. A barrier is a multiprocessing.Barrier over the ranks,
which checks that all of them barrier on the same allocation. Processes run their kernels
concurrently, as GPUs do: the only cross-rank order is the barrier, the contract the GPU
transport relies on. The row kernels use no atomics on peer memory (the interpreter's are
atomic within one process only).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import zlib

import torch

from megatron_ext.moe.buffers import SymmetricBuffer
from megatron_ext.testing.threaded_peers import (PeerBarrier, ScratchByRole, around_kernels, check_same_allocation,
                                                 wait_until_parked)

_ALIGN = 256  # bytes between allocations, as a GPU allocator would align them
_LEDGER_ENTRIES = 4096


class ForkedPeers:
    """Create in the parent before `run_on_ranks`; each rank then runs its work through `run_rank`."""

    def __init__(self, world: int, bytes_per_rank: int = 4 << 20, timeout_s: float = 60.0):
        ctx = mp.get_context("fork")
        self.world, self.bytes_per_rank, self.timeout_s = world, bytes_per_rank, timeout_s
        self.pool = torch.full((world * bytes_per_rank,), 0xFF, dtype=torch.uint8).share_memory_()
        # The bookkeeping lives in plain shared arrays, not tensors: a sync audit in the layer counts
        # host reads of tensors, and the simulation's own must not count as the layer's.
        # allocation i: its offset, bytes and a checksum of its shape and dtype at [3i, 3i + 3)
        self.ledger = ctx.RawArray("q", [-1] * (3 * _LEDGER_ENTRIES))
        self.arriving = ctx.RawArray("q", [-1] * world)  # the allocation each rank barriers on
        self.finished = ctx.RawValue("q", 0)  # ranks done (or failed)
        self._ledger_lock = ctx.Lock()
        self._barrier = ctx.Barrier(world, action=lambda: check_same_allocation(self.arriving), timeout=timeout_s)

    def run_rank(self, rank: int, fn, *args, late_rank: int | None = None):
        """In forked rank `rank`: `fn(heap, *args)` with the layer's symm transports on this rank's heap
        (`use_forked_heap`). `late_rank`: that rank, before each of the transport's kernels and after
        each barrier, waits until its peers are parked at a barrier or done, so they run ahead as far
        as the barriers let them (and in no other wait: a gloo collective between barriers would hold
        them, so callers run such collectives before or after the late rank's symm work). A failure
        breaks the barrier, so peers fail at once instead of at its timeout."""
        late = rank == late_rank
        heap = ForkedHeap(self, rank, self.wait_until_peers_parked if late else None)
        use_forked_heap(heap)
        if late:
            from megatron_ext.moe.transport import symm

            around_kernels(symm, lambda: _after_parked(self))
        try:
            return fn(heap, *args)
        except BaseException:
            self._barrier.abort()
            raise
        finally:
            with self._ledger_lock:
                self.finished.value += 1

    def wait_until_peers_parked(self) -> None:
        wait_until_parked(self._barrier, lambda: self.finished.value, self.world, self.timeout_s)

    def _agree(self, index: int, offset: int, nbytes: int, shape, dtype) -> None:
        """Every rank's allocation `index` is the same (offset, bytes, shape and dtype) as the first's."""
        if index >= _LEDGER_ENTRIES:
            raise RuntimeError(f"more than {_LEDGER_ENTRIES} symmetric allocations on forked ranks")
        mine = [offset, nbytes, zlib.crc32(repr((tuple(shape), str(dtype))).encode())]
        with self._ledger_lock:
            entry = self.ledger[3 * index: 3 * index + 3]
            if entry[0] < 0:
                self.ledger[3 * index: 3 * index + 3] = mine
            elif entry != mine:
                raise RuntimeError(f"forked ranks allocated out of order: allocation {index} (offset {offset}, "
                                   f"{tuple(shape)} {dtype} here) differs from another rank's (offset {entry[0]}, "
                                   f"{entry[1]} bytes)")


class ForkedHeap(ScratchByRole):
    """SymmetricHeap of one forked rank: bump allocation in its region of the shared pool."""

    def __init__(self, peers: ForkedPeers, rank: int, after_barrier=None):
        self.peers, self.rank, self._after_barrier = peers, rank, after_barrier
        self._count, self._cursor = 0, 0
        self._scratch: dict[tuple, SymmetricBuffer] = {}
        self.barriers_passed = 0
        self._lock = threading.Lock()  # the autograd thread allocates too

    @property
    def bytes_used(self) -> int:
        return self._cursor

    def _passed(self) -> None:
        self.barriers_passed += 1
        if self._after_barrier is not None:
            self._after_barrier()

    def allocate(self, shape, dtype, device) -> SymmetricBuffer:
        if torch.device(device).type != "cpu":
            raise ValueError("forked peers live on the CPU")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            index, offset = self._count, self._cursor
            self._count += 1
            self._cursor += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if self._cursor > self.peers.bytes_per_rank:
            raise RuntimeError(f"the forked ranks' pool ({self.peers.bytes_per_rank} bytes per rank) is full: "
                               f"pass a larger bytes_per_rank to ForkedPeers")
        self.peers._agree(index, offset, nbytes, shape, dtype)
        size = self.peers.bytes_per_rank
        # A tensor of its own over the pool's storage: a slice would share the pool's version counter
        # with every other allocation, and autograd would take one buffer's poison fill for a change
        # of another's rows. No region is handed out twice, so it holds the pool's 0xFF until written.
        local = torch.empty(0, dtype=torch.uint8).set_(self.peers.pool.untyped_storage(), self.rank * size + offset,
                                                       (nbytes,))
        local = local.view(dtype).view(shape)
        base = self.peers.pool.data_ptr() + offset
        table = torch.tensor([base + r * size for r in range(self.peers.world)], dtype=torch.int64)
        return SymmetricBuffer(local, table, PeerBarrier(self.peers._barrier, self.peers.arriving, self.rank, index,
                                                         self._passed))


@contextlib.contextmanager
def _after_parked(peers: ForkedPeers):
    peers.wait_until_peers_parked()
    yield


def use_forked_heap(heap: ForkedHeap) -> None:
    """In a forked rank: the layer's symm transports take `heap` and run on CPU tensors.

    Patches megatron_ext's transport factory (`resolve_transport` refuses 'symm' off the GPU) and
    SymmRowTransport's default heap (the torch symmetric-memory one), in this process only."""
    import torch.distributed as dist

    import megatron_ext.moe.transport as transports
    from megatron_ext.moe.transport.symm import SymmRowTransport

    resolve = transports.resolve_transport

    def resolve_on_cpu(choice, group, device):
        return "symm" if choice == "symm" else resolve(choice, group, device)

    transports.resolve_transport = resolve_on_cpu
    init = SymmRowTransport.__init__

    def init_on_heap(self, group, capacity, **kwargs):
        kwargs.update(heap=heap, rank=dist.get_rank(group), world=dist.get_world_size(group))
        init(self, group, capacity, **kwargs)

    SymmRowTransport.__init__ = init_on_heap
