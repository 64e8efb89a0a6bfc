"""Megatron's distributed optimizer checkpoints the grouped experts with biases (one GPU, DP=1).

The biases are flat parameters saved as SequentialMLP's [L, rows] through a ShardedTensorFactory
(moe/expert_checkpoint.py); the distributed optimizer builds its states' entries from that
factory. Saved in Megatron's two formats for training checkpoints (dp_reshardable, the default;
fully_reshardable, --dist-ckpt-optim-fully-reshardable) and loaded into a model and optimizer
that took another step: the next step then equals the source's, which it does not without the
optimizer's state. The parameters are bf16, as in training: with fp32 parameters the distributed
optimizer's main parameters are views of them, and Megatron 0.19.2 loads dp_reshardable state
into those views with autograd on (an error for any parameter, Megatron's own too). Without Apex
or Transformer Engine (this GPU machine) Megatron's optimizer is torch's Adam, whose step 0.19.2's
distributed optimizer does not load right for any parameter: the fixture `torch_adam_step_kept`.
"""

import pytest
import torch

from megatron_ext.moe.experts import DeviceOffsetGroupedMLP
from megatron_ext.testing.expert_variants import ExpertParams, expert_params_of, load_expert_params, variant_config

pytestmark = pytest.mark.gpu
EXPERTS, HIDDEN, FFN = 4, 64, 32


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    from megatron_ext.testing.single_rank import init_single_rank_megatron

    init_single_rank_megatron()


class _Experts(torch.nn.Module):
    """The experts as a model chunk (Megatron's DDP and checkpoint calls take a module)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.experts.sharded_state_dict(prefix=f"{prefix}experts.")


@pytest.fixture
def torch_adam_step_kept(monkeypatch):
    """Two faults of Megatron 0.19.2's distributed optimizer with torch's Adam (no Apex/TE), for
    every parameter, Megatron's own too. Its load sets each parameter's `step` to one tensor, shared
    by all of them, holding the checkpoint's step; torch's foreach Adam then advances that tensor
    once per parameter, so every later step's bias corrections are wrong (dp_reshardable, silently).
    And it copies a parameter's state tensors from the loaded entries, which for fully_reshardable
    leave `step` out (KeyError 'step'). Here each parameter gets its own copy of the checkpoint's
    step, and that copy is what the load copies."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def own_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    monkeypatch.setattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", own_step)


def _trained(config, seed):
    """Experts from `seed` with Megatron's DDP and distributed Adam, after one step on `seed`'s batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    experts = DeviceOffsetGroupedMLP(EXPERTS, config).cuda()
    load_expert_params(experts, ExpertParams.random(config, seed=seed))
    chunk = _Experts(experts)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                       bf16=True, params_dtype=torch.bfloat16), [ddp])
    _step(experts, ddp, optimizer, seed)
    return chunk, ddp, optimizer


def _step(experts, ddp, optimizer, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, g = (torch.randn(24, HIDDEN, device="cuda", generator=gen).bfloat16() for _ in range(2))
    counts, probs = torch.tensor([5, 7, 0, 12]), torch.rand(24, device="cuda", generator=gen)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    (experts(x, counts, probs)[0] * g).sum().backward()
    ddp.finish_grad_sync()
    optimizer.step()


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_distributed_optimizer_state_of_biased_experts_round_trips(tmp_path, sharding, torch_adam_step_kept):
    from megatron.core import dist_checkpointing

    config = variant_config("gelu_bias", hidden=HIDDEN, ffn=FFN, experts=EXPERTS, dtype=torch.bfloat16)
    source, source_ddp, source_opt = _trained(config, seed=1)
    metadata = {"distrib_optim_sharding_type": sharding}
    model_entries = source.sharded_state_dict()
    dist_checkpointing.save({"model": model_entries, "optimizer": source_opt.sharded_state_dict(
        model_entries, metadata=metadata)}, str(tmp_path))
    runs = {}
    for load_optimizer in (True, False):
        target, target_ddp, target_opt = _trained(config, seed=2)
        entries = target.sharded_state_dict()
        wanted = {"model": entries}
        if load_optimizer:
            wanted["optimizer"] = target_opt.sharded_state_dict(entries, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load(wanted, str(tmp_path))
        target.experts.load_state_dict({k[len("experts."):]: v for k, v in loaded["model"].items()})
        if load_optimizer:
            target_opt.load_state_dict(loaded["optimizer"])
        else:
            target_opt.reload_model_params()  # the distributed optimizer's main params from the loaded model
        assert all(torch.equal(a, b) for a, b in zip(expert_params_of(target.experts).values(),
                                                    expert_params_of(source.experts).values()))
        _step(target.experts, target_ddp, target_opt, seed=3)
        runs[load_optimizer] = expert_params_of(target.experts)
    _step(source.experts, source_ddp, source_opt, seed=3)
    want = expert_params_of(source.experts)
    for name in want:
        assert torch.equal(runs[True][name], want[name]), f"{sharding}: {name} after the next step differs"
    assert any(not torch.equal(runs[False][name], want[name]) for name in want), "the check must be able to fail"
