"""Proofs of synchronization freedom on the GPU (docs/design.md, "Proofs of synchronization freedom"), strongest first.

1. `capture_replay(step)`: capture one forward+backward in a CUDA graph and replay it; a host
   synchronization inside makes capture fail (cudaErrorStreamCaptureInvalidated / "operation
   not permitted when stream is capturing"). Its last warm-up step also runs under check 2,
   which sees what the capture's "thread_local" mode does not (another thread's syncs).
2. `profiled_sync_calls(step)`: run the step eagerly under torch.profiler and list the CUDA
   runtime calls that block the host (stream/event/device synchronize, blocking D2H copies).
3. megatron_ext.sync_audit.count_host_syncs: Python call sites with stacks.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

SYNC_RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                      "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")


def profiled_sync_calls(step: Callable[[], object]) -> dict[str, int]:
    """Blocking CUDA runtime calls made by one eager `step()` (empty dict: none).

    The profiler itself synchronizes the device when it stops; those calls are measured on an
    empty step and subtracted.
    """
    own = _blocking_calls(lambda: None)
    found = _blocking_calls(step)
    found.subtract(own)
    return {name: n for name, n in found.items() if n > 0}


def _blocking_calls(step: Callable[[], object]) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    torch.cuda.synchronize()
    found = Counter()
    for event in prof.events():
        name = event.name
        if any(call in name for call in SYNC_RUNTIME_CALLS):
            found[name] += 1
        elif "Memcpy" in name and "DtoH" in name and "Async" not in name:
            found[name] += 1  # a blocking device-to-host copy
    return found


class HostSyncFound(RuntimeError):
    """An eager run of a step made blocking CUDA calls: it synchronizes with the host."""


def capture_replay(step: Callable[[], object], warmup: int = 2, check_blocking: bool = True):
    """Capture `step()` in a CUDA graph after warm-up on a side stream; return (graph, outputs).

    A host synchronization inside makes the capture fail: raises CaptureFailed (a RuntimeError
    naming the CUDA error), with the process left usable (megatron_ext/cuda_graphs/capture.py).
    The capture runs in "thread_local" mode, which does not see every sync of another thread: a
    backward node that synchronizes another stream (`torch.cuda.default_stream().synchronize()`
    on the autograd engine's device thread) was captured without error on an H200. So with
    `check_blocking` the last warm-up step runs under the profiler (`profiled_sync_calls`, every
    thread's CUDA runtime calls) and a blocking call raises HostSyncFound: the two checks together
    are the proof.
    For training, use the layer's graph runner (MoEExtConfig.cuda_graphs), which also agrees
    across EP ranks and falls back to eager; this is the proof tool. The graph keeps `step`, and
    so the modules and tensors it reads, alive: a CUDA graph holds no reference to them, and a
    caller that kept only `graph.replay` had its modules collected while their memory was still
    replayed into (an illegal address once the allocator had returned it, on an H200).
    """
    from megatron_ext.cuda_graphs.capture import capture

    if check_blocking and warmup < 1:
        raise ValueError("capture_replay(check_blocking=True) profiles the last warm-up step: warmup must be >= 1")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for index in range(warmup):
            if check_blocking and index == warmup - 1:
                blocking = profiled_sync_calls(step)
                if blocking:
                    raise HostSyncFound(f"the step made blocking CUDA calls in an eager run: {blocking}")
            else:
                step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    outputs = capture(graph, step)
    graph.captured_step = step
    return graph, outputs
