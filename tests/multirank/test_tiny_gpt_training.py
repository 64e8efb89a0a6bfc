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


def test_tiny_gpt_trains_the_same_with_the_dropless_arena():
    """Megatron's GPTModel (block spec, 2 MoE layers) with one arena per microbatch: the same losses,
    bitwise, as worst-case dropless over 8 steps while it learns (no route beyond the budget), and
    no host sync in the MoE layers."""
    arena = MoEExtConfig(transport="torch", dropless_arena=True, capacity_factor=1.5, arena_region_factor=0.9)
    got = run_on_ranks(train, 2, TinyGPTConfig(), arena, 8, sizes=ParallelSizes(ep=2))[0]
    want = run_on_ranks(train, 2, TinyGPTConfig(), MoEExtConfig(transport="torch", dropless=True), 8,
                        sizes=ParallelSizes(ep=2))[0]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert all(r["dropped_routes"] == 0 and r["moe_host_syncs"] == 0 for r in got), got
