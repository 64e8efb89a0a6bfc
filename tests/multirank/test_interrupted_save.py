"""A rank killed in the middle of a checkpoint save: the previous checkpoint still loads and
training resumes from it, with megatron_ext's MoE layers in the model.

The mechanism is Megatron's own, unchanged: `megatron.training.checkpointing.save_checkpoint`
(torch_dist: every rank writes its shard files into the iteration folder `iter_<7-digit iteration>/`, rank 0 writes
`metadata.json` after a barrier, and only then `latest_checkpointed_iteration.txt`) and
`load_checkpoint`, here with Megatron's FP32Optimizer around torch Adam so the optimizer state
travels too. Run 1 (2 gloo ranks, EP=2, RowwiseMoELayer + grouped experts) trains iteration 1,
saves it, trains iterations 2 and 3 (their losses are recorded), then saves iteration 3 and one
rank SIGKILLs itself after writing the first item of its shard file (Megatron's
`filesystem_async._write_item`). Run 2 (fresh ranks) must load iteration 1 and train iterations
2 and 3 to exactly the recorded losses, then save iteration 3 again over the partial folder and
load it back.

Only for CPU ranks, test-side: FP32Optimizer's constructor (a CUDA tensor for its loss scale)
and `read_metadata` (a CUDA tensor for the iteration all-reduce) are replaced by CPU
equivalents in the rank processes; everything that writes, orders or reads files is Megatron's.
"""

import functools
import json
import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_ext.cpu_ranks import ParallelSizes, RankFailure, run_on_ranks
from tests.multirank import ckpt_models as cm

LR = 1e-2
KILLED_MARK = "killed_mid_save.json"


def _megatron_training_state(ckpt_dir):
    """megatron.training's global args (its defaults, torch_dist checkpoints in `ckpt_dir`) and
    microbatch calculator, as `initialize_megatron` would leave them, on this rank process."""
    import megatron.training.checkpointing as checkpointing
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    argv = sys.argv
    sys.argv = ["pretrain_gpt.py", "--save", ckpt_dir, "--load", ckpt_dir, "--ckpt-format", "torch_dist",
                "--micro-batch-size", str(cm.CFG.micro_batch)]
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    args.use_dist_ckpt = True  # validate_args derives it from --ckpt-format
    global_vars._GLOBAL_ARGS = None
    global_vars.set_args(args)
    destroy_num_microbatches_calculator()
    world = dist.get_world_size()
    init_num_microbatches_calculator(dist.get_rank(), None, world * cm.CFG.micro_batch, cm.CFG.micro_batch, world)

    def read_metadata(tracker_filename):  # Megatron's, with a CPU tensor for the all-reduce
        with open(tracker_filename) as handle:
            text = handle.read().strip()
        release = text == "release"
        iteration = torch.tensor([0 if release else int(text)])
        dist.all_reduce(iteration, op=dist.ReduceOp.MAX)
        return int(iteration), release

    checkpointing.read_metadata = read_metadata
    return checkpointing


def _optimizer(model):
    """Megatron's FP32Optimizer (its state_dict / sharded_state_dict / load_state_dict) around
    torch Adam; only its CUDA loss-scale tensor is replaced."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    def init_state_fn(opt, config=None):  # megatron.core.optimizer's, for Adam
        for group in opt.param_groups:
            for param in group["params"]:
                if len(opt.state[param]) == 0:
                    opt.state[param]["exp_avg"] = torch.zeros_like(param.data)
                    opt.state[param]["exp_avg_sq"] = torch.zeros_like(param.data)

    class CPUFP32Optimizer(FP32Optimizer):
        def __init__(self, optimizer, config):
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.ones(1)
            self.is_stub_optimizer = False

    config = OptimizerConfig(optimizer="adam", lr=LR, clip_grad=0.0)
    return CPUFP32Optimizer(torch.optim.Adam(model.parameters(), lr=LR), config)


def _die_while_writing(mark_path):
    """Make this rank SIGKILL itself once the first item of its shard file is written."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

    write_item = fsa._write_item

    @functools.wraps(write_item)  # Megatron inspects its signature
    def dying_write_item(*args, **kwargs):
        write_item(*args, **kwargs)
        for arg in args:
            if hasattr(arg, "flush"):
                arg.flush()
        # Megatron's write-results queue lives in a spawned manager process of this rank; it
        # outlives a SIGKILL, so tell the test its pid to end it.
        queue = getattr(fsa, "_results_queue", None)
        process = getattr(getattr(queue, "_manager", None), "_process", None)
        with open(mark_path, "w") as handle:
            json.dump({"rank": dist.get_rank(), "manager_pid": getattr(process, "pid", None)}, handle)
        os.kill(os.getpid(), signal.SIGKILL)

    fsa._write_item = dying_write_item


