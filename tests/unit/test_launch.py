"""megatron_ext.launch: the hook on Megatron's parser, the spec injection, and the Megatron
internals it relies on (a test fails loudly when megatron-core changes them)."""

import argparse
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

from megatron_ext import launch, specs
from megatron_ext.arguments import MoEExtArgumentError
from megatron_ext.config import MoEExtConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE_MODEL = ["--num-experts", "8", "--swiglu", "--disable-bias-linear", "--transformer-impl", "local",
             "--no-persist-layer-norm"]


@pytest.fixture
def hooked(monkeypatch):
    """The hook installed for one test, removed (with the default ext config reset) after it."""
    from megatron.training import arguments

    original, original_validate = arguments.parse_args, arguments.validate_args
    monkeypatch.setattr(launch, "_printed", set())  # each test a fresh process: its notices print once
    uninstall = launch.install()
    yield arguments
    uninstall()
    assert arguments.parse_args is original and arguments.validate_args is original_validate
    monkeypatch.setattr(specs, "_default_ext_config", None)


def parse_with(arguments, argv, provider=None):
    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        return arguments.parse_args(extra_args_provider=provider)
    finally:
        sys.argv = saved


def test_megatron_hook_points_are_as_written_for():
    launch.check_megatron_hook_points()


def test_hook_point_check_fails_loudly_when_parse_args_changes(monkeypatch):
    from megatron.training import arguments

    def parse_args(extra_args_provider=None, ignore_unknown_args=False, new_option=None):
        raise AssertionError("never called")

    monkeypatch.setattr(arguments, "parse_args", parse_args)
    with pytest.raises(launch.MegatronInternalsChanged, match="parse_args"):
        launch.check_megatron_hook_points()


def test_megatron_calls_a_spec_the_way_gpt_block_spec_accepts():
    parameters = inspect.signature(specs.gpt_block_spec).parameters
    assert "vp_stage" in parameters and list(parameters)[0] == "config"


def test_hook_adds_the_group_and_chains_the_scripts_provider(hooked):
    def provider(parser):
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    args = parse_with(hooked, MOE_MODEL + ["--my-flag", "3", "--moe-ext-transport", "torch",
                                           "--moe-ext-capacity-factor", "2"], provider)
    assert args.my_flag == 3
    assert args.spec == launch.EXT_SPEC
    assert specs.default_ext_config() == MoEExtConfig(transport="torch", capacity_factor=2.0)


def test_hook_covers_parse_and_validate_args(hooked):
    """parse_and_validate_args looks parse_args up at call time, so it reaches the wrapper."""
    assert hooked.parse_and_validate_args.__globals__["parse_args"] is hooked.parse_args


TRAINABLE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-4", "--bf16", "--vocab-size", "1000",
             "--tokenizer-type", "NullTokenizer", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]


@pytest.mark.parametrize("world_size, flags, refusal", [
    # Megatron derives a virtual pipeline of 2 from the layout: 4 microbatches alive per layer
    ("2", ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|tL",
           "--moe-ext-lease-slots", "2"], "set --moe-ext-lease-slots 4"),
    # Megatron turns the deprecated module value into --cuda-graph-impl full_iteration
    ("1", ["--cuda-graph-modules", "full_iteration", "--no-check-for-nan-in-loss-and-grad", "--moe-ext-cuda-graphs"],
     "--cuda-graph-impl full_iteration with --moe-ext-cuda-graphs"),
])
def test_settings_megatron_derives_in_validate_args_are_checked_too(hooked, monkeypatch, world_size, flags, refusal):
    """The first check runs inside parse_args, before validate_args derives these; unmodified
    pretrain_gpt.py calls parse_and_validate_args, whose validate_args the hook wraps."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setenv("RANK", "0")
    args = parse_with(hooked, MOE_MODEL + TRAINABLE + flags)  # passes the first check
    with pytest.raises(MoEExtArgumentError, match=re.escape(refusal)):
        hooked.validate_args(args)


def test_hook_covers_validate_args_of_parse_and_validate_args(hooked):
    assert hooked.parse_and_validate_args.__globals__["validate_args"] is hooked.validate_args
    assert hooked.validate_args.__wrapped__.__module__ == "megatron.training.arguments"


def test_a_script_importing_the_launcher_shares_its_printed_notices(tmp_path):
    """`python -m megatron_ext.launch` runs the launcher as __main__; a script that imports
    megatron_ext.launch (examples/pretrain_gpt.py) must reach the same module, or every start-up
    notice printed by both prints twice."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        from megatron.training import arguments
        from megatron_ext import launch
        launch._print_once("megatron_ext: a notice")
        hooks_print_once = arguments.parse_args._megatron_ext_uninstall.__globals__["_print_once"]
        hooks_print_once("megatron_ext: a notice")
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "megatron_ext.launch", str(script)], env=env, cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("megatron_ext: a notice") == 1, result.stdout


