"""The example entries on CPU ranks: examples/pretrain_gpt.py's arguments, model (through
megatron.training's GPTModelBuilder calling our --spec hook), mock datasets and loss function;
examples/custom_model.py's swapped custom spec, forward and backward."""

import contextlib
import io
import os
import runpy

import pytest
import torch

from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_ARGV = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
             "--micro-batch-size 2 --global-batch-size 2 --train-iters 3 --lr 1e-3 --num-experts 4 --swiglu "
             "--disable-bias-linear --vocab-size 128 --transformer-impl local --no-persist-layer-norm "
             "--normalization RMSNorm "
             "--position-embedding-type rope --no-rope-fusion --no-gradient-accumulation-fusion "
             "--use-cpu-initialization --moe-ext-transport torch --moe-ext-capacity-factor 2").split()


def _pretrain_gpt_pieces(rank, world, extra_argv=()):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_ext.moe.layer import RowwiseMoELayer
    from megatron_ext.specs import default_ext_config

    example = runpy.run_path(os.path.join(REPO_ROOT, "examples", "pretrain_gpt.py"), run_name="example")
    args = example["parse_arguments"]([*TINY_ARGV, *extra_argv])  # no data flag: mock data is the default
    model = GPTModelBuilder(example["model_config"](args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    train, _, _ = example["train_valid_test_datasets_provider"]([4, 0, 0])
    samples = [train[i] for i in range(2)]
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}
    mask = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), diagonal=1)
    output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"], loss_mask=batch["loss_mask"])
    loss, num_tokens, report = example["loss_func"](batch["loss_mask"], output)
    (loss / num_tokens).backward()
    return {"spec": args.spec, "mock_data": args.mock_data, "ext_config": default_ext_config(),
            "rowwise_layers": sum(isinstance(m, RowwiseMoELayer) for m in model.modules()),
            "moe_layers": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("MoELayer")}),
            "experts": sorted({type(m.experts).__name__ for m in model.modules() if hasattr(m, "experts")}),
            "loss_per_token": float(loss / num_tokens), "num_tokens": int(num_tokens),
            "report": report["lm loss"].tolist(),
            "expert_grads": all(p.grad is not None for n, p in model.named_parameters() if "experts" in n)}


def test_pretrain_gpt_entry_builds_its_model_through_megatron_training():
    result = run_on_ranks(_pretrain_gpt_pieces, 1, sizes=ParallelSizes(), timeout=180)[0]
    assert result["spec"] == ["megatron_ext.specs", "gpt_block_spec"] and result["mock_data"]
    assert result["ext_config"].transport == "torch" and result["ext_config"].capacity_factor == 2.0
    assert result["rowwise_layers"] == 2
    assert result["num_tokens"] == 64 and abs(result["loss_per_token"] - torch.log(torch.tensor(128.0)).item()) < 1.0
    assert result["report"][1] == 64.0 and abs(result["report"][0] / 64 - result["loss_per_token"]) < 1e-5
    assert result["expert_grads"]



def test_pretrain_gpt_entry_keeps_megatrons_layer_under_megatrons_spec():
    """tools/bench_training.py's baseline: --spec megatron.training.models.gpt default_layer_spec
    builds Megatron's own MoE layer (SequentialMLP without Transformer Engine), untouched."""
    spec = ("--spec", "megatron.training.models.gpt", "default_layer_spec")
    result = run_on_ranks(_pretrain_gpt_pieces, 1, spec, sizes=ParallelSizes(), timeout=180)[0]
    assert result["spec"] == list(spec[1:]) and result["rowwise_layers"] == 0
    assert result["moe_layers"] == ["MoELayer"] and result["experts"] == ["SequentialMLP"]
    assert abs(result["loss_per_token"] - torch.log(torch.tensor(128.0)).item()) < 1.0 and result["expert_grads"]


