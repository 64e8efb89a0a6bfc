"""The GPU proofs' host-side logic on CPU (megatron_ext/host_sync.py), with a stand-in profiler and
CUDA calls: which profiled events count as blocking, the profiler's own synchronizations taken
off, and which warm-up step of capture_replay runs under the profiler."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_ext import host_sync
from megatron_ext.cuda_graphs import capture as capture_module


class _Profile:
    """torch.profiler.profile's stand-in: the events a step records, then the profiler's own stop sync."""
    recorded: list[str] = []

    def __init__(self, activities):
        pass

    def __enter__(self):
        _Profile.recorded = []
        return self

    def __exit__(self, *exc):
        _Profile.recorded.append("cudaDeviceSynchronize")  # the profiler synchronizes when it stops

    def events(self):
        return [SimpleNamespace(name=name) for name in _Profile.recorded]


@pytest.fixture
def profiler(monkeypatch):
    monkeypatch.setattr(torch.profiler, "profile", _Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_blocking_calls_are_counted_without_the_profilers_own(profiler):
    def step():
        _Profile.recorded += ["cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync",
                              "Memcpy DtoH (Device -> Pageable)", "Memcpy HtoD (Pageable -> Device)",
                              "cudaEventSynchronize", "cudaStreamSynchronize"]
    assert host_sync.profiled_sync_calls(step) == {"cudaStreamSynchronize": 2, "cudaEventSynchronize": 1,
                                                   "Memcpy DtoH (Device -> Pageable)": 1}
    assert host_sync.profiled_sync_calls(lambda: _Profile.recorded.append("cudaLaunchKernel")) == {}, \
        "a step without blocking calls finds none (the profiler's stop sync is not the step's)"
    assert host_sync.profiled_sync_calls(lambda: _Profile.recorded.append("cudaDeviceSynchronize")) == {
        "cudaDeviceSynchronize": 1}


def test_capture_replay_profiles_the_last_warm_up_step(monkeypatch):
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace())
    monkeypatch.setattr(capture_module, "capture", lambda graph, fn: fn())
    calls, profiled = [], []

    def step():
        calls.append(len(calls))
        return "outputs"

    def profiled_sync_calls(fn):
        profiled.append(len(calls))
        fn()
        return {}
    monkeypatch.setattr(host_sync, "profiled_sync_calls", profiled_sync_calls)
    graph, outputs = host_sync.capture_replay(step, warmup=3)
    assert calls == [0, 1, 2, 3] and profiled == [2], "warm-ups 0 and 1 eagerly, 2 under the profiler, then capture"
    assert outputs == "outputs" and graph.captured_step is step
    monkeypatch.setattr(host_sync, "profiled_sync_calls", lambda fn: {"cudaStreamSynchronize": 1})
    with pytest.raises(host_sync.HostSyncFound, match=r"blocking CUDA calls in an eager run: "
                                                      r"\{'cudaStreamSynchronize': 1\}"):
        host_sync.capture_replay(step, warmup=1)
    calls.clear()
    host_sync.capture_replay(step, warmup=2, check_blocking=False)
    assert calls == [0, 1, 2]


def test_capture_replay_needs_a_warm_up_step_to_profile():
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        host_sync.capture_replay(lambda: None, warmup=0)
