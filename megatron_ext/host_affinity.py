"""Keep the threads that submit an eager MoE layer's work on one CPU core
(MoEExtConfig.pin_host_threads; docs/design.md, "Host submission of the eager layer").

An eager layer step is ~100 small host calls split between two threads: the main thread runs
the forward, PyTorch's autograd device thread (`pt_autograd_<device>`) the backward. Left to the
scheduler, the two land on different cores and each call finds cold caches. On one core they
share them: in the one kept run timed in turns at the reference shape the layer's host
submission fell 9% (x0.91, per-round 0.79..1.21) with the same device time, and a later short run
measured x1.07; the training bench's step time did not change (BENCHMARKS.md, eighth session).
Hence off by default.
Cost accepted: the main thread and whatever it starts afterwards (threads and processes inherit
the mask) share that core; Megatron starts its process groups and data loaders before the first
forward, so they keep every core.
"""

from __future__ import annotations

import os
import threading

import torch

_pinned = threading.local()  # .core: the core this thread was pinned to (dies with the thread)
_backward_thread_pinned = False  # set by the first backward that ran the pinning hook


def choose_core(allowed: set[int], local_rank: int, local_world_size: int) -> int:
    """The core for this rank: its share of the cores it may use, so that ranks of one host that
    may all use every core (torchrun's default) take different ones, and a rank bound to its own
    cores by the launcher stays inside them."""
    if not allowed:
        raise ValueError("choose_core needs at least one allowed CPU core")
    ranks = max(local_world_size, 1)
    if not 0 <= local_rank < ranks:
        raise ValueError(f"local rank {local_rank} is outside a host of {local_world_size} rank(s)")
    cores = sorted(allowed)
    return cores[local_rank * len(cores) // ranks]


def host_core() -> int:
    """choose_core for this process, from its allowed cores and torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE (read as facts about the launch; rank 0 of 1 without them, and
    LOCAL_RANK + 1 ranks where only LOCAL_RANK is set)."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("pin_host_threads (--moe-ext-pin-host-threads) needs Linux's sched_setaffinity; "
                           "turn it off on this platform")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    return choose_core(os.sched_getaffinity(0), local_rank, local_world_size)


def pin_current_thread(core: int) -> bool:
    """Restrict the calling thread to `core`, once per thread; True if this call pinned it."""
    if getattr(_pinned, "core", None) == core:
        return False
    os.sched_setaffinity(threading.get_native_id(), {core})
    _pinned.core = core
    return True


def pin_submitting_threads(output: torch.Tensor, core: int) -> None:
    """Pin the calling (forward) thread now, and the thread that will run `output`'s backward
    when it does (a gradient hook, attached until one backward has run it)."""
    pin_current_thread(core)
    if output.requires_grad and not _backward_thread_pinned:
        output.register_hook(_backward_pin(core))


def _backward_pin(core: int):
    def pin_backward_thread(grad):
        global _backward_thread_pinned
        pin_current_thread(core)
        _backward_thread_pinned = True
    return pin_backward_thread
