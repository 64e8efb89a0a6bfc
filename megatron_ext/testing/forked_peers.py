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
the same offset in every rank's region. A barrier is a multiprocessing.Barrier over the ranks,
which checks that all of them barrier on the same allocation. Processes run their kernels
concurrently, as GPUs do: the only cross-rank order is the barrier, the contract the GPU
transport relies on. The row kernels use no atomics on peer memory (the interpreter's are
atomic within one process only).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import torch

from megatron_ext.moe.buffers import SymmetricBuffer

_ALIGN = 256  # bytes between allocations, as a GPU allocator would align them
_LEDGER_ENTRIES = 4096


class ForkedPeers:
    """Create in the parent before `run_on_ranks`; each rank then runs its work through `run_rank`."""

    def __init__(self, world: int, bytes_per_rank: int = 4 << 20, timeout_s: float = 60.0):
        ctx = mp.get_context("fork")
        self.world, self.bytes_per_rank = world, bytes_per_rank
        self.pool = torch.zeros(world * bytes_per_rank, dtype=torch.uint8).share_memory_()
        # The bookkeeping lives in plain shared arrays, not tensors: a sync audit in the layer counts
        # host reads of tensors, and the simulation's own must not count as the layer's.
        self.ledger = ctx.RawArray("q", [-1] * (2 * _LEDGER_ENTRIES))  # allocation i: offset, bytes at [2i, 2i+1]
        self.arriving = ctx.RawArray("q", [-1] * world)  # the allocation each rank barriers on
        self.finished = ctx.RawValue("q", 0)  # ranks done (or failed)
        self._ledger_lock = ctx.Lock()
        self._barrier = ctx.Barrier(world, action=self._check_same_allocation, timeout=timeout_s)
        self.timeout_s = timeout_s

    def run_rank(self, rank: int, fn, *args, late_rank: int | None = None):
        """In forked rank `rank`: `fn(heap, *args)` with the layer's symm transports on this rank's heap
        (`use_forked_heap`). `late_rank`: that rank waits before each of the transport's kernels until
        its peers are parked at a barrier or done, so they run ahead as far as the barriers let them.
        A failure breaks the barrier, so peers fail at once instead of at its timeout."""
        heap = ForkedHeap(self, rank)
        use_forked_heap(heap)
        if late_rank == rank:
            _before_kernels(self.wait_until_peers_parked)
        try:
            return fn(heap, *args)
        except BaseException:
            self._barrier.abort()
            raise
        finally:
            with self._ledger_lock:
                self.finished.value += 1

    def wait_until_peers_parked(self) -> None:
        """Block until each other rank waits at a barrier or has finished."""
        deadline = time.monotonic() + self.timeout_s
        while self._barrier.n_waiting + self.finished.value < self.world - 1:
            if self._barrier.broken:
                return  # a peer failed: run_on_ranks reports it
            if time.monotonic() > deadline:
                raise TimeoutError(f"forked peers did not park at a barrier within {self.timeout_s} s")
            time.sleep(0.0005)

    def _check_same_allocation(self) -> None:
        """Run once all ranks arrived, before any leaves (one Barrier stands in for every
        allocation's signal pad, so ranks barriering on different allocations would meet here)."""
        arriving = list(self.arriving)
        if len(set(arriving)) > 1:
            raise RuntimeError(f"forked ranks met at barriers of different symmetric allocations {arriving} "
                               f"(by rank): every rank must call the same barriers in the same order")

    def _agree(self, index: int, offset: int, nbytes: int) -> None:
        if index >= _LEDGER_ENTRIES:
            raise RuntimeError(f"more than {_LEDGER_ENTRIES} symmetric allocations on forked ranks")
        with self._ledger_lock:
            entry = self.ledger[2 * index: 2 * index + 2]
            if entry[0] < 0:
                self.ledger[2 * index: 2 * index + 2] = [offset, nbytes]
            elif entry != [offset, nbytes]:
                raise RuntimeError(f"forked ranks allocated out of order: allocation {index} is {entry} (offset, "
                                   f"bytes) on another rank, {[offset, nbytes]} here")


class _Barrier:
    def __init__(self, peers: ForkedPeers, rank: int, allocation: int, passed: list[int]):
        self.peers, self.rank, self.allocation, self._passed = peers, rank, allocation, passed

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self.peers.arriving[self.rank] = self.allocation
        self.peers._barrier.wait()
        self._passed[0] += 1


class ForkedHeap:
    """SymmetricHeap of one forked rank: bump allocation in its region of the shared pool."""

    def __init__(self, peers: ForkedPeers, rank: int):
        self.peers, self.rank = peers, rank
        self._count, self._cursor = 0, 0
        self._scratch: dict[tuple, SymmetricBuffer] = {}
        self._passed = [0]
        self._lock = threading.Lock()  # the autograd thread allocates too

    @property
    def barriers_passed(self) -> int:
        return self._passed[0]

    @property
    def bytes_used(self) -> int:
        return self._cursor

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
        self.peers._agree(index, offset, nbytes)
        size = self.peers.bytes_per_rank
        # A tensor of its own over the pool's storage (zero: the pool starts zeroed, and no region is
        # handed out twice): a slice would share the pool's version counter with every other
        # allocation, and autograd would take one buffer's poison fill for a change of another's rows.
        local = torch.empty(0, dtype=torch.uint8).set_(self.peers.pool.untyped_storage(), self.rank * size + offset,
                                                       (nbytes,))
        local = local.view(dtype).view(shape)
        base = self.peers.pool.data_ptr() + offset
        table = torch.tensor([base + r * size for r in range(self.peers.world)], dtype=torch.int64)
        return SymmetricBuffer(local, table, _Barrier(self.peers, self.rank, index, self._passed))

    def scratch(self, role, shape, dtype, device) -> SymmetricBuffer:
        key = (role, tuple(shape), dtype)
        if key not in self._scratch:
            self._scratch[key] = self.allocate(shape, dtype, device)
        return self._scratch[key]


def _before_kernels(wait) -> None:
    """Call `wait()` before each of the symm transport's kernel entry points, in this process."""
    from megatron_ext.moe.transport import symm
    from megatron_ext.testing.threaded_peers import KERNEL_ENTRY_POINTS

    for name in KERNEL_ENTRY_POINTS:
        kernel = getattr(symm, name, None)
        if kernel is None:
            continue

        def waited(*args, _kernel=kernel, **kwargs):
            wait()
            return _kernel(*args, **kwargs)
        setattr(symm, name, waited)


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
