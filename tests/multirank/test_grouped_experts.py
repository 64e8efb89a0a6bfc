"""DeviceOffsetGroupedMLP: under Megatron's dispatchers, on capacity buffers, and checkpoints."""

import functools
import tempfile

import pytest
import torch

from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from tests.layer_check import Case, run_and_compare
from megatron_ext.testing.megatron_moe import megatron_moe_layer, moe_config
from megatron_ext.testing.reference import MoEWeights, assert_close


def _swapped_experts_rank(rank, world, dispatcher):
    build = functools.partial(megatron_moe_layer, experts_builder=DeviceOffsetGroupedMLP)
    return run_and_compare(rank, Case(experts=8, tokens=12), build,
                           config_overrides=dict(moe_token_dispatcher_type=dispatcher))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("world,ep", [(1, 1), (2, 2), (2, 1)])
def test_grouped_experts_under_megatron_dispatchers_match_oracle(world, ep, dispatcher):
    run_on_ranks(_swapped_experts_rank, world, dispatcher, sizes=ParallelSizes(ep=ep))


def _capacity_buffer_rank(rank, world, dtype):
    torch.manual_seed(3)
    experts, hidden, ffn, capacity = 4, 32, 16, 40
    config = moe_config(hidden=hidden, ffn=ffn, experts=experts, dtype=dtype)
    module = DeviceOffsetGroupedMLP(experts, config)
    weights = MoEWeights.random(experts, hidden, ffn, seed=11, dtype=dtype)
    with torch.no_grad():
        module.fc1_weight.copy_(weights.fc1)
        module.fc2_weight.copy_(weights.fc2)
    counts = torch.tensor([7, 0, 12, 9])  # one empty expert, 28 valid rows, 12 tail rows
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    valid = int(offsets[-1])
    x = torch.randn(capacity, hidden).to(dtype)
    probs = torch.rand(capacity)
    grad_out = torch.randn(capacity, hidden).to(dtype)

    def run(tail_value):
        module.zero_grad()
        buf = x.clone()
        buf[valid:] = tail_value
        buf.requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        out = module.forward_offsets(buf, offsets, p)
        g = grad_out.clone()
        g[valid:] = tail_value  # the combine never writes tail gradients; garbage must not leak
        out.backward(g)
        return (out[:valid].detach().clone(), buf.grad[:valid].clone(), p.grad[:valid].clone(),
                module.fc1_weight.grad.clone(), module.fc2_weight.grad.clone())

    first = run(float("nan"))
    for name, t in zip(("out", "x grad", "prob grad", "fc1 grad", "fc2 grad"), first):
        assert torch.isfinite(t.float()).all(), f"{name} picked up the NaN tail"
    second = run(1e30)
    for name, a, b in zip(("out", "x grad", "prob grad", "fc1 grad", "fc2 grad"), first, second):
        assert torch.equal(a, b), f"{name} depends on capacity-tail contents"

    # Oracle: per-expert loop in fp32.
    ref = MoEWeights(weights.router, weights.fc1.float().requires_grad_(True), weights.fc2.float().requires_grad_(True))
    xr = x[:valid].float().requires_grad_(True)
    pr = probs[:valid].clone().requires_grad_(True)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate_up = xr[start:start + n] @ ref.fc1[e].t()
        gate, up = gate_up.chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up * pr[start:start + n, None]) @ ref.fc2[e].t())
        start += n
    out_ref = torch.cat(outs)
    (out_ref * grad_out[:valid].float()).sum().backward()
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(first[0], out_ref, rtol, "capacity-buffer output")
    assert_close(first[1], xr.grad, rtol, "capacity-buffer input grad")
    assert_close(first[2], pr.grad, rtol, "capacity-buffer prob grad")
    assert_close(first[3], ref.fc1.grad, 2 * rtol, "fc1 weight grad")
    assert_close(first[4], ref.fc2.grad, 2 * rtol, "fc2 weight grad")
    assert torch.count_nonzero(first[3][1]) == 0, "the empty expert got a gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capacity_buffer_tail_never_read_and_matches_oracle(dtype):
    run_on_ranks(_capacity_buffer_rank, 1, dtype, sizes=ParallelSizes())


