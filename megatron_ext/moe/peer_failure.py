"""Bounded waits on expert-parallel peers: a dead or stalled rank ends the job with a message
(docs/design.md, "Faults").

Every wait of the rowwise path is on its EP peers: the count exchange and the torch transport's
all-to-alls (collectives of the process group), and the symm transport's device barriers. When
a peer dies (OOM, node fault, preemption) or stalls, the survivors must not spin forever.

- Collectives are bounded by the process group's own timeout (Megatron's
  --distributed-timeout-minutes); a dead peer usually fails them at once. `named_phase` turns the
  backend's error into `PeerFailure` naming the phase, this rank and the group.
- Device barriers: the barrier kernel gets twice the timeout (`timeout_ms`, a backstop; after it the kernel
  traps and the next CUDA call fails), and `BarrierWatchdog` records an event after each eager
  barrier; a host thread that sees one still pending after the timeout prints which phase and
  which ranks, then ends the process with exit code 1 (the device cannot be trusted after a
  trapped barrier, and the host may be blocked in a synchronize). Costs: one event record per
  barrier and a thread that wakes once a second; none inside CUDA graphs (replays record one
  event per graph instead).

The timeout: MoEExtConfig.peer_timeout_s, else megatron.training's --distributed-timeout-minutes
when it is initialised, else torch's default process-group timeout (30 min).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


class PeerFailure(RuntimeError):
    """An expert-parallel peer did not take part in a phase (it died, stalled or raised)."""


def peer_timeout_seconds(configured: float | None = None) -> float:
    if configured is not None:
        return float(configured)
    try:
        from megatron.training.global_vars import get_args

        minutes = getattr(get_args(), "distributed_timeout_minutes", None)
        if minutes:
            return 60.0 * minutes
    except (ImportError, AssertionError, AttributeError):  # megatron.training not initialised
        pass
    return dist.distributed_c10d.default_pg_timeout.total_seconds()


def describe(group) -> str:
    """'rank R (global G) of the expert-parallel group [..]' for messages."""
    if group is None or not dist.is_initialized():
        return "this rank (no process group)"
    ranks = dist.get_process_group_ranks(group)
    return f"rank {dist.get_rank(group)} (global rank {dist.get_rank()}) of the expert-parallel group {ranks}"


@contextlib.contextmanager
def named_phase(phase: str, group, timeout_s: float | None = None):
    """Re-raise a collective's failure as PeerFailure naming the phase and the group."""
    try:
        yield
    except (RuntimeError, dist.DistError) as error:
        if isinstance(error, PeerFailure):
            raise
        bound = f" (waits are bounded by {timeout_s:.0f} s)" if timeout_s else ""
        raise PeerFailure(f"megatron_ext rowwise MoE: the {phase} failed on {describe(group)}: a peer of the group "
                          f"stopped (crashed, was killed, stalled or raised){bound}. Cause: "
                          f"{type(error).__name__}: {error}") from error


class BarrierWatchdog:
    """Ends the process when an eager device barrier has not completed within `timeout_s`."""

    def __init__(self, timeout_s: float, group, poll_s: float = 1.0):
        self.timeout_s, self.group, self.poll_s = timeout_s, group, poll_s
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def record(self, phase: str) -> None:
        """Mark the point after a barrier on the current stream (skipped while capturing a graph)."""
        if torch.cuda.is_current_stream_capturing():
            return
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            self._pending.append((phase, event, time.monotonic()))
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megatron_ext-barrier-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            phase = self.overdue()
            if phase is not None:
                self.fail(phase)

    def overdue(self) -> str | None:
        """Drop completed barriers; the phase of the oldest one pending longer than the timeout, if any.

        A barrier's wait counts from when it was enqueued or from when the barrier before it was
        seen complete, whichever is later: a host that runs ahead enqueues barriers long before
        the device reaches them (a review's simulation had a healthy run killed). Work queued
        ahead of the first pending barrier still counts, a floor the timeout must exceed."""
        now = time.monotonic()
        with self._lock:
            completed = False
            while self._pending and self._pending[0][1].query():
                self._pending.popleft()
                completed = True
            if completed and self._pending:
                phase, event, started = self._pending[0]
                self._pending[0] = (phase, event, max(started, now))
            oldest = self._pending[0] if self._pending else None
        if oldest is not None and now - oldest[2] > self.timeout_s:
            return oldest[0]
        return None

    def fail(self, phase: str) -> None:
        print(f"megatron_ext rowwise MoE: {describe(self.group)} waited {self.timeout_s:.0f} s in the {phase} barrier: "
              f"a peer of the group stopped (crashed, was killed or stalled); ending this process (exit code 1)",
              file=sys.stderr, flush=True)
        os._exit(1)
