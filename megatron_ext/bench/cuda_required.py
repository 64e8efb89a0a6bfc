"""The up-front check of the GPU-only tools: without a visible CUDA GPU they exit at once.

Without it a GPU tool fails late and differently on a machine without a GPU (a CUDA driver
error, a failure JSON written into bench/results/, or a CPU run of a GPU-sized benchmark for
many minutes). Each GPU-only tool calls `require_cuda` right after parsing its arguments (so
--help and argument errors still work), before any work and before any file is written.
"""

from __future__ import annotations

import sys
import warnings

NO_GPU_EXIT_STATUS = 2


def no_gpu_message(tool_name: str) -> str:
    return f"{tool_name} needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)"


def require_cuda(tool_name: str) -> None:
    """Return when a CUDA GPU is visible; otherwise print one line to stderr and exit with
    status 2. torch's own warnings about a missing or too old driver are silenced, so that the
    line is the whole message."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        available = torch.cuda.is_available()
    if available:
        return
    print(no_gpu_message(tool_name), file=sys.stderr, flush=True)
    raise SystemExit(NO_GPU_EXIT_STATUS)
