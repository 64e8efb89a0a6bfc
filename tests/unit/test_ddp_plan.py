"""Bucket plan (pure), averaging rule, single-process bucket mechanics, and the Megatron DDP guard."""

import pytest
import torch

from megatron_ext.ddp.buckets import MultiGroupGradBuckets
from megatron_ext.ddp.plan import DENSE, EXPERT, ParamInfo, param_infos, plan_buckets, resolve_divisors

F32, BF16 = torch.float32, torch.bfloat16


def info(name, numel, group=DENSE, dtype=F32):
    return ParamInfo(name, (numel,), dtype, group)


def layout(plan):
    return [(b.group, b.dtype, b.names) for b in plan]


def test_reverse_order_and_new_bucket_on_group_change():
    params = [info("emb", 4), info("attn", 4), info("router", 2), info("fc1", 8, EXPERT), info("fc2", 8, EXPERT),
              info("attn2", 4), info("fc1_2", 8, EXPERT)]
    plan = plan_buckets(params, bucket_bytes=None)
    assert layout(plan) == [
        (EXPERT, F32, ("fc1_2",)),
        (DENSE, F32, ("attn2",)),
        (EXPERT, F32, ("fc2", "fc1")),
        (DENSE, F32, ("router", "attn", "emb")),
    ]
    assert [b.index for b in plan] == [0, 1, 2, 3]
    last = plan[-1]
    assert [(s.offset, s.numel) for s in last.slots] == [(0, 2), (2, 4), (6, 4)] and last.numel == 10


def test_new_bucket_on_dtype_change():
    plan = plan_buckets([info("a", 4), info("b", 4, dtype=BF16), info("c", 4, dtype=BF16)], bucket_bytes=None)
    assert layout(plan) == [(DENSE, BF16, ("c", "b")), (DENSE, F32, ("a",))]
    assert plan[0].nbytes == 16 and plan[1].nbytes == 16


def test_byte_cap():
    # fp32: 4 bytes per element; cap 40 bytes = 10 elements.
    params = [info("a", 3), info("b", 3), info("c", 4), info("d", 5), info("big", 30), info("e", 1)]
    plan = plan_buckets(params, bucket_bytes=40)
    assert [b.names for b in plan] == [("e",), ("big",), ("d", "c"), ("b", "a")]
    assert all(b.nbytes <= 40 for b in plan if len(b.slots) > 1)
    # Exactly at the cap stays in one bucket.
    assert [b.names for b in plan_buckets([info("x", 5), info("y", 5)], bucket_bytes=40)] == [("y", "x")]


def test_plan_is_deterministic_and_covers_every_parameter_once():
    params = [info(f"p{i}", 1 + (7 * i) % 11, EXPERT if i % 3 == 0 else DENSE) for i in range(40)]
    first, second = plan_buckets(params, bucket_bytes=64), plan_buckets(list(params), bucket_bytes=64)
    assert first == second
    names = [n for b in first for n in b.names]
    assert sorted(names) == sorted(p.name for p in params) and len(names) == len(params)
    assert names == [p.name for p in reversed(params)]


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([info("a", 1), info("a", 2)])
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([info("a", 1)], bucket_bytes=0)


def test_averaging_rule():
    sizes = {DENSE: 8, EXPERT: 2}
    assert resolve_divisors(sizes, None) == {DENSE: 8, EXPERT: 8}
    assert resolve_divisors(sizes, {EXPERT: EXPERT}) == {DENSE: 8, EXPERT: 2}
    assert resolve_divisors(sizes, {DENSE: 1, EXPERT: 1}) == {DENSE: 1, EXPERT: 1}
    with pytest.raises(ValueError, match="not one of"):
        resolve_divisors(sizes, {"shared": 2})
    with pytest.raises(ValueError, match="positive int"):
        resolve_divisors(sizes, {EXPERT: 0})
    with pytest.raises(ValueError, match="averages over 'dense'"):
        resolve_divisors({EXPERT: 2}, None)