def _dataset_config_fields(rank, world, counts_path):
    example = runpy.run_path(os.path.join(REPO_ROOT, "examples", "pretrain_gpt.py"), run_name="example")
    data_flags = ["--mid-level-dataset-surplus", "0.05", "--allow-ambiguous-pad-tokens",
                  "--num-dataset-builder-threads", "3", "--dataloader-fast-cache-load",
                  "--dataloader-defer-npy-index-mmap", "--object-storage-cache-path", "/tmp/idx",
                  "--data-cache-path", "/tmp/cache", "--per-dataset-sequences-path", counts_path]
    args = example["parse_arguments"]([*TINY_ARGV, *data_flags])
    config = example["dataset_config"](args)
    return {name: getattr(config, name) for name in (
        "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens", "num_dataset_builder_threads", "fast_cache_load",
        "defer_npy_index_mmap", "object_storage_cache_path", "sequences_per_dataset")}


def test_pretrain_gpt_entry_passes_megatrons_data_flags_to_its_dataset_config(tmp_path):
    """Each data flag of Megatron's parser that GPTDatasetConfig has a field for reaches it (none
    silently left at the config's default)."""
    counts = tmp_path / "counts.json"
    counts.write_text('{"/data/a": 12}')
    fields = run_on_ranks(_dataset_config_fields, 1, str(counts), sizes=ParallelSizes(), timeout=180)[0]
    assert fields == {"mid_level_dataset_surplus": 0.05, "allow_ambiguous_pad_tokens": True,
                      "num_dataset_builder_threads": 3, "fast_cache_load": True, "defer_npy_index_mmap": True,
                      "object_storage_cache_path": "/tmp/idx", "sequences_per_dataset": {"/data/a": 12}}


def _pretrain_gpt_refusal(rank, world, extra_argv):
    """(exit code, stderr) of parse_arguments on a refused combination; None if it was accepted."""
    example = runpy.run_path(os.path.join(REPO_ROOT, "examples", "pretrain_gpt.py"), run_name="example")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            example["parse_arguments"]([*TINY_ARGV, *extra_argv])
    except SystemExit as stop:
        return stop.code, stderr.getvalue()
    return None


def test_pretrain_gpt_entry_refuses_in_one_message():
    """Run directly (torchrun examples/pretrain_gpt.py), a refused combination is one message, not a
    traceback, with the launcher's exit code (2, as argparse's), and MTP with experts is not sent
    to the launcher, which refuses it too."""
    code, mtp = run_on_ranks(_pretrain_gpt_refusal, 1, ["--mtp-num-layers", "1"], sizes=ParallelSizes(),
                             timeout=180)[0]
    assert code == 2 and mtp.startswith("megatron_ext: error:") and "not from --spec" in mtp, mtp
    assert "launch" not in mtp and "Traceback" not in mtp, mtp
    code, capacity = run_on_ranks(_pretrain_gpt_refusal, 1, ["--moe-expert-capacity-factor", "1.0"],
                                  sizes=ParallelSizes(), timeout=180)[0]
    assert code == 2 and capacity.startswith("megatron_ext: error:"), capacity
    assert "--moe-expert-capacity-factor 1.0" in capacity, capacity
    flag = "--dataloader-inter-document-masking"  # refused by the example itself, after Megatron's checks
    code, unhandled = run_on_ranks(_pretrain_gpt_refusal, 1, [flag], sizes=ParallelSizes(), timeout=180)[0]
    assert code == 2 and unhandled.startswith(f"examples/pretrain_gpt.py does not handle {flag}"), unhandled


def test_custom_model_example_swaps_only_the_moe_layer(capsys):
    example = runpy.run_path(os.path.join(REPO_ROOT, "examples", "custom_model.py"), run_name="example")
    results = example["main"](["--ranks", "2"])
    assert [r["mlp_per_layer"] for r in results] == [["MLP", "RowwiseMoELayer", "MLP"]] * 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["expert_grad_norm"] > 0 for r in results)
    assert "layers' MLPs" in capsys.readouterr().out


def test_custom_model_example_refuses_ranks_that_do_not_divide_the_experts(capsys):
    example = runpy.run_path(os.path.join(REPO_ROOT, "examples", "custom_model.py"), run_name="example")
    with pytest.raises(SystemExit) as exit_:
        example["main"](["--ranks", "3"])
    assert exit_.value.code == 2
    assert "--ranks must divide the model's 4 experts" in capsys.readouterr().err
