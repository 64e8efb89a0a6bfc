"""Count calls that force a device-to-host synchronization, with the Python stack of each.

`count_host_syncs()` wraps the tensor methods that read device values on the host (.item,
.tolist, .cpu, .numpy, bool/int/float conversion, nonzero) plus stream/event/device
synchronize, for the duration of a `with` block. It sees the Python call sites, on any device
(on CPU it audits the code path; on GPU the CUDA-graph capture and profiler checks in
tools/host_sync_audit.py are the stronger proof,
docs/design.md, "Proofs of synchronization freedom"). Calls made while the audit is paused
(`audit.paused()`) are not counted, e.g. a logging step's metric read.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field

import torch

_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


@dataclass
class SyncAudit:
    calls: list[tuple[str, str]] = field(default_factory=list)  # (what, stack)
    active: bool = True

    @property
    def count(self) -> int:
        return len(self.calls)

    @contextlib.contextmanager
    def paused(self):
        self.active, previous = False, self.active
        try:
            yield
        finally:
            self.active = previous

    def report(self, limit: int = 5) -> str:
        lines = [f"{self.count} host synchronization(s)"]
        for what, stack in self.calls[:limit]:
            lines.append(f"--- {what}\n{stack}")
        return "\n".join(lines)


@contextlib.contextmanager
def count_host_syncs(only_device: str | None = None):
    """Yield a SyncAudit that records every synchronizing call inside the block.

    `only_device="cuda"` counts tensor reads only for CUDA tensors (on a GPU, CPU-tensor reads
    are not syncs); None counts them on every device (the CPU code-path audit).
    """
    audit = SyncAudit()
    originals = {}

    def wrap(owner, name, label, is_tensor_method):
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def counted(*args, **kwargs):
            if audit.active:
                tensor = args[0] if is_tensor_method and args else None
                if only_device is None or (tensor is not None and tensor.device.type == only_device) or (
                        not is_tensor_method):
                    audit.active = False  # the stack capture itself must not be counted
                    try:
                        audit.calls.append((label, "".join(traceback.format_stack(limit=12)[:-1])))
                    finally:
                        audit.active = True
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in _TENSOR_METHODS:
        wrap(torch.Tensor, name, f"Tensor.{name}", True)
    wrap(torch, "nonzero", "torch.nonzero", False)
    if torch.cuda.is_available():
        wrap(torch.cuda, "synchronize", "torch.cuda.synchronize", False)
        wrap(torch.cuda.Event, "synchronize", "Event.synchronize", False)
        wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize", False)
    try:
        yield audit
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
