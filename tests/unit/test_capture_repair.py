"""cuda_graphs/capture.py's repair logic on CPU, with stand-ins for torch.cuda.graph, the graph and
the allocator's pool calls: the stream is always restored and the garbage collector back on; a
failed body drops the partial graph; a failed capture_end hands the pool back and clears the RNG's
capture flag; the body's error is the one reported, with the legacy-stream hint where it applies."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_ext.cuda_graphs import capture as capture_module
from megatron_ext.cuda_graphs.capture import CaptureFailed, capture


class _Graph:
    def __init__(self, events, end_error=None):
        self.events, self.end_error = events, end_error

    def capture_end(self):
        self.events.append("capture_end")
        if self.end_error is not None:
            raise self.end_error

    def reset(self):
        self.events.append("graph reset")


class _Events(list):
    context = None  # the torch.cuda.graph stand-in, whose begin_error a test may set


@pytest.fixture
def events(monkeypatch):
    events = _Events()

    class _StreamContext:
        def __exit__(self, *exc):
            events.append("stream restored")

    class _GraphContext:
        begin_error = None

        def __init__(self, graph, pool, capture_error_mode):
            assert capture_error_mode == "thread_local"
            events.append(f"capture into {pool}")
            self.stream_ctx = _StreamContext()

        def __enter__(self):
            if _GraphContext.begin_error is not None:
                raise _GraphContext.begin_error

    events.context = _GraphContext
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "own pool")
    monkeypatch.setattr(torch.cuda, "graph", _GraphContext)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: events.append(f"end {device} {pool}"))
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: events.append(f"release {device} {pool}"))
    monkeypatch.setattr(capture_module, "_clear_rng_capture_flag", lambda: events.append("rng flag cleared"))
    return events


def _body(events, error=None):
    def fn():
        events.append(f"fn, gc {'on' if gc.isenabled() else 'off'}")
        if error is not None:
            raise error
        return "result"
    return fn


def test_a_capture_returns_the_bodys_result(events):
    assert capture(_Graph(events), _body(events), pool="given pool") == "result"
    assert events == ["capture into given pool", "fn, gc off", "capture_end", "stream restored"]
    assert gc.isenabled()


def test_a_failed_body_drops_the_partial_graph(events):
    with pytest.raises(CaptureFailed, match=r"^RuntimeError: boom$") as failed:
        capture(_Graph(events), _body(events, RuntimeError("boom")))
    assert events == ["capture into own pool", "fn, gc off", "capture_end", "stream restored", "graph reset"]
    assert str(failed.value.__cause__) == "boom" and gc.isenabled()


def test_a_failed_capture_end_hands_the_pool_back_and_clears_the_rng_flag(events):
    invalidated = RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(CaptureFailed, match="^RuntimeError: operation not permitted when stream is capturing$"):
        capture(_Graph(events, end_error=invalidated), _body(events))
    assert events == ["capture into own pool", "fn, gc off", "capture_end", "stream restored", "end 3 own pool",
                      "release 3 own pool", "rng flag cleared"]
    events.clear()
    with pytest.raises(CaptureFailed, match=r"^RuntimeError: the body's own error$"):  # the cause, not the symptom
        capture(_Graph(events, end_error=invalidated), _body(events, RuntimeError("the body's own error")))
    assert "graph reset" not in events and "rng flag cleared" in events


def test_the_legacy_stream_failure_names_the_fix(events):
    with pytest.raises(CaptureFailed, match=r"legacy stream.*; hint: the parameters' gradient accumulators were "
                                            r"created on the default \(legacy\) CUDA stream"):
        capture(_Graph(events), _body(events, RuntimeError("cannot capture on the legacy stream")))
    events.clear()
    with pytest.raises(CaptureFailed) as failed:
        capture(_Graph(events), _body(events, RuntimeError("boom")))
    assert "hint" not in str(failed.value)


def test_a_capture_that_cannot_begin_restores_the_stream(events):
    events.context.begin_error = RuntimeError("capture already underway")
    with pytest.raises(CaptureFailed, match=r"^capture could not begin: RuntimeError: capture already underway$"):
        capture(_Graph(events), _body(events))
    assert events == ["capture into own pool", "stream restored"]
