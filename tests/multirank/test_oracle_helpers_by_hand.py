"""The oracles' loading helpers against hand-written formulas: expert_variants' ExpertParams,
load_expert_params (which expert gets which slice) and expert_param_grads, on Megatron's own
SequentialMLP. The layer tests compare the product with SequentialMLP loaded by the same
helpers, so a helper that zeroes a bias, shifts an expert or reads no gradient would hide
the same fault in both."""

import torch
import torch.nn.functional as F

from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.testing.expert_variants import (ExpertParams, expert_param_grads, load_expert_params,
                                                  sequential_mlp, variant_config)
from megatron_ext.testing.reference import assert_close


def _by_hand_rank(rank, world):
    experts, local, first, hidden, ffn = 4, 2, 2, 8, 6
    config = variant_config("gelu_bias", hidden=hidden, ffn=ffn, experts=experts)
    params = ExpertParams.random(config, seed=5)
    for name, tensor in params.named().items():  # every parameter, biases included, takes part
        assert torch.count_nonzero(tensor) == tensor.numel(), f"ExpertParams.{name} has zeros"
    mlp = sequential_mlp(local, config)
    load_expert_params(mlp, params, first_expert=first)  # experts 2 and 3 of 4

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 2])
    x = torch.randn(5, hidden, generator=gen)
    probs = torch.rand(5, generator=gen) + 0.1
    grad_out = torch.randn(5, hidden, generator=gen)
    out = mlp(x, counts, probs)[0]
    out.backward(grad_out)
    got_grads = expert_param_grads(mlp)

    leaves = {k: v[first:first + local].clone().requires_grad_(True) for k, v in params.named().items()}
    rows, want = 0, []
    for i, n in enumerate(counts.tolist()):  # prob * (gelu(x W1^T + b1) W2^T + b2), expert first + i
        xs = x[rows:rows + n]
        h = F.gelu(xs @ leaves["fc1"][i].t() + leaves["fc1_bias"][i])
        want.append(probs[rows:rows + n, None] * (h @ leaves["fc2"][i].t() + leaves["fc2_bias"][i]))
        rows += n
    want = torch.cat(want)
    want.backward(grad_out)
    assert_close(out, want, 1e-5, "SequentialMLP loaded by load_expert_params vs the formula")
    assert sorted(got_grads) == sorted(leaves)
    for name, leaf in leaves.items():
        assert torch.count_nonzero(leaf.grad) > 0, name
        assert_close(got_grads[name], leaf.grad, 1e-5, f"expert_param_grads {name} vs the formula")


def test_expert_variant_helpers_match_the_formula_by_hand():
    run_on_ranks(_by_hand_rank, 1, sizes=ParallelSizes())