def test_install_twice_is_one_hook(hooked):
    wrapper = hooked.parse_args
    launch.install()
    assert hooked.parse_args is wrapper


def test_dense_models_keep_megatrons_spec(hooked):
    assert parse_with(hooked, []).spec is None


@pytest.mark.parametrize("flag", ["--hybrid-layer-pattern", "--hybrid-override-pattern"])
def test_hybrid_models_keep_their_own_stack_spec(hooked, capsys, flag):
    """The deprecated --hybrid-override-pattern too: Megatron moves it to hybrid_layer_pattern only
    in validate_args, after the hook."""
    assert parse_with(hooked, MOE_MODEL + [flag, "M*E"]).spec is None
    assert f"hybrid model ({flag})" in capsys.readouterr().out


def test_checkpoint_args_are_refused_not_loaded_past_the_checks(hooked):
    """Megatron loads --use-checkpoint-args after parse_args: the checkpoint's --num-experts would
    reach a model whose spec the hook left at Megatron's (its own MoE layers, silently)."""
    with pytest.raises(MoEExtArgumentError, match="--use-checkpoint-args: .* give the model's flags on the command"):
        parse_with(hooked, ["--use-checkpoint-args", "--load", "/tmp/no_checkpoint"])
    # examples/pretrain_gpt.py checks after Megatron's parse_and_validate_args has loaded them: accepted there
    args = parse_with(hooked, MOE_MODEL)
    args.use_checkpoint_args = True  # as Megatron leaves it after loading the checkpoint's flags
    launch.prepare_parsed_args(args)
    assert args.spec == launch.EXT_SPEC


@pytest.mark.parametrize("layout", [["--hybrid-layer-pattern", "M*E"], ["--spec", "local"]])
def test_moe_models_that_keep_megatrons_layers_get_no_rowwise_checks_and_say_what_they_do_not_use(
        hooked, capsys, layout):
    # Megatron's own MoE layers: its capacity factor is theirs, not a rowwise conflict.
    args = parse_with(hooked, MOE_MODEL + layout + ["--moe-expert-capacity-factor", "1.0"])
    assert args.spec == (None if "--hybrid-layer-pattern" in layout else ["local"])
    out = capsys.readouterr().out
    assert "the MoE layers stay Megatron's" in out and "do not use" not in out
    parse_with(hooked, MOE_MODEL + layout + ["--moe-ext-dropless-arena", "--moe-ext-capacity-factor", "2"])
    assert "the MoE layers stay Megatron's, which do not use --moe-ext-capacity-factor, --moe-ext-dropless-arena" \
        in capsys.readouterr().out


def test_an_explicit_spec_is_kept(hooked):
    args = parse_with(hooked, MOE_MODEL + ["--spec", "megatron_ext.specs", "gpt_block_spec"])
    assert args.spec == ["megatron_ext.specs", "gpt_block_spec"]


