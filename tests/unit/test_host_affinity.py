"""host_affinity: which core a rank takes, and that the forward and backward threads get pinned."""

import os
import threading

import pytest
import torch

from megatron_ext import host_affinity
from megatron_ext.config import MoEExtConfig


def test_ranks_of_one_host_take_different_cores():
    cores = set(range(16))
    assert [host_affinity.choose_core(cores, rank, 8) for rank in range(8)] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert host_affinity.choose_core(cores, 0, 1) == 0
    # a launcher that bound each rank to its own cores: the rank stays inside them
    assert host_affinity.choose_core({8, 9, 10, 11}, 1, 2) in {8, 9, 10, 11}
    with pytest.raises(ValueError, match="at least one allowed CPU core"):
        host_affinity.choose_core(set(), 0, 1)
    for rank in (3, 2):  # 2: the first rank past the host (it would index past the cores' shares)
        with pytest.raises(ValueError, match=f"local rank {rank} is outside a host of 2"):
            host_affinity.choose_core(cores, rank, 2)


def test_ranks_share_uneven_and_unordered_cores_in_core_order():
    """Rank r of R on N cores takes the floor(r * N / R)-th lowest core: 10 cores over 4 ranks give
    indices 0, 2, 5, 7 (shares 2.5 wide); the allowed set's iteration order does not matter
    ({3, 17, 40, 100} iterates 40 first)."""
    assert [host_affinity.choose_core(set(range(10)), rank, 4) for rank in range(4)] == [0, 2, 5, 7]
    assert [host_affinity.choose_core({3, 17, 40, 100}, rank, 2) for rank in range(2)] == [3, 40]


def test_host_core_reads_the_local_rank_and_the_cores_the_launcher_allowed(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})
    monkeypatch.setenv("RANK", "5")  # the global rank says nothing about this host
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # then LOCAL_RANK + 1 ranks on the host
    assert host_affinity.host_core() == 10
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_affinity.host_core() == 9


def _in_thread(fn):
    """Run fn in a fresh thread (pinning it leaves the test process's threads alone); return its result."""
    result = {}

    def run():
        result["value"] = fn()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["value"]


def _own_affinity():
    return os.sched_getaffinity(threading.get_native_id())


def test_forward_thread_is_pinned_at_once_and_backward_thread_at_its_backward(monkeypatch):
    monkeypatch.setattr(host_affinity, "_backward_thread_pinned", False)
    core = max(os.sched_getaffinity(0))
    x = torch.randn(4, 3, requires_grad=True)

    def forward():
        y = x * 2
        host_affinity.pin_submitting_threads(y, core)
        return y, _own_affinity()

    y, forward_affinity = _in_thread(forward)
    assert forward_affinity == {core}

    def backward():
        before = _own_affinity()
        y.sum().backward()  # CPU autograd runs on the calling thread: the hook pins it here
        return before, _own_affinity()

    before, after = _in_thread(backward)
    assert after == {core} and before == os.sched_getaffinity(0)
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # the hook leaves the gradient alone
    z = x * 3  # later forwards add no hook: a backward thread is pinned
    _in_thread(lambda: host_affinity.pin_submitting_threads(z, core))
    assert not z._backward_hooks


def test_a_forward_without_gradients_adds_no_hook(monkeypatch):
    """An evaluation forward under no_grad before training: nothing to hook (register_hook would raise)."""
    monkeypatch.setattr(host_affinity, "_backward_thread_pinned", False)
    core = min(os.sched_getaffinity(0))

    def forward():
        with torch.no_grad():
            y = torch.randn(3, requires_grad=True) * 2
        host_affinity.pin_submitting_threads(y, core)
        return y._backward_hooks

    assert not _in_thread(forward)


def test_pinning_a_thread_happens_once():
    core = min(os.sched_getaffinity(0))
    assert _in_thread(lambda: (host_affinity.pin_current_thread(core), host_affinity.pin_current_thread(core),
                               _own_affinity())) == (True, False, {core})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")
def test_a_thread_pinned_to_one_core_can_be_moved_to_another():
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert _in_thread(lambda: (host_affinity.pin_current_thread(first), host_affinity.pin_current_thread(second),
                               _own_affinity())) == (True, True, {second})


def test_megatron_dispatcher_refuses_pinning():
    with pytest.raises(ValueError, match="pin_host_threads applies to the rowwise layer"):
        MoEExtConfig(dispatcher="megatron", pin_host_threads=True)
    with pytest.raises(TypeError, match="pin_host_threads must be True or False"):
        MoEExtConfig(pin_host_threads=1)


def test_platform_without_sched_setaffinity_is_told_to_turn_it_off(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(RuntimeError, match="needs Linux's sched_setaffinity; turn it off"):
        host_affinity.host_core()
