"""Multi-group DDP buckets on 4 gloo ranks: gradients equal a single-process reference on the
global batch, experts reduce over EP_DP only, replicas stay equal and the checker names a
perturbed parameter; the Megatron DDP hook gives the same gradients in one fixed launch order.

Model: a dense Linear (H -> H) feeding megatron_ext's RowwiseMoELayer (torch transport,
dropless). Per-rank objective: L_r = (1/T) sum_t <out_t, g_t> with rank-specific tokens x and
output weights g; the global objective is the mean of L_r over the DP x CP ranks, which the
reference computes in one process over all ranks' tokens with the dense oracle.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.ddp.buckets import DENSE, EXPERT, MultiGroupGradBuckets, groups_from_folding
from megatron_ext.ddp.replica_check import ReplicaMismatch, check_replicas, maybe_check_replicas
from megatron_ext.parallel.folding import FoldingMesh
from megatron_ext.specs import moe_builder
from megatron_ext.testing.megatron_moe import load_weights, local_expert_range, moe_config, rank_tokens
from megatron_ext.testing.reference import MoEWeights, assert_close, dense_moe

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 16, 8, 4, 2, 6
RTOL = 1e-6


class DenseThenMoE(torch.nn.Module):
    def __init__(self, ep: int):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        config = moe_config(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, ep=ep)
        self.moe = moe_builder(MoEExtConfig(transport="torch", dropless=True))(config=config)

    def forward(self, x):
        out, _ = self.moe(self.proj(x).view(x.shape[0], 1, HIDDEN))
        return out.view(x.shape[0], HIDDEN)


def proj_weight(seed: int = 3) -> torch.Tensor:
    return torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed)) * HIDDEN ** -0.5


def build(ep: int):
    weights = MoEWeights.random(EXPERTS, HIDDEN, FFN, seed=11)
    model = DenseThenMoE(ep)
    with torch.no_grad():
        model.proj.weight.copy_(proj_weight())
    load_weights(model.moe, weights)
    return model, weights


def local_loss(model, rank: int, step: int = 0):
    x, g = rank_tokens(rank + 1000 * step, TOKENS, HIDDEN)
    return (model(x) * g).sum() / TOKENS


def reference_grads(weights: MoEWeights, dp_ranks: int, step: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of mean_r L_r over every data-parallel rank's tokens, in one process."""
    w_proj = proj_weight().requires_grad_(True)
    ref = weights.detached_leaves()
    loss = 0.0
    for r in range(dp_ranks):
        x, g = rank_tokens(r + 1000 * step, TOKENS, HIDDEN)
        loss = loss + (dense_moe(x @ w_proj.t(), ref, TOPK) * g).sum() / TOKENS
    (loss / dp_ranks).backward()
    return {"proj.weight": w_proj.grad, "moe.router.weight": ref.router.grad,
            "moe.experts.fc1_weight": ref.fc1.grad, "moe.experts.fc2_weight": ref.fc2.grad}


def compare_with_reference(model, ref: dict, rank: int, prefix: str = "", grad_of=lambda p: p.grad):
    experts = local_expert_range(model.moe)
    named = dict(model.named_parameters())
    assert sorted(named) == sorted(ref), f"model parameters {sorted(named)} != reference {sorted(ref)}"
    for name, want in ref.items():
        if name.startswith("moe.experts."):
            want = want[experts.start:experts.stop]
        assert_close(grad_of(named[name]), want, RTOL, f"{prefix}rank {rank} {name} gradient")


def mesh_groups(world: int, **mesh_kwargs):
    return groups_from_folding(FoldingMesh(world, **mesh_kwargs).create_groups())


# ---------------------------------------------------------------- DP4 with EP2 (EP_DP = 2)