class Toy(torch.nn.Module):
    """Dense Linear -> 'expert' Linear (allreduce=False) -> dense Linear, plus an unused param."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 6)
        self.expert = torch.nn.Linear(6, 6, bias=False)
        self.expert.weight.allreduce = False
        self.out = torch.nn.Linear(6, 3)
        self.unused = torch.nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.out(torch.relu(self.expert(self.inp(x))))


def test_param_infos_use_megatron_expert_mark():
    groups = {i.name: i.group for i in param_infos(Toy())}
    assert groups["expert.weight"] == EXPERT and groups["inp.weight"] == DENSE and groups["unused"] == DENSE


def _reference_grads(model, xs):
    model.zero_grad(set_to_none=True)
    for x in xs:
        model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_single_rank_buckets_equal_autograd_and_launch_in_plan_order():
    model = Toy()
    x = torch.randn(4, 6)
    expected = _reference_grads(model, [x])
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    assert len(buckets.plan) >= 4
    for _ in range(2):  # the second step reuses the bound views
        buckets.zero_grad_buffers()
        model(x).square().mean().backward()
        assert buckets.launched_in_backward > 0, "no bucket launched from a backward hook"
        buckets.finish_grad_sync()
        for name, param in model.named_parameters():
            want = expected.get(name, torch.zeros_like(param))
            torch.testing.assert_close(param.grad, want, rtol=0, atol=0, msg=name)
    assert buckets.launch_order == [] and "bucket 0" in buckets.describe()


def test_set_to_none_unused_param_and_no_sync_accumulation():
    model = Toy()
    xs = [torch.randn(4, 6), torch.randn(4, 6)]
    expected = _reference_grads(model, xs)
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    for flat in buckets.flat:
        flat.fill_(7.0)  # stale values: copied-over or zero-filled slots must not keep them
    model.zero_grad(set_to_none=True)  # the optimizer's way: the hook copies into the slots
    with buckets.no_sync():
        model(xs[0]).square().mean().backward()
    model(xs[1]).square().mean().backward()
    buckets.finish_grad_sync()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected.get(name, torch.zeros_like(param)), msg=name)
    unused = model.unused
    assert unused.grad.data_ptr() == buckets._views[unused].data_ptr()


def test_second_backward_after_launch_is_a_clear_error():
    model = Toy()
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    assert buckets.launch_order, "the first backward launched no bucket"
    with pytest.raises(RuntimeError, match="after bucket .* was launched"):
        model(x).sum().backward()


def test_unknown_group_is_a_clear_error():
    with pytest.raises(ValueError, match=r"assign\(\) returned groups \['expert'\]"):
        MultiGroupGradBuckets(Toy(), {DENSE: None})


def test_megatron_ddp_internals_are_as_relied_on():
    from megatron_ext.ddp.megatron_hook import check_megatron_ddp_internals

    check_megatron_ddp_internals()


def test_megatron_ddp_guard_names_a_changed_internal(monkeypatch):
    from megatron.core.distributed import param_and_grad_buffer

    from megatron_ext.ddp.megatron_hook import MegatronInternalsChanged, check_megatron_ddp_internals

    class Renamed:
        def __init__(self, buckets, ddp_config, group, group_size):
            pass

    monkeypatch.setattr(param_and_grad_buffer, "_ParamAndGradBucketGroup", Renamed)
    with pytest.raises(MegatronInternalsChanged) as error:
        check_megatron_ddp_internals()
    message = str(error.value)
    assert "_ParamAndGradBucketGroup.__init__ lost parameters ['collective_group', 'collective_group_size']" in message
    assert "0.19.2" in message and "start_grad_sync no longer exists" in message


@pytest.mark.parametrize("change,expected", [
    ("reset removed", "_ParamAndGradBucketGroup.reset no longer exists"),
    ("register_grad_ready no longer launches", "register_grad_ready no longer contains `self.start_grad_sync(`"),
    ("no source installed", "source not available to check"),
])
def test_one_changed_internal_is_enough_to_refuse(monkeypatch, change, expected):
    """A single change must be caught (the test above changes several at once); an install without
    sources cannot be checked and says so rather than passing."""
    import inspect

    from megatron.core.distributed import param_and_grad_buffer

    from megatron_ext.ddp.megatron_hook import MegatronInternalsChanged, check_megatron_ddp_internals

    group_cls = param_and_grad_buffer._ParamAndGradBucketGroup
    if change == "reset removed":
        monkeypatch.delattr(group_cls, "reset")
    elif change == "register_grad_ready no longer launches":
        monkeypatch.setattr(group_cls, "register_grad_ready", lambda self, param, force_all_reduce=False: None)
    else:
        monkeypatch.setattr(inspect, "getsource", lambda fn: (_ for _ in ()).throw(OSError("could not get source")))
    with pytest.raises(MegatronInternalsChanged) as error:
        check_megatron_ddp_internals()
    assert expected in str(error.value)


def test_megatron_launcher_launches_in_fixed_order_whatever_the_request_order():
    from megatron_ext.ddp.megatron_hook import _OrderedLauncher

    launched = []
    order = [object(), object(), object()]
    originals = {id(g): (lambda g=g, **kw: launched.append(order.index(g))) for g in order}
    launcher = _OrderedLauncher(order, originals)
    launcher.request(order[2])
    launcher.request(order[1])
    assert launched == []
    launcher.request(order[0])
    assert launched == [0, 1, 2] and launcher.log == [0, 1, 2]


def test_megatron_launcher_serves_a_request_made_inside_a_launch_after_it():
    """Megatron's start_grad_sync may ask for the next group's launch from inside its own (the fp32
    reduce-scatter drain, 0.19.2): that launch must start after the one in progress returns, never
    nested in it. Written out: group 0 starts, asks for group 1 from inside, ends; then group 1."""
    from megatron_ext.ddp.megatron_hook import _OrderedLauncher

    events = []
    order = [object(), object()]

    def original(g, **kwargs):
        events.append(f"start {order.index(g)}")
        if g is order[0]:
            launcher.request(order[1])  # re-entrant request
        events.append(f"end {order.index(g)}")

    launcher = _OrderedLauncher(order, {id(g): (lambda g=g, **kw: original(g, **kw)) for g in order})
    launcher.request(order[0])
    assert events == ["start 0", "end 0", "start 1", "end 1"] and launcher.log == [0, 1]


def test_fixed_launch_order_is_installed_once():
    """A second install returns the first launcher and leaves the bucket groups' start_grad_sync on it
    (wrapping twice would route each launch through two launchers); a step still launches each group
    once, in backward order."""
    from types import SimpleNamespace

    from megatron_ext.ddp.megatron_hook import install_fixed_launch_order

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    launched = []

    def group(name, index):
        bucket_group = SimpleNamespace(name=name, buckets=[SimpleNamespace(params_list=[params[index]])])
        bucket_group.start_grad_sync = lambda force_all_reduce=False: launched.append(name)
        return bucket_group

    first, second = group("D[0]", 0), group("E[1]", 1)
    ddp = SimpleNamespace(module=module, bucket_groups=[first], expert_parallel_bucket_groups=[second],
                          ddp_config=SimpleNamespace(overlap_grad_reduce=True))
    launcher = install_fixed_launch_order(ddp)
    hooks = (first.start_grad_sync, second.start_grad_sync, ddp.start_grad_sync)
    assert install_fixed_launch_order(ddp) is launcher
    assert (first.start_grad_sync, second.start_grad_sync, ddp.start_grad_sync) == hooks
    ddp.start_grad_sync()
    assert launched == ["E[1]", "D[0]"] and launcher.log == [0, 1]


@pytest.mark.parametrize("attr,why", [("sequence_parallel", "summed over tensor-parallel ranks"),
                                      ("average_gradients_across_tp_domain", "averaged over tensor-parallel ranks"),
                                      ("shared_embedding", "summed over the first and last pipeline stages")])
def test_buckets_refuse_parameters_that_finalize_model_grads_reduces_beyond_the_replica_groups(attr, why):
    """Megatron marks these (sequence-parallel norms and router, the embedding shared across
    stages); MultiGroupGradBuckets does not run finalize_model_grads, so a review's TP2 x DP2 run
    trained each TP rank on its partial norm gradient with no error."""
    from megatron_ext.ddp.buckets import MultiGroupGradBuckets

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None})  # unmarked: accepted
    setattr(model[1].weight, attr, True)
    with pytest.raises(ValueError, match=rf"'1.weight' must also be {why}.* by Megatron's finalize_model_grads"):
        MultiGroupGradBuckets(torch.nn.Sequential(*model), {DENSE: None, EXPERT: None})


def test_buckets_refuse_qk_layernorms_under_tensor_parallelism(monkeypatch):
    """finalize_model_grads sums q/k layernorm gradients over TP by name (qk_layernorm, 0.19.2): each TP
    rank's heads give part of them. A review's TP2 run with MultiGroupGradBuckets left the two TP
    ranks' q/k norms apart with no error."""
    from megatron_ext.ddp import buckets
    from megatron_ext.ddp.buckets import MultiGroupGradBuckets

    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "q_layernorm": torch.nn.LayerNorm(4),
                                 "k_layernorm": torch.nn.LayerNorm(4)})
    MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None})  # TP = 1: nothing to sum
    monkeypatch.setattr(buckets, "_tensor_parallel_size", lambda: 2)
    with pytest.raises(ValueError, match=r"'q_layernorm.weight', 'q_layernorm.bias', 'k_layernorm.weight' \.\.\. must "
                                         r"also be summed over tensor-parallel ranks \(qk_layernorm"):
        MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None})
    MultiGroupGradBuckets(torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4)}), {DENSE: None, EXPERT: None})


