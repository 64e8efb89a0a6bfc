"""The `--moe-ext-*` flags checked against Megatron's own parsed arguments, before any layer is built.

    validate_against_megatron(args)   # every wrong combination in one MoEExtArgumentError, naming both flags
    training_loop_conflicts(args)     # what the training hooks cannot do (any model)

Each check returns its problems as lines, so the launcher reports all of them at once. The rules
the layer shares live in megatron_ext.rules; this module adds what only parsed arguments show
(the schedule's live microbatches, the installed packages, Megatron's wrapper flags). Written
against megatron-core 0.19.2 (megatron_ext.rules.MEGATRON_VERSION).
"""

from __future__ import annotations

import importlib.util

from megatron_ext.arguments import FLAGS, MoEExtArgumentError, ext_config_from_args
from megatron_ext.cuda_graphs.schedule import live_microbatches
from megatron_ext.rules import (MEGATRON_VERSION, MOE_ACT_RECOMPUTE, MXFP8_FP16, MXFP8_PROBS_ON_INPUT, ExpertSettings,
                                arena_args_problems, expert_problems, graph_runner_clash, moe_problems,
                                optimizer_problems, rowwise_problems)


def _rowwise_conflicts(args) -> list[str]:
    """Megatron options the rowwise dispatcher refuses (megatron_ext.rules, shared with the layer). The
    graph runner's and the arena's clashes name both flags themselves; --moe-ext-dispatcher megatron
    refuses those settings too, so it is not offered there."""
    return [f"--moe-ext-dispatcher rowwise cannot be combined with {problem}; or use --moe-ext-dispatcher megatron"
            for problem in rowwise_problems(args)] + graph_runner_clash(args, args)


def _schedule_conflicts(args) -> list[str]:
    """A pipeline keeps several microbatches of a layer alive (megatron_ext.cuda_graphs.live_microbatches):
    the symm transport's dispatch slots, the arena's and the graph slots must cover them, or the first
    stage stops at its second forward while the others wait."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    uses_slots = args.moe_ext_transport in ("auto", "symm") or args.moe_ext_cuda_graphs or \
        args.moe_ext_dropless_arena
    if pp == 1 or not uses_slots:
        return []
    model_parallel = pp * (getattr(args, "tensor_model_parallel_size", 1) or 1) * \
        (getattr(args, "context_parallel_size", 1) or 1)
    data_parallel = max((getattr(args, "world_size", None) or model_parallel) // model_parallel, 1)
    micro = getattr(args, "micro_batch_size", None) or 1
    per_step = getattr(args, "global_batch_size", None) or micro * data_parallel
    microbatches = max(per_step // (micro * data_parallel), 1)
    # Before Megatron's validate_args (which derives virtual_pipeline_model_parallel_size) the two
    # flags that set it are read directly.
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or \
        getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if vpp is None and per_stage and getattr(args, "num_layers", None):
        vpp = args.num_layers // pp // per_stage
    try:
        needed = live_microbatches(pp, 0, microbatches, vpp, getattr(args, "microbatch_group_size_per_vp_stage", None),
                                   bool(getattr(args, "overlap_moe_expert_parallel_comm", False)))
    except ValueError:
        return []  # a schedule Megatron's own checks refuse, with their message
    if args.moe_ext_lease_slots >= needed:
        return []
    return [f"--pipeline-model-parallel-size {pp} with {microbatches} microbatches per step keeps up to {needed} "
            f"microbatches alive in each MoE layer of the first stage, and --moe-ext-lease-slots "
            f"{args.moe_ext_lease_slots} gives each layer that many dispatch-buffer (and graph) slots: set "
            f"--moe-ext-lease-slots {needed}"]


def _ext_flag_conflicts(args) -> list[str]:
    """--moe-ext-* flags against the model's shape (combinations of the flags themselves are
    MoEExtConfig's checks, reported with flag names by ext_config_from_args)."""
    hidden = getattr(args, "hidden_size", None)
    problems = []
    if args.moe_ext_mxfp8_dispatch:
        if hidden is not None and hidden % 32:
            problems.append(f"--moe-ext-mxfp8-dispatch needs --hidden-size divisible by 32 (one E8M0 scale per 32 "
                            f"values), got --hidden-size {hidden}")
        if getattr(args, "fp16", False):
            problems.append(MXFP8_FP16)
    return problems + training_loop_conflicts(args)


