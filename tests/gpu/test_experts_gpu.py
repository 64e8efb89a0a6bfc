"""DeviceOffsetGroupedMLP and the tail-aware SwiGLU on CUDA, bf16 (issue 3, docs/design.md, "Experts").

- parity with Megatron's SequentialMLP on the same weights and permuted rows (output and every
  gradient), with an empty expert;
- a capacity buffer whose tail (inputs, probs, output gradient) is poisoned: valid-row results
  are finite and bit-identical for a NaN and a 1e30 tail;
- the Triton SwiGLU kernels against the torch path, tail gradient of the probs zero;
- forward+backward captured in a CUDA graph (proof of no host sync) and replayed with new
  inputs and new counts, equal to eager.

Runs under pytest (marked gpu, skipped without CUDA) or as `python3 tests/gpu/test_experts_gpu.py`
where pytest is missing.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_ext.bench.measurement import collector_held_off  # noqa: E402
from megatron_ext.kernels.swiglu import _backward_torch, _forward_torch, swiglu_valid_prefix  # noqa: E402
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP  # noqa: E402
from megatron_ext.testing.expert_steps import expert_rows as _rows  # noqa: E402
from megatron_ext.testing.expert_steps import expert_counts, experts_step, replay_inputs  # noqa: E402
from megatron_ext.testing.graphs import replay_with_new_inputs  # noqa: E402
from megatron_ext.testing.megatron_moe import moe_config  # noqa: E402
from megatron_ext.testing.reference import assert_close  # noqa: E402
from megatron_ext.testing.single_rank import init_single_rank_megatron  # noqa: E402

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the GPU machine may lack pytest: see __main__
    pytest = None

BF16_RTOL = 2e-2
DEVICE = "cuda"


def _config(experts, hidden, ffn):
    init_single_rank_megatron()
    return moe_config(hidden=hidden, ffn=ffn, experts=experts, dtype=torch.bfloat16,
                      use_cpu_initialization=False, perform_initialization=False)


def _weights(experts, hidden, ffn, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    fc1 = torch.randn(experts, 2 * ffn, hidden, device=DEVICE, generator=gen) * hidden ** -0.5
    fc2 = torch.randn(experts, hidden, ffn, device=DEVICE, generator=gen) * ffn ** -0.5
    return fc1.to(torch.bfloat16), fc2.to(torch.bfloat16)


def _grouped(experts, hidden, ffn, seed=1):
    module = DeviceOffsetGroupedMLP(experts, _config(experts, hidden, ffn))
    fc1, fc2 = _weights(experts, hidden, ffn, seed)
    with torch.no_grad():
        module.fc1_weight.copy_(fc1)
        module.fc2_weight.copy_(fc2)
    return module


def _sequential(experts, hidden, ffn, seed=1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import get_submodules

    config = _config(experts, hidden, ffn)
    layer_mlp = get_submodules(get_gpt_layer_local_submodules(num_experts=experts).mlp)
    module = SequentialMLP(experts, config, get_submodules(layer_mlp.experts),
                           pg_collection=get_default_pg_collection())
    fc1, fc2 = _weights(experts, hidden, ffn, seed)
    with torch.no_grad():
        for i, expert in enumerate(module.local_experts):
            expert.linear_fc1.weight.copy_(fc1[i])
            expert.linear_fc2.weight.copy_(fc2[i])
    return module


def _run(module, x, counts, probs, grad_out):
    """Forward and backward on fresh leaves: (out, x grad, prob grad, fc1 grad, fc2 grad)."""
    out, x, probs = experts_step(module, x, counts, probs, grad_out)
    if hasattr(module, "local_experts"):
        fc1 = torch.stack([e.linear_fc1.weight.grad for e in module.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight.grad for e in module.local_experts])
    else:
        fc1, fc2 = module.fc1_weight.grad, module.fc2_weight.grad
    return out.detach(), x.grad, probs.grad, fc1.clone(), fc2.clone()


NAMES = ("output", "input grad", "prob grad", "fc1 weight grad", "fc2 weight grad")


def test_bf16_parity_with_sequential_mlp():
    experts, hidden, ffn, tokens, topk = 8, 1024, 512, 2048, 2
    rows = tokens * topk
    counts = expert_counts(experts, rows, seed=5)
    x, probs, grad_out = _rows(rows, hidden, seed=6)
    want = _run(_sequential(experts, hidden, ffn), x, counts, probs, grad_out)  # host counts, as Megatron's
    got = _run(_grouped(experts, hidden, ffn), x, counts.to(DEVICE), probs, grad_out)  # device counts
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a.float()).all(), f"{name} is not finite"
        assert_close(a, b, BF16_RTOL, f"grouped vs SequentialMLP {name}")
    assert torch.count_nonzero(got[3][2]) == 0 and torch.count_nonzero(got[4][2]) == 0, \
        "the empty expert got a weight gradient"
    nonempty = counts.nonzero().flatten().tolist()
    assert all(torch.count_nonzero(got[3][e]) > 0 for e in nonempty), "a non-empty expert got no gradient"


def test_capacity_tail_poison_on_cuda():
    experts, hidden, ffn = 6, 512, 1408  # F > 1024: the SwiGLU kernels loop over column blocks
    module = _grouped(experts, hidden, ffn, seed=3)
    counts = expert_counts(experts, 1500, seed=7, empty=(0, 4)).to(DEVICE)
    valid, capacity = 1500, 1875  # capacity factor 1.25
    x, probs, grad_out = _rows(capacity, hidden, seed=8)

    def run(tail_value):
        poisoned = [t.clone() for t in (x, probs, grad_out)]
        for t in poisoned:
            t[valid:] = tail_value
        out, x_grad, prob_grad, fc1, fc2 = _run(module, poisoned[0], counts, poisoned[1], poisoned[2])
        return out[:valid].clone(), x_grad[:valid].clone(), prob_grad[:valid].clone(), fc1, fc2

    first, second = run(float("nan")), run(1e30)
    for name, a, b in zip(NAMES, first, second):
        assert torch.isfinite(a.float()).all(), f"{name} picked up the NaN tail"
        assert torch.equal(a, b), f"{name} depends on capacity-tail contents"
    # The valid rows alone (no tail at all) give the same numbers (up to GEMM tiling choices).
    clean = _run(module, x[:valid], counts, probs[:valid], grad_out[:valid])
    for name, a, b in zip(NAMES, first, clean):
        assert_close(a, b, BF16_RTOL, f"{name}: capacity buffer vs exact-size input")


def _swiglu_case(rows, valid, ffn, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(rows, 2 * ffn, device=DEVICE, generator=gen).to(torch.bfloat16)
    prob = torch.rand(rows, device=DEVICE, generator=gen)
    grad = torch.randn(rows, ffn, device=DEVICE, generator=gen).to(torch.bfloat16)
    for t in (h, prob, grad):
        t[valid:] = float("nan")
    return h, prob, grad, torch.tensor(valid, dtype=torch.int32, device=DEVICE)


def test_triton_swiglu_matches_torch_path_on_valid_prefix():
    for rows, valid, ffn, with_prob in ((3000, 2345, 1408, True), (3000, 2345, 1408, False),
                                        (1024, 1024, 512, True), (640, 0, 96, True)):
        h, prob, grad, valid_rows = _swiglu_case(rows, valid, ffn, seed=rows + ffn)
        prob = prob if with_prob else None
        h_leaf = h.clone().requires_grad_(True)
        prob_leaf = prob.clone().requires_grad_(True) if with_prob else None
        out = swiglu_valid_prefix(h_leaf, valid_rows, prob_leaf)
        out.backward(grad)
        want_out = _forward_torch(h, prob, valid_rows)
        want_grad_h, want_grad_prob = _backward_torch(grad, h, prob, valid_rows)
        case = f"rows {rows} valid {valid} F {ffn} prob {with_prob}"
        assert out.shape == (rows, ffn) and h_leaf.grad.shape == h.shape
        if valid:
            assert_close(out[:valid], want_out[:valid], 1e-2, f"{case}: forward")
            assert_close(h_leaf.grad[:valid], want_grad_h[:valid], 1e-2, f"{case}: grad h")
            assert torch.isfinite(out[:valid].float()).all() and torch.isfinite(h_leaf.grad[:valid].float()).all()
        if with_prob:
            if valid:
                assert_close(prob_leaf.grad[:valid], want_grad_prob[:valid], 1e-3, f"{case}: grad prob")
            assert torch.equal(prob_leaf.grad[valid:], torch.zeros(rows - valid, device=DEVICE)), \
                f"{case}: prob gradient tail must be zero"


def test_cuda_graph_capture_forward_backward_matches_eager():
    experts, hidden, ffn, capacity = 8, 1024, 512, 4096
    module = _grouped(experts, hidden, ffn, seed=4)
    (x, probs, grad_out, counts), second = replay_inputs(experts, hidden, capacity, DEVICE)
    new_x, new_probs, new_grad, new_counts = second  # another number of valid rows per expert
    static_out = replay_with_new_inputs(module, (x, probs, grad_out, counts), second)
    valid = 3500
    replayed = (static_out[:valid].clone(), x.grad[:valid].clone(), probs.grad[:valid].clone(),
                module.fc1_weight.grad.clone(), module.fc2_weight.grad.clone())
    eager = _run(module, new_x, new_counts, new_probs, new_grad)
    eager = (eager[0][:valid], eager[1][:valid], eager[2][:valid], eager[3], eager[4])
    for name, a, b in zip(NAMES, replayed, eager):
        assert torch.isfinite(a.float()).all(), f"graph replay {name} not finite"
        assert_close(a, b, 1e-3, f"graph replay vs eager {name}")
    assert torch.count_nonzero(replayed[3][5]) == 0, "expert 5 has no rows after the update: its grad must be 0"


def test_one_node_fast_path_equals_torch_autograd_of_the_three_ops():
    """moe/expert_mlp.py against torch's own autograd of grouped GEMM -> SwiGLU -> grouped GEMM
    (what the fast path ran before): the same kernels, so the output and the input, fc1 and prob
    gradients are bitwise equal; fc2's gradient is formed in its own layout (close, not bitwise)."""
    from megatron_ext.moe.expert_mlp import swiglu_grouped_mlp

    experts, hidden, ffn, valid, capacity = 8, 1024, 512, 3000, 3750
    fc1, fc2 = _weights(experts, hidden, ffn, seed=13)
    x, probs, grad_out = _rows(capacity, hidden, seed=14)
    offsets = torch.cumsum(expert_counts(experts, valid, seed=15).to(DEVICE), 0, dtype=torch.int32)

    def run(node: bool):
        leaves = [t.clone().requires_grad_(True) for t in (x, fc1, fc2, probs)]
        with collector_held_off():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if node:
                out = swiglu_grouped_mlp(*leaves[:3], offsets, leaves[3])
            else:
                act = swiglu_valid_prefix(torch._grouped_mm(leaves[0], leaves[1].transpose(1, 2), offs=offsets),
                                          offsets[-1], leaves[3])
                out = torch._grouped_mm(act, leaves[2].transpose(1, 2), offs=offsets)
            out.backward(grad_out)
            peaks.append(torch.cuda.max_memory_allocated() - base)
        return out[:valid].detach(), leaves[0].grad[:valid], leaves[1].grad, leaves[3].grad, leaves[2].grad

    peaks = []
    got, want = run(True), run(False)
    assert peaks[0] <= peaks[1], f"the one-node backward peaks higher ({peaks[0]} B) than torch's ({peaks[1]} B)"
    for name, a, b in zip(("output", "input grad", "fc1 weight grad", "prob grad"), got[:4], want[:4]):
        assert torch.equal(a, b), f"one node vs torch autograd: {name} differs"
    assert got[4].is_contiguous()
    assert_close(got[4], want[4], 1e-2, "one node vs torch autograd: fc2 weight grad")