def _one_step_rank(rank, world):
    groups = mesh_groups(world, ep=2)
    assert dist.get_process_group_ranks(groups[EXPERT]) == [rank % 2, rank % 2 + 2]
    model, weights = build(ep=2)
    buckets = MultiGroupGradBuckets(model, groups, bucket_bytes=600)
    assert [b.group for b in buckets.plan] == [EXPERT, EXPERT, DENSE, DENSE], buckets.describe()
    local_loss(model, rank).backward()
    assert buckets.launched_in_backward == len(buckets.plan), "buckets should launch during backward"
    launched = list(buckets.launch_order)
    buckets.finish_grad_sync()
    compare_with_reference(model, reference_grads(weights, world), rank)
    return launched


def test_dp4_ep2_gradients_equal_global_batch_reference():
    orders = run_on_ranks(_one_step_rank, 4, sizes=ParallelSizes(ep=2))
    assert orders == [[0, 1, 2, 3]] * 4, orders


def _wrong_expert_group_rank(rank, world):
    """Experts reduced over the full DP (4 ranks, two different shards): must not match."""
    groups = mesh_groups(world, ep=2)
    model, weights = build(ep=2)
    buckets = MultiGroupGradBuckets(model, {DENSE: groups[DENSE], EXPERT: groups[DENSE]})
    local_loss(model, rank).backward()
    buckets.finish_grad_sync()
    ref = reference_grads(weights, world)
    experts = local_expert_range(model.moe)
    error = (model.moe.experts.fc1_weight.grad - ref["moe.experts.fc1_weight"][experts.start:experts.stop]).abs().max()
    assert error > 1e-3 * ref["moe.experts.fc1_weight"].abs().max(), "reducing experts over DP matched the reference"
    assert_close(model.proj.weight.grad, ref["proj.weight"], RTOL, "dense grads are unaffected")
    return float(error)


def test_expert_grads_reduced_over_ep_dp_only():
    """Passes only because the expert group is EP_DP: the DP-wide variant is wrong by > 0.1%."""
    errors = run_on_ranks(_wrong_expert_group_rank, 4, sizes=ParallelSizes(ep=2))
    assert all(e > 0 for e in errors)


def _train_and_check_rank(rank, world):
    groups = mesh_groups(world, ep=2)
    model, _ = build(ep=2)
    buckets = MultiGroupGradBuckets(model, groups, bucket_bytes=600)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        buckets.zero_grad_buffers()
        local_loss(model, rank, step).backward()
        buckets.finish_grad_sync()
        optimizer.step()
        assert maybe_check_replicas(step, 2, model, groups) in (None, [])
    assert check_replicas(model, groups) == []
    with torch.no_grad():
        if rank == 1:
            model.moe.experts.fc2_weight[0, 3, 2] += 1e-6
        if rank == 2:
            model.moe.router.weight[1, 0] += 1e-6
    messages = check_replicas(model, groups)
    try:
        maybe_check_replicas(4, 2, model, groups)
        raised = None
    except ReplicaMismatch as error:
        raised = str(error)
    return messages, raised


def test_replicas_agree_after_training_and_checker_names_perturbed_parameter():
    results = run_on_ranks(_train_and_check_rank, 4, sizes=ParallelSizes(ep=2))
    for rank, (messages, raised) in enumerate(results):
        # The router (dense, all 4 ranks) comes before the experts in registration order.
        assert messages and "'moe.router.weight'" in messages[0] and "'dense'" in messages[0], messages
        assert "rank 0 vs rank 2" in messages[0]
        expert_seen = any("'moe.experts.fc2_weight'" in m for m in messages)
        assert expert_seen == (rank in (1, 3)), (rank, messages)  # only EP_DP group [1, 3] has it
        if expert_seen:
            assert "'expert'" in messages[1] and "ranks [1, 3]" in messages[1], messages
        assert raised is not None and raised.startswith(messages[0])


# ---------------------------------------------------------------- CP2 x DP2 with EP2


