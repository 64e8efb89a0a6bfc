"""The torch internals megatron_ext.cuda_graphs.capture relies on still exist (fails loudly if not)."""

import inspect

import torch


def test_torch_graph_context_keeps_its_stream_context():
    init = inspect.getsource(torch.cuda.graphs.graph.__init__)
    exit_ = inspect.getsource(torch.cuda.graphs.graph.__exit__)
    assert "self.stream_ctx = torch.cuda.stream(" in init, "torch.cuda.graph no longer keeps stream_ctx"
    assert "self.cuda_graph.capture_end()" in exit_ and "self.stream_ctx.__exit__" in exit_, \
        "torch.cuda.graph.__exit__ changed: re-check megatron_ext/cuda_graphs/capture.py"
    assert "capture_error_mode" in inspect.signature(torch.cuda.graph).parameters


def test_allocator_pool_entry_points_exist():
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        assert hasattr(torch._C, name), f"torch._C.{name} is gone: re-check megatron_ext/cuda_graphs/capture.py"
    assert callable(torch.cuda.graph_pool_handle)
    for name in ("capture_end", "reset", "replay"):
        assert hasattr(torch.cuda.CUDAGraph, name), f"CUDAGraph.{name} is gone"
