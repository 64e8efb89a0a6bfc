"""The --moe-ext-* flags: one per MoEExtConfig field, round trips, wrong combinations, --help, README."""

import argparse
import dataclasses
import os

import pytest

from megatron_ext.argument_checks import validate_against_megatron
from megatron_ext.arguments import (FLAGS, MoEExtArgumentError, add_moe_ext_args, ext_config_from_args,
                                    ext_config_to_argv, flag_table_markdown)
from megatron_ext.config import MoEExtConfig
from megatron_ext.rules import MOE_ACT_RECOMPUTE

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE_MODEL = ["--num-experts", "8", "--swiglu", "--disable-bias-linear", "--transformer-impl", "local",
             "--no-persist-layer-norm"]


@pytest.fixture(scope="module")
def megatron_parser():
    """Megatron 0.19.2's full training parser with the megatron_ext group added."""
    from megatron.training.arguments import add_megatron_arguments

    return add_moe_ext_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def test_every_config_field_has_exactly_one_flag():
    assert sorted(f.field for f in FLAGS) == sorted(MoEExtConfig.field_names())
    assert all(f.flag.startswith("--moe-ext-") for f in FLAGS)
    assert len({f.flag for f in FLAGS}) == len(FLAGS)


def test_defaults_round_trip(megatron_parser):
    assert ext_config_from_args(megatron_parser.parse_args([])) == MoEExtConfig()


@pytest.mark.parametrize("config", [
    MoEExtConfig(dispatcher="megatron", ddp_buckets=True, debug_checks=True, replica_check_interval=3),
    MoEExtConfig(dropless=True, max_tokens_per_rank=4096, metrics_interval=10,
                 debug_poison=True, lease_slots=3, fused_route_map=False, fused_router=False, peer_timeout_s=9.5),
    MoEExtConfig(capacity_factor=2.0, router_gemms="cublas"),
    MoEExtConfig(dropless_arena=True, capacity_factor=1.5, arena_region_factor=0.75, on_overflow="drop"),
    MoEExtConfig(transport="symm", mxfp8_dispatch=True, cuda_graphs=True, capacity_factor=1.0),
    MoEExtConfig(transport="torch", replica_check_interval=5),
    MoEExtConfig(transport="torch", cuda_graphs=True, lease_slots=2),
    MoEExtConfig(transport="deepep", max_tokens_per_rank=1),
])
def test_non_default_configs_round_trip_through_megatrons_parser(megatron_parser, config):
    changed = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != f.default]
    assert changed, "a round-trip case must change something"
    assert ext_config_from_args(megatron_parser.parse_args(ext_config_to_argv(config))) == config


def test_every_field_is_reachable_from_its_flag(megatron_parser):
    """Each flag alone changes exactly its own field."""
    for flag in FLAGS:
        value = {"dispatcher": "megatron", "transport": "torch",
                 "capacity_factor": "3.5", "on_overflow": "error", "return_transfer": "put",
                 "router_gemms": "cublas"}.get(flag.field, "7")
        argv = [flag.flag] if flag.kind != "value" else [flag.flag, value]
        needs = {"arena_region_factor": ["--moe-ext-dropless-arena", "--moe-ext-capacity-factor", "7"]}
        config = ext_config_from_args(megatron_parser.parse_args(argv + needs.get(flag.field, [])))
        differs = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != f.default]
        companions = {"arena_region_factor": ["capacity_factor", "dropless_arena"]}.get(flag.field, [])
        assert sorted(differs) == sorted([flag.field] + companions), (flag.flag, differs)


def test_group_is_added_once(megatron_parser):
    assert add_moe_ext_args(megatron_parser) is megatron_parser  # idempotent, no argparse conflict


def test_help_lists_every_flag(megatron_parser):
    from megatron_ext.launch import escape_stray_percent

    text = escape_stray_percent(megatron_parser).format_help()
    assert "megatron_ext MoE" in text
    for flag in FLAGS:
        assert flag.flag in text



def test_help_prints_without_the_launchers_escaping(capsys):
    """A parser of its own (python -m megatron_ext.arguments, a patched pretrain_gpt.py's
    extra_args_provider) prints the group's help: a '%' in a help text is not read as a format code."""
    from megatron_ext.arguments import main

    text = add_moe_ext_args(argparse.ArgumentParser()).format_help()
    assert "18-35% of the host time" in text, text
    main([])
    assert "--moe-ext-pin-host-threads" in capsys.readouterr().out

