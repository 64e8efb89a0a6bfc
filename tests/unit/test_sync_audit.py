"""sync_audit.count_host_syncs: every spelling of a host read counts once, in the forward and in
a backward, and device-only work counts nothing (a review found boolean masks, torch.where,
slice bounds, torch.equal and unique passing the old method wrappers unseen)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.sync_audit import count_host_syncs
from megatron_ext.testing.sync_probes import doubling_with_backward_action

x = torch.randn(8)
mask = x > 0
ends = torch.tensor([1, 2, 3])

HOST_READS = {
    "item": (lambda: x.sum().item(), "Tensor.item"),
    "bool": (lambda: bool(mask.any()), "Tensor.__bool__"),
    "tolist": (lambda: ends.tolist(), "Tensor.tolist"),
    "boolean mask": (lambda: x[mask], "aten.index with a boolean mask"),
    "masked assignment": (lambda: x.clone().__setitem__(mask, 0.0), "aten.index_put_ with a boolean mask"),
    "where(mask)": (lambda: torch.where(mask), "aten.nonzero"),
    "slice bound": (lambda: x[: ends[-1]], "aten._local_scalar_dense"),
    "equal": (lambda: torch.equal(x, x), "aten.equal"),
    "allclose": (lambda: torch.allclose(x, x), "aten.allclose"),
    "unique": (lambda: torch.unique(ends), "aten._unique2"),
    "repeat_interleave": (lambda: x[:3].repeat_interleave(ends), "aten.repeat_interleave without output_size"),
    "bincount": (lambda: torch.bincount(ends), "aten.bincount"),
    "masked_select": (lambda: x.masked_select(mask), "aten.masked_select"),
    "unique_consecutive": (lambda: torch.unique_consecutive(ends), "aten.unique_consecutive"),
    "uint8 mask": (lambda: x[mask.to(torch.uint8)], "aten.index with a boolean mask"),
}

DEVICE_ONLY = {
    "arithmetic and scans": lambda: (x * 2).cumsum(0).topk(3),
    "integer index": lambda: x[ends],
    "masked_fill": lambda: x.masked_fill(mask, 0.0),
    "where(mask, a, b)": lambda: torch.where(mask, x, -x),
    "repeat_interleave with output_size": lambda: x[:3].repeat_interleave(ends, output_size=6),
    "repeat_interleave by an int": lambda: x.repeat_interleave(2),
    "scatter_add": lambda: torch.zeros(4).scatter_add_(0, ends, x[:3]),
}


@pytest.mark.parametrize("case", HOST_READS)
def test_each_host_read_counts_once(case):
    fn, what = HOST_READS[case]
    with count_host_syncs() as audit:
        fn()
    assert [name for name, _ in audit.calls] == [what]
    assert "test_sync_audit.py" in audit.calls[0][1], "the stack names the call site"


@pytest.mark.parametrize("case", DEVICE_ONLY)
def test_device_only_work_counts_nothing(case):
    with count_host_syncs() as audit:
        DEVICE_ONLY[case]()
    assert audit.count == 0, audit.report()


def test_a_host_read_in_a_backward_counts_and_a_paused_one_does_not():
    a = torch.randn(4, requires_grad=True)
    with count_host_syncs() as audit:  # a host read in a backward written in Python
        doubling_with_backward_action(a, lambda grad: grad[grad > 0]).sum().backward()
        with audit.paused():
            x.sum().item()
    assert [name for name, _ in audit.calls] == ["aten.index with a boolean mask"]


def test_only_device_cuda_ignores_cpu_reads():
    with count_host_syncs(only_device="cuda") as audit:
        x.sum().item()
        x[mask]
        torch.nonzero(ends)  # a review found torch.nonzero counted on any device
        torch.nonzero(input=ends)
    assert audit.count == 0, audit.report()


def test_every_read_in_a_block_counts_and_the_patches_are_undone():
    item, nonzero = torch.Tensor.item, torch.nonzero
    with count_host_syncs() as audit:
        x.sum().item()
        ends.tolist()
        torch.nonzero(ends)
    assert [name for name, _ in audit.calls] == ["Tensor.item", "Tensor.tolist", "torch.nonzero"]
    assert torch.Tensor.item is item and torch.nonzero is nonzero, "the wrappers outlived the block"


def test_a_nested_pause_keeps_the_outer_one():
    with count_host_syncs() as audit:
        with audit.paused():
            with audit.paused():
                pass
            x.sum().item()
    assert audit.count == 0, audit.report()


def test_device_to_host_copies_are_reads_and_host_copies_are_not():
    from types import SimpleNamespace

    from megatron_ext.sync_audit import host_read

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))  # host_read looks only at devices
    to_cpu = {"device": torch.device("cpu")}
    assert host_read(torch.ops.aten._to_copy.default, (on_gpu,), to_cpu) == "aten._to_copy to the CPU"
    assert host_read(torch.ops.aten.copy_.default, (torch.empty(2), on_gpu), {}) == "aten.copy_ to the CPU"
    assert host_read(torch.ops.aten._to_copy.default, (torch.empty(2),), to_cpu) is None
