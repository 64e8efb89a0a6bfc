"""Lease pool: slots are held until released, exhaustion is a clear error, poison fills NaN."""

import pytest
import torch

from megatron_ext.moe.buffers import LeasePool, TorchSymmetricHeap, allocate_symmetric, rows_with_values, shared_scratch


def make_pool(slots, poison=False):
    return LeasePool([allocate_symmetric((4, 8), torch.float32, torch.device("cpu"), None) for _ in range(slots)],
                     poison=poison)


def test_slots_are_exclusive_until_released():
    pool = make_pool(2)
    first, second = pool.acquire(), pool.acquire()
    assert {first.slot, second.slot} == {0, 1} and pool.live == 2
    with pytest.raises(RuntimeError, match="raise --moe-ext-lease-slots"):
        pool.acquire()
    first.release()
    first.release()  # idempotent: a double release must not free someone else's slot
    third = pool.acquire()
    assert third.slot == first.slot and pool.live == 2
    with pytest.raises(RuntimeError):
        pool.acquire()


def test_poison_marks_released_and_fresh_slots():
    pool = make_pool(1, poison=True)
    lease = pool.acquire()
    assert torch.isnan(lease.buffer.local).all(), "a fresh slot must be poisoned before rows are written"
    lease.buffer.local.fill_(1.0)
    lease.release()
    assert torch.isnan(pool.slots[0].local).all(), "a released slot must be poisoned"


def test_single_rank_peer_table_points_at_the_local_buffer():
    buf = allocate_symmetric((4, 8), torch.float32, torch.device("cpu"), None)
    assert buf.peer_table.dtype == torch.int64 and buf.peer_table.tolist() == [buf.local.data_ptr()]
    buf.barrier()  # no-op with one rank


@pytest.mark.parametrize("width, dtype", [(13, torch.bfloat16), (8, torch.float32), (5, torch.float16)])
def test_rows_with_values_share_one_allocation_without_overlap(width, dtype):
    """Rows then per-row fp32 values in one allocation: the values start 16-byte aligned after the
    rows, the value table points at them, writing one never touches the other, and a poisoned
    slot has NaN in both."""
    from megatron_ext.moe.buffers import TorchSymmetricHeap, rows_with_values

    capacity = 7
    slot = rows_with_values(TorchSymmetricHeap(None), capacity, width, dtype, torch.device("cpu"))
    assert slot.local.shape == (capacity, width) and slot.local.dtype == dtype
    assert slot.values.shape == (capacity,) and slot.values.dtype == torch.float32
    values_at = slot.values.data_ptr() - slot.local.data_ptr()
    assert values_at % 16 == 0 and values_at >= slot.local.nbytes
    assert int(slot.values_table[0]) == slot.values.data_ptr() and int(slot.peer_table[0]) == slot.local.data_ptr()
    slot.local.fill_(3.0)
    slot.values.fill_(-1.0)
    assert bool((slot.local == 3.0).all()) and bool((slot.values == -1.0).all())
    pool = LeasePool([slot], poison=True)
    pool.acquire()
    assert slot.local.isnan().all() and slot.values.isnan().all()


def test_a_poisoned_slot_is_fenced_by_the_transports_barrier():
    """The fill's barrier is the transport's (bounded by the peer timeout and named to its watchdog,
    SymmRowTransport.poison_fence), and it runs after the fill: peers PUT only after it."""
    seen = []
    pool = make_pool(1, poison=True)
    pool.fence = lambda buffer: seen.append((buffer is pool.slots[0], bool(buffer.local.isnan().all())))
    pool.acquire()
    assert seen == [(True, True)]


def test_a_named_slot_is_leased_only_while_free():
    """The graph runner asks for its graph's slot by index: a busy one is refused, not leased twice."""
    pool = make_pool(2)
    lease = pool.acquire(slot=1)
    with pytest.raises(RuntimeError, match="slot 1 of this MoE layer holds a live microbatch"):
        pool.acquire(slot=1)
    assert pool.acquire().slot == 0  # the other slot is still free
    lease.release()
    assert pool.acquire(slot=1).slot == 1


def test_a_stale_second_release_frees_nothing_of_the_next_lease():
    pool = make_pool(1)
    first = pool.acquire()
    first.release()
    second = pool.acquire()
    first.release()  # a second release of the old lease: the slot belongs to `second` now
    assert pool.live == 1 and second.slot == 0
    with pytest.raises(RuntimeError, match="hold a live microbatch"):
        pool.acquire()


def test_return_ids_start_16_byte_aligned_after_the_values():
    slot = rows_with_values(TorchSymmetricHeap(None), 7, 5, torch.bfloat16, torch.device("cpu"), return_ids=True)
    returns_at = slot.return_ids.data_ptr() - slot.local.data_ptr()
    assert returns_at % 16 == 0 and returns_at >= slot.values.data_ptr() - slot.local.data_ptr() + 4 * 7
    assert slot.return_ids.shape == (7,) and int(slot.return_table[0]) == slot.return_ids.data_ptr()


def test_scratch_of_one_role_is_one_buffer_per_shape():
    small = shared_scratch("test-role", (4, 8), torch.float32, torch.device("cpu"), None)
    large = shared_scratch("test-role", (8, 8), torch.float32, torch.device("cpu"), None)
    assert small.local.shape == (4, 8) and large.local.shape == (8, 8) and small is not large
    assert shared_scratch("test-role", (4, 8), torch.float32, torch.device("cpu"), None) is small
    half = shared_scratch("test-role", (4, 8), torch.bfloat16, torch.device("cpu"), None)
    assert half is not small and half.local.dtype == torch.bfloat16  # same bytes per row would not do


def test_a_symm_layers_rows_keep_their_width_and_dtype():
    """The dispatch slots are allocated at the first dispatch; rows of the same width in another
    dtype would reinterpret the slots' bits, so they are refused like another width."""
    from megatron_ext.moe.transport.symm import SymmRowTransport

    transport = SymmRowTransport(None, 8)
    transport._ensure_buffers(16, torch.float32, torch.device("cpu"))
    transport._ensure_buffers(16, torch.float32, torch.device("cpu"))  # the same rows again: kept
    for width, dtype in ((16, torch.bfloat16), (32, torch.float32)):
        with pytest.raises(ValueError, match="row size and dtype must stay fixed"):
            transport._ensure_buffers(width, dtype, torch.device("cpu"))


def test_release_all_poisons_what_it_frees():
    pool = make_pool(2, poison=True)
    pool.acquire()
    pool.slots[0].local.fill_(1.0)
    pool.release_all()
    assert pool.live == 0 and pool.slots[0].local.isnan().all()


def test_a_one_rank_group_gets_plain_local_memory(monkeypatch):
    """EP = 1 under a process group of one rank: no symmetric allocation or rendezvous."""
    from megatron_ext.moe import buffers

    monkeypatch.setattr(buffers.dist, "get_world_size", lambda group=None: 1)
    buffer = allocate_symmetric((4, 2), torch.float32, torch.device("cpu"), object())
    assert buffer.handle is None and buffer.peer_table.tolist() == [buffer.local.data_ptr()]
