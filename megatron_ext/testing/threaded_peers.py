"""Simulated EP ranks in one process: one thread per rank, CPU buffers as "symmetric memory".

Each rank's SymmRowTransport gets a `RankHeap`: allocations are collective by call order, as
with torch symmetric memory, and every rank's peer table holds the addresses of all ranks'
CPU tensors, so the Triton row kernels (under TRITON_INTERPRET=1) store into and load from
"peers" for real. A barrier is a threading.Barrier over the ranks, which checks that all ranks
barrier on the same allocation (on GPUs each allocation has its own signal pad). The interpreter runs a
kernel to completion on the calling thread, so a thread's order is its "device" order and the
only cross-rank ordering is the barrier: exactly the contract the GPU transport relies on.
A late rank (`phase_delay("late<r>")`) waits until every peer is parked at a barrier or done, so
the peers have run as far ahead as the barriers let them, whatever the host's load: no sleep
stands in for "late enough".

Triton's interpreter is not thread-safe, so `serialize_kernels` makes the transport's kernel
entry points run one at a time (a kernel is atomic, as if the ranks shared one device queue);
ranks still interleave freely between kernels.
"""

from __future__ import annotations

import functools
import threading
import time

import torch

from megatron_ext.moe.buffers import SymmetricBuffer


def check_same_allocation(arriving) -> None:
    """A simulated barrier's action, run once all ranks arrived and before any leaves. One barrier
    stands in for every allocation's signal pad, so ranks that barrier on different allocations
    would meet here where on GPUs each would wait on its own pad for peers that never come."""
    if len(set(arriving)) > 1:
        raise RuntimeError(f"simulated ranks met at barriers of different symmetric allocations {list(arriving)} "
                           f"(by rank): every rank must call the same barriers in the same order")


def wait_until_parked(barrier, finished, world: int, timeout_s: float) -> None:
    """Block the calling rank until each other rank waits at `barrier` or has finished (`finished()`
    ranks): they have then done every write the barriers allow before this rank's next phase."""
    deadline = time.monotonic() + timeout_s
    while barrier.n_waiting + finished() < world - 1:
        if barrier.broken:
            return  # a peer failed: the runner reports it
        if time.monotonic() > deadline:
            raise TimeoutError(f"simulated peers did not park at a barrier within {timeout_s} s")
        time.sleep(0.0005)


class PeerBarrier:
    """One rank's barrier on one symmetric allocation: note the allocation (`arriving[rank]`, read by
    `check_same_allocation`), wait for every rank, then `passed()`."""

    def __init__(self, barrier, arriving, rank: int, allocation: int, passed):
        self._barrier, self._arriving, self.rank, self.allocation, self._passed = (barrier, arriving, rank,
                                                                                 allocation, passed)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self._arriving[self.rank] = self.allocation
        self._barrier.wait()
        self._passed()


class ScratchByRole:
    """A SymmetricHeap's shared scratch: one allocation per (role, shape, dtype) for all layers, as
    TorchSymmetricHeap's. Needs `allocate` and a `_scratch` dict."""

    def scratch(self, role, shape, dtype, device) -> SymmetricBuffer:
        key = (role, tuple(shape), dtype)
        if key not in self._scratch:
            self._scratch[key] = self.allocate(shape, dtype, device)
        return self._scratch[key]


class ThreadedPeers:
    def __init__(self, world: int, timeout_s: float = 60.0):
        self.world = world
        self._arriving: list[int | None] = [None] * world  # the allocation each rank barriers on
        self._barrier = threading.Barrier(world, action=lambda: check_same_allocation(self._arriving),
                                          timeout=timeout_s)
        self._lock = threading.Lock()
        self._allocations: list[list[torch.Tensor]] = []
        self.barriers_passed = [0] * world
        self._finished = 0

    def heap(self, rank: int) -> "RankHeap":
        return RankHeap(self, rank)

    def _collective_alloc(self, index: int, shape, dtype) -> list[torch.Tensor]:
        with self._lock:
            if index == len(self._allocations):
                # zeros, not empty: a stale read in a test must be deterministic
                self._allocations.append([torch.zeros(shape, dtype=dtype) for _ in range(self.world)])
            buffers = self._allocations[index]
        if buffers[0].shape != torch.Size(shape) or buffers[0].dtype != dtype:
            raise RuntimeError(f"simulated ranks allocated out of order: allocation {index} is "
                               f"{tuple(buffers[0].shape)} {buffers[0].dtype}, "
                               f"this rank asked for {tuple(shape)} {dtype}")
        return buffers

    def run(self, fn, *args) -> list:
        """fn(rank, *args) on every rank's thread; returns the results, re-raises the first error."""
        results, errors = [None] * self.world, [None] * self.world

        def body(rank):
            try:
                results[rank] = fn(rank, *args)
            except BaseException as error:  # noqa: BLE001 - reported below with its rank
                errors[rank] = error
                self._barrier.abort()  # never leave the other ranks waiting
            finally:
                with self._lock:
                    self._finished += 1

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._finished = 0
        for rank, error in enumerate(errors):
            if error is not None and not isinstance(error, threading.BrokenBarrierError):
                raise RuntimeError(f"simulated rank {rank} failed: {type(error).__name__}: {error}") from error
        for rank, error in enumerate(errors):
            if error is not None:
                raise RuntimeError(f"simulated rank {rank}: barrier broken") from error
        return results

    def wait_until_peers_parked(self, timeout_s: float = 60.0) -> None:
        wait_until_parked(self._barrier, lambda: self._finished, self.world, timeout_s)

    def _passed(self, rank: int) -> None:
        self.barriers_passed[rank] += 1