def test_readme_table_matches_the_flags():
    with open(os.path.join(REPO_ROOT, "README.md")) as handle:
        readme = handle.read()
    assert flag_table_markdown() in readme, (
        "README's flag table is out of date: replace it with `python -m megatron_ext.arguments --markdown`")


def _parse(parser, argv):
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv,flags", [
    (MOE_MODEL + ["--moe-expert-capacity-factor", "1.0"],
     ["--moe-ext-dispatcher rowwise", "--moe-expert-capacity-factor"]),
    (MOE_MODEL + ["--moe-pad-expert-input-to-capacity"],
     ["--moe-ext-dispatcher rowwise", "--moe-pad-expert-input-to-capacity"]),
    (MOE_MODEL + ["--moe-shared-expert-overlap"], ["--moe-ext-dispatcher rowwise", "--moe-shared-expert-overlap"]),
    (MOE_MODEL + ["--overlap-moe-expert-parallel-comm"],
     ["--moe-ext-dispatcher rowwise", "--overlap-moe-expert-parallel-comm"]),
    (MOE_MODEL + ["--expert-tensor-parallel-size", "2"],
     ["--moe-ext-dispatcher rowwise", "--expert-tensor-parallel-size 2"]),
    (MOE_MODEL + ["--tensor-model-parallel-size", "2"],
     ["--moe-ext-dispatcher rowwise", "--tensor-model-parallel-size 2", "--expert-tensor-parallel-size 1"]),
    (MOE_MODEL + ["--moe-token-dispatcher-type", "flex"],
     ["--moe-ext-dispatcher rowwise", "--moe-token-dispatcher-type flex"]),
    (MOE_MODEL + ["--moe-enable-deepep"], ["--moe-ext-dispatcher rowwise", "--moe-enable-deepep"]),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--moe-ext-cuda-graphs"],
     ["--cuda-graph-impl local", "--moe-ext-cuda-graphs", "twice"]),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--moe-ext-debug-checks"],
     ["--cuda-graph-impl local", "--moe-ext-debug-checks"]),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--moe-ext-transport", "torch", "--expert-model-parallel-size", "2"],
     ["--cuda-graph-impl local", "--moe-ext-transport torch", "--moe-ext-transport symm"]),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe"],
     ["--cuda-graph-impl local", "--cuda-graph-modules attn moe:", "--moe-ext-cuda-graphs"]),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"],
     ["--cuda-graph-impl local with --cuda-graph-scope attn:", "leave --cuda-graph-scope out"]),
    (MOE_MODEL + ["--external-cuda-graph"], ["--external-cuda-graph: Megatron's transformer_engine CUDA-graph"]),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--pipeline-model-parallel-size", "2"],
     ["--cuda-graph-impl local", "--pipeline-model-parallel-size 2", "--moe-ext-cuda-graphs"]),
    (MOE_MODEL + ["--cuda-graph-impl", "transformer_engine"], ["--cuda-graph-impl transformer_engine",
                                                               "--cuda-graph-impl local", "--moe-ext-cuda-graphs"]),
    (["--num-experts", "6", "--swiglu", "--disable-bias-linear", "--expert-model-parallel-size", "4"],
     ["--num-experts 6", "--expert-model-parallel-size 4"]),
    (MOE_MODEL + ["--moe-ext-mxfp8-dispatch", "--hidden-size", "100"],
     ["--moe-ext-mxfp8-dispatch", "--hidden-size 100"]),
    (MOE_MODEL + ["--moe-ext-mxfp8-dispatch", "--fp16"], ["--moe-ext-mxfp8-dispatch", "--fp16", "--bf16"]),
    (MOE_MODEL + ["--moe-mlp-glu-interleave-size", "8"],
     ["--moe-mlp-glu-interleave-size 8", "--moe-ext-dispatcher rowwise", "--moe-ext-dispatcher megatron"]),
    (MOE_MODEL + ["--moe-apply-probs-on-input"], ["--moe-apply-probs-on-input", "--moe-router-topk 1"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-apply-probs-on-input"],
     ["--moe-apply-probs-on-input", "--moe-router-topk 1"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-ext-mxfp8-dispatch"],
     ["--moe-ext-mxfp8-dispatch", "--moe-ext-dispatcher megatron"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-ext-cuda-graphs"],
     ["--moe-ext-cuda-graphs", "--moe-ext-dispatcher megatron"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-ext-transport", "symm"],
     ["--moe-ext-transport symm", "--moe-ext-dispatcher"]),
    (MOE_MODEL + ["--moe-router-topk", "9"], ["--moe-router-topk 9", "--num-experts 8"]),
    (MOE_MODEL + ["--moe-ext-cuda-graphs", "--moe-ext-transport", "torch", "--expert-model-parallel-size", "2"],
     ["--moe-ext-cuda-graphs", "--moe-ext-transport torch", "--moe-ext-transport symm"]),
    (["--num-experts", "8", "--transformer-impl", "local", "--no-persist-layer-norm", "--moe-ext-dropless-arena"],
     ["--moe-ext-dropless-arena", "--swiglu --disable-bias-linear"]),
    (MOE_MODEL + ["--moe-ext-dropless-arena", "--moe-apply-probs-on-input", "--moe-router-topk", "1"],
     ["--moe-apply-probs-on-input", "--moe-ext-dropless-arena"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-ext-lease-slots", "2"],
     ["--moe-ext-lease-slots", "--moe-ext-dispatcher rowwise"]),
    (["--num-experts", "8", "--swiglu", "--disable-bias-linear", "--transformer-impl", "local"],
     ["--transformer-impl local", "--no-persist-layer-norm"]),
    (["--num-experts", "8", "--swiglu", "--disable-bias-linear"],  # Megatron's default impl, no TE here
     ["--transformer-impl transformer_engine", "--transformer-impl local"]),
    (MOE_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--micro-batch-size", "1"],
     ["--pipeline-model-parallel-size 2 with 8 microbatches", "up to 2 microbatches", "--moe-ext-lease-slots 2"]),
    (MOE_MODEL + ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--num-virtual-stages-per-pipeline-rank",
                  "2", "--global-batch-size", "8", "--micro-batch-size", "1", "--moe-ext-lease-slots", "2"],
     ["keeps up to 5 microbatches", "--moe-ext-lease-slots 5"]),
    (MOE_MODEL + ["--experimental-attention-variant", "gated_delta_net"],
     ["--experimental-attention-variant gated_delta_net", "drop the variant"]),
    (MOE_MODEL + ["--mtp-num-layers", "1"], ["--mtp-num-layers 1", "not from --spec"]),
    (MOE_MODEL + ["--optimizer", "muon"], ["--optimizer muon", "Adam", "--optimizer adam"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--optimizer", "soap"], ["--optimizer soap", "3-D"]),
    (MOE_MODEL + ["--optimizer", "lion"], ["--optimizer lion", "--optimizer adam or sgd"]),
    (MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--mtp-num-layers", "2"], ["--mtp-num-layers 2"]),
])
def test_wrong_combinations_name_both_flags(megatron_parser, argv, flags):
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, argv))
    for flag in flags:
        assert flag in str(error.value), (flag, str(error.value))


def test_expert_tensor_parallelism_is_one_problem(megatron_parser):
    """The rowwise dispatcher's rules and the grouped experts' both exclude it: said once."""
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--expert-tensor-parallel-size", "2"]))
    assert str(error.value).count("--expert-tensor-parallel-size 2") == 1, str(error.value)
    assert "--expert-model-parallel-size" in str(error.value)


def test_all_problems_are_listed_at_once(megatron_parser):
    args = _parse(megatron_parser, ["--num-experts", "8", "--moe-expert-capacity-factor", "1.0"])
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(args)
    message = str(error.value)
    assert "--transformer-impl transformer_engine" in message and "--moe-expert-capacity-factor" in message
    assert "--swiglu" not in message and "--disable-bias-linear" not in message  # every expert variant runs


@pytest.mark.parametrize("argv,advice", [
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--moe-ext-dropless-arena"], "drop one (--moe-ext-cuda-graphs"),
    (MOE_MODEL + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--moe-ext-cuda-graphs"],
     "drop one"),
    (MOE_MODEL + ["--recompute-granularity", "selective", "--recompute-modules", "moe", "--moe-ext-dropless-arena"],
     "drop one"),
    (MOE_MODEL + ["--moe-ext-cuda-graphs", "--moe-ext-transport", "torch", "--expert-model-parallel-size", "2"],
     "use --moe-ext-transport symm"),
    (MOE_MODEL + ["--cuda-graph-impl", "local", "--moe-ext-cuda-graphs"], "keep one"),
])
def test_graph_and_recompute_clashes_do_not_offer_the_megatron_dispatcher(megatron_parser, argv, advice):
    """--moe-ext-dispatcher megatron refuses the graph runner, the arena and a transport: offering it
    as the way out of these clashes would send the user to another refusal."""
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, argv))
    message = str(error.value)
    assert "--moe-ext-dispatcher megatron" not in message and "cannot be combined with" not in message, message
    assert advice in message, message


@pytest.mark.parametrize("dispatcher", ["rowwise", "megatron"])
def test_expert_activation_recompute_needs_grouped_gemm_as_megatron_says(megatron_parser, dispatcher):
    """Megatron's TransformerConfig raises for moe_act without --moe-grouped-gemm when the model is
    built (a traceback); the launcher says it at start-up with the whole setting."""
    argv = MOE_MODEL + ["--moe-ext-dispatcher", dispatcher, "--recompute-granularity", "selective",
                        "--recompute-modules", "moe_act"]
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, argv))
    assert "--recompute-modules moe_act without --moe-grouped-gemm" in str(error.value)
    assert MOE_ACT_RECOMPUTE in str(error.value)
    validate_against_megatron(_parse(megatron_parser, argv + ["--moe-grouped-gemm"]))
    # moe_act is also the advice of other refusals: always spelled in full
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--cpu-offloading-num-layers", "1"]))
    assert MOE_ACT_RECOMPUTE in str(error.value)