def test_a_missing_megatron_ext_spec_is_an_error_not_a_silent_fallback(hooked):
    with pytest.raises(MoEExtArgumentError, match="no spec builder"):
        parse_with(hooked, MOE_MODEL + ["--spec", "megatron_ext.specs", "no_such_builder"])


@pytest.mark.parametrize("name,first", [("gpt_layer_spec", "num_experts"), ("moe_builder", "ext_config")])
def test_a_megatron_ext_function_megatron_cannot_call_as_a_spec_is_refused(hooked, name, first):
    with pytest.raises(MoEExtArgumentError, match=f"{name} takes '{first}' first; megatron_ext's spec is --spec "
                                                  f"megatron_ext.specs gpt_block_spec"):
        parse_with(hooked, MOE_MODEL + ["--spec", "megatron_ext.specs", name])


def test_wrong_combination_fails_at_parse_time(hooked):
    with pytest.raises(MoEExtArgumentError, match="--moe-expert-capacity-factor"):
        parse_with(hooked, MOE_MODEL + ["--moe-expert-capacity-factor", "1.0"])


def test_local_attention_backend_is_refused_with_a_reason(hooked):
    with pytest.raises(MoEExtArgumentError, match="--attention-backend local"):
        parse_with(hooked, MOE_MODEL + ["--attention-backend", "local"])


MEGATRONS_LAYERS = MOE_MODEL + ["--spec", "megatron.training.models.gpt", "default_layer_spec"]


@pytest.mark.parametrize("model", [MOE_MODEL, [], MEGATRONS_LAYERS], ids=["ours", "dense", "megatrons"])
def test_ddp_buckets_go_to_the_training_hook_not_the_layers(hooked, monkeypatch, model):
    """Any model (its DDP is Megatron's whatever builds the MoE layers): the training hook gets
    ddp_buckets, the layers' default config does not (the layer builder refuses it)."""
    from megatron_ext import training_hooks

    installed = []
    monkeypatch.setattr(training_hooks, "install", lambda config: installed.append(config) or True)
    parse_with(hooked, model + ["--moe-ext-ddp-buckets"])
    assert [config.ddp_buckets for config in installed] == [True]
    assert not specs.default_ext_config().ddp_buckets


@pytest.mark.parametrize("model", [MOE_MODEL, [], MEGATRONS_LAYERS], ids=["ours", "dense", "megatrons"])
@pytest.mark.parametrize("flags, named", [
    (["--use-megatron-fsdp", "--use-distributed-optimizer"], "--moe-ext-ddp-buckets with --use-megatron-fsdp"),
    (["--use-torch-fsdp2"], "--moe-ext-ddp-buckets with --use-torch-fsdp2"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
     "--moe-ext-ddp-buckets with --num-distributed-optimizer-instances 2"),
])
def test_ddp_buckets_without_megatrons_whole_ddp_are_refused(hooked, model, flags, named):
    """On any model (the hook wraps Megatron's DDP whatever builds the MoE layers); without
    --moe-ext-ddp-buckets the same Megatron flags are megatron_ext's business no more."""
    parse_with(hooked, model + flags)  # no DDP buckets asked for: accepted
    with pytest.raises(MoEExtArgumentError, match=named):
        parse_with(hooked, model + ["--moe-ext-ddp-buckets", *flags])