class RankHeap(ScratchByRole):
    """SymmetricHeap of one simulated rank."""

    def __init__(self, peers: ThreadedPeers, rank: int):
        self.peers, self.rank = peers, rank
        self._count = 0
        self._scratch: dict[tuple, SymmetricBuffer] = {}

    def allocate(self, shape, dtype, device) -> SymmetricBuffer:
        if torch.device(device).type != "cpu":
            raise ValueError("simulated peers live on the CPU")
        index = self._count
        buffers = self.peers._collective_alloc(index, tuple(shape), dtype)
        self._count += 1
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        passed = functools.partial(self.peers._passed, self.rank)
        return SymmetricBuffer(buffers[self.rank], table,
                               PeerBarrier(self.peers._barrier, self.peers._arriving, self.rank, index, passed))


def sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000)


def schedule_events(schedule: str) -> list[tuple[str, int]]:
    """"F0 F1 B1 B0" -> [("F", 0), ("F", 1), ("B", 1), ("B", 0)]: forwards and backwards of microbatches."""
    return [(event[0], int(event[1:])) for event in schedule.split()]


def phase_delay(mode: str, rank: int, rng, peers: ThreadedPeers) -> "callable":
    """A rank's pause between phases: "random" (0-3 ms from `rng`), "late<r>" (rank r only waits
    until its peers are parked at a barrier or done: they run ahead as far as the barriers let
    them), anything else none."""
    def wait():
        if mode == "random":
            sleep_ms(rng.uniform(0, 3))
        elif mode == f"late{rank}":
            peers.wait_until_peers_parked()
    return wait


def report_case(name: str, failures: list[str], summary: str) -> bool:
    """Print a case's outcome ("ok"/"FAIL", its summary, the first failures); True if it failed."""
    print(f"{'FAIL' if failures else 'ok'} {name}: {summary}")
    for line in failures[:5]:
        print("   ", line)
    return bool(failures)


def failed_checks(checks: dict, where: str) -> list[str]:
    """`checks` {name: (got, want)} compared to fp32 rounding: a line per wrong one, with its NaN
    count and largest error."""
    import torch

    return [f"{where}: {name} wrong ({int(torch.isnan(got).sum())} NaN, max err "
            f"{float((got - want).nan_to_num(1e9).abs().max()):.3g})"
            for name, (got, want) in checks.items() if not torch.allclose(got, want, rtol=1e-5, atol=1e-5)]


_KERNEL_LOCK = threading.Lock()


KERNEL_ENTRY_POINTS = ("put_rows", "get_rows", "put_rows_mxfp8", "copy_rows_below", "put_rows_back")


def around_kernels(module, before, names=KERNEL_ENTRY_POINTS, mark: str = "_around") -> None:
    """Call `module`'s kernel entry points (e.g. moe.transport.symm) inside `before()`, a context
    manager; an entry point already wrapped under `mark` is left as it is."""
    for name in names:
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, mark, False):
            continue

        @functools.wraps(fn)
        def wrapped(*args, _fn=fn, **kwargs):
            with before():
                return _fn(*args, **kwargs)
        setattr(wrapped, mark, True)
        setattr(module, name, wrapped)


def serialize_kernels(module, names=KERNEL_ENTRY_POINTS) -> None:
    """Wrap `module`'s kernel entry points with one process-wide lock."""
    around_kernels(module, lambda: _KERNEL_LOCK, names, mark="_serialized")
