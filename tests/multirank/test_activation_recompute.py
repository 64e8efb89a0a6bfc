"""Megatron's activation recompute with the grouped experts and the rowwise layer (gloo ranks, torch
transport): `--recompute-modules moe_act` keeps no activation for the backward and gives the same
outputs and gradients bitwise; Megatron's whole-MoE-layer recompute (`moe`) runs the rowwise layer
twice and gives the same results, as do whole-layer checkpoints (full recompute), counting each
forward's routes once; the experts refuse activation offloading by name.
"""

import pytest
import torch
import torch.utils.checkpoint

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from megatron_ext.specs import moe_builder
from megatron_ext.testing.expert_variants import ExpertParams, expert_param_grads, load_expert_params, variant_config
from megatron_ext.testing.megatron_moe import load_weights, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights

RECOMPUTE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)
ROWS, VALID, COUNTS = 40, 28, [7, 0, 12, 9]


def _expert_step(module, x, probs, grad_out):
    """Forward+backward on a capacity buffer; returns (results, bytes of the [rows, F] tensors kept for
    the backward)."""
    module.zero_grad(set_to_none=True)
    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = module.forward_offsets(x, torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32), probs)
    ffn = module.fc2_weight.shape[2] if module.padding is None else module.padding.ffn_padded  # fc2's GEMM reads
    activation_bytes = sum(t.untyped_storage().nbytes() for t in saved if t.dim() == 2 and t.shape[1] == ffn)
    recomputing = module.recompute_activation
    node = out.grad_fn if module.padding is None else out.grad_fn.next_functions[0][0]  # under the unpad slice
    if not module.fast_path and module.fc2_bias is None:  # else fc2's node sits under the bias add
        assert (type(node).__name__ == "_RecomputedActivationFc2Backward") == recomputing, type(node).__name__
    if module.fast_path:  # its activation lives on the node, not in saved tensors
        activation = out.grad_fn.intermediates[1]
        activation_bytes += 0 if activation is None else activation.untyped_storage().nbytes()
    out.backward(grad_out)
    results = [out[:VALID], x.grad[:VALID], probs.grad[:VALID], *expert_param_grads(module).values()]
    return [t.detach().clone() for t in results], activation_bytes


def _recompute_rank(rank, world, name, hidden, ffn):
    gen = torch.Generator().manual_seed(4)
    x, grad_out = torch.randn(ROWS, hidden, generator=gen), torch.randn(ROWS, hidden, generator=gen)
    probs = torch.rand(ROWS, generator=gen) + 0.1
    runs = []
    for recompute in (False, True):
        extra = RECOMPUTE_ACT if recompute else {}
        config = variant_config(name, hidden=hidden, ffn=ffn, experts=len(COUNTS), **extra)
        module = DeviceOffsetGroupedMLP(len(COUNTS), config)
        load_expert_params(module, ExpertParams.random(config, seed=11))
        assert module.recompute_activation == recompute
        runs.append(_expert_step(module, x, probs, grad_out))
    (kept, kept_bytes), (recomputed, recomputed_bytes) = runs
    # torch.autograd.grad (the graph runner's capture) gives what .backward gave
    leaves = [x.clone().requires_grad_(True), probs.clone().requires_grad_(True), module.fc2_weight]
    out = module.forward_offsets(leaves[0], torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32), leaves[1])
    by_grad = torch.autograd.grad(out, leaves, grad_out)
    assert torch.equal(by_grad[0][:VALID], recomputed[1]) and torch.equal(by_grad[1][:VALID], recomputed[2])
    width = ffn if module.padding is None else module.padding.ffn_padded
    return all(torch.equal(a, b) for a, b in zip(kept, recomputed)), kept_bytes - recomputed_bytes, width, \
        module.fast_path


@pytest.mark.parametrize("name,hidden,ffn", [("swiglu", 32, 16), ("gelu_bias", 32, 16), ("swiglu", 12, 5)])
def test_moe_act_recompute_keeps_no_activation_and_changes_nothing(name, hidden, ffn):
    equal, bytes_freed, width, fast = run_on_ranks(_recompute_rank, 1, name, hidden, ffn, sizes=ParallelSizes())[0]
    assert equal, f"{name} H={hidden} F={ffn}: recompute changed a result"
    assert fast == (name == "swiglu" and hidden == 32)  # the fast path and both general ones are covered
    # At least the [rows, F] fp32 activation fc2 reads is gone (non-gated: also what the activation
    # saved inside; its input, fc1's output, stays for the recompute).
    assert bytes_freed >= ROWS * width * 4, (bytes_freed, ROWS * width * 4)