def _cp_rank(rank, world, dense_over):
    """CP2 DP2 EP2: the dense replica group is DP x CP (4 ranks), not DP (2 ranks). The model is
    token-wise, so a CP rank holding one sequence chunk is a rank holding other tokens."""
    from megatron.core import parallel_state as ps

    folding = FoldingMesh(world, cp=2, ep=2, etp=1).create_groups()
    groups = groups_from_folding(folding)
    if dense_over == "dp":
        groups = {DENSE: folding.dp_group, EXPERT: groups[EXPERT]}
    assert ps.get_context_parallel_world_size() == 2 and dist.get_world_size(groups[EXPERT]) == 2
    model, weights = build(ep=2)
    # Pin the divisor to DP x CP = 4 so that the "dp" variant differs only in its reduction group.
    buckets = MultiGroupGradBuckets(model, groups, average_over={DENSE: 4, EXPERT: 4})
    local_loss(model, rank).backward()
    buckets.finish_grad_sync()
    compare_with_reference(model, reference_grads(weights, world), rank)


def test_cp2_dp2_ep2_dense_grads_reduce_over_dp_times_cp():
    run_on_ranks(_cp_rank, 4, "dp_cp", sizes=ParallelSizes(cp=2, ep=2, etp=1))
    try:
        run_on_ranks(_cp_rank, 4, "dp", sizes=ParallelSizes(cp=2, ep=2, etp=1))
    except AssertionError as error:
        assert "proj.weight gradient" in str(error) or "router.weight gradient" in str(error), error
    else:
        raise AssertionError("reducing dense grads over DP without CP matched the reference")


# ---------------------------------------------------------------- Megatron DDP hook (CPU, gloo)


def _megatron_ddp_rank(rank, world):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.ddp.megatron_hook import FoldingDistributedDataParallel

    folding = FoldingMesh(world, ep=2).create_groups()
    model, weights = build(ep=2)
    ddp = FoldingDistributedDataParallel(
        model.moe.config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=150), model,
        folding_groups=folding)
    assert all("already reduces" in line for line in ddp.replica_report), ddp.replica_report
    launcher = ddp.grad_launcher
    logs = []
    for step in range(2):  # step 0: Megatron's first-batch path; step 1: launches from hooks
        ddp.zero_grad_buffer()
        x, g = rank_tokens(rank, TOKENS, HIDDEN)
        ((ddp(x) * g).sum() / TOKENS).backward()
        in_backward = len(launcher.log)
        ddp.finish_grad_sync()
        logs.append((in_backward, launcher.last_log))
        compare_with_reference(model, reference_grads(weights, world), rank, f"Megatron DDP step {step} ",
                               grad_of=lambda p: p.main_grad)
    return logs, len(launcher.order)


def test_megatron_ddp_with_folding_hook_matches_reference_in_fixed_order():
    results = run_on_ranks(_megatron_ddp_rank, 4, sizes=ParallelSizes(ep=2))
    logs, groups = results[0]
    assert groups >= 3, "expected several bucket groups (dense and expert)"
    assert all(r == results[0] for r in results), results
    (first_in_backward, first_log), (in_backward, log) = logs
    assert first_in_backward == 0 and first_log == list(range(groups))
    assert in_backward == groups and log == list(range(groups))


def _training_hook_rank(rank, world):
    """--moe-ext-ddp-buckets under megatron.training: the train_step hook installs the folding DDP on
    a plain Megatron DDP chunk before its first step (a stand-in for Megatron's train_step runs the
    step as finalize_model_grads does: backward, then finish_grad_sync by attribute)."""
    import contextlib
    import io

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.training import training

    from megatron_ext import training_hooks

    model, weights = build(ep=2)
    ddp = DistributedDataParallel(model.moe.config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                  bucket_size=150), model)
    seen = []

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        chunk = model[0]
        seen.append(getattr(chunk, "grad_launcher", None))
        chunk.zero_grad_buffer()
        x, g = rank_tokens(rank, TOKENS, HIDDEN)
        ((chunk(x) * g).sum() / TOKENS).backward()
        chunk.finish_grad_sync()

    training.train_step = train_step  # this rank's process only
    assert training_hooks.install(MoEExtConfig(transport="torch", dropless=True, ddp_buckets=True))
    logs, printed = [], io.StringIO()
    for step in range(2):
        with contextlib.redirect_stdout(printed):
            training.train_step(None, None, [ddp], None, None, None, None, iteration=step + 1)
        compare_with_reference(model, reference_grads(weights, world), rank, f"hooked step {step} ",
                               grad_of=lambda p: p.main_grad)
        logs.append(ddp.grad_launcher.last_log)
    assert seen[0] is not None and seen[1] is seen[0], "installed once, before the first step"
    return logs, len(ddp.grad_launcher.order), printed.getvalue().splitlines()


