"""The grouped experts' weight gradients added to Megatron DDP's main_grad in the GEMM
(moe/expert_wgrad.py, kernels/grouped_wgrad.py): the kernel against the definition under Triton's
interpreter; on CPU, the experts' node under DDP's main_grad protocol (megatron_ext.testing
.ddp_main_grads) against an fp64 oracle over two microbatches, and with the fusion off; the
placeholders DDP's hook gets; the graph runner's main_grad helpers; DDP's hook source, so a change
in Megatron's protocol fails here."""

import inspect

import pytest
import torch

from megatron_ext.cuda_graphs.main_grads import flag_added, flagged_by, main_grads_set_aside
from megatron_ext.kernels.grouped_wgrad import WgradTiles
from megatron_ext.moe.expert_mlp import swiglu_grouped_mlp
from megatron_ext.moe.expert_wgrad import expert_weight_grad, grouped_linear
from megatron_ext.testing.ddp_main_grads import attach_main_grads, zero_main_grads
from megatron_ext.testing.expert_steps import expert_counts, expert_rows
from tests.unit.interpreter import run_under_interpreter

EXPERTS, HIDDEN, FFN, CAPACITY, VALID = 4, 8, 16, 24, 19  # bf16 rows: 16-byte strides


def test_kernel_equals_the_definition_under_interpreter():
    stdout = run_under_interpreter("_grouped_wgrad_interp.py")
    assert "all grouped wgrad interpreter checks passed" in stdout
    assert stdout.count("ok counts=") == 9 and "ok paths" in stdout


def _weights(seed=3):
    """bf16 weights: the fusion takes 16-bit rows (fp32 rows would be rounded to TF32 by Triton's dot)."""
    gen = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) * 0.3).bfloat16().requires_grad_(True)
    fc2 = (torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) * 0.3).bfloat16().requires_grad_(True)
    return fc1, fc2


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def _microbatch(seed):
    x, probs, grad_out = expert_rows(CAPACITY, HIDDEN, seed=seed, dtype=torch.bfloat16, device="cpu")
    counts = expert_counts(EXPERTS, VALID, seed=seed + 1, empty=(1,))
    return x, probs, grad_out, torch.cumsum(counts, 0, dtype=torch.int32)