def _errors_rank(rank, world):
    config = moe_config(hidden=32, ffn=16, experts=2)
    module = DeviceOffsetGroupedMLP(2, config)
    x = torch.randn(8, 32)
    with pytest.raises(TypeError, match="int32"):
        module.forward_offsets(x, torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="device"):
        module.forward_offsets(x, torch.tensor([3, 8], dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"hidden \[rows, 32\]"):
        module(torch.randn(8, 16), [3, 5])
    with pytest.raises(TypeError, match="dtype"):
        module(x.to(torch.bfloat16), [3, 5])
    checked = DeviceOffsetGroupedMLP(2, config, debug_checks=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        checked.forward_offsets(x, torch.tensor([5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"<= rows \(8\)"):
        checked.forward_offsets(x, torch.tensor([3, 9], dtype=torch.int32))
    # the checks' edges are valid: an empty expert (a zero step) and every row taken (end == rows)
    checked.load_state_dict(module.state_dict())
    for offsets in ([0, 8], [8, 8], [3, 8]):
        torch.testing.assert_close(checked.forward_offsets(x, torch.tensor(offsets, dtype=torch.int32)),
                                   module.forward_offsets(x, torch.tensor(offsets, dtype=torch.int32)))
    with pytest.raises(ValueError, match="expert-tensor-parallel-size 1"):
        DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2, etp=2, tp=1))
    with pytest.raises(ValueError, match=r"moe_mlp_glu_interleave_size=32 \(--moe-mlp-glu-interleave-size 32\)"):
        DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2, moe_mlp_glu_interleave_size=32))
    with pytest.raises(ValueError, match=r"params_dtype=torch.float64: .*--bf16"):
        DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2, dtype=torch.float64))
    needs_top1 = (r"moe_apply_probs_on_input \(--moe-apply-probs-on-input\) needs moe_router_topk=1 "
                  r"\(--moe-router-topk 1\)")
    with pytest.raises(ValueError, match=needs_top1):
        DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2, moe_apply_probs_on_input=True))


def test_bad_inputs_are_clear_errors():
    run_on_ranks(_errors_rank, 1, sizes=ParallelSizes())


def _param_attrs_rank(rank, world, bias=False):
    module = DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2 * world, ep=world,
                                                  add_bias_linear=bias))
    return [p.allreduce for p in module.parameters()]


def test_expert_params_marked_for_expert_ddp_buffers():
    assert run_on_ranks(_param_attrs_rank, 1, sizes=ParallelSizes()) == [[True, True]]
    assert run_on_ranks(_param_attrs_rank, 2, sizes=ParallelSizes(ep=2)) == [[False, False]] * 2
    # biases too: each EP rank's biases belong to its own experts, reduced over expert-DP only
    assert run_on_ranks(_param_attrs_rank, 2, True, sizes=ParallelSizes(ep=2)) == [[False] * 4] * 2


def _bias_init_rank(rank, world):
    module = DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2, add_bias_linear=True))
    biases = [module.fc1_bias, module.fc2_bias]
    for bias in biases:
        bias.data.fill_(float("nan"))  # what uninitialized memory may hold
    module._init_weights(None)
    return [bool((bias == 0).all()) for bias in biases]


def test_expert_biases_start_at_zero():
    """As Megatron's SequentialMLP (its linear layers zero their biases; no draw)."""
    assert run_on_ranks(_bias_init_rank, 1, sizes=ParallelSizes()) == [[True, True]]