def _full_layer_recompute(layer, tokens, how):
    """The layer under a whole-layer checkpoint: Megatron's (what --recompute-granularity full wraps
    each transformer layer in; reentrant) or torch's non-reentrant one."""
    if how == "full":
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(lambda t: layer(t)[0], False, tokens)
    return torch.utils.checkpoint.checkpoint(lambda t: layer(t)[0], tokens, use_reentrant=False)


def _layer_rank(rank, world, recompute, ext):
    x, g = rank_tokens(rank, 16, 32)
    results, all_metrics = [], []
    for how in (None, recompute):
        modules = recompute if isinstance(recompute, list) and how else None
        extra = dict(recompute_granularity="selective", recompute_modules=modules, moe_grouped_gemm=True) \
            if modules else {}
        layer = moe_builder(MoEExtConfig(transport="torch", dropless=True, **ext))(
            config=moe_config(hidden=32, ffn=16, experts=8, topk=2, ep=world, **extra))
        load_weights(layer, MoEWeights.random(8, 32, 16, seed=8))
        layer.train()
        assert layer.experts.recompute_activation == (modules == ["moe_act"])
        assert layer.moe_layer_recompute == (modules == ["moe"])  # Megatron checkpoints the whole layer
        tokens = x.clone().view(16, 1, 32).requires_grad_(True)
        out = layer(tokens)[0] if modules or how is None else _full_layer_recompute(layer, tokens, how)
        out.backward(g.view_as(out))
        results.append([out.detach(), tokens.grad, layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad,
                        layer.router.weight.grad])
        metrics = layer.read_metrics()
        assert metrics["steps"] == 1, f"recompute={how}: {metrics['steps']} forwards counted"
        all_metrics.append(metrics)
    assert all_metrics[0] == all_metrics[1], "the recompute changed the route metrics"
    return all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("recompute,ext", [(["moe_act"], {}), (["moe"], {}),
                                           (["moe_act"], dict(mxfp8_dispatch=True)),  # MXFP8: the payload path
                                           ("full", {}), ("full_nonreentrant", {})])
def test_rowwise_layer_under_megatrons_recompute_equals_no_recompute(recompute, ext):
    """Selective recompute (`moe_act`, `moe`) and whole-layer checkpoints (Megatron's full recompute,
    torch's non-reentrant checkpoint): the same outputs, gradients and route metrics as no recompute,
    each forward's routes counted once (the recompute's forward adds nothing)."""
    assert all(run_on_ranks(_layer_rank, 2, recompute, ext, sizes=ParallelSizes(ep=2)))


def test_activation_offloading_is_refused_with_the_flag_to_use_instead():
    config = moe_config(fine_grained_activation_offloading=True, offload_modules=["moe_act"])
    with pytest.raises(ValueError, match=r"--offload-modules moe_act.*--recompute-modules moe_act"):
        DeviceOffsetGroupedMLP._check_config(config)


def test_the_launcher_reads_the_same_settings_from_megatrons_args():
    from argparse import Namespace

    from megatron_ext.rules import ExpertSettings, expert_problems

    args = Namespace(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"],
                     fine_grained_activation_offloading=True, offload_modules=["attn_norm", "expert_fc1"])
    settings = ExpertSettings.from_args(args)
    assert settings.recompute_activation and settings.offloaded == ("expert_fc1",)
    assert any("--offload-modules expert_fc1" in problem for problem in expert_problems(settings))
    full = ExpertSettings.from_args(Namespace(recompute_granularity="full", recompute_modules=["moe_act"]))
    assert not full.recompute_activation and not expert_problems(full)  # full recompute: Megatron's checkpoint


