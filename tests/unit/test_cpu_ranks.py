"""run_on_ranks, the forked gloo harness every multi-rank CPU test stands on: what each rank is
given, a rank that never finishes, a rank that dies, and no state inherited from the parent."""

import os
import time
import types

import pytest

from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, _record_dead_ranks, run_on_ranks


def _environment(rank, world):
    import torch.distributed as dist

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return tuple(os.environ[name] for name in names), dist.get_rank(), dist.get_world_size()


def test_each_rank_sees_its_own_rank_in_the_environment_and_the_results_come_back_in_rank_order():
    """Code that reads torchrun's variables (Megatron's launch helpers, ours) sees what torchrun sets."""
    assert run_on_ranks(_environment, 2, timeout=60) == [(("0", "2", "0", "2"), 0, 2), (("1", "2", "1", "2"), 1, 2)]


def _sleep_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(20)
    return rank


def test_a_rank_that_does_not_finish_is_reported_at_the_timeout():
    """A deadlocked rank must fail the test at `timeout`, naming the rank, not hang the suite."""
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[1\] did not finish within 2 s"):
        run_on_ranks(_sleep_on_rank_1, 2, timeout=2)
    assert time.monotonic() - start < 10


def test_a_dead_rank_is_recorded_on_the_second_empty_poll():
    """The first empty poll after a rank died may still be followed by the result it queued just before
    exiting; only the second records it as dead, with its exit code."""
    procs = [types.SimpleNamespace(is_alive=lambda: False, exitcode=-9),
             types.SimpleNamespace(is_alive=lambda: True, exitcode=None)]
    outcomes, seen_dead = {}, set()
    _record_dead_ranks(procs, outcomes, seen_dead)
    assert outcomes == {} and seen_dead == {0}
    _record_dead_ranks(procs, outcomes, seen_dead)
    assert outcomes == {0: (False, "rank 0 exited with code -9 without a result (killed, or os._exit)\n")}


def _has_probe(rank, world):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return "audit_probe" in get_moe_metrics_tracker().metrics


def test_ranks_start_with_a_fresh_moe_metrics_tracker():
    """Megatron's MoE metrics tracker is process-global and sized by the first model: a rank must not
    inherit the parent's through fork (a deeper model than an earlier test's failed with an IndexError)."""
    import torch
    from megatron.core.transformer.moe.moe_logging import (MetricEntry, destroy_moe_metrics_tracker,
                                                           get_moe_metrics_tracker)

    get_moe_metrics_tracker().metrics["audit_probe"] = MetricEntry(values=torch.zeros(3))
    try:
        assert run_on_ranks(_has_probe, 1, sizes=ParallelSizes(), timeout=60) == [False]
    finally:
        destroy_moe_metrics_tracker()