def test_bucket_groups_launch_in_the_order_backward_completes_them():
    """A group is complete when backward reaches its first-registered parameter. A review's tiny GPT:
    a dense group spanning layers 1-3 and the output layer went first by its last parameter, so the
    experts' groups of those layers waited for it, and layer 0's for the embedding."""
    from types import SimpleNamespace

    from megatron_ext.ddp.megatron_hook import launch_order

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(6)]  # registration order 0..5
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)

    def group(name, *indices):
        return SimpleNamespace(name=name, buckets=[SimpleNamespace(params_list=[params[i] for i in indices])])

    dense_late, experts_2, dense_early, experts_0 = (group("D[1,2,3,5]", 1, 2, 3, 5), group("E[4]", 4),
                                                     group("D[0]", 0), group("E[2]", 2))
    ddp = SimpleNamespace(module=module, bucket_groups=[dense_late, dense_early],
                          expert_parallel_bucket_groups=[experts_0, experts_2])
    # backward reaches 5, 4, 3, 2, 1, 0: E[4] is complete first, then E[2], D[1,2,3,5] at 1, D[0] last
    assert [g.name for g in launch_order(ddp)] == ["E[4]", "E[2]", "D[1,2,3,5]", "D[0]"]


# ---- cases a mutation audit found unasserted -------------------------------------------------------