@pytest.mark.parametrize("topk", ["0", "-1"])
def test_top_k_below_one_is_refused_at_start_up(megatron_parser, topk):
    with pytest.raises(MoEExtArgumentError, match=f"--moe-router-topk {topk}\\): every token needs at least one"):
        validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--moe-router-topk", topk]))


def test_advice_to_use_megatrons_dispatcher_is_given_once(megatron_parser):
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--fp8-format", "e4m3"]))
    assert str(error.value).count("--moe-ext-dispatcher megatron") == 1, str(error.value)


@pytest.mark.parametrize("argv,flag", [
    (["--moe-ext-capacity-factor", "0"], "--moe-ext-capacity-factor"),
    (["--moe-ext-lease-slots", "0"], "--moe-ext-lease-slots"),
    (["--moe-ext-max-tokens-per-rank", "0"], "--moe-ext-max-tokens-per-rank"),
    (["--moe-ext-metrics-interval", "-1"], "--moe-ext-metrics-interval"),
])
def test_bad_single_values_name_their_flag(megatron_parser, argv, flag):
    with pytest.raises(MoEExtArgumentError, match=flag):
        ext_config_from_args(_parse(megatron_parser, argv))


def test_several_bad_values_are_named_together(megatron_parser):
    argv = ["--moe-ext-capacity-factor", "0", "--moe-ext-lease-slots", "0", "--moe-ext-metrics-interval", "-1"]
    with pytest.raises(MoEExtArgumentError) as error:
        ext_config_from_args(_parse(megatron_parser, argv))
    message = str(error.value)
    assert message.startswith("3 problems")
    for flag in ("--moe-ext-capacity-factor must", "--moe-ext-lease-slots must", "--moe-ext-metrics-interval must"):
        assert flag in message, (flag, message)