def _router_gemms_conflicts(args) -> list[str]:
    """--moe-ext-router-gemms places the fused router's gating GEMMs only with bf16 tokens and an fp32
    router (moe/fused_router.py); elsewhere Megatron's router dtype decides and the flag does nothing."""
    from megatron_ext.moe.fused_router import unfused_reasons_for_args

    gemms, bf16 = getattr(args, "moe_ext_router_gemms", "triton"), bool(getattr(args, "bf16", False))
    router_dtype = getattr(args, "moe_router_dtype", None)
    if gemms == "triton":
        return []
    if not (bf16 and router_dtype == "fp32"):
        return [f"--moe-ext-router-gemms {gemms} places the fused router's gating GEMMs with bf16 tokens and an fp32 "
                f"router, and this run has {'--bf16' if bf16 else 'no --bf16'} and --moe-router-dtype {router_dtype}: "
                f"it would do nothing; drop it, or set --bf16 --moe-router-dtype fp32"]
    unfused = unfused_reasons_for_args(args)  # fused_router / fused_route_map off: MoEExtConfig says so
    if unfused:
        return [f"--moe-ext-router-gemms {gemms} places the fused router's gating GEMMs, and this run's router is not "
                f"fused ({', '.join(unfused)}: Megatron's routing runs): it would do nothing; drop it"]
    return []


def training_loop_conflicts(args) -> list[str]:
    """What the training hooks (training_hooks.py) cannot do with Megatron's settings; they run on
    any model, whatever builds its MoE layers."""
    return replica_check_conflicts(args) + ddp_bucket_conflicts(args)


FSDP_FLAGS = (("--use-megatron-fsdp", "use_megatron_fsdp"), ("--use-torch-fsdp2", "use_torch_fsdp2"))


def ddp_bucket_conflicts(args) -> list[str]:
    """--moe-ext-ddp-buckets reorders and checks the buckets of Megatron's DistributedDataParallel;
    FSDP wrappers have none, and a partial distributed optimizer needs groups it does not build."""
    if not getattr(args, "moe_ext_ddp_buckets", False):
        return []
    problems = [f"--moe-ext-ddp-buckets with {flag}: the model is then wrapped in FSDP, not Megatron's "
                f"DistributedDataParallel whose buckets it orders; drop one of the two"
                for flag, field in FSDP_FLAGS if getattr(args, field, False)]
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if instances != 1:
        problems.append(f"--moe-ext-ddp-buckets with --num-distributed-optimizer-instances {instances}: a partial "
                        f"distributed optimizer needs intra- and inter-instance groups the folding DDP does not "
                        f"build; use 1 instance or drop --moe-ext-ddp-buckets")
    return problems


def replica_check_conflicts(args) -> list[str]:
    """The replica check compares each rank's whole parameters right after Megatron's train_step.
    With --overlap-param-gather the distributed optimizer gathers the updated shards in the next
    forward instead (0.19.2), so replicas differ there by design and the check would stop a good run;
    under FSDP each data-parallel rank holds a different shard, so there is no replica to compare."""
    if not getattr(args, "moe_ext_replica_check_interval", 0):
        return []
    problems = [f"--moe-ext-replica-check-interval with {flag}: FSDP gives each data-parallel rank a different "
                f"shard of every parameter, so the ranks hold no replicas to compare; drop one of the two"
                for flag, field in FSDP_FLAGS if getattr(args, field, False)]
    if getattr(args, "overlap_param_gather", False):
        problems.append("--moe-ext-replica-check-interval with --overlap-param-gather: the distributed optimizer "
                        "gathers the updated parameters in the next forward, so right after a step each "
                        "data-parallel rank holds only its own shard's update and the check would report every "
                        "parameter; drop one of the two")
    return problems


def _offering_megatrons_experts(problem: str) -> str:
    """The problem with Megatron's experts as a way out, unless its own advice offers them already."""
    fallback = "--moe-ext-dispatcher megatron"
    return problem if fallback in problem else f"{problem}; or use {fallback} (Megatron's own experts)"


