"""GPT-MoE pretraining on megatron.training (GPUs) with megatron_ext's MoE layers.

The project's own training entry: Megatron's argument parser with the "megatron_ext MoE" group
(`--moe-ext-*`), Megatron's GPT model built from `megatron_ext.specs.gpt_block_spec`, and
Megatron's `pretrain` loop (optimizer, DDP, checkpoints, logging). Data: Megatron's
MockGPTDataset unless `--data-path` (a tokenized Megatron dataset prefix) is given; the
tokenizer defaults to NullTokenizer (pass --vocab-size), pass --tokenizer-type/--tokenizer-model
for real data.

    torchrun --nproc-per-node 1 examples/pretrain_gpt.py --num-experts 8 --swiglu ... --moe-ext-transport symm
    python -m megatron_ext.launch examples/pretrain_gpt.py ...     # the same, through the launcher

See examples/run_1gpu.sh and examples/run_8gpu_folding.sh. Supports TP (dense layers), PP, CP,
EP and Megatron's distributed optimizer; for SFT, FIM, packed sequences or MTP (dense models: MTP's
MoE layers would be Megatron's) run Megatron-LM's own pretrain_gpt.py through `python -m megatron_ext.launch`.
Written against megatron-core 0.19.2.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DATA_FLAGS = ("--data-path", "--data-args-path", "--train-data-path", "--per-split-data-args-path", "--mock-data")
UNSUPPORTED = {  # args field -> why this entry refuses it (upstream pretrain_gpt.py handles them)
    "sft": "--sft", "fim_data": "--fim-data",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking",
    "mtp_num_layers": "--mtp-num-layers", "hybrid_context_parallel": "--hybrid-context-parallel",
}


def default_to_mock_data(argv: list[str]) -> list[str]:
    """Append --mock-data when no data source flag is given (mock data is this entry's default)."""
    if any(arg.split("=")[0] in DATA_FLAGS for arg in argv):
        return argv
    return [*argv, "--mock-data"]


def parse_arguments(argv: list[str] | None = None):
    """Megatron's args with the --moe-ext-* group, validated; MoE specs installed for MoE models."""
    from megatron.training.arguments import parse_and_validate_args

    from megatron_ext.arguments import MoEExtArgumentError, add_moe_ext_args
    from megatron_ext.launch import escape_stray_percent, prepare_parsed_args, usage_error

    sys.argv = [sys.argv[0], *default_to_mock_data(sys.argv[1:] if argv is None else argv)]
    args = parse_and_validate_args(extra_args_provider=lambda parser: escape_stray_percent(add_moe_ext_args(parser)),
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    try:  # first: megatron_ext refuses some of UNSUPPORTED itself (--mtp-num-layers with --num-experts)
        prepare_parsed_args(args)  # idempotent when the launcher already did it
    except MoEExtArgumentError as error:  # one message, as the launcher prints it
        usage_error(f"megatron_ext: error: {error}")
    for field, flag in UNSUPPORTED.items():
        if getattr(args, field, None):
            usage_error(f"examples/pretrain_gpt.py does not handle {flag}; run Megatron-LM's pretrain_gpt.py "
                        f"through python -m megatron_ext.launch for it")
    return args


def model_config(args):
    """GPTModelConfig from the args; MoE models get megatron_ext's block spec via args.spec."""
    from megatron.training.argument_utils import gpt_config_from_args

    return gpt_config_from_args(args)


def get_batch(data_iterator, vp_stage=None):
    """One microbatch on this rank: read on TP rank 0, broadcast over TP, sliced for CP.

    Returns (tokens, labels, loss_mask, attention_mask, position_ids); all None on middle
    pipeline stages, which get their input from the previous stage.
    """
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {key: (raw[key].cuda(non_blocking=True) if raw.get(key) is not None else None)
                 for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss, token count, and the 'lm loss' report Megatron averages over DP."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model):
    """Megatron's forward_step contract: (output tensor, loss function of it)."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def dataset_config(args):
    """GPTDatasetConfig: mock data when args.mock_data, else the --data-path blend."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = (None, None) if args.mock_data else get_blend_and_blend_per_split(args)
    sequences_per_dataset = None  # --per-dataset-sequences-path: a JSON of each dataset's sequence count
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as counts:
            sequences_per_dataset = json.load(counts)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap, sequences_per_dataset=sequences_per_dataset,
        context_parallel_size=args.context_parallel_size, data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's dataset-provider contract: (train, valid, test) datasets."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {'mock' if args.mock_data else 'tokenized'} GPT datasets ...")

    def built_on_this_rank():
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_on_this_rank,
                                         dataset_config(args)).build()


train_valid_test_datasets_provider.is_distributed = True  # build on the ranks above, not rank 0 only


def main(argv: list[str] | None = None) -> None:
    from megatron_ext.quiet import quiet_known_warnings

    quiet_known_warnings(announce=int(os.environ.get("RANK", "0")) == 0)
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    args = parse_arguments(argv)
    full_config = pretrain_cfg_container_from_args(args, model_config(args))
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