def _weight_grads_fp64(fc1, fc2, batches):
    """Sum over microbatches of each weight's gradient: each expert's SwiGLU MLP from the
    definition on its valid rows, torch's autograd in fp64."""
    ref1, ref2 = (w.detach().double().requires_grad_(True) for w in (fc1, fc2))
    for x, probs, grad_out, offsets in batches:
        start = 0
        for expert, end in enumerate(offsets.tolist()):
            rows = slice(start, end)
            gate, up = (x[rows].double() @ ref1[expert].t()).chunk(2, dim=-1)
            out = (torch.nn.functional.silu(gate) * up * probs[rows, None].double()) @ ref2[expert].t()
            out.backward(grad_out[rows].double())
            start = end
    return ref1.grad, ref2.grad


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_weight_gradients_go_to_main_grad_over_microbatches(recompute):
    fc1, fc2 = _weights()
    attach_main_grads([fc1, fc2])
    batches = [_microbatch(10), _microbatch(20)]
    input_grads = []
    for x, probs, grad_out, offsets in batches:
        x = x.clone().requires_grad_(True)
        out = swiglu_grouped_mlp(x, fc1, fc2, offsets, probs, recompute_activation=recompute, wgrad_fusion=True)
        out.backward(grad_out)
        assert fc1.grad_added_to_main_grad and fc2.grad_added_to_main_grad, "DDP's hook must skip its add"
        assert fc1.grad is None and fc2.grad is None, "the placeholder reached param.grad"
        input_grads.append(x.grad)
    want1, want2 = _weight_grads_fp64(fc1, fc2, batches)
    # bf16 intermediates (the SwiGLU gradient, the activation) against fp64 ones: ~1e-3; a gradient
    # added twice or not at all would be off by ~50%.
    assert _relative(fc1.main_grad, want1) < 1e-2 and _relative(fc2.main_grad, want2) < 1e-2
    assert torch.equal(fc1.main_grad[1], torch.zeros_like(fc1.main_grad[1])), "the empty expert's main_grad"
    # The other gradients do not depend on where the weight gradients go.
    for (x, probs, grad_out, offsets), got in zip(batches, input_grads):
        x = x.clone().requires_grad_(True)
        swiglu_grouped_mlp(x, fc1.detach(), fc2.detach(), offsets, probs).backward(grad_out)
        assert torch.equal(got[:VALID], x.grad[:VALID])


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("frozen", ["fc1", "fc2"])
def test_a_frozen_weight_keeps_its_main_grad_untouched(frozen, recompute):
    """Fine-tuning with one weight frozen: the fused backward adds nothing to its main_grad and sets no
    flag on it, and the training weight's main_grad is what it would be with both training."""
    fc1, fc2 = _weights()
    weights = {"fc1": fc1, "fc2": fc2}
    attach_main_grads([fc1, fc2])
    weights[frozen].requires_grad_(False)  # frozen after DDP gave it a main_grad
    batch = _microbatch(10)
    x, probs, grad_out, offsets = batch
    swiglu_grouped_mlp(x.clone().requires_grad_(True), fc1, fc2, offsets, probs, recompute_activation=recompute,
                       wgrad_fusion=True).backward(grad_out)
    assert torch.count_nonzero(weights[frozen].main_grad) == 0 and not weights[frozen].grad_added_to_main_grad
    (training,) = [name for name in weights if name != frozen]
    want = dict(zip(("fc1", "fc2"), _weight_grads_fp64(fc1, fc2, [batch])))
    assert weights[training].grad_added_to_main_grad and _relative(weights[training].main_grad, want[training]) < 1e-2


def test_fusion_off_hands_ddp_the_gradient_to_add():
    fc1, fc2 = _weights()
    attach_main_grads([fc1, fc2])
    batches = [_microbatch(10), _microbatch(20)]
    for x, probs, grad_out, offsets in batches:
        swiglu_grouped_mlp(x, fc1, fc2, offsets, probs, wgrad_fusion=False).backward(grad_out)
        assert not fc1.grad_added_to_main_grad and not fc2.grad_added_to_main_grad
    want1, want2 = _weight_grads_fp64(fc1, fc2, batches)
    assert _relative(fc1.main_grad, want1) < 1e-2 and _relative(fc2.main_grad, want2) < 1e-2


def test_without_ddp_the_weights_get_plain_gradients():
    fc1, fc2 = _weights()
    x, probs, grad_out, offsets = _microbatch(10)
    swiglu_grouped_mlp(x, fc1, fc2, offsets, probs, wgrad_fusion=True).backward(grad_out)
    want1, want2 = _weight_grads_fp64(fc1, fc2, [(x, probs, grad_out, offsets)])
    assert _relative(fc1.grad, want1) < 1e-2 and _relative(fc2.grad, want2) < 1e-2
    assert not hasattr(fc1, "grad_added_to_main_grad")


