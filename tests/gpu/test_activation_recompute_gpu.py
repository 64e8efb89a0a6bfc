"""Megatron's `--recompute-modules moe_act` with the rowwise layer on one H200 (bf16, symm transport):
the fast path (SwiGLU) and a general path (GEGLU, moe/expert_recompute.py) give
bitwise the results without it, hold less memory after the forward by at least the activation's
[C, F], and replay under the graph runner equal to eager."""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.bench.measurement import held_for_backward
from megatron_ext.config import MoEExtConfig
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, moe_config
from tests.gpu import test_graph_runner_gpu as graph_runner_tests

pytestmark = pytest.mark.gpu
SHAPE = graph_runner_tests.SHAPE  # the graph-runner tests' layer, and their two module fixtures
single_rank = graph_runner_tests.single_rank
weights = graph_runner_tests.weights
TOKENS = 2048
RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)
VARIANTS = {"swiglu": {}, "geglu": dict(activation_func=F.gelu)}


def make_layer(weights, variant, recompute, **ext):
    config = moe_config(**SHAPE, dtype=torch.bfloat16, use_cpu_initialization=False, moe_router_dtype="fp32",
                        **VARIANTS[variant], **(RECOMPUTE if recompute else {}))
    layer = moe_builder(MoEExtConfig(transport="symm", **ext))(config=config).cuda()
    load_weights(layer, weights)
    assert layer.experts.recompute_activation == recompute
    assert layer.experts.fast_path == (variant == "swiglu")
    return layer


def batch(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, 1, SHAPE["hidden"], device="cuda", generator=gen).bfloat16()
    return x, torch.randn(x.shape, device="cuda", generator=gen).bfloat16()


def step(layer, x, g):
    """The results of one forward+backward."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(g)
    grads = [p.grad for p in (layer.experts.fc1_weight, layer.experts.fc2_weight, layer.router.weight)]
    return [out.detach(), x.grad, *grads]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recompute_changes_no_result_and_frees_the_activation(weights, variant):
    kept, recomputed = make_layer(weights, variant, False), make_layer(weights, variant, True)
    for seed in range(3):
        x, g = batch(seed)
        step(kept, x, g), step(recomputed, x, g)  # first step: buffers, kernels
        want, got = step(kept, x, g), step(recomputed, x, g)
        for name, a, b in zip(("output", "input grad", "fc1 grad", "fc2 grad", "router grad"), got, want):
            assert torch.equal(a, b), f"{variant} seed {seed}: {name} differs with recompute"
        kept_bytes, recomputed_bytes = held_for_backward(kept, x, g), held_for_backward(recomputed, x, g)
        activation = kept.token_dispatcher.capacity * SHAPE["ffn"] * 2  # bf16 [C, F]
        assert kept_bytes - recomputed_bytes >= activation, (variant, kept_bytes, recomputed_bytes, activation)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_graph_runner_replays_recompute_equal_to_eager(weights, variant):
    eager, graphed = make_layer(weights, variant, True), make_layer(weights, variant, True, cuda_graphs=True)
    for seed in range(4):  # capture, then replays with new inputs and routes
        x, g = batch(100 + seed)
        want = step(eager, x, g)
        got = step(graphed, x, g)
        assert graphed._graph_runner.eager_reason is None, graphed._graph_runner.eager_reason
        for name, a, b in zip(("output", "input grad"), got, want):
            assert torch.equal(a, b), f"{variant} step {seed}: replayed {name} differs from eager"
        for name, a, b in zip(("fc1 grad", "fc2 grad", "router grad"), got[2:], want[2:]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=lambda m: f"{variant} {name}\n{m}")
