"""The rowwise layer over the symm transport at EP 2, 3 and 4, on forked ranks (Triton interpreter).

The ordering tests (test_symm_ordering.py) drive the transport alone on threads; here the whole
layer runs as in training, each rank a process with its own Megatron state, its kernels writing
into the peers' buffers in a shared-memory pool: one step against the dense oracle (drops,
debug poison, PUT return, uneven tokens), and stacks of layers over several steps bitwise equal
to the torch transport with a late rank (two live microbatches, the dropless arena spilling,
MXFP8 payloads, PUT return at EP=4 and into the arena at EP=2); and Megatron's GPTModel trains
over it with the same losses, bitwise, and no host read in its MoE layers. Dropping any phase
barrier, or the poison fill's barrier, must make the results differ.
"""

import pytest

from tests.unit.interpreter import run_at_once, run_shards
from tests.unit.symm_mutations import PHASES


def test_layer_over_symm_transport_on_forked_ranks():
    returncode, out = run_shards("_symm_layer_interp.py")
    assert returncode == 0 and "FAIL" not in out, out
    assert out.count("\nok ") + out.startswith("ok ") == 11, out


def test_each_barrier_is_needed_in_the_layer():
    """Without any one of the transport's phase barriers the late rank reads rows or counts before its peer
    wrote them, or the peer overwrites what it still reads; without the poison fill's barrier (the first
    two-GPU run's race) the late rank's fill wipes rows peers already PUT (two live microbatches, and in the
    arena): the layer's results must differ. One step each; the two mutations run in two processes at once."""
    dropped = [arg for phase in PHASES for arg in ("--drop-barrier", phase)]
    phases, poison = run_at_once([
        ["_symm_layer_interp.py", "--case", "ep2_two_live_microbatches_poison", "--steps", "1", *dropped],
        ["_symm_layer_interp.py", "--unfenced-poison", "--case", "ep2_two_live_microbatches_poison", "--case",
         "ep2_arena_spill_poison", "--steps", "1"]])
    assert phases.returncode == 1, phases.stdout + phases.stderr[-3000:]
    runs = phases.stdout.split("-- without the ")[1:]
    assert [run.split(" barrier")[0] for run in runs] == list(PHASES), phases.stdout
    for run in runs:
        assert "FAIL ep2_two_live_microbatches_poison: EP=2" in run and "tensor" in run, run
    assert poison.returncode == 1, poison.stdout + poison.stderr[-3000:]
    assert poison.stdout.count("FAIL ep2_") == 2 and "NaN" in poison.stdout, poison.stdout


def _misordered_rank(rank, world, peers, mistake):
    import torch

    def allocate(heap):
        if mistake == "shape":  # rank 1 asks for the transpose: same bytes, another shape
            heap.allocate((4, 8) if rank == 0 else (8, 4), torch.float32, "cpu")
            return None
        first, second = (heap.allocate((4, 8), torch.float32, "cpu") for _ in range(2))
        (first if rank == 0 else second).barrier()  # "barrier": ranks meet on different allocations
    return peers.run_rank(rank, allocate)


@pytest.mark.parametrize("mistake,message", [("shape", "allocated out of order"),
                                             ("barrier", "different symmetric allocations")])
def test_forked_peers_refuse_ranks_that_disagree(mistake, message):
    """The simulation's own checks: ranks must allocate the same buffers in the same order, and barrier
    on the same allocation (on GPUs each allocation has its own signal pad)."""
    from megatron_ext.cpu_ranks import RankFailure, run_on_ranks
    from megatron_ext.testing.forked_peers import ForkedPeers

    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_misordered_rank, 2, ForkedPeers(2, bytes_per_rank=1 << 16, timeout_s=10), mistake,
                     timeout=60, wait_all=True)