def _train_then_die_saving(rank, world, ckpt_dir, victim, out_dir):
    checkpointing = _megatron_training_state(ckpt_dir)
    model = cm.build("ours", seed=1)
    optimizer = _optimizer(model)
    losses = [cm.train_step(model, optimizer, rank, world, step=0)]
    checkpointing.save_checkpoint(1, [model], optimizer, None, 0)
    losses.append(cm.train_step(model, optimizer, rank, world, step=1))
    losses.append(cm.train_step(model, optimizer, rank, world, step=2))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as handle:
            json.dump(losses, handle)
    if rank == victim:
        _die_while_writing(os.path.join(out_dir, KILLED_MARK))
    checkpointing.save_checkpoint(3, [model], optimizer, None, 0)
    return "the interrupted save returned"


def _resume(rank, world, ckpt_dir):
    checkpointing = _megatron_training_state(ckpt_dir)
    model = cm.build("ours", seed=2)  # other weights: the checkpoint must supply them
    optimizer = _optimizer(model)
    unloaded_loss = cm.mean_loss(model, rank, world, step=1)
    iteration, _ = checkpointing.load_checkpoint([model], optimizer, None)
    resumed = [cm.train_step(model, optimizer, rank, world, step=1),
               cm.train_step(model, optimizer, rank, world, step=2)]
    # Training goes on: save iteration 3 again, over the partial folder, and load it back.
    checkpointing.save_checkpoint(3, [model], optimizer, None, 0)
    reloaded = cm.build("ours", seed=3)
    reloaded_iteration, _ = checkpointing.load_checkpoint([reloaded], _optimizer(reloaded), None)
    return {"iteration": iteration, "resumed": resumed, "unloaded_loss": unloaded_loss,
            "reloaded_iteration": reloaded_iteration, "loss_saved": cm.losses(model, rank, world, step=3),
            "loss_reloaded": cm.losses(reloaded, rank, world, step=3)}


def _end_orphaned_writer_manager(mark_path):
    """The killed rank's spawned result-queue manager (started by Megatron's save in this test)."""
    with open(mark_path) as handle:
        pid = json.load(handle)["manager_pid"]
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator_rank0_killed", "rank1_killed"])
def test_rank_killed_mid_save_leaves_previous_checkpoint_to_resume_from(tmp_path, victim):
    from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint

    ckpt_dir, out_dir = tmp_path / "ckpt", tmp_path / "out"
    ckpt_dir.mkdir()
    out_dir.mkdir()
    mark = out_dir / KILLED_MARK
    try:
        with pytest.raises(RankFailure) as failure:
            run_on_ranks(_train_then_die_saving, 2, str(ckpt_dir), victim, str(out_dir),
                         sizes=ParallelSizes(ep=2), timeout=60)
    finally:
        if mark.exists():
            _end_orphaned_writer_manager(mark)
    assert mark.exists(), f"rank {victim} was not killed inside the shard write:\n{failure.value}"
    assert json.loads(mark.read_text())["rank"] == victim
    # The surviving rank is stopped inside the save by the dead peer (gloo closes the pair), it does not hang.
    report = str(failure.value)
    assert f"rank {1 - victim} of 2" in report and "save_checkpoint" in report, report

    # On disk: the tracker still names iteration 1, which is complete; iteration 3 was begun only.
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert check_is_distributed_checkpoint(str(ckpt_dir / "iter_0000001"))
    partial = ckpt_dir / "iter_0000003"
    assert any(name.endswith(".distcp") for name in os.listdir(partial)), os.listdir(partial)
    assert not check_is_distributed_checkpoint(str(partial)), "the interrupted save was finalized"
    assert not (partial / ".metadata").exists()

    recorded = json.loads((out_dir / "losses.json").read_text())  # iterations 1, 2, 3 of run 1
    results = run_on_ranks(_resume, 2, str(ckpt_dir), sizes=ParallelSizes(ep=2), timeout=120)
    for rank, result in enumerate(results):
        assert result["iteration"] == 1, result["iteration"]
        # The check can fail: the model before loading is far from the trained one.
        assert abs(result["unloaded_loss"] - recorded[1]) > 0.05, (rank, result["unloaded_loss"], recorded[1])
        # Iterations 2 and 3 again, from the checkpoint of iteration 1 (weights and Adam state).
        assert result["resumed"] == pytest.approx(recorded[1:], rel=1e-6, abs=0), (result["resumed"], recorded)
        assert result["reloaded_iteration"] == 3
        assert result["loss_reloaded"] == result["loss_saved"]
    assert len(set(recorded)) == 3, recorded
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert check_is_distributed_checkpoint(str(partial))