def test_layer_recompute_with_the_graph_runner_is_refused_by_name():
    from types import SimpleNamespace

    from megatron_ext.rules import graph_runner_clash

    graphs = MoEExtConfig(cuda_graphs=True)
    for settings, flag in ((SimpleNamespace(recompute_granularity="selective", recompute_modules=["moe"]),
                            "--recompute-modules moe"),
                           (SimpleNamespace(recompute_granularity="full", recompute_modules=None),
                            "--recompute-granularity full")):
        problems = graph_runner_clash(settings, graphs)
        assert len(problems) == 1 and problems[0].startswith(f"{flag} with --moe-ext-cuda-graphs"), problems
        assert graph_runner_clash(settings, MoEExtConfig()) == []
    deprecated = graph_runner_clash(SimpleNamespace(moe_layer_recompute=True), graphs)  # the launcher's args
    assert len(deprecated) == 1 and deprecated[0].startswith("--moe-layer-recompute with --moe-ext-cuda-graphs")
    moe_act = SimpleNamespace(recompute_granularity="selective", recompute_modules=["moe_act"])
    assert graph_runner_clash(moe_act, graphs) == []
    message = run_on_ranks(_build_graphed_with_moe_recompute, 1, sizes=ParallelSizes())[0]
    assert "--recompute-modules moe with --moe-ext-cuda-graphs" in message, message


def _build_graphed_with_moe_recompute(rank, world):
    config = moe_config(recompute_granularity="selective", recompute_modules=["moe"])
    with pytest.raises(ValueError) as refused:
        moe_builder(MoEExtConfig(transport="symm", cuda_graphs=True))(config=config)
    return str(refused.value)


def test_a_double_backward_through_the_recompute_node_is_refused_not_given_wrong():
    """Its backward runs autograd inside; second derivatives would miss the recomputed graph."""
    from megatron_ext.moe.expert_recompute import activation_then_fc2

    gen = torch.Generator().manual_seed(2)
    h = torch.randn(ROWS, 8, generator=gen, requires_grad=True)
    fc2 = torch.randn(len(COUNTS), 4, 8, generator=gen)  # rows of 16-byte multiples (torch._grouped_mm)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    out = activation_then_fc2(lambda x, valid, probs: torch.nn.functional.gelu(x), h, offsets[-1], None, fc2, offsets)
    grad_out = torch.randn(out.shape, generator=gen, requires_grad=True)
    (grad_h,) = torch.autograd.grad(out, h, grad_out, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_h.sum().backward()


def test_the_recompute_node_gives_the_probabilities_their_gradient_alone():
    """fc1's output frozen (its input and fc1 need no gradient) and the probabilities training: their
    gradient equals the one through the kept activation."""
    from megatron_ext.moe.expert_recompute import activation_then_fc2

    gen = torch.Generator().manual_seed(4)
    h = torch.randn(ROWS, 8, generator=gen)
    probs = torch.rand(ROWS, generator=gen)
    fc2 = torch.randn(len(COUNTS), 4, 8, generator=gen)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    grad_out = torch.randn(ROWS, 4, generator=gen)

    def activation(x, valid, p):
        return torch.nn.functional.gelu(x) * p[:, None]

    got = probs.clone().requires_grad_(True)
    activation_then_fc2(activation, h, offsets[-1], got, fc2, offsets).backward(grad_out)
    want = probs.clone().requires_grad_(True)
    torch._grouped_mm(activation(h, None, want), fc2.transpose(1, 2), offs=offsets).backward(grad_out)
    # rows past the last offset belong to no expert: torch._grouped_mm leaves their gradient unspecified
    torch.testing.assert_close(got.grad[:VALID], want.grad[:VALID], rtol=1e-6, atol=1e-6)


def test_the_recompute_node_trains_fc2_alone_without_probabilities():
    """fc1's output frozen and no probabilities (they were applied on the input): fc2's weight gradient
    equals the one through the kept activation, and nothing else is asked for."""
    from megatron_ext.moe.expert_recompute import activation_then_fc2

    gen = torch.Generator().manual_seed(5)
    h = torch.randn(ROWS, 8, generator=gen)
    fc2 = torch.randn(len(COUNTS), 4, 8, generator=gen)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    grad_out = torch.randn(ROWS, 4, generator=gen)

    def activation(x, valid, p):
        assert p is None, "no probabilities were given"
        return torch.nn.functional.gelu(x)

    got = fc2.clone().requires_grad_(True)
    activation_then_fc2(activation, h, offsets[-1], None, got, offsets).backward(grad_out)
    want = fc2.clone().requires_grad_(True)
    torch._grouped_mm(activation(h, None, None), want.transpose(1, 2), offs=offsets).backward(grad_out)
    assert h.grad is None
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)