@pytest.mark.parametrize("argv", [
    MOE_MODEL,
    MOE_MODEL + ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
    MOE_MODEL + ["--expert-model-parallel-size", "8", "--hidden-size", "64", "--moe-ext-mxfp8-dispatch"],
    MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-expert-capacity-factor", "1.0",
                 "--moe-token-dispatcher-type", "flex"],
    ["--moe-expert-capacity-factor", "1.0"],  # dense model: nothing to check
    # Every expert variant Megatron builds (issue 21): its defaults (GELU, biases), squared ReLU, GEGLU,
    # clamped quick-GEGLU with an offset, probabilities on the input (top-1), odd sizes.
    ["--num-experts", "8", "--transformer-impl", "local", "--no-persist-layer-norm"],
    ["--num-experts", "8", "--squared-relu", "--disable-bias-linear", "--transformer-impl", "local",
     "--no-persist-layer-norm"],
    ["--num-experts", "8", "--quick-geglu", "--activation-func-clamp-value", "7.0", "--glu-linear-offset", "1.0",
     "--transformer-impl", "local", "--no-persist-layer-norm", "--hidden-size", "12", "--fp16"],
    MOE_MODEL + ["--moe-apply-probs-on-input", "--moe-router-topk", "1", "--moe-router-pre-softmax"],
    # What the grouped experts cannot serve falls back to Megatron's experts under its dispatcher.
    MOE_MODEL + ["--moe-ext-dispatcher", "megatron", "--moe-mlp-glu-interleave-size", "8"],
    # A pipeline with enough slots, or a transport whose buffers autograd owns.
    MOE_MODEL + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "8", "--moe-ext-lease-slots", "4"],
    MOE_MODEL + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "8", "--moe-ext-transport", "torch"],
])
def test_valid_combinations_pass(megatron_parser, argv):
    validate_against_megatron(_parse(megatron_parser, argv))