def _expert_conflicts(args) -> list[str]:
    """MoE settings no experts can run (both dispatchers), what the grouped experts cannot serve
    (rowwise only: the megatron dispatcher falls back to Megatron's experts), plus the launcher-only
    norm check (megatron_ext.rules)."""
    settings = ExpertSettings.from_args(args)
    problems = [f"--num-experts {args.num_experts}: {problem}" for problem in moe_problems(settings)]
    problems += optimizer_problems(args)
    if args.moe_ext_dispatcher == "rowwise":  # with megatron the layer builds Megatron's own experts instead
        problems += [f"--num-experts {args.num_experts} with megatron_ext's grouped experts (--moe-ext-dispatcher "
                     f"rowwise): {_offering_megatrons_experts(problem)}" for problem in expert_problems(settings)]
    moe_act = "moe_act" in (getattr(args, "recompute_modules", None) or ())
    if getattr(args, "recompute_granularity", None) == "selective" and moe_act and not args.moe_grouped_gemm:
        problems.append(f"--recompute-modules moe_act without --moe-grouped-gemm: Megatron {MEGATRON_VERSION}'s "
                        f"TransformerConfig refuses it (a traceback when the model is built); add --moe-grouped-gemm "
                        f"(megatron_ext's experts are grouped either way): {MOE_ACT_RECOMPUTE}")
    if getattr(args, "moe_ext_dropless_arena", False):
        problems += arena_args_problems(args)
    if getattr(args, "moe_ext_mxfp8_dispatch", False) and getattr(args, "moe_apply_probs_on_input", False):
        problems.append(MXFP8_PROBS_ON_INPUT)
    mtp_layers = getattr(args, "mtp_num_layers", None)
    if mtp_layers:  # megatron.training.models.gpt.mtp_block_spec (0.19.2) ignores --spec
        problems.append(f"--mtp-num-layers {mtp_layers} with --num-experts: megatron.training builds the MTP layers "
                        f"from Megatron's own layer specs, not from --spec, so their MoE layers would be Megatron's "
                        f"with none of the --moe-ext-* settings; drop --mtp-num-layers, or build the MTP block from "
                        f"megatron_ext.specs in your own model script")
    variant = getattr(args, "experimental_attention_variant", None)
    if variant is not None and getattr(args, "spec", None) is None:
        problems.append(f"--experimental-attention-variant {variant} with --num-experts: megatron_ext's layer specs "
                        f"build Megatron's standard attention, and Megatron builds this variant from its own spec; "
                        f"drop the variant, or run Megatron without megatron_ext")
    if getattr(args, "transformer_impl", None) == "transformer_engine" and getattr(args, "spec", None) is None \
            and importlib.util.find_spec("transformer_engine") is None:
        problems.append("--transformer-impl transformer_engine (Megatron's default) without Transformer Engine "
                        "installed: use --transformer-impl local (with --no-persist-layer-norm), or install "
                        "megatron-ext[te]")
    if getattr(args, "transformer_impl", None) == "local" and not getattr(args, "no_persist_layer_norm", True) \
            and importlib.util.find_spec("apex") is None:
        problems.append("--transformer-impl local without Apex needs --no-persist-layer-norm: Megatron's torch "
                        "norm (WrappedTorchNorm) refuses persist_layer_norm, which is on by default")
    return problems


def validate_against_megatron(args) -> None:
    """Raise MoEExtArgumentError listing every wrong combination (each naming both flags).

    Dense models (no --num-experts) are checked only for --moe-ext-* values and combinations.
    Runtime conditions (GPU present, one NVLink domain, DeepEP importable) are checked at each
    layer's first forward, when it builds its transport.
    """
    if not hasattr(args, FLAGS[0].dest):
        ext_config_from_args(args)  # raises: the group was never added
    ext_config_from_args(args)  # MoEExtConfig's own checks, named by flag
    problems = _ext_flag_conflicts(args)
    if getattr(args, "num_experts", None) is not None:
        problems += _expert_conflicts(args)
        if args.moe_ext_dispatcher == "rowwise":
            problems += _rowwise_conflicts(args) + _schedule_conflicts(args) + _router_gemms_conflicts(args)
    if problems:
        raise MoEExtArgumentError("megatron_ext cannot run with these flags:\n  - " + "\n  - ".join(problems))
