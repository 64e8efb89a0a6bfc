"""A tiny GPTModel built from megatron_ext specs trains on 2 CPU ranks (EP=2) and its loss falls."""

import pytest

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.tiny_gpt import TinyGPTConfig, train


@pytest.mark.parametrize("spec_kind", ["block", "layer"])
def test_tiny_gpt_moe_trains_with_rowwise_layer(spec_kind):
    records = run_on_ranks(train, 2, TinyGPTConfig(), MoEExtConfig(transport="torch"), 12, None, spec_kind,
                           sizes=ParallelSizes(ep=2))
    rank0 = records[0]
    first, last = rank0[0]["loss"], sum(r["loss"] for r in rank0[-3:]) / 3
    assert last < 0.8 * first, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert all(r["moe_host_syncs"] == 0 for r in rank0), [r["moe_host_syncs"] for r in rank0]
    assert [r["loss"] for r in rank0] == [r["loss"] for r in records[1]], "ranks disagree on the mean loss"


def test_audit_sees_megatron_alltoall_host_syncs():
    """The same audit counts Megatron's own dispatcher's host reads: it can fail."""
    records = run_on_ranks(train, 2, TinyGPTConfig(), None, 1, sizes=ParallelSizes(ep=2))
    assert records[0][0]["moe_host_syncs"] > 0
