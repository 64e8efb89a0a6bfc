"""Multi-group DDP on CUDA with NCCL (docs/design.md, "Parallel Folding and DDP buckets"): Megatron's
DistributedDataParallel with the folding hook, and MultiGroupGradBuckets, against plain autograd on
the global batch.

Per world (1 GPU always; 2 GPUs when present, DP2 with the expert group EP_DP = DP):
- FoldingDistributedDataParallel installs (replica groups verified, fixed launch order), and
  after each of 3 steps every param.main_grad equals the reference gradient; from the second
  step on, every bucket group launches from a backward hook, in the same order on every rank;
- MultiGroupGradBuckets gives the same gradients;
- both backward+finish paths run under torch.cuda.set_sync_debug_mode("error"): no host sync.

Runs under pytest (marked gpu, skipped without CUDA) or as
`python3 tests/gpu/test_ddp_megatron_gpu.py` where pytest is missing.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the GPU machine may lack pytest: see __main__
    pytest = None

HIDDEN, TOKENS, STEPS = 64, 32, 3
RTOL = 1e-5  # fp32 on GPU; sums over ranks in another order than the reference


class DenseExpertDense(torch.nn.Module):
    """dense Linear -> 'expert' Linear (allreduce=False: Megatron's expert buffer) -> dense Linear."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.expert = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.expert.weight.allreduce = False
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.out(torch.nn.functional.silu(self.expert(self.inp(x))))


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(TOKENS, HIDDEN, generator=gen).cuda(), torch.randn(TOKENS, HIDDEN, generator=gen).cuda())


def local_loss(model, data):
    x, g = data
    return (model(x) * g).sum() / TOKENS


def reference_grads(model, world, step) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (sum(local_loss(model, batch(r, step)) for r in range(world)) / world).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads(named, ref, what, grad_of):
    for name, param in named:
        got, want = grad_of(param), ref[name]
        err = (got - want).abs().max()
        limit = RTOL * want.abs().max().clamp_min(1e-12)
        assert err <= limit, f"{what} {name}: max abs error {err:.3e} > {limit:.3e}"


def check_ddp(rank: int, world: int) -> list:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.ddp.buckets import MultiGroupGradBuckets, groups_from_folding
    from megatron_ext.ddp.megatron_hook import FoldingDistributedDataParallel
    from megatron_ext.parallel.folding import FoldingMesh

    folding = FoldingMesh(world).create_groups()
    torch.manual_seed(0)
    reference = DenseExpertDense().cuda()
    for_megatron, for_buckets = copy.deepcopy(reference), copy.deepcopy(reference)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1)
    ddp = FoldingDistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=HIDDEN * HIDDEN),
        for_megatron, folding_groups=folding)
    assert all("already reduces" in line for line in ddp.replica_report), ddp.replica_report
    buckets = MultiGroupGradBuckets(for_buckets, groups_from_folding(folding), bucket_bytes=4 * HIDDEN * HIDDEN)
    launcher, logs = ddp.grad_launcher, []
    for step in range(STEPS):
        ref = reference_grads(reference, world, step)
        ddp.zero_grad_buffer()
        buckets.zero_grad_buffers()
        data = batch(rank, step)  # host-to-device copies happen before the sync check
        torch.cuda.synchronize()
        if step > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            local_loss(ddp, data).backward()
            launched_in_backward = len(launcher.log)
            ddp.finish_grad_sync()
            local_loss(for_buckets, data).backward()
            buckets_in_backward = buckets.launched_in_backward
            buckets.finish_grad_sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_grads(for_megatron.named_parameters(), ref, f"step {step} Megatron DDP", lambda p: p.main_grad)
        assert_grads(for_buckets.named_parameters(), ref, f"step {step} buckets", lambda p: p.grad)
        logs.append((launched_in_backward, launcher.last_log, buckets_in_backward))
        # Keep the three models in step (equal up to rounding): plain SGD on each one's gradients.
        with torch.no_grad():
            trios = zip(reference.parameters(), for_megatron.parameters(), for_buckets.parameters())
            for p_ref, p_meg, p_buck in trios:
                p_ref -= 0.1 * p_ref.grad
                p_meg -= 0.1 * p_meg.main_grad
                p_buck -= 0.1 * p_buck.grad
    groups = len(launcher.order)
    assert groups >= 2, f"expected dense and expert bucket groups, got {groups}"
    assert logs[0][:2] == (0, list(range(groups))), logs  # Megatron's first batch: launched in finish
    for in_backward, log, _ in logs[1:]:
        assert in_backward == groups and log == list(range(groups)), logs
    assert all(b == len(buckets.plan) for _, _, b in logs), (logs, buckets.describe())
    return logs


def _spawned_rank(rank: int, world: int, port: int, results) -> None:
    from megatron.core import parallel_state

    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, check_ddp(rank, world)))
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def run_spawned(world: int) -> list:
    import torch.multiprocessing as mp

    from megatron_ext.cpu_ranks import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_spawned_rank, args=(world, free_port(), results), nprocs=world, join=True,
                       start_method="spawn")
    logs = dict(results.get() for _ in range(world))
    assert all(logs[r] == logs[0] for r in range(world)), f"ranks launched differently: {logs}"
    return logs[0]


def test_folding_ddp_single_gpu_matches_autograd():
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()
    check_ddp(0, 1)


def test_folding_ddp_two_gpus_nccl_matches_global_batch():
    if torch.cuda.device_count() < 2:
        if pytest is not None:
            pytest.skip("needs 2 GPUs")
        return
    run_spawned(2)


if __name__ == "__main__":
    test_folding_ddp_single_gpu_matches_autograd()
    print("single GPU: ok")
    if torch.cuda.device_count() >= 2:
        print("2 GPUs:", run_spawned(2))