def test_placeholder_is_zeros_where_ddp_adds_it_anyway():
    weight = torch.zeros(2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    attach_main_grads([weight])
    left, right = torch.randn(5, 3).bfloat16(), torch.randn(5, 4).bfloat16()
    ends = torch.tensor([2, 5], dtype=torch.int32)
    placeholder = expert_weight_grad(weight, left, right, ends, fuse=True)
    assert placeholder.shape == weight.shape and weight.grad_added_to_main_grad
    weight.zero_out_wgrad = True  # DDP's hook adds param.grad even with the flag set
    assert torch.equal(expert_weight_grad(weight, left, right, ends, fuse=True), torch.zeros_like(weight))
    left, right = left.float(), right.float()
    want = torch.stack([left[:2].t() @ right[:2], left[2:].t() @ right[2:]])
    torch.testing.assert_close(weight.main_grad, 2 * want)


def test_fp32_rows_and_fsdp_params_keep_the_plain_gradient():
    """fp32 rows: Triton's dot would round them to TF32. Megatron-FSDP's main_grad is a bucket it
    hands out per microbatch, not a buffer to add to."""
    weight = torch.zeros(2, 4, 8, requires_grad=True)
    attach_main_grads([weight])
    left, right = torch.randn(8, 4), torch.randn(8, 8)
    ends = torch.tensor([2, 8], dtype=torch.int32)
    grad = expert_weight_grad(weight, left, right, ends, fuse=True)
    assert not weight.grad_added_to_main_grad and torch.equal(weight.main_grad, torch.zeros_like(weight))
    torch.testing.assert_close(grad[0], left[:2].t() @ right[:2])
    weight16 = torch.zeros(2, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    attach_main_grads([weight16])
    weight16.__fsdp_param__ = True
    rows16 = torch.randn(8, 8).bfloat16()
    expert_weight_grad(weight16, rows16, rows16, ends, fuse=True)
    assert not weight16.grad_added_to_main_grad and torch.equal(weight16.main_grad, torch.zeros_like(weight16))


def test_grouped_linear_node_equals_torch_autograd_and_fuses_under_ddp():
    gen = torch.Generator().manual_seed(8)
    rows = torch.randn(CAPACITY, HIDDEN, generator=gen).bfloat16()
    grad_out = torch.randn(CAPACITY, FFN, generator=gen).bfloat16()
    weight = (torch.randn(EXPERTS, FFN, HIDDEN, generator=gen) * 0.3).bfloat16()
    offsets = torch.cumsum(expert_counts(EXPERTS, VALID, seed=9, empty=(2,)), 0, dtype=torch.int32)
    want_rows, want_weight = rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    torch._grouped_mm(want_rows, want_weight.transpose(1, 2), offs=offsets)[:VALID].backward(grad_out[:VALID])
    got_rows, got_weight = rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = grouped_linear(got_rows, got_weight, offsets, fuse=True)  # no DDP: a plain gradient
    out[:VALID].backward(grad_out[:VALID])
    assert torch.equal(got_rows.grad[:VALID], want_rows.grad[:VALID])
    torch.testing.assert_close(got_weight.grad.float(), want_weight.grad.float(), rtol=1e-2, atol=1e-2)
    assert got_weight.grad.is_contiguous(), "the weight gradient comes in the parameter's layout"
    fused = weight.clone().requires_grad_(True)
    attach_main_grads([fused])
    grouped_linear(rows, fused, offsets, fuse=True)[:VALID].backward(grad_out[:VALID])
    assert fused.grad is None and fused.grad_added_to_main_grad
    torch.testing.assert_close(fused.main_grad, want_weight.grad.float(), rtol=1e-2, atol=1e-2)


def test_main_grad_of_another_shape_is_not_written():
    weight = torch.zeros(2, 4, 8, requires_grad=True)  # sizes the CPU grouped GEMM takes (16-byte strides)
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(64), False  # e.g. a flat shard
    left, right = torch.randn(5, 4), torch.randn(5, 8)
    grad = expert_weight_grad(weight, left, right, torch.tensor([2, 5], dtype=torch.int32), fuse=True)
    assert torch.equal(weight.main_grad, torch.zeros(64)) and not weight.grad_added_to_main_grad
    torch.testing.assert_close(grad[1], left[2:].t() @ right[2:])


def test_only_a_main_grad_the_kernel_can_add_to_is_fused():
    """The kernel adds in place to a contiguous fp32 or bf16 main_grad of the weight's shape; anything
    else (a flat shard, a strided view, fp16) is left to DDP's own add. (The test above cannot reach
    this check on CPU: fp32 rows never fuse.)"""
    from megatron_ext.moe.expert_wgrad import fuses_into_main_grad

    def weight_with(main_grad):
        weight = torch.zeros(2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
        weight.main_grad, weight.grad_added_to_main_grad = main_grad, False
        return weight

    assert fuses_into_main_grad(weight_with(torch.zeros(2, 4, 8)))
    assert fuses_into_main_grad(weight_with(torch.zeros(2, 4, 8, dtype=torch.bfloat16)))
    for name, main_grad in (("flat", torch.zeros(64)), ("strided", torch.zeros(2, 8, 4).transpose(1, 2)),
                            ("fp16", torch.zeros(2, 4, 8, dtype=torch.float16))):
        assert not fuses_into_main_grad(weight_with(main_grad)), name
    assert not fuses_into_main_grad(torch.zeros(2, 4, 8))  # no DDP


def test_graph_runner_helpers_keep_main_grad_and_learn_the_flags():
    fc1, fc2 = _weights()
    router = torch.zeros(3, requires_grad=True)
    attach_main_grads([fc1, fc2, router])
    originals = [fc1.main_grad, fc2.main_grad]
    x, probs, grad_out, offsets = _microbatch(10)
    with main_grads_set_aside([fc1, fc2, router]):  # a warm-up step
        stand_ins = [fc1.main_grad, fc2.main_grad]
        assert all(s.untyped_storage().data_ptr() == stand_ins[0].untyped_storage().data_ptr() for s in stand_ins), \
            "the stand-ins share one scratch buffer (the warm-up's sums are thrown away)"
        assert stand_ins[0].data_ptr() != originals[0].data_ptr() and stand_ins[0].shape == originals[0].shape
        swiglu_grouped_mlp(x, fc1, fc2, offsets, probs, wgrad_fusion=True).backward(grad_out)
        assert fc1.grad_added_to_main_grad, "the warm-up's backward went to the stand-in"
    assert fc1.main_grad is originals[0] and fc2.main_grad is originals[1]
    assert torch.equal(fc1.main_grad, torch.zeros_like(fc1.main_grad)), "a warm-up step reached main_grad"
    zero_main_grads([fc1, fc2, router])
    router.grad_added_to_main_grad = True  # stale from an earlier step: flagged_by must not count it

    def backward():
        return torch.autograd.grad(swiglu_grouped_mlp(x, fc1, fc2, offsets, probs, wgrad_fusion=True),
                                   (fc1, fc2), grad_out)

    grads, flagged = flagged_by([fc1, fc2, router], backward)
    assert flagged == [fc1, fc2] and len(grads) == 2
    zero_main_grads([fc1, fc2, router])
    flag_added(flagged)
    assert fc1.grad_added_to_main_grad and fc2.grad_added_to_main_grad and not router.grad_added_to_main_grad


def test_main_grads_set_aside_keeps_one_stand_in_per_dtype():
    """DDP may keep fp32 and bf16 main_grads side by side (bf16 gradient reduction): each stand-in has
    its main_grad's dtype and shape, one scratch per dtype (the largest of that dtype), and a write
    to a stand-in never reaches the original."""
    a, b, c = (torch.zeros(shape, requires_grad=True) for shape in ((2, 3), (5,), (4, 2)))
    attach_main_grads([a, b])  # fp32: 6 and 5 elements
    attach_main_grads([c], dtype=torch.bfloat16)  # bf16: 8 elements
    originals = [a.main_grad, b.main_grad, c.main_grad]
    with main_grads_set_aside([a, b, c]):
        assert [(p.main_grad.dtype, tuple(p.main_grad.shape)) for p in (a, b, c)] == [
            (torch.float32, (2, 3)), (torch.float32, (5,)), (torch.bfloat16, (4, 2))]
        assert a.main_grad.untyped_storage().data_ptr() == b.main_grad.untyped_storage().data_ptr()
        assert a.main_grad.untyped_storage().nbytes() == 6 * 4 and c.main_grad.untyped_storage().nbytes() == 8 * 2
        for p in (a, b, c):
            p.main_grad.fill_(7)
    assert [p.main_grad for p in (a, b, c)] == originals
    assert all(torch.equal(m, torch.zeros_like(m)) for m in originals)


def test_megatron_ddp_protocol_is_what_the_experts_follow():
    """megatron-core 0.19.2: the hook skips its add when grad_added_to_main_grad is set (unless
    zero_out_wgrad), and zero_grad_buffer resets the flag. If this fails, revisit
    moe/expert_wgrad.py, cuda_graphs/main_grads.py and megatron_ext/testing/ddp_main_grads.py."""
    from megatron.core.distributed import DistributedDataParallel

    hook = inspect.getsource(DistributedDataParallel._make_backward_post_hook)
    assert "param.main_grad.add_(param.grad.data)" in hook
    assert "not param.grad_added_to_main_grad or getattr(param, 'zero_out_wgrad', False)" in hook
    assert "param.grad = None" in hook
    assert "param.grad_added_to_main_grad = False" in inspect.getsource(DistributedDataParallel.zero_grad_buffer)


def test_the_setting_reaches_the_experts_of_both_dispatchers():
    from megatron_ext.config import MoEExtConfig
    from megatron_ext.specs import moe_builder

    for dispatcher in ("rowwise", "megatron"):
        experts = moe_builder(MoEExtConfig(dispatcher=dispatcher, expert_wgrad_fusion=False)).keywords[
            "submodules"].experts
        assert experts.keywords["wgrad_fusion"] is False, dispatcher
    experts = moe_builder(MoEExtConfig()).keywords["submodules"].experts
    assert getattr(experts, "keywords", {}).get("wgrad_fusion", True), "fusion is the default"


def test_graph_runner_captures_again_when_main_grad_moved(monkeypatch):
    """A captured backward writes main_grad where it was at capture: after DDP re-created its
    gradient buffers the runner drops its graphs (to capture again), or refuses while a
    microbatch is live in them."""
    from types import SimpleNamespace

    from megatron_ext.cuda_graphs.main_grads import main_grad_addresses, main_grads_moved
    from megatron_ext.cuda_graphs.runner import GraphedMoELayer

    fc1, fc2 = _weights()
    attach_main_grads([fc1, fc2])
    addresses = main_grad_addresses([fc1, fc2])
    assert not main_grads_moved([fc1, fc2], addresses)
    fc2.main_grad = fc2.main_grad.clone()  # as restore_grad_buffers reallocates the storage
    assert main_grads_moved([fc1, fc2], addresses)

    runner = GraphedMoELayer(torch.nn.Linear(2, 2), num_slots=1)
    graph = SimpleNamespace(reset=lambda: None)
    runner.slots = [SimpleNamespace(busy=True, forward_graph=graph, backward_graph=graph)]
    runner.main_grad_params = [fc1, fc2]
    with pytest.raises(RuntimeError, match="while microbatches are live in the graphs"):
        runner._drop_for_moved_main_grads()
    runner.slots[0].busy = False
    from megatron_ext.cuda_graphs import runner as runner_module

    with monkeypatch.context() as patch:  # EP > 1: every rank must drop its graphs at the same point
        patch.setattr(runner_module, "ep_group_of", lambda layer: object())
        with pytest.raises(RuntimeError, match=r"at EP > 1 call megatron_ext.cuda_graphs.release_cuda_graphs"):
            runner._drop_for_moved_main_grads()
    runner._drop_for_moved_main_grads()
    assert runner.slots is None and runner.main_grad_params == []
    from megatron_ext.cuda_graphs import release_cuda_graphs  # the function the message names
    assert callable(release_cuda_graphs)


@pytest.mark.parametrize("change,message", [
    (dict(right=torch.zeros(7, 8, dtype=torch.bfloat16)),
     "left and right must be \\[rows, M\\] and \\[rows, N\\] with the same rows"),
    (dict(right=torch.zeros(8, 8)), "must both be bf16 or both fp16 .*got torch.bfloat16 and torch.float32"),
    (dict(left=torch.zeros(8, 4), right=torch.zeros(8, 8)), "fp32 rows would be rounded to TF32"),
    (dict(ends=torch.tensor([2, 8])), "ends must be the contiguous int32 end offsets \\[L\\], got torch.int64"),
    (dict(ends=torch.tensor([[2, 0], [8, 0]], dtype=torch.int32)[:, 0]), "contiguous int32 .*stride \\(2,\\)"),
    (dict(tiles=WgradTiles(block_m=8)), "tiles must be powers of two from 16 to 256"),
    (dict(tiles=WgradTiles(block_rows=512)), "tiles must be powers of two from 16 to 256"),
    (dict(tiles=WgradTiles(block_n=96)), "tiles must be powers of two from 16 to 256"),
    (dict(out=torch.zeros(3, 4, 8)), "out must be \\[L, M, N\\] = \\[2, 4, 8\\], got \\(3, 4, 8\\)"),
    (dict(out=torch.zeros(2, 4, 8, dtype=torch.float16)), "out must be contiguous fp32 or bf16"),
    (dict(out=torch.zeros(2, 8, 4).transpose(1, 2)), "out must be contiguous fp32 or bf16 .*strided"),
    (dict(left=torch.zeros(4, 8, dtype=torch.bfloat16).t()), "unit column stride .*pass .contiguous\\(\\) rows"),
])
def test_kernel_arguments_are_checked_before_any_launch(change, message):
    from megatron_ext.kernels.grouped_wgrad import accumulate_grouped_wgrad

    arguments = dict(left=torch.zeros(8, 4, dtype=torch.bfloat16), right=torch.zeros(8, 8, dtype=torch.bfloat16),
                     ends=torch.tensor([2, 8], dtype=torch.int32), out=torch.zeros(2, 4, 8))
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        accumulate_grouped_wgrad(**arguments)


def _mxfp8_payload(rows: torch.Tensor):
    from megatron_ext.formats import mxfp8
    from megatron_ext.moe.mxfp8_dispatch import MXFP8Payload

    return MXFP8Payload(mxfp8.pack_rows(mxfp8.quantize_rows(rows)), rows.shape[1], rows.dtype)


@pytest.mark.parametrize("fc1_trains", [True, False], ids=["trained", "frozen"])
def test_mxfp8_payload_fc1_under_ddp_equals_the_dequantized_gemm(fc1_trains):
    """The MXFP8 up-projection's node: its input gradient and main_grad against torch's autograd of
    the GEMM on the dequantized payload; a frozen fc1 with a main_grad gets nothing added and no flag
    (its backward once formed and added a weight gradient nobody asked for)."""
    from megatron_ext.kernels.mxfp8_rows import dequantize_packed
    from megatron_ext.moe.mxfp8_dispatch import payload_fc1

    gen = torch.Generator().manual_seed(12)
    rows = torch.randn(CAPACITY, 32, generator=gen).bfloat16()  # hidden 32: one MXFP8 block per row
    grad_out = torch.randn(CAPACITY, FFN, generator=gen).bfloat16()
    weight = (torch.randn(EXPERTS, FFN, rows.shape[1], generator=gen) * 0.3).bfloat16()
    offsets = torch.cumsum(expert_counts(EXPERTS, VALID, seed=13, empty=(2,)), 0, dtype=torch.int32)
    payload = _mxfp8_payload(rows)
    dequantized = dequantize_packed(payload.packed, payload.hidden, payload.dtype)
    want_rows, want_weight = dequantized.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    torch._grouped_mm(want_rows, want_weight.transpose(1, 2), offs=offsets)[:VALID].backward(grad_out[:VALID])

    fc1 = weight.clone().requires_grad_(fc1_trains)
    if fc1_trains:
        attach_main_grads([fc1])
    else:  # frozen after DDP built its buffers: the main_grad stays, the hook is never called
        fc1.main_grad, fc1.grad_added_to_main_grad = torch.zeros(fc1.shape), False
    anchor = torch.zeros((), dtype=rows.dtype).expand(*rows.shape).requires_grad_(True)
    out = payload_fc1(anchor, fc1, offsets, payload, wgrad_fusion=True)
    want_out = torch._grouped_mm(dequantized, weight.transpose(1, 2), offs=offsets)
    torch.testing.assert_close(out[:VALID], want_out[:VALID])
    out[:VALID].backward(grad_out[:VALID])
    torch.testing.assert_close(anchor.grad[:VALID], want_rows.grad[:VALID])
    if fc1_trains:
        assert fc1.grad is None and fc1.grad_added_to_main_grad
        torch.testing.assert_close(fc1.main_grad, want_weight.grad.float(), rtol=1e-2, atol=1e-2)
    else:
        assert not fc1.grad_added_to_main_grad and torch.equal(fc1.main_grad, torch.zeros_like(fc1.main_grad))


def test_grouped_linear_takes_a_transposed_view():
    """A column-major view of the rows (a transposed activation) is made contiguous before the node:
    the grouped GEMM's backward refuses it, on the GPU only."""
    gen = torch.Generator().manual_seed(14)
    rows_t = torch.randn(HIDDEN, CAPACITY, generator=gen)
    weight = torch.randn(EXPERTS, FFN, HIDDEN, generator=gen, requires_grad=True)
    offsets = torch.cumsum(expert_counts(EXPERTS, VALID, seed=15), 0, dtype=torch.int32)
    rows = rows_t.t().requires_grad_(True)
    assert not rows.is_contiguous()
    out = grouped_linear(rows, weight, offsets, fuse=False)
    ctx_rows = out.grad_fn.saved_tensors[0]
    assert ctx_rows.is_contiguous()
    out[:VALID].sum().backward()
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        torch.testing.assert_close(rows.grad[start:end], weight[expert].detach().sum(0).expand(end - start, HIDDEN))
        start = end


def test_main_grad_is_given_back_when_the_warm_up_fails():
    """A warm-up that raises (out of memory, a refused setting) falls back to eager: the eager
    backward must add to DDP's main_grad again, not to the scratch stand-in."""
    weight = torch.nn.Parameter(torch.zeros(2, 3))
    weight.main_grad = original = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        with main_grads_set_aside([weight]):
            assert weight.main_grad is not original
            raise RuntimeError("warm-up failed")
    assert weight.main_grad is original


def test_cpu_reference_rounds_old_plus_sum_once():
    """The torch reference (CPU tensors) adds each expert's sum to a bf16 `out` in fp32 and rounds once,
    as the kernel's epilogue does. Small integers keep every fp32 sum exact, so the expectation is exact;
    rounding the sum to bf16 first (twice in all) differs on some elements of this case."""
    from megatron_ext.kernels.grouped_wgrad import accumulate_grouped_wgrad_reference

    gen = torch.Generator().manual_seed(11)
    rows, left_width, right_width = 96, 6, 5
    left = torch.randint(-15, 16, (rows, left_width), generator=gen).bfloat16()
    right = torch.randint(-15, 16, (rows, right_width), generator=gen).bfloat16()
    ends = torch.tensor([40, 40, 96], dtype=torch.int32)  # an empty expert
    old = torch.randint(-9, 10, (3, left_width, right_width), generator=gen).bfloat16()
    out = old.clone()
    accumulate_grouped_wgrad_reference(left, right, ends, out)
    sums = torch.zeros(3, left_width, right_width, dtype=torch.float64)
    for expert, (start, end) in enumerate(((0, 40), (40, 40), (40, 96))):
        sums[expert] = left[start:end].double().t() @ right[start:end].double()
    want = (old.double() + sums).bfloat16()
    assert torch.equal(out, want)
    assert torch.equal(out[1], old[1]), "the empty expert's out is left as it was"
    rounded_twice = (old.float() + sums.bfloat16().float()).bfloat16()
    assert not torch.equal(rounded_twice, want), "this case must tell one rounding from two"
