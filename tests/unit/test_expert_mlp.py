"""The experts' fast path as one autograd node (moe/expert_mlp.py) against each expert's SwiGLU MLP
computed from the definition in fp64: outputs, input, weight and probability gradients, with an
empty expert, a capacity tail and gradients asked for only in part. CPU, fp32 (torch's
per-group grouped GEMM); the GPU test compares the node with torch's autograd of the same ops."""

import pytest
import torch

from megatron_ext.moe.expert_mlp import swiglu_grouped_mlp
from megatron_ext.testing.expert_steps import expert_counts, expert_rows
from megatron_ext.testing.reference import swiglu_expert

EXPERTS, HIDDEN, FFN, CAPACITY, VALID = 4, 8, 12, 24, 19


def _inputs():
    gen = torch.Generator().manual_seed(3)
    fc1 = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) * 0.3
    fc2 = torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) * 0.3
    x, probs, grad_out = expert_rows(CAPACITY, HIDDEN, seed=4, dtype=torch.float32, device="cpu")
    counts = expert_counts(EXPERTS, VALID, seed=5, empty=(1,))
    return x, fc1, fc2, probs, grad_out, counts


def _oracle(x, fc1, fc2, probs, counts):
    """Per expert, in fp64, on the valid rows only."""
    outs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = slice(start, start + count)
        act_scale = 1.0 if probs is None else probs[rows, None].double()
        gate, up = (x[rows].double() @ fc1[expert].double().t()).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up * act_scale) @ fc2[expert].double().t())
        start += count
    return torch.cat(outs)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("with_probs", [False, True])
def test_node_equals_the_definition(with_probs, recompute):
    x, fc1, fc2, probs, grad_out, counts = _inputs()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    leaves = [t.clone().requires_grad_(True) for t in (x, fc1, fc2, probs)]
    out = swiglu_grouped_mlp(*leaves[:3], offsets, leaves[3] if with_probs else None, recompute_activation=recompute)
    out.backward(grad_out)
    refs = [t.clone().double().requires_grad_(True) for t in (x, fc1, fc2, probs)]
    want = _oracle(*refs[:3], refs[3] if with_probs else None, counts)
    want.backward(grad_out[:VALID].double())
    torch.testing.assert_close(out[:VALID].double(), want, rtol=1e-5, atol=1e-6)
    names = ["input", "fc1", "fc2", "probs"][:4 if with_probs else 3]
    for name, got, ref in zip(names, leaves, refs):
        grad = got.grad[:VALID] if name in ("input", "probs") else got.grad
        torch.testing.assert_close(grad.double(), ref.grad[:VALID] if name in ("input", "probs") else ref.grad,
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} gradient\n{m}")
    assert torch.equal(leaves[1].grad[1], torch.zeros_like(fc1[1])), "the empty expert's fc1 gradient"
    assert leaves[2].grad.is_contiguous(), "fc2's gradient comes in the parameter's layout"
    if with_probs:
        assert torch.equal(leaves[3].grad[VALID:], torch.zeros(CAPACITY - VALID)), "tail probs get zero gradient"


def test_only_the_weight_gradients_asked_for():
    x, fc1, fc2, _, grad_out, counts = _inputs()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    fc1_leaf, fc2_leaf = fc1.clone().requires_grad_(True), fc2.clone().requires_grad_(True)
    swiglu_grouped_mlp(x, fc1_leaf, fc2_leaf, offsets).backward(grad_out)
    refs = [fc1.double().requires_grad_(True), fc2.double().requires_grad_(True)]
    _oracle(x, *refs, None, counts).backward(grad_out[:VALID].double())
    for got, ref in zip((fc1_leaf, fc2_leaf), refs):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)