def test_grouped_wgrad_kernel_accumulates_into_main_grad():
    """kernels/grouped_wgrad.py on CUDA: out[e] += left_e^T @ right_e, fp32 and bf16 main_grad,
    sizes off the tile, an empty expert untouched, NaN rows past the last offset never read,
    against an fp32 reference; the same bits on a second run; bf16 main_grad rounded once (old +
    fp32 sum), not twice. Rows read by TMA (aligned) and, as views off 16 bytes, by masked loads."""
    from megatron_ext.kernels.grouped_wgrad import DEFAULT_TILES, _tma_descriptor, accumulate_grouped_wgrad

    gen = torch.Generator(device="cuda").manual_seed(7)
    counts, m, n, tail = [300, 0, 1, 517, 64], 200, 136, 40
    rows = sum(counts)
    left = torch.randn(rows + tail, m, device="cuda", generator=gen).bfloat16()
    right = torch.randn(rows + tail, n, device="cuda", generator=gen).bfloat16()
    left[rows:], right[rows:] = float("nan"), float("nan")
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    # the same rows one column into wider rows: off 16 bytes, so no TMA descriptor can read them
    left_off, right_off = (torch.cat([t[:, :1], t], dim=1)[:, 1:] for t in (left, right))
    assert left_off.data_ptr() % 16 and right_off.data_ptr() % 16
    box = [DEFAULT_TILES.block_rows, DEFAULT_TILES.block_m]
    assert _tma_descriptor(left, box) is not None and _tma_descriptor(left_off, box) is None
    cases = [(dtype, tolerance, pair) for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2))
             for pair in ((left, right), (left_off, right_off))]
    for dtype, tolerance, (left, right) in cases:
        start = torch.randn(len(counts), m, n, device="cuda", generator=gen).to(dtype)
        want, first = start.float().clone(), 0
        for expert, count in enumerate(counts):
            want[expert] += left[first:first + count].float().t() @ right[first:first + count].float()
            first += count
        runs = []
        for _ in range(2):
            out = start.clone()
            accumulate_grouped_wgrad(left, right, ends, out)
            runs.append(out)
        assert torch.equal(runs[0], runs[1]), "two runs differ"
        assert torch.equal(runs[0][1], start[1]), "the empty expert's main_grad changed"
        assert torch.isfinite(runs[0]).all(), "a row past the last offset was read"
        read = "TMA" if left.data_ptr() % 16 == 0 else "masked loads"
        assert_close(runs[0].float(), want.to(dtype).float(), tolerance,
                     f"grouped wgrad into {dtype} main_grad ({read})")
        if dtype == torch.bfloat16:  # one rounding of old + sum: at most 1 ulp off, and rarely (two: ~25%)
            ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8)
            ulps = (runs[0].float() - want.to(dtype).float()).abs() / ulp
            assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01, (ulps.max(), (ulps > 0).float().mean())


def _main() -> int:
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASSED {name}")
            except Exception as exc:  # noqa: BLE001
                failed += 1
                print(f"FAILED {name}: {type(exc).__name__}: {exc}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