def test_frozen_parameters_are_left_out_of_the_plan():
    model = Toy()
    model.unused.requires_grad_(False)
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    assert all("unused" not in bucket.names for bucket in buckets.plan)
    assert "unused" not in {info.name for info in param_infos(model)}


def test_a_second_backward_into_a_single_bucket_is_a_clear_error():
    model = torch.nn.Linear(3, 2, bias=False)
    buckets = MultiGroupGradBuckets(model, {DENSE: None}, bucket_bytes=None)
    assert len(buckets.plan) == 1
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="after bucket 0 was launched"):
        model(torch.randn(2, 3)).sum().backward()


def test_zeroing_the_buffers_mid_step_is_refused():
    """On one rank nothing is in flight, but the step's first buckets are launched: zeroing them
    would lose the step."""
    model = Toy()
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    model(torch.randn(4, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="in flight; call finish_grad_sync"):
        buckets.zero_grad_buffers()


def test_nested_no_sync_keeps_syncing_off_until_the_outer_block_ends():
    model = Toy()
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    with buckets.no_sync():
        with buckets.no_sync():
            pass
        model(torch.randn(4, 6)).sum().backward()
    assert buckets.launch_order == [], "a backward inside the outer no_sync launched a bucket"


def test_a_parameter_used_only_in_no_sync_microbatches_keeps_their_sum():
    """Microbatch 0 (no_sync) uses `unused`, the last microbatch does not: finish_grad_sync must keep
    the slot's sum, not zero it."""
    model = Toy()
    buckets = MultiGroupGradBuckets(model, {DENSE: None, EXPERT: None}, bucket_bytes=64)
    buckets.zero_grad_buffers()
    x = torch.randn(4, 6)
    with buckets.no_sync():
        (model(x).square().mean() + model.unused.sum() * 2).backward()
    model(x).square().mean().backward()
    buckets.finish_grad_sync()
    torch.testing.assert_close(model.unused.grad, torch.full((5,), 2.0))


def test_a_weight_whose_hook_fires_twice_is_counted_once():
    """Reentrant checkpointing runs each segment's backward on its own, so a weight used in two
    segments accumulates twice: its bucket must launch after both, with both contributions."""
    from torch.utils.checkpoint import checkpoint

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first = torch.nn.Linear(4, 4)
            self.shared = torch.nn.Linear(4, 4)

        def forward(self, x):
            x = checkpoint(self.shared, self.first(x), use_reentrant=True)
            return checkpoint(self.shared, x, use_reentrant=True)

    model, x = Shared(), torch.randn(3, 4, requires_grad=True)
    model(x).square().sum().backward()
    expected = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    buckets = MultiGroupGradBuckets(model, {DENSE: None}, bucket_bytes=None)
    buckets.zero_grad_buffers()
    model(x).square().sum().backward()
    buckets.finish_grad_sync()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