def test_ddp_buckets_flag_installs_the_folding_hook_before_the_first_step():
    results = run_on_ranks(_training_hook_rank, 4, sizes=ParallelSizes(ep=2))
    logs, groups, _ = results[0]
    assert groups >= 3 and all(r[:2] == results[0][:2] for r in results), results
    assert logs == [list(range(groups))] * 2
    said = results[0][2]  # rank 0 alone says what it found, once
    assert len(said) == 1 and "already reduces" in said[0], said
    assert said[0].startswith("megatron_ext: DDP buckets of model chunk 0 in one launch order; "), said
    assert [r[2] for r in results[1:]] == [[], [], []], results


# ---------------------------------------------------------------- Megatron's train() call sequence


def _reference_of(model, ref: dict) -> dict:
    """Each parameter's expected gradient (this rank's experts only), keyed by the parameter."""
    experts = local_expert_range(model.moe)
    named = dict(model.named_parameters())
    return {named[name]: want[experts.start:experts.stop] if name.startswith("moe.experts.") else want
            for name, want in ref.items()}


def _assert_reduced(ddp, model, ref: dict, prefix: str) -> None:
    """Every bucket's reduced values against the reference: whole buffers after an all-reduce, this
    rank's shard after the distributed optimizer's reduce-scatter."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    want_of = _reference_of(model, ref)
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket in bucket_group.buckets:
            want = torch.zeros_like(bucket.grad_data)
            for param in bucket.params_list:
                start = (param.main_grad.data_ptr() - bucket.grad_data.data_ptr()) // want.element_size()
                want[start:start + param.numel()] = want_of[param].reshape(-1)
            have = bucket.grad_data
            if ddp.ddp_config.use_distributed_optimizer:
                size, index = (bucket_group.intra_distributed_optimizer_instance_size,
                               bucket_group.intra_distributed_optimizer_instance_rank)
                have, want = shard_buffer(have, size)[index], shard_buffer(want, size)[index]
            assert_close(have, want, RTOL, f"{prefix}bucket {bucket.bucket_id}")


def _megatron_loop_rank(rank, world, settings):
    """Megatron's train() sets config.no_sync_func, config.grad_sync_func (the chunks' own bound
    start_grad_sync, with --align-grad-reduce) and config.finalize_model_grads_func before its first
    train_step, i.e. before the hook installs the folding DDP (megatron/training/training.py 3532-3550).
    The stand-in step runs the interleaved schedule's calls on two chunks (schedules.py 1073-1114,
    1395-1429, 2037-2066) and Megatron's real finalize_model_grads: every step must launch every bucket
    group through the ordered launcher and reduce every gradient."""
    import contextlib
    import types

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.training import training

    from megatron_ext import training_hooks

    results = []
    for overlap, align, distopt in settings:
        built = [build(ep=2) for _ in range(2)]
        chunks = [DistributedDataParallel(m.moe.config, DistributedDataParallelConfig(
            overlap_grad_reduce=overlap, use_distributed_optimizer=distopt, bucket_size=150), m) for m, _ in built]
        config = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None, finalize_model_grads_func=None)
        if overlap:  # train(), before the first train_step
            config.no_sync_func = [chunk.no_sync for chunk in chunks]
            if align:
                config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        config.finalize_model_grads_func = finalize_model_grads

        def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                       forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
            for chunk in model:
                chunk.zero_grad_buffer()
            x, g = rank_tokens(rank, TOKENS, HIDDEN)
            no_sync = contextlib.ExitStack()
            for chunk_no_sync in config.no_sync_func or []:
                no_sync.enter_context(chunk_no_sync())
            for microbatch in range(2):
                if microbatch == 1 and config.grad_sync_func is None:
                    no_sync.close()  # the last microbatch's backward launches from the hooks
                for chunk in model:
                    ((chunk(x) * g).sum() / TOKENS / 2).backward()
            no_sync.close()
            for index, grad_sync in enumerate(config.grad_sync_func or []):
                grad_sync(model[index].parameters())
            config.finalize_model_grads_func(model)

        training.train_step = train_step  # this rank's process only
        assert training_hooks.install(MoEExtConfig(transport="torch", dropless=True, ddp_buckets=True))
        logs = []
        for step in range(3):
            training.train_step(None, None, chunks, None, None, config, None, iteration=step + 1)
            for chunk, (model, weights) in zip(chunks, built):
                _assert_reduced(chunk, model, reference_grads(weights, world),
                                f"{(overlap, align, distopt)} step {step} rank {rank} ")
            logs.append([chunk.grad_launcher.last_log for chunk in chunks])
        results.append((logs, [len(chunk.grad_launcher.order) for chunk in chunks]))
    return results


# (overlap_grad_reduce, align_grad_reduce, use_distributed_optimizer)
MEGATRON_LOOP_SETTINGS = [(True, True, False), (True, False, True), (True, True, True), (False, False, False),
                          (False, False, True)]


def test_ddp_buckets_under_megatrons_train_call_sequence_reduce_every_step():
    results = run_on_ranks(_megatron_loop_rank, 4, MEGATRON_LOOP_SETTINGS, sizes=ParallelSizes(ep=2))
    assert all(r == results[0] for r in results), results
    for (logs, groups), setting in zip(results[0], MEGATRON_LOOP_SETTINGS):
        assert logs == [[list(range(n)) for n in groups]] * 3, (setting, logs)


def _fp32_reduce_scatter_rank(rank, world):
    """Megatron links each bucket group to its predecessor under reduce_scatter_with_fp32_accumulation
    and drains it inside start_grad_sync (whose first-batch finish_grad_sync starts it again): the
    ordered launcher must serve that re-entrant request, not recurse (a review's RecursionError)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_ext.ddp.megatron_hook import FoldingDistributedDataParallel

    folding = FoldingMesh(world, ep=2).create_groups()
    grads, logs = {}, None
    for kind in ("megatron", "folding"):
        model, _ = build(ep=2)
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                                   reduce_scatter_with_fp32_accumulation=True, bucket_size=150)
        ddp = (FoldingDistributedDataParallel(model.moe.config, ddp_config, model, folding_groups=folding)
               if kind == "folding" else DistributedDataParallel(model.moe.config, ddp_config, model))
        steps = []
        for step in range(2):
            ddp.zero_grad_buffer()
            x, g = rank_tokens(rank, TOKENS, HIDDEN)
            with ddp.no_sync():  # as Megatron's pipeline schedules run the last backward with grad_sync_func set
                ((ddp(x) * g).sum() / TOKENS).backward()
            ddp.start_grad_sync()  # what grad_sync_func calls
            ddp.finish_grad_sync()
            steps.append([p.main_grad.clone() for p in model.parameters()])
            if kind == "folding":
                logs = (logs or []) + [ddp.grad_launcher.last_log]
        grads[kind] = steps
        linked = sum(bg.previous_grad_reduce_bucket_group is not None
                     for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups)
    equal = all(torch.equal(a, b) for s in range(2) for a, b in zip(grads["megatron"][s], grads["folding"][s]))
    return equal, logs, len(ddp.grad_launcher.order), linked


