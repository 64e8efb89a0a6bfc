"""`recomputing`: the torch internal that tells a recompute's forward from the one it repeats."""

import torch
import torch.utils.checkpoint

from megatron_ext.moe.metric_sinks import recomputing


class _Probe(torch.autograd.Function):
    """Records `recomputing()` in its forward and its backward."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        _Probe.seen.append(recomputing())
        ctx.save_for_backward(x)  # a saved tensor: torch's non-reentrant checkpoint recomputes only for those
        return x * x

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append(recomputing())
        (x,) = ctx.saved_tensors
        return grad * 2 * x


def test_recomputing_is_true_only_inside_a_backward():
    _Probe.seen = []
    x = torch.ones(3, requires_grad=True)
    _Probe.apply(x).sum().backward()
    assert _Probe.seen == [False, True]
    assert not recomputing()


def test_a_checkpointed_forward_is_recomputing_only_when_it_repeats():
    for reentrant in (True, False):  # Megatron's checkpoints are reentrant; torch's default is not
        _Probe.seen = []
        x = torch.full((3,), 3.0, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(_Probe.apply, x, use_reentrant=reentrant)
        out.sum().backward()
        # first forward, its recompute in the backward, then the probe's own backward
        assert _Probe.seen == [False, True, True], (reentrant, _Probe.seen)
        assert torch.equal(x.grad, torch.full((3,), 6.0))


def test_megatrons_graph_warm_up_flag_is_where_the_layer_reads_it():
    """in_megatron_graph_warmup reads megatron-core 0.19.2's flag, set around create_fwd_graph's
    eager warm-up loop; if either moves, Megatron's warm-up steps would count as training steps."""
    import inspect

    from megatron.core.transformer import cuda_graphs

    from megatron_ext.moe.metric_sinks import in_megatron_graph_warmup

    source = inspect.getsource(cuda_graphs._CudaGraphRunner.create_fwd_graph)
    assert source.index("_set_warmup_start()") < source.index("self.func(") < source.index("_set_warmup_end()")
    assert not in_megatron_graph_warmup()
    cuda_graphs._set_warmup_start()
    try:
        assert in_megatron_graph_warmup()
    finally:
        cuda_graphs._set_warmup_end()
