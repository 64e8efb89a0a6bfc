"""The simulated ranks' barrier (megatron_ext.testing.threaded_peers) holds the GPU's contract."""

import pytest
import torch

from megatron_ext.testing.threaded_peers import ThreadedPeers


def _barrier_on(rank, heaps, order):
    buffers = [heaps[rank].allocate((4,), torch.float32, "cpu") for _ in range(2)]
    for index in order[rank]:
        buffers[index].barrier()
    return [float(b.local.sum()) for b in buffers]


def test_ranks_meet_at_barriers_of_the_same_allocation():
    peers = ThreadedPeers(2, timeout_s=10)
    heaps = [peers.heap(rank) for rank in range(2)]
    assert peers.run(_barrier_on, heaps, [[0, 1], [0, 1]]) == [[0.0, 0.0], [0.0, 0.0]]
    assert peers.barriers_passed == [2, 2]


def test_ranks_barriering_on_different_allocations_fail():
    """On GPUs each allocation has its own signal pad: rank 0 waiting on buffer 0 while rank 1 waits
    on buffer 1 would hang. One threading.Barrier for all would let them pass: it must refuse."""
    peers = ThreadedPeers(2, timeout_s=10)
    heaps = [peers.heap(rank) for rank in range(2)]
    with pytest.raises(RuntimeError, match=r"different symmetric allocations \[[01], [01]\]"):
        peers.run(_barrier_on, heaps, [[0, 1], [1, 0]])