def test_megatron_ddp_hook_with_fp32_reduce_scatter_drains_predecessors_in_order():
    for equal, logs, groups, linked in run_on_ranks(_fp32_reduce_scatter_rank, 4, sizes=ParallelSizes(ep=2)):
        assert linked >= 1, "Megatron linked no bucket groups: the case does not reach the drain"
        assert equal, "the reduce-scattered main_grads differ from Megatron's own DDP"
        assert logs == [list(range(groups))] * 2, logs


def _megatron_group_swap_rank(rank, world):
    """The hook really sets Megatron's reduction group: swapping EP_DP for EP_MP (same size,
    other ranks) breaks the expert gradients; swapping back restores them; a group of another
    size is refused."""
    import pytest
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.ddp.megatron_hook import FoldingDistributedDataParallel, install_replica_groups

    folding = FoldingMesh(world, ep=2).create_groups()
    model, weights = build(ep=2)
    ddp = FoldingDistributedDataParallel(model.moe.config, DistributedDataParallelConfig(), model,
                                         folding_groups=folding)
    ref = reference_grads(weights, world)
    fc1 = model.moe.experts.fc1_weight
    experts = local_expert_range(model.moe)
    errors = []
    import logging

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("megatron_ext.ddp.megatron_hook").addHandler(handler)
    for expert_group in (folding.ep_mp_group, folding.ep_dp_group):
        report = install_replica_groups(ddp, folding.dp_cp_group, expert_group)
        assert any(line.startswith("expert") and "replaced" in line for line in report), report
        assert warned and "now reduces over the folding mesh's" in warned.pop(), "a replaced group must be said"
        # the expert buffers record the group too (Megatron regroups buckets from buffer.data_parallel_group)
        want = dist.get_process_group_ranks(expert_group)
        assert all(dist.get_process_group_ranks(b.data_parallel_group) == want for b in ddp.expert_parallel_buffers)
        assert all(dist.get_process_group_ranks(b.data_parallel_group) == [0, 1, 2, 3] for b in ddp.buffers)
        ddp.zero_grad_buffer()
        x, g = rank_tokens(rank, TOKENS, HIDDEN)
        ((ddp(x) * g).sum() / TOKENS).backward()
        ddp.finish_grad_sync()
        errors.append(float((fc1.main_grad - ref["moe.experts.fc1_weight"][experts.start:experts.stop]).abs().max()))
    with pytest.raises(ValueError, match="expert bucket group 0 reduces over 2 ranks"):
        install_replica_groups(ddp, folding.dp_cp_group, folding.dp_cp_group)
    sharded = FoldingDistributedDataParallel(model.moe.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True), build(ep=2)[0], folding_groups=folding)
    with pytest.raises(ValueError, match="under the distributed optimizer each rank's shard follows its index"):
        install_replica_groups(sharded, folding.dp_cp_group, folding.ep_mp_group)
    return errors