def test_symm_transport_without_gpus_is_left_to_runtime(megatron_parser):
    validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--moe-ext-transport", "symm"]))


def test_missing_group_is_a_clear_error():
    with pytest.raises(MoEExtArgumentError, match="add_moe_ext_args"):
        ext_config_from_args(argparse.Namespace(num_experts=8))


def test_router_gemms_refused_where_the_router_dtype_leaves_nothing_to_place(megatron_parser):
    """The fused router's gating GEMMs are placed only with bf16 tokens and an fp32 router."""
    with pytest.raises(MoEExtArgumentError, match="--moe-ext-router-gemms cublas places .* no --bf16 and "
                                                  "--moe-router-dtype None: it would do nothing"):
        validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--moe-ext-router-gemms", "cublas"]))
    validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--moe-ext-router-gemms", "cublas", "--bf16",
                                                                   "--moe-router-dtype", "fp32"]))


@pytest.mark.parametrize("router, reason", [
    (["--moe-router-score-function", "sigmoid"], "moe_router_score_function='sigmoid'"),
    (["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"], "moe_router_enable_expert_bias"),
    (["--moe-z-loss-coeff", "0.1"], "moe_z_loss_coeff"),
])
def test_router_gemms_refused_where_the_router_is_not_fused(megatron_parser, router, reason):
    placed = MOE_MODEL + ["--moe-ext-router-gemms", "cublas", "--bf16", "--moe-router-dtype", "fp32"]
    with pytest.raises(MoEExtArgumentError) as error:
        validate_against_megatron(_parse(megatron_parser, placed + router))
    message = str(error.value)
    assert "this run's router is not fused" in message and reason in message, message
    validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--bf16", "--moe-router-dtype", "fp32"] + router))


def test_off_flags_are_named_as_typed(megatron_parser):
    """A setting another one turns off is refused, and the message spells the --moe-ext-no-* flag."""
    args = _parse(megatron_parser, ["--moe-ext-no-fused-router", "--moe-ext-router-gemms", "cublas"])
    with pytest.raises(MoEExtArgumentError) as error:
        ext_config_from_args(args)
    message = str(error.value)
    assert "--moe-ext-router-gemms cublas does nothing here" in message and "--moe-ext-no-fused-router" in message
    assert "fused_router" not in message.replace("--moe-ext-no-fused-router", ""), message


@pytest.mark.parametrize("flag, value, said", [
    ("--moe-ext-max-tokens-per-rank", "0", "--moe-ext-max-tokens-per-rank must be >= 1 (or leave the flag out), got 0"),
    ("--moe-ext-peer-timeout-s", "-1", "--moe-ext-peer-timeout-s must be > 0 seconds (or leave the flag out), got -1"),
])
def test_a_fields_none_reads_as_a_flag_left_out(megatron_parser, flag, value, said):
    """On the command line a field's None is the flag not given; the message says so."""
    with pytest.raises(MoEExtArgumentError) as error:
        ext_config_from_args(_parse(megatron_parser, MOE_MODEL + [flag, value]))
    assert said in str(error.value) and "None" not in str(error.value), str(error.value)


