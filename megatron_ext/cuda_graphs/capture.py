"""Capture into a CUDA graph so that a failed capture leaves the process usable.

`torch.cuda.graph` ends a capture in `__exit__` with `CUDAGraph.capture_end()`, which calls
cudaStreamEndCapture before it hands the graph's memory pool back to the caching allocator.
When the capture was invalidated (a host synchronization, another thread's unsafe CUDA call
in "global" mode), capture_end raises there: the allocator still counts a capture underway and
the next allocation or empty_cache aborts the process (`captures_underway.empty()` INTERNAL
ASSERT, seen at EP=2), `__exit__` never restores the current stream, and the CUDA RNG keeps
its capture flag (the next random op outside a capture raises "Offset increment outside graph
capture encountered unexpectedly"). `capture` ends every step itself and repairs all three on
failure (the RNG by one trivial capture, whose end clears the flag), then raises
`CaptureFailed` with the cause.

Python's cyclic garbage collector is off while `fn` is captured: a collection there runs the
finalizers of unrelated older objects (an earlier model's symmetric buffers, graphs, streams),
and a CUDA call they make (a free, a synchronizing destroy) invalidates the capture. Seen as
"operation failed due to a previous error during capture" in about half of the multi-file GPU
test runs, every time with a generation-0 collection inside the capture; none with it off.

Captures run in "thread_local" mode: the ProcessGroupNCCL watchdog thread queries events of
earlier eager collectives, which in "global" mode may invalidate a capture on another thread.

Torch internals used (checked by tests/unit/test_graph_capture_internals.py; torch 2.11-2.13):
`torch.cuda.graph.stream_ctx`, `CUDAGraph.capture_end/reset`, `torch.cuda.graph_pool_handle`,
`torch._C._cuda_endAllocateToPool`, `torch._C._cuda_releasePool`.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch


class CaptureFailed(RuntimeError):
    """A capture did not produce a graph; the process, its streams and its allocator are intact."""


def capture(graph: torch.cuda.CUDAGraph, fn: Callable[[], object], pool=None):
    """Run `fn()` under capture into `graph` (in `pool`, if given) and return its result."""
    device = torch.cuda.current_device()
    if pool is None:  # name the pool ourselves: CUDAGraph.pool() refuses after a failed capture
        pool = torch.cuda.graph_pool_handle()
    context = torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
    try:
        context.__enter__()
    except Exception as error:
        context.stream_ctx.__exit__(None, None, None)
        raise CaptureFailed(f"capture could not begin: {type(error).__name__}: {error}") from error
    body_error = end_error = None
    result = None
    collecting = gc.isenabled()
    gc.disable()  # see the module docstring: no finalizers of older objects inside the capture
    try:
        result = fn()
    except Exception as error:  # noqa: BLE001 - reported below, after the capture is ended
        body_error = error
    finally:
        if collecting:
            gc.enable()
    try:
        graph.capture_end()
    except Exception as error:  # noqa: BLE001 - an invalidated capture
        end_error = error
    finally:
        context.stream_ctx.__exit__(None, None, None)
    if end_error is not None:  # capture_end stopped before returning the pool to the allocator
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)
        _clear_rng_capture_flag()
    if body_error is None and end_error is None:
        return result
    if end_error is None:
        graph.reset()  # a valid but partial graph: drop it (and its hold on the pool)
    cause = body_error or end_error
    raise CaptureFailed(f"{type(cause).__name__}: {cause}".strip() + _hint(cause)) from cause


def _hint(cause: BaseException) -> str:
    """What to change for the failures users can fix."""
    if "legacy stream" in str(cause):
        # The autograd engine syncs each parameter's gradient accumulator on the stream it was
        # created on; wrappers such as Megatron's DDP create them at construction time.
        return ("; hint: the parameters' gradient accumulators were created on the default (legacy) CUDA "
                "stream, e.g. by constructing Megatron's DistributedDataParallel there: construct it inside "
                "`with torch.cuda.stream(torch.cuda.Stream()):`, as Megatron's training does")
    return ""


def _clear_rng_capture_flag() -> None:
    """A capture that ends cleanly runs the RNG's capture epilogue; one that failed did not."""
    scratch = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        scratch.add_(1)
    graph.reset()
