"""The symm transport's ordering across EP ranks, on simulated peers (threads + Triton interpreter).

The first two-GPU run found that debug poison wiped rows a faster peer had already PUT. These
tests replay the transport's phases on 2 and 4 simulated ranks with fresh routes every step,
drops (cf 1.0) and none (cf 1.25), one and two live microbatches in both backward orders, poison
on and off, and delays that let one rank run ahead as far as the barriers allow.
"""

import pytest

from tests.unit.interpreter import run_at_once, run_shards


def test_symm_phases_are_ordered_on_simulated_ranks():
    returncode, out = run_shards("_symm_ordering_interp.py")
    assert returncode == 0 and "FAIL" not in out, out
    assert out.count("\nok ") + out.startswith("ok ") == 8, out


@pytest.mark.parametrize("phase", ["route-count exchange", "dispatch", "combine", "combine backward",
                                   "dispatch backward"])
def test_each_phase_barrier_is_needed(phase):
    """Without any one of the transport's phase barriers a late rank reads rows or counts before its
    peer wrote them, or a peer overwrites what it still reads: the checks must see it. The case has
    no debug poison, whose own barriers before PUTs would hide a missing combine-backward barrier."""
    proc, = run_at_once([["_symm_ordering_interp.py", "--drop-barrier", phase, "--case", "cf1.0_one_mb_late_rank0"]])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL cf1.0_one_mb_late_rank0" in proc.stdout and "wrong" in proc.stdout, proc.stdout


def test_unfenced_poison_is_caught():
    """The pre-fix poison (NaN fill with no barrier before peers write) must fail the check."""
    cases = ["--case", "cf1.0_one_mb_poison_late_rank0", "--case", "cf1.0_two_mb_late_rank1_poison"]
    proc, = run_at_once([["_symm_ordering_interp.py", "--unfenced-poison", *cases]])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("FAIL ") == 2 and "NaN" in proc.stdout, proc.stdout


def test_put_return_phases_are_ordered_on_simulated_ranks():
    """return_transfer="put" (combine and dispatch backward PUT rows back to their routes) on 2 and 4
    simulated ranks with poison and a late rank: outputs, token and probability gradients exact."""
    returncode, out = run_shards("_symm_ordering_interp.py", "--return-put")
    assert returncode == 0 and "FAIL" not in out, out
    assert out.count("ok put_") == 5, out


def test_put_return_without_its_barrier_is_caught():
    """The sum read before a late peer's rows landed: the same check must see it (the case has no
    debug poison, whose own barrier before the PUT would narrow the window to a race)."""
    proc, = run_at_once([["_symm_ordering_interp.py", "--return-put", "--unfenced-put-back", "--case",
                          "put_cf1.0_one_mb_late_rank1"]])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("FAIL put_") == 1, proc.stdout


def test_fused_route_map_phases_are_ordered_on_simulated_ranks():
    """The GPU route map (Triton kernels, the default on GPUs) on 2 and 4 simulated ranks: the plan
    reads the count table peers PUT over symmetric memory, then the same checks as above."""
    returncode, out = run_shards("_symm_ordering_interp.py", "--fused-route-map")
    assert returncode == 0 and "FAIL" not in out, out
    assert out.count("ok fused_") == 2, out


def test_dropless_arena_spills_are_ordered_on_simulated_ranks():
    """The arena's layers on 2 and 4 simulated ranks: each layer's spill out of region i+1 comes
    before any peer PUTs the next layer's rows there, and comes back before the backward reads."""
    returncode, out = run_shards("_arena_ordering_interp.py")
    assert returncode == 0 and "FAIL" not in out, out
    assert out.count("ok ep") == 3, out


def test_a_spill_after_the_next_dispatch_is_caught():
    mutations = ("--spill-deferred", "--no-spill")
    runs = [["_arena_ordering_interp.py", mutation, "--case", "ep2_spills_late_rank0"] for mutation in mutations]
    for proc in run_at_once(runs):
        assert proc.returncode == 1 and "rows read by the backward wrong" in proc.stdout, proc.stdout + proc.stderr


def test_dropless_arena_with_put_return_on_simulated_ranks():
    """return_transfer="put" in the arena: the rows' return ids spill and come back with them, so
    the dispatch backward sends each spilled row's gradient to its route; without that spill
    (the ids left in region i+1, which the next layer's dispatch overwrites) the check fails."""
    kept = ["_arena_ordering_interp.py", "--return-put", "--case", "ep2_two_mb_random",
            "--case", "ep4_spills_late_rank1"]
    *shards, lost = run_at_once([[*kept, "--shard", "0/2"], [*kept, "--shard", "1/2"],
                                 ["_arena_ordering_interp.py", "--return-put", "--no-id-spill", "--case",
                                  "ep2_spills_late_rank0"]])
    for proc in shards:
        assert proc.returncode == 0 and proc.stdout.count("ok ep") == 1, proc.stdout + proc.stderr
    assert lost.returncode == 1 and "token gradient wrong" in lost.stdout, lost.stdout + lost.stderr