def test_megatrons_mtp_block_still_ignores_the_spec():
    """--mtp-num-layers is refused because megatron.training (0.19.2) builds the MTP block from its
    own decoder layer specs; if it starts honoring --spec, this fails and the refusal can go."""
    import inspect

    from megatron.training.models import gpt

    source = inspect.getsource(gpt.mtp_block_spec)
    assert "get_gpt_decoder_layer_specs(" in source and "get_gpt_mtp_block_spec(" in source, source


def test_every_megatron_optimizer_is_allowed_or_refused_by_name(megatron_parser):
    """Megatron's --optimizer choices (0.19.2): those that route parameters by their number of
    dimensions are refused (rules.NDIM_ROUTED_OPTIMIZERS); a new choice fails here until sorted."""
    from megatron_ext.rules import NDIM_ROUTED_OPTIMIZERS

    choices = next(a.choices for a in megatron_parser._actions if "--optimizer" in a.option_strings)
    assert sorted(set(choices) - set(NDIM_ROUTED_OPTIMIZERS)) == ["adam", "sgd"], choices
    assert set(NDIM_ROUTED_OPTIMIZERS) <= set(choices)


# ---- cases a mutation audit found unasserted -------------------------------------------------------

@pytest.mark.parametrize("half", [["--bf16"], ["--moe-router-dtype", "fp32"]])
def test_router_gemms_need_both_bf16_tokens_and_an_fp32_router(megatron_parser, half):
    with pytest.raises(MoEExtArgumentError, match="it would do nothing"):
        validate_against_megatron(_parse(megatron_parser, MOE_MODEL + ["--moe-ext-router-gemms", "cublas"] + half))


def _lease_check(megatron_parser, argv, world_size=None):
    args = _parse(megatron_parser, MOE_MODEL + argv)
    if world_size is not None:
        args.world_size = world_size  # parse_args reads WORLD_SIZE; this parser does not
    validate_against_megatron(args)


def test_lease_slots_count_microbatches_per_data_parallel_replica(megatron_parser):
    """pp 4 on 16 ranks is data parallel 4: a global batch of 8 is 2 microbatches per replica."""
    pipeline = ["--pipeline-model-parallel-size", "4", "--global-batch-size", "8", "--micro-batch-size", "1",
                "--moe-ext-lease-slots", "2"]
    _lease_check(megatron_parser, pipeline, world_size=16)
    with pytest.raises(MoEExtArgumentError, match="with 8 microbatches per step .* set --moe-ext-lease-slots 4"):
        _lease_check(megatron_parser, pipeline, world_size=4)


def test_lease_slots_read_the_virtual_pipeline_from_layers_per_stage(megatron_parser):
    """8 layers, pp 2, 2 layers per virtual stage: vpp 2, so 5 microbatches alive (not vpp 4's 9)."""
    argv = ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2",
            "--global-batch-size", "16", "--micro-batch-size", "1"]
    _lease_check(megatron_parser, argv + ["--moe-ext-lease-slots", "5"])
    with pytest.raises(MoEExtArgumentError, match="set --moe-ext-lease-slots 5"):
        _lease_check(megatron_parser, argv + ["--moe-ext-lease-slots", "4"])


def test_lease_slots_count_the_extra_forward_of_overlapped_expert_communication(megatron_parser):
    argv = ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "2",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--moe-ext-lease-slots", "5"]
    _lease_check(megatron_parser, argv)
    args = _parse(megatron_parser, MOE_MODEL + argv)
    args.overlap_moe_expert_parallel_comm = True  # the rowwise layer refuses the flag; the count models it
    from megatron_ext.argument_checks import _schedule_conflicts

    assert "set --moe-ext-lease-slots 6" in " ".join(_schedule_conflicts(args))


def test_an_explicit_megatron_ext_spec_takes_an_attention_variant(megatron_parser):
    """Only Megatron's own spec choice (no --spec) builds the variant from Megatron's spec."""
    validate_against_megatron(_parse(megatron_parser, MOE_MODEL + [
        "--experimental-attention-variant", "gated_delta_net", "--spec", "megatron_ext.specs", "gpt_block_spec"]))


def test_top_k_equal_to_the_number_of_experts_is_valid(megatron_parser):
    validate_against_megatron(_parse(megatron_parser, MOE_MODEL[2:] + ["--num-experts", "4", "--moe-router-topk",
                                                                       "4"]))