def _checkpoint_rank(rank, world, ckpt_dir, direction):
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.spec_utils import get_submodules

    experts_total = 4
    config = moe_config(hidden=32, ffn=16, experts=experts_total, ep=world)
    local = experts_total // world
    layer_mlp = get_submodules(get_gpt_layer_local_submodules(num_experts=experts_total).mlp)
    mlp_submodules = get_submodules(layer_mlp.experts)
    sequential = SequentialMLP(local, config, mlp_submodules, pg_collection=get_default_pg_collection())
    grouped = DeviceOffsetGroupedMLP(local, config)
    source, target = (sequential, grouped) if direction == "sequential_to_grouped" else (grouped, sequential)
    with torch.no_grad():
        for p in target.parameters():
            p.fill_(0.123)
    dist_checkpointing.save(source.sharded_state_dict(prefix="mlp.experts."), ckpt_dir)
    loaded = dist_checkpointing.load(target.sharded_state_dict(prefix="mlp.experts."), ckpt_dir)
    target.load_state_dict({k[len("mlp.experts."):]: v for k, v in loaded.items()})

    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(rank))
    counts = torch.tensor([4, 6] if local == 2 else [2, 3, 1, 4])
    probs = torch.ones(10)
    out_seq, _ = sequential(x, counts, probs)
    out_grp, _ = grouped(x, counts, probs)
    assert_close(out_grp, out_seq, 1e-5, f"rank {rank} {direction} output")


@pytest.mark.parametrize("direction", ["sequential_to_grouped", "grouped_to_sequential"])
@pytest.mark.parametrize("world", [1, 2])
def test_checkpoint_interchanges_with_sequential_mlp(world, direction):
    with tempfile.TemporaryDirectory() as ckpt_dir:
        run_on_ranks(_checkpoint_rank, world, ckpt_dir, direction,
                     sizes=ParallelSizes(ep=world))


def _plain_state_dict_rank(rank, world):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.spec_utils import get_submodules

    config = moe_config(hidden=32, ffn=16, experts=2)
    mlp_submodules = get_submodules(get_submodules(get_gpt_layer_local_submodules(num_experts=2).mlp).experts)
    sequential = SequentialMLP(2, config, mlp_submodules, pg_collection=get_default_pg_collection())
    grouped = DeviceOffsetGroupedMLP(2, config)
    grouped.load_state_dict(sequential.state_dict())
    x = torch.randn(6, 32)
    counts, probs = torch.tensor([2, 4]), torch.rand(6)
    assert_close(grouped(x, counts, probs)[0], sequential(x, counts, probs)[0], 1e-5, "torch-format load")


def test_loads_plain_sequential_mlp_state_dict():
    run_on_ranks(_plain_state_dict_rank, 1, sizes=ParallelSizes())


def _singleton_rank(rank, world):
    experts = DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2))
    stacked = experts.sharded_state_dict("experts.", metadata={})["experts.fc1_weight"]
    assert stacked.key == "experts.experts.linear_fc1.weight"
    with pytest.raises(NotImplementedError, match="singleton_local_shards=True"):
        experts.sharded_state_dict("experts.", metadata={"singleton_local_shards": True})


def test_the_singleton_local_shards_layout_is_refused_not_written_in_the_other_one():
    """SequentialMLP writes one key per expert with it (a review: loading such a checkpoint into the
    grouped experts failed with a KeyError naming the missing stacked key)."""
    run_on_ranks(_singleton_rank, 1, sizes=ParallelSizes())


def _expert_count_mismatch_rank(rank, world):
    module = DeviceOffsetGroupedMLP(2, moe_config(hidden=32, ffn=16, experts=2))
    fc1, fc2 = module.fc1_weight.detach(), module.fc2_weight.detach()
    errors = []
    for experts in ([0, 1, 2], [0]):  # one expert too many (would be dropped silently), one missing
        state = {}
        for i in experts:
            state[f"local_experts.{i}.linear_fc1.weight"] = fc1[0].clone()
            state[f"local_experts.{i}.linear_fc2.weight"] = fc2[0].clone()
        try:
            module.load_state_dict(state)
            errors.append(None)
        except (ValueError, RuntimeError) as error:
            errors.append(str(error))
    return errors


def test_a_sequential_checkpoint_of_other_experts_is_refused():
    [errors] = run_on_ranks(_expert_count_mismatch_rank, 1, sizes=ParallelSizes())
    assert all(error is not None and "this module holds 2 local experts" in error for error in errors), errors