def test_frozen_fc1_still_passes_gradient_to_the_input():
    x, fc1, fc2, _, grad_out, counts = _inputs()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x_leaf = x.clone().requires_grad_(True)
    swiglu_grouped_mlp(x_leaf, fc1, fc2, offsets).backward(grad_out)
    x_ref = x.double().requires_grad_(True)
    _oracle(x_ref, fc1, fc2, None, counts).backward(grad_out[:VALID].double())
    torch.testing.assert_close(x_leaf.grad[:VALID].double(), x_ref.grad[:VALID], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_only_the_probabilities_train(recompute):
    """Input and fc1 frozen (the router trains through the probabilities, e.g. experts frozen below
    a trained router): the probabilities still get their gradient."""
    x, fc1, fc2, probs, grad_out, counts = _inputs()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    probs_leaf = probs.clone().requires_grad_(True)
    swiglu_grouped_mlp(x, fc1, fc2, offsets, probs_leaf, recompute_activation=recompute).backward(grad_out)
    probs_ref = probs.double().requires_grad_(True)
    _oracle(x, fc1, fc2, probs_ref, counts).backward(grad_out[:VALID].double())
    assert probs_leaf.grad is not None, "no gradient for the probabilities"
    torch.testing.assert_close(probs_leaf.grad[:VALID].double(), probs_ref.grad[:VALID], rtol=1e-5, atol=1e-6)


def test_reference_helper_agrees_with_the_oracle():
    """The oracle above and testing.reference.swiglu_expert are the same formula."""
    x, fc1, fc2, _, _, _ = _inputs()
    torch.testing.assert_close(_oracle(x[:5], fc1, fc2, None, torch.tensor([5, 0, 0, 0])).float(),
                               swiglu_expert(x[:5], fc1[0], fc2[0]), rtol=1e-5, atol=1e-6)


def test_a_second_backward_says_what_to_do():
    x, fc1, fc2, _, grad_out, counts = _inputs()
    out = swiglu_grouped_mlp(x, fc1.requires_grad_(True), fc2, torch.cumsum(counts, 0, dtype=torch.int32))
    out.backward(grad_out, retain_graph=True)
    with pytest.raises(RuntimeError, match="run the forward again"):
        out.backward(grad_out)


def test_the_activation_lives_through_both_of_fc2s_gradient_gemms():
    """Released between them, its memory went to the next GEMM's output and captured backwards
    replayed NaN fc2 weight gradients on an H200 (docs/design.md, "Experts"); released after them,
    before the fc1 GEMMs, the peak stays torch's."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    x, fc1, fc2, probs, grad_out, counts = _inputs()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    leaves = [t.clone().requires_grad_(True) for t in (x, fc1, fc2, probs)]
    out = swiglu_grouped_mlp(*leaves[:3], offsets, leaves[3])
    activation = weakref.ref(out.grad_fn.intermediates[1])
    alive_at_gemm = []

    class RecordGemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default:
                alive_at_gemm.append(activation() is not None)
            return func(*args, **(kwargs or {}))

    with RecordGemms():
        out.backward(grad_out)
    assert alive_at_gemm == [True, True, False, False], alive_at_gemm


def test_a_double_backward_is_refused_not_given_wrong():
    """fc1's output and the activation live on the node without a graph: second derivatives through
    them would be missing."""
    x, fc1, fc2, probs, grad_out, counts = _inputs()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x_leaf = x.clone().requires_grad_(True)
    out = swiglu_grouped_mlp(x_leaf, fc1, fc2, offsets, probs)
    (grad_x,) = torch.autograd.grad(out, x_leaf, grad_out.clone().requires_grad_(True), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_x.sum().backward()


def test_swiglu_kernels_read_and_keep_fc1_in_two_parts():
    """The dropless arena's fc1 rows in two parts (kernels/swiglu.RowPlace): the real kernels under
    Triton's interpreter against the torch forms, and the rows past P stored exactly."""
    from tests.unit.interpreter import run_under_interpreter
    assert "22 cases, 0 failures" in run_under_interpreter("_swiglu_place_interp.py")


def test_save_to_needs_the_read_place_region_rows():
    from megatron_ext.kernels.swiglu import RowPlace, swiglu_forward
    rows = torch.zeros(4, 8)
    spill = torch.zeros((), dtype=torch.int64)
    read = RowPlace(rows[:2], rows[2:], spill)
    with pytest.raises(ValueError, match="region rows must be read_from's"):
        swiglu_forward(None, torch.tensor(3, dtype=torch.int32), None, read_from=read, rows=4,
                       save_to=RowPlace(rows[:2].clone(), torch.zeros(5, 8), spill))


# (end offsets, region P) over 24 rows: experts straddling P, empty experts on either side, every
# valid row below P, P at the last valid row, every row in the region (no run-on rows)
FC1_SPLITS = [([5, 5, 14, 19], 8), ([0, 7, 7, 19], 7), ([3, 6, 9, 12], 16), ([4, 9, 12, 19], 19),
              ([6, 12, 18, 24], 24), ([0, 0, 0, 19], 4), ([10, 20, 20, 24], 20)]


@pytest.mark.parametrize("ends, region", FC1_SPLITS)
def test_fc1_as_two_grouped_gemms_equals_one(ends, region):
    """The arena's fc1 on GPUs (moe/expert_mlp.fc1_two_gemms): the rows below P and past P, each on
    offsets clamped to its range, give one GEMM's valid rows. bf16: bitwise on CPU (each row one dot
    product per column); the GPU test repeats it on CUTLASS's kernels."""
    from megatron_ext.moe.expert_mlp import fc1_two_gemms
    gen = torch.Generator().manual_seed(region)
    x = torch.randn(CAPACITY, HIDDEN, generator=gen).bfloat16()
    weight = torch.randn(EXPERTS, HIDDEN, 2 * FFN, generator=gen).bfloat16()
    offsets = torch.tensor(ends, dtype=torch.int32)
    below, past = fc1_two_gemms(x, weight, offsets, region)
    assert below.shape == (region, 2 * FFN) and past.shape == (CAPACITY - region, 2 * FFN)
    valid = ends[-1]
    expected = torch.cat([x[start:end].double() @ weight[e].double()
                          for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))])
    both = torch.cat([below, past])[:valid]
    assert torch.equal(both, torch._grouped_mm(x, weight, offs=offsets)[:valid])
    torch.testing.assert_close(both.double(), expected, rtol=1e-2, atol=1e-2)