def test_megatron_hook_controls_the_expert_reduction_group():
    for wrong, right in run_on_ranks(_megatron_group_swap_rank, 4, sizes=ParallelSizes(ep=2)):
        assert wrong > 1e-3 and right < 1e-6, (wrong, right)


def _scaling_rank(rank, world):
    """Megatron's own scaling factors pass the averaging rule: 1 / |DP x CP| = 1/4 for a mean loss, 1.0
    with calculate_per_token_loss (the loss is divided by the global token count instead), and with
    average_in_collective the factor times the collective's 1/size; a factor off by one part in a
    million is refused."""
    import pytest
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.ddp.megatron_hook import FoldingDistributedDataParallel, install_replica_groups

    folding = FoldingMesh(world, ep=2).create_groups()
    model, _ = build(ep=2)
    model.moe.config.calculate_per_token_loss = True  # this forked rank's config only
    per_token = FoldingDistributedDataParallel(model.moe.config, DistributedDataParallelConfig(), model,
                                               folding_groups=folding)
    factors = {b.gradient_scaling_factor for bg in per_token.bucket_groups + per_token.expert_parallel_bucket_groups
               for b in bg.buckets}
    model, _ = build(ep=2)  # averaging in the collective: dense 1.0 over 4 ranks, experts 2/4 over EP_DP's 2
    averaged = FoldingDistributedDataParallel(model.moe.config, DistributedDataParallelConfig(
        average_in_collective=True), model, folding_groups=folding)
    in_collective = [{b.gradient_scaling_factor for bg in groups for b in bg.buckets}
                     for groups in (averaged.bucket_groups, averaged.expert_parallel_bucket_groups)]
    model, _ = build(ep=2)
    mean = FoldingDistributedDataParallel(model.moe.config, DistributedDataParallelConfig(), model,
                                          folding_groups=folding)
    mean.bucket_groups[0].buckets[0].gradient_scaling_factor *= 1 + 1e-6
    with pytest.raises(ValueError, match=r"dense bucket group 0 scales gradients by 0.25, the averaging rule "
                                         r"wants 0.25 \(mean over the 4 DP x CP ranks\)"):
        install_replica_groups(mean, folding.dp_cp_group, folding.ep_dp_group)
    return factors, in_collective