def test_megatrons_own_help_prints_under_the_hook(hooked, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_with(hooked, ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--moe-ext-dispatcher" in out and "--moe-paged-stash-buffer-size-factor-cuda" in out


def test_stray_percent_escape_keeps_format_codes():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", default=3, help="10%) headroom, 100%% of it, default %(default)s")
    launch.escape_stray_percent(parser)
    assert "10%) headroom, 100% of it, default 3" in " ".join(parser.format_help().split())


def test_a_mistyped_flag_is_answered_with_the_closest_ones(hooked, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_with(hooked, MOE_MODEL + ["--moe-ext-dropples", "--moe-router-topk=2", "--num-expert", "4",
                                        "--no-such-thing-at-all"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --moe-ext-dropples --num-expert 4 --no-such-thing-at-all" in err, err
    assert "--moe-ext-dropples: did you mean --moe-ext-dropless" in err, err
    assert "--num-expert: did you mean --num-experts" in err, err
    assert "--no-such-thing-at-all:" not in err and "4:" not in err, err  # no hint where nothing is close


def test_launcher_runs_an_unmodified_script_as_main(tmp_path):
    """End to end in a subprocess: a script that only calls Megatron's parse_args gets our flags."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from megatron.training.arguments import parse_args
        from megatron_ext.specs import default_ext_config

        def provider(parser):
            parser.add_argument("--my-flag", type=int, default=0)
            return parser

        if __name__ == "__main__":
            args = parse_args(extra_args_provider=provider)
            print("RESULT", args.my_flag, args.spec, default_ext_config())
    """))
    result = subprocess.run([sys.executable, "-m", "megatron_ext.launch", str(script), "--my-flag", "5", *MOE_MODEL,
                             "--moe-ext-transport", "torch", "--moe-ext-metrics-interval", "2"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    assert line == ("RESULT 5 ['megatron_ext.specs', 'gpt_block_spec'] "
                    f"{MoEExtConfig(transport='torch', metrics_interval=2)}")


def test_launcher_usage_without_a_script():
    with pytest.raises(SystemExit) as exit_info:
        launch.main([])
    assert exit_info.value.code == 2


def test_prebuilt_dataset_helpers_skip_the_make_step():
    """The wheel has helpers_cpp but no Makefile: Megatron's make would fail and exit training."""
    import importlib.util

    from megatron.core.datasets import utils as dataset_utils

    from megatron_ext.launch import use_prebuilt_dataset_helpers

    assert importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    original = dataset_utils.compile_helpers
    try:
        use_prebuilt_dataset_helpers()
        assert dataset_utils.compile_helpers is not original
        dataset_utils.compile_helpers()  # must not run make (which would sys.exit here)
    finally:
        dataset_utils.compile_helpers = original


def _launch(tmp_path, body: str, *flags, env=None):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "megatron_ext.launch", str(script), *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})


PARSE_ONLY = """
    from megatron.training.arguments import parse_args

    if __name__ == "__main__":
        parse_args()
        print("PARSED")
"""


@pytest.mark.parametrize("flags,message", [
    (["--moe-ext-lease-slots", "0"], "--moe-ext-lease-slots must be >= 1"),
    (["--moe-ext-dropless"], "--moe-ext-dropless configures MoE layers, and this model has none"),
    (MOE_MODEL + ["--spec", "megatron_ext.no_such_module", "gpt_block_spec"], "cannot import megatron_ext.no_such"),
], ids=["bad_value", "dense_model", "bad_spec"])
def test_user_errors_exit_2_with_one_message_and_no_traceback(tmp_path, flags, message):
    result = _launch(tmp_path, PARSE_ONLY, *flags)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "PARSED" not in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert message in result.stderr.strip().splitlines()[-1], result.stderr[-3000:]


def test_moe_settings_on_a_moe_model_without_moe_layers_are_refused(hooked):
    """--moe-layer-freq [0,0] builds dense layers only: a rowwise setting would do nothing."""
    dense_freq = MOE_MODEL + ["--num-layers", "2", "--moe-layer-freq", "[0,0]"]
    with pytest.raises(MoEExtArgumentError, match=re.escape("this model has none (--moe-layer-freq [0, 0] places "
                                                            "none)")):
        parse_with(hooked, dense_freq + ["--moe-ext-dropless"])
    parse_with(hooked, dense_freq)  # the model itself is Megatron's to accept
    parse_with(hooked, MOE_MODEL + ["--num-layers", "2", "--moe-layer-freq", "[0,1]", "--moe-ext-dropless"])


def test_dense_model_keeps_the_replica_check(tmp_path):
    result = _launch(tmp_path, PARSE_ONLY, "--moe-ext-replica-check-interval", "5")
    assert result.returncode == 0 and "PARSED" in result.stdout, result.stderr[-3000:]


def test_megatron_on_a_machine_without_a_gpu_is_a_usage_error(tmp_path):
    # Megatron 0.19.2's initialize asserts CUDA; the launcher says what to run instead. No GPU is
    # visible to the child, on any machine.
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    body = """
        if __name__ == "__main__":
            assert False, "Megatron requires CUDA."
    """
    result = _launch(tmp_path, body, *MOE_MODEL, env=no_gpu)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "megatron.training needs a GPU" in result.stderr and "train_tiny_moe_cpu.py" in result.stderr
    other = _launch(tmp_path, 'if __name__ == "__main__":\n    assert False, "expected a CUDA tensor"\n', env=no_gpu)
    assert other.returncode == 1 and "AssertionError: expected a CUDA tensor" in other.stderr  # other asserts


@pytest.mark.parametrize("flags,dropping", [
    (["--expert-model-parallel-size", "2"], True),  # cf 1.25 < EP: beyond it routes drop
    (["--expert-model-parallel-size", "2", "--moe-ext-capacity-factor", "2.0"], False),  # cf >= EP: dropless
    (["--expert-model-parallel-size", "2", "--moe-ext-dropless-arena"], False),  # beyond its budget: an error
    (["--expert-model-parallel-size", "2", "--moe-ext-dropless-arena", "--moe-ext-on-overflow", "drop"], True),
    (["--moe-ext-dropless-arena", "--moe-ext-on-overflow", "drop", "--moe-ext-metrics-interval", "10"], True),
    (["--expert-model-parallel-size", "2", "--moe-ext-dropless"], False),
    (["--expert-model-parallel-size", "2", "--moe-ext-on-overflow", "drop"], True),  # drop said, not the default
    ([], False)])  # EP = 1: the capacity is the worst case
def test_a_layer_that_may_drop_where_megatrons_would_not_says_so_at_start_up(hooked, capsys, flags, dropping):
    parse_with(hooked, [*MOE_MODEL, *flags])
    out = capsys.readouterr().out
    assert ("may drop routes Megatron's own layer would keep" in out) is dropping, out
    if not dropping:
        return
    assert "--moe-ext-capacity-factor 1.25 x" in out
    if "--moe-ext-dropless-arena" in flags:  # the advice is not the flag already given
        assert "their dropless arena holds" in out and "To stop with an error instead: --moe-ext-on-overflow error" \
            in out and "To drop none: --moe-ext-dropless-arena" not in out, out
    else:  # the arena with an explicit drop policy would drop too: the advice names the policy to set
        arena = "--moe-ext-dropless-arena with --moe-ext-on-overflow auto" if "drop" in flags else \
            "--moe-ext-dropless-arena (bounded"
        assert "per destination rank" in out and f"To drop none: {arena}" in out, out
        assert "To drop fewer: raise --moe-ext-capacity-factor" in out, out
    reported = "every 10 steps (--moe-ext-metrics-interval)" if "--moe-ext-metrics-interval" in flags else \
        "reported at each --log-interval"
    assert reported in out, out


@pytest.mark.parametrize("model", [[], MOE_MODEL, MOE_MODEL + ["--spec", "local"]], ids=["dense", "moe", "megatrons"])
def test_the_replica_check_is_refused_where_parameters_are_gathered_in_the_next_forward(hooked, model):
    """Right after a step with --overlap-param-gather each data-parallel rank holds only its own
    shard's update (a review's emulation: every parameter reported), on any model the check runs on."""
    check = ["--moe-ext-replica-check-interval", "5", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    parse_with(hooked, model + check)  # gathered in the step: checked
    with pytest.raises(launch.MoEExtArgumentError, match="--moe-ext-replica-check-interval with "
                                                         "--overlap-param-gather: .*drop one of the two"):
        parse_with(hooked, model + check + ["--overlap-param-gather"])


@pytest.mark.parametrize("fsdp", [["--use-megatron-fsdp", "--use-distributed-optimizer"], ["--use-torch-fsdp2"]],
                         ids=["megatron_fsdp", "torch_fsdp2"])
def test_the_replica_check_is_refused_under_fsdp(hooked, fsdp):
    """FSDP gives each data-parallel rank a different shard of every parameter: no replicas to compare."""
    parse_with(hooked, MOE_MODEL + fsdp)
    with pytest.raises(launch.MoEExtArgumentError, match=f"--moe-ext-replica-check-interval with {fsdp[0]}: FSDP "
                                                         f"gives each data-parallel rank a different shard"):
        parse_with(hooked, MOE_MODEL + fsdp + ["--moe-ext-replica-check-interval", "5"])


def test_probabilities_on_the_input_with_mxfp8_payloads_are_refused_at_start_up(hooked):
    flags = [*MOE_MODEL, "--moe-router-topk", "1", "--moe-apply-probs-on-input", "--hidden-size", "64"]
    parse_with(hooked, flags)
    with pytest.raises(launch.MoEExtArgumentError, match="with --moe-ext-mxfp8-dispatch fc1 reads the MXFP8 payload"):
        parse_with(hooked, flags + ["--moe-ext-mxfp8-dispatch"])


@pytest.mark.parametrize("flags,said", [
    (["--use-distributed-optimizer", "--save", "CKPT"], True),
    (["--use-distributed-optimizer", "--load", "CKPT"], True),
    (["--use-distributed-optimizer"], False),  # nothing saved or loaded
    (["--save", "CKPT"], False),  # not the distributed optimizer
    (["--use-distributed-optimizer", "--save", "CKPT", "--optimizer", "sgd"], False)])
def test_resuming_torch_adam_under_the_distributed_optimizer_is_flagged(hooked, capsys, tmp_path, flags, said):
    """This machine has neither Apex nor Transformer Engine, as Megatron itself reads it; the notice
    names Megatron 0.19.2's fault (tests/gpu/test_expert_checkpoint_gpu.py) and what to do."""
    from megatron.core.optimizer import distrib_optimizer

    assert distrib_optimizer.HAVE_APEX_OR_TE is False  # the flag the notice reads (fails loudly if it goes)
    parse_with(hooked, [*MOE_MODEL, *(str(tmp_path) if flag == "CKPT" else flag for flag in flags)])
    out = capsys.readouterr().out
    assert ("whose step megatron-core 0.19.2 does not resume right" in out) is said, out
    if said:
        assert "--no-load-optim" in out and "KeyError 'step'" in out


def test_no_resume_notice_with_apex_or_transformer_engine(hooked, capsys, tmp_path, monkeypatch):
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    parse_with(hooked, [*MOE_MODEL, "--use-distributed-optimizer", "--save", str(tmp_path)])
    assert "does not resume right" not in capsys.readouterr().out


def test_no_resume_notice_where_the_optimizer_is_not_torchs_adam_on_the_device():
    """Only torch's Adam under the distributed optimizer meets the fault: another optimizer (muon)
    has no Adam step, and --optimizer-cpu-offload runs Megatron's HybridDeviceOptimizer, which
    handles the step itself. Called directly: the parser need not accept every combination."""
    from types import SimpleNamespace

    from megatron_ext.optimizer_resume import torch_adam_resume_notice

    adam = dict(use_distributed_optimizer=True, optimizer="adam", save="/ck")
    assert "does not resume right" in torch_adam_resume_notice(SimpleNamespace(**adam))  # this machine: no Apex/TE
    assert torch_adam_resume_notice(SimpleNamespace(**adam, optimizer_cpu_offload=True)) is None
    assert torch_adam_resume_notice(SimpleNamespace(**{**adam, "optimizer": "muon"})) is None