def test_only_plain_swiglu_takes_the_swiglu_kernel():
    """The kernel computes silu(gate) * up: a clamp (GPT-OSS style) or a linear offset must take the
    torch formula, which the activation then equals."""
    import torch.nn.functional as F

    from megatron_ext.moe.expert_activation import ExpertActivation

    assert ExpertActivation(F.silu, gated=True).plain_swiglu
    for other in (ExpertActivation(F.silu, gated=True, clamp=0.5), ExpertActivation(F.silu, gated=True, offset=1.0),
                  ExpertActivation(F.silu, gated=False), ExpertActivation(F.gelu, gated=True)):
        assert not other.plain_swiglu, other
    h = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    gate, up = h.chunk(2, -1)
    clamped = ExpertActivation(F.silu, gated=True, clamp=0.5, offset=1.0)
    want = F.silu(gate.clamp(max=0.5)) * (up.clamp(-0.5, 0.5) + 1.0)
    torch.testing.assert_close(clamped(h, torch.tensor(6)), want, rtol=1e-6, atol=1e-6)


def test_the_swiglu_tail_is_zero_on_cpu_whatever_it_held():
    """Rows at or past valid_rows (a capacity tail, NaN under debug poison) come out zero on CPU, and
    so does their gradient, as the docstring of kernels/swiglu.swiglu_valid_prefix says."""
    from megatron_ext.kernels.swiglu import swiglu_valid_prefix

    h = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    h[4:] = float("nan")
    h.requires_grad_(True)
    probs = torch.rand(6, generator=torch.Generator().manual_seed(2))
    act = swiglu_valid_prefix(h, torch.tensor(4, dtype=torch.int32), probs)
    gate, up = h.detach()[:4].chunk(2, -1)
    torch.testing.assert_close(act[:4], torch.nn.functional.silu(gate) * up * probs[:4, None])
    assert torch.equal(act[4:], torch.zeros(2, 4))
    grad_out = torch.ones(6, 4)
    grad_out[4:] = float("nan")  # what the tail's downstream gradient may hold
    act.backward(grad_out)
    assert torch.equal(h.grad[4:], torch.zeros(2, 8)) and not h.grad[:4].isnan().any()