def test_megatron_scaling_factors_pass_the_averaging_rule_and_a_small_error_does_not():
    assert run_on_ranks(_scaling_rank, 4, sizes=ParallelSizes(ep=2)) == [({1.0}, [{1.0}, {0.5}])] * 4


def _steps_checked_rank(rank, world, argvs):
    """Replicas that disagree from the start (weight = rank); per command line, the interval the
    flag sets and the steps of 0..11 at which maybe_check_replicas raises."""
    import argparse

    from megatron_ext.arguments import add_moe_ext_args, ext_config_from_args

    parser = add_moe_ext_args(argparse.ArgumentParser())
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(float(rank))
    groups = {DENSE: dist.group.WORLD, EXPERT: None}
    found = []
    for argv in argvs:
        interval = ext_config_from_args(parser.parse_args(argv)).replica_check_interval
        caught = []
        for step in range(12):
            try:
                maybe_check_replicas(step, interval, model, groups)
            except ReplicaMismatch as error:
                assert "'weight'" in str(error), error
                caught.append(step)
        found.append((interval, caught))
    return found


def test_replica_check_interval_flag_sets_the_steps_that_are_checked():
    """--moe-ext-replica-check-interval 5 catches a mismatch at steps 0, 5 and 10 of 0..11; the
    default (0) never checks; a negative interval is refused, naming the flag."""
    import argparse

    from megatron_ext.arguments import MoEExtArgumentError, add_moe_ext_args, ext_config_from_args

    argvs = [["--moe-ext-replica-check-interval", "5"], ["--moe-ext-replica-check-interval", "1"], []]
    expected = [(5, [0, 5, 10]), (1, list(range(12))), (0, [])]
    assert run_on_ranks(_steps_checked_rank, 2, argvs) == [expected, expected]
    args = add_moe_ext_args(argparse.ArgumentParser()).parse_args(["--moe-ext-replica-check-interval", "-1"])
    with pytest.raises(MoEExtArgumentError, match="--moe-ext-replica-check-interval"):
        ext_config_from_args(args)


def test_folding_ddp_refuses_a_partial_distributed_optimizer():
    """--num-distributed-optimizer-instances > 1 needs intra- and inter-instance groups the folding DDP
    does not build: both paths refuse it with one message (a review saw Megatron blame a
    pg_collection the user never built on one path, and a bare NotImplementedError on the other)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.ddp.megatron_hook import FoldingDistributedDataParallel, install_replica_groups

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    message = r"supports num_distributed_optimizer_instances == 1 only \(--num-distributed-optimizer-instances\), got 2"
    with pytest.raises(NotImplementedError, match=message):
        FoldingDistributedDataParallel(None, ddp_config, torch.nn.Linear(2, 2), folding_groups=object())
    with pytest.raises(NotImplementedError, match=message):
        install_replica_groups(type("DDP", (), {"ddp_config": ddp_config})(), None, None)
