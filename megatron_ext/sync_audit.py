"""Count calls that force a device-to-host synchronization, with the Python stack of each.

`count_host_syncs()` counts, for the duration of a `with` block:
- the tensor methods that read device values on the host (.item, .tolist, .cpu, .numpy,
  bool/int/float conversion, nonzero) and stream/event/device synchronize, wrapped in Python;
- the aten operators whose result size or value the host must read (`HOST_READ_OPS`: a scalar
  read, nonzero and boolean-mask indexing, unique, equal, masked_select, repeat_interleave without
  an output size, bincount, a copy to the CPU), seen by a TorchDispatchMode, so calls made from
  C++ or through other Python spellings (`x[mask]`, `torch.where(mask)`, `x[:t[-1]]`,
  `torch.equal`) count too.
It sees the code path on any device (on CPU it audits what would synchronize on a GPU; on GPU
the CUDA-graph capture and profiler checks in tools/host_sync_audit.py are the stronger proof,
docs/design.md, "Proofs of synchronization freedom"). What it cannot see on CPU: a device
transfer or a synchronize guarded by `is_cuda`. Calls made while the audit is paused
(`audit.paused()`) are not counted, e.g. a logging step's metric read.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

    def record(self, what: str) -> None:
        self.active = False  # the stack capture itself must not be counted
        try:
            self.calls.append((what, "".join(traceback.format_stack(limit=12)[:-2])))
        finally:
            self.active = True

    def report(self, limit: int = 5) -> str:
        lines = [f"{self.count} host synchronization(s)"]
        for what, stack in self.calls[:limit]:
            lines.append(f"--- {what}\n{stack}")
        return "\n".join(lines)


# aten operators (overload packets) that read device values on the host: their output's size or
# value depends on the data. index / index_put count only with a boolean or uint8 index (a mask).
HOST_READ_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "masked_select", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount"})
_MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def host_read(func, args, kwargs) -> str | None:
    """The aten call's name if it reads device values on the host, else None."""
    name = func.overloadpacket.__name__
    if name in HOST_READ_OPS:
        return f"aten.{name}"
    if name in _MASK_INDEX_OPS and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2])):
        return f"aten.{name} with a boolean mask"
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") \
            and kwargs.get("output_size") is None:
        return "aten.repeat_interleave without output_size"
    if name in ("_to_copy", "copy_"):
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device")
        if target is not None and torch.device(target).type == "cpu" and source.device.type not in ("cpu", "meta"):
            return f"aten.{name} to the CPU"
    return None


class _HostReadOps(TorchDispatchMode):
    """Records HOST_READ_OPS calls into `audit` while it is active."""

    def __init__(self, audit: SyncAudit, only_device: str | None):
        super().__init__()
        self.audit, self.only_device = audit, only_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.audit.active:
            what = host_read(func, args, kwargs)
            on_device = self.only_device is None or any(t.device.type == self.only_device for t in _tensors(args))
            if what is not None and on_device:
                self.audit.record(what)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs(only_device: str | None = None):
    """Yield a SyncAudit that records every synchronizing call inside the block.

    `only_device="cuda"` counts tensor reads only for CUDA tensors (on a GPU, CPU-tensor reads
    are not syncs); None counts them on every device (the CPU code-path audit).
    """
    audit = SyncAudit()
    originals = {}

    def wrap(owner, name, label, reads_tensor):
        """`reads_tensor`: the call reads its first tensor argument (counted per `only_device`);
        otherwise it synchronizes whatever it is given (always counted)."""
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def counted(*args, **kwargs):
            if not audit.active:
                return original(*args, **kwargs)
            tensor = (args[0] if args else kwargs.get("input")) if reads_tensor else None
            if not reads_tensor or only_device is None or (
                    isinstance(tensor, torch.Tensor) and tensor.device.type == only_device):
                audit.record(label)
            with audit.paused():  # the aten call inside is the same read: count it once
                return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in _TENSOR_METHODS:
        wrap(torch.Tensor, name, f"Tensor.{name}", True)
    wrap(torch, "nonzero", "torch.nonzero", True)
    if torch.cuda.is_available():
        wrap(torch.cuda, "synchronize", "torch.cuda.synchronize", False)
        wrap(torch.cuda.Event, "synchronize", "Event.synchronize", False)
        wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize", False)
    try:
        with _HostReadOps(audit, only_device):
            yield audit
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
