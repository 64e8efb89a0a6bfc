"""Run an unmodified Megatron training script with megatron_ext's flags and MoE specs.

    python -m megatron_ext.launch pretrain_gpt.py --num-experts 8 --swiglu ... --moe-ext-transport symm
    torchrun --nproc-per-node 8 -m megatron_ext.launch pretrain_gpt.py ...

What it does, before running the script as `__main__` (runpy, `sys.argv` = the script and its
arguments, the script's folder first on `sys.path` as `python script.py` would have it):

1. Wraps `megatron.training.arguments.parse_args` so Megatron's parser also gets the
   "megatron_ext MoE" group (`--moe-ext-*`), chained after whatever `extra_args_provider` the
   script passes (upstream pretrain_gpt.py passes ModelOpt's). `parse_and_validate_args` looks
   `parse_args` up in its module at call time, so it is covered too. The wrapper also escapes a
   stray '%' in one of Megatron 0.19.2's help texts, without which `--help` crashes, and names
   the closest flags when argparse finds one it does not know.
2. After parsing, and again after Megatron's `validate_args` (which derives some settings, e.g. a
   virtual pipeline from --pipeline-model-parallel-layout): checks the flags against Megatron's
   (`validate_against_megatron`, errors name both flags), sets
   `megatron_ext.specs.set_default_ext_config(...)`, and, for MoE models (`--num-experts`) without a
   `--spec`, sets `args.spec = ["megatron_ext.specs", "gpt_block_spec"]`:
   megatron.training's `gpt_config_from_args` imports it with `import_module(args.spec)` and
   `GPTModelBuilder.build_model` calls it as `gpt_block_spec(model_config, vp_stage=...)`.

This module is the one place that touches Megatron's launch internals (argument parsing, the
spec hook); other concerns have their own (docs/design.md lists them). Written against
megatron-core 0.19.2 (megatron.training as shipped in that wheel, identical to Megatron-LM tag
core_v0.19.0); `check_megatron_hook_points()` raises MegatronInternalsChanged, naming what
moved, and runs on every launch and in the unit tests.
"""

from __future__ import annotations

import dataclasses

import difflib
import functools
import inspect
import os
import re
import runpy
import sys

from megatron_ext.argument_checks import training_loop_conflicts, validate_against_megatron
from megatron_ext.arguments import (FLAG_OF_FIELD, MoEExtArgumentError, add_moe_ext_args, ext_config_from_args,
                                    flag_words)
from megatron_ext.moe.drop_notice import drops_beyond_capacity, how_to_drop_none, mark_given, what_is_held
from megatron_ext.rules import MEGATRON_VERSION, MegatronInternalsChanged  # noqa: F401 - re-exported

EXT_SPEC = ["megatron_ext.specs", "gpt_block_spec"]

USAGE = """usage: python -m megatron_ext.launch SCRIPT.py [script arguments ...]

Runs SCRIPT.py (e.g. Megatron-LM's unmodified pretrain_gpt.py, or examples/pretrain_gpt.py) as
__main__ with megatron_ext's --moe-ext-* flags added to Megatron's parser and megatron_ext's
MoE specs installed for MoE models (--num-experts, no --spec given).
See the flags with: python -m megatron_ext.launch SCRIPT.py --help"""



def check_megatron_hook_points() -> None:
    """Raise MegatronInternalsChanged naming every hooked Megatron internal that changed."""
    from megatron.core.transformer import spec_utils
    from megatron.training import argument_utils, arguments
    from megatron.training.models.gpt import GPTModelBuilder

    problems = []
    parse_args = getattr(arguments.parse_args, "__wrapped__", arguments.parse_args)
    if list(inspect.signature(parse_args).parameters) != ["extra_args_provider", "ignore_unknown_args"]:
        problems.append(f"megatron.training.arguments.parse_args{inspect.signature(parse_args)} (expected "
                        f"(extra_args_provider=None, ignore_unknown_args=False))")
    validate = arguments.parse_and_validate_args
    if list(inspect.signature(validate).parameters) != ["extra_args_provider", "ignore_unknown_args",
                                                        "args_defaults"]:
        problems.append(f"megatron.training.arguments.parse_and_validate_args{inspect.signature(validate)}")
    if "parse_args" not in validate.__code__.co_names or validate.__globals__ is not vars(arguments):
        problems.append("parse_and_validate_args no longer calls the module-level parse_args (the wrapper "
                        "would be bypassed)")
    if "validate_args" not in validate.__code__.co_names:
        problems.append("parse_and_validate_args no longer calls the module-level validate_args (the checks of "
                        "the settings it derives would be bypassed)")
    validate_args = getattr(arguments.validate_args, "__wrapped__", arguments.validate_args)
    if list(inspect.signature(validate_args).parameters) != ["args", "defaults"]:
        problems.append(f"megatron.training.arguments.validate_args{inspect.signature(validate_args)} (expected "
                        f"(args, defaults={{}}))")
    if "import_module" not in argument_utils.gpt_config_from_args.__code__.co_names:
        problems.append("megatron.training.argument_utils.gpt_config_from_args no longer imports args.spec "
                        "with import_module")
    if list(inspect.signature(spec_utils.import_module).parameters) != ["module_path"]:
        problems.append(f"megatron.core.transformer.spec_utils.import_module"
                        f"{inspect.signature(spec_utils.import_module)} (expected (module_path))")
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import initialize

    if not callable(getattr(dataset_utils, "compile_helpers", None)) or \
            "compile_helpers" not in inspect.getsource(initialize):
        problems.append("megatron.training.initialize no longer builds the dataset helpers with "
                        "megatron.core.datasets.utils.compile_helpers")
    build_source = inspect.getsource(GPTModelBuilder.build_model)
    if "transformer_layer_spec(self._model_config, vp_stage=vp_stage)" not in build_source:
        problems.append("GPTModelBuilder.build_model no longer calls a callable spec as "
                        "spec(model_config, vp_stage=vp_stage)")
    if problems:
        raise MegatronInternalsChanged(
            f"megatron_ext.launch was written against megatron-core {MEGATRON_VERSION}; these hook points "
            f"changed:\n  - " + "\n  - ".join(problems))


def _chain_providers(*providers):
    """One extra_args_provider that runs `providers` in order (None entries skipped)."""
    providers = [provider for provider in providers if provider is not None]

    def chained(parser):
        for provider in providers:
            parser = provider(parser)
        return parser

    return chained


def escape_stray_percent(parser):
    """Megatron 0.19.2's own --help crashes: --moe-paged-stash-buffer-size-factor-cuda's help says
    "10%)", which argparse reads as a format code. Escape every '%' that does not start a
    "%(name)s" code or an escaped "%%", so `--help` prints (help text only; parsing is unchanged)."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            action.help = re.sub(r"%%|%\(|%", lambda m: m.group(0) if len(m.group(0)) == 2 else "%%", action.help)
    return parser


def suggest_close_flags(parser):
    """argparse (Python 3.12) answers a mistyped flag with "unrecognized arguments" alone; name the
    flags it is closest to (`--moe-ext-dropples` -> did you mean --moe-ext-dropless?), Megatron's and ours."""
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    report = parser.error

    def error(message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            hints = []
            for word in message[len(prefix):].split():
                flag = word.split("=", 1)[0]
                close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75) if flag.startswith("--") else []
                if close:
                    hints.append(f"{flag}: did you mean {' or '.join(close)}?")
            if hints:
                message += "\n  " + "\n  ".join(hints)
        report(message)

    parser.error = error
    return parser


def prepare_parsed_args(args) -> None:
    """Validate the --moe-ext-* flags, set the default ext config, install the spec for MoE models.

    Raises MoEExtArgumentError with a message naming the flags to change.
    """
    from megatron.core.transformer.enums import AttnBackend

    from megatron_ext import specs, training_hooks
    from megatron_ext.optimizer_resume import torch_adam_resume_notice

    resume_notice = torch_adam_resume_notice(args)  # Megatron's fault, any model: said before anything else
    if resume_notice:
        _print_once(resume_notice)
    kept_megatrons = _megatrons_moe_layers(args)
    if kept_megatrons is not None:  # a MoE model whose MoE layers megatron_ext does not build
        ext_config = ext_config_from_args(args)
        problems = training_loop_conflicts(args)  # the training hooks still run on such a model
        if problems:
            raise MoEExtArgumentError("megatron_ext cannot run with these flags:\n  - " + "\n  - ".join(problems))
        specs.set_default_ext_config(_layer_settings(ext_config))
        training_hooks.install(ext_config)
        _print_once(f"megatron_ext: {kept_megatrons}; the MoE layers stay Megatron's"
                    f"{_unused_moe_settings(ext_config)}")
        return
    validate_against_megatron(args)
    ext_config = ext_config_from_args(args)
    why_dense = _no_moe_layers(args)
    if why_dense:
        _refuse_moe_settings_without_experts(ext_config, why_dense)
    specs.set_default_ext_config(_layer_settings(ext_config))
    training_hooks.install(ext_config)  # DDP buckets, metrics and replica checks around every train_step
    if getattr(args, "num_experts", None) is None:
        return  # dense model: nothing of ours to install
    if args.spec is None:
        if getattr(args, "attention_backend", None) == AttnBackend.local:
            raise MoEExtArgumentError(
                "--attention-backend local requires --spec local in Megatron 0.19.2, which would bypass "
                "megatron_ext's MoE specs (--spec megatron_ext.specs gpt_block_spec); use another "
                "--attention-backend (e.g. auto, flash, fused, unfused)")
        args.spec = list(EXT_SPEC)
        _print_once(f"megatron_ext: MoE layers from --spec {' '.join(EXT_SPEC)} ({ext_config})")
    elif args.spec[0].startswith("megatron_ext"):
        _resolve_spec(args.spec)
    notice = _drop_notice(ext_config, getattr(args, "expert_model_parallel_size", 1) or 1)
    if notice:
        _print_once(notice)


def _drop_notice(ext_config, ep: int) -> str | None:
    """Megatron's MoE layer under these flags is dropless (its capacity factor is refused here, see
    megatron_ext.rules); the rowwise layer's capacity drops beyond cf x the balanced load when cf < EP,
    and the arena's budget with --moe-ext-on-overflow drop."""
    if not drops_beyond_capacity(ext_config, ep):
        return None
    mark_given()  # the layers say nothing more
    reported = (f"counted in the routing metrics every {ext_config.metrics_interval} steps (--moe-ext-metrics-interval)"
                if ext_config.metrics_interval else "reported at each --log-interval")
    return (f"megatron_ext: the rowwise MoE layers may drop routes Megatron's own layer would keep: "
            f"{what_is_held(ext_config, flag_words)}; dropped routes are {reported}. "
            f"{how_to_drop_none(ext_config, flag_words)}")


# What a model without MoE layers still uses: the replica check compares every parameter, and
# the DDP buckets apply to Megatron's DDP whatever its layers.
DENSE_FIELDS = ("replica_check_interval", "ddp_buckets")


def _layer_settings(ext_config):
    """The config the MoE layers are built from: ddp_buckets is applied to the model's DDP by the
    training hook (training_hooks.install_ddp_buckets), not by a layer, which refuses it."""
    return dataclasses.replace(ext_config, ddp_buckets=False)


def _megatrons_moe_layers(args) -> str | None:
    """Why this MoE model's MoE layers are Megatron's own (None: megatron_ext builds them)."""
    if getattr(args, "num_experts", None) is None:
        return None
    # Megatron copies the deprecated --hybrid-override-pattern into hybrid_layer_pattern later, in validate_args
    for flag in ("--hybrid-layer-pattern", "--hybrid-override-pattern"):
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            return f"hybrid model ({flag}): its --spec is a hybrid stack spec, which megatron_ext does not provide"
    spec = getattr(args, "spec", None)
    if spec and not spec[0].startswith("megatron_ext"):
        return f"--spec {' '.join(spec)} is not megatron_ext's (--spec {' '.join(EXT_SPEC)})"
    return None


def _changed_moe_flags(ext_config) -> str:
    """The --moe-ext-* flags set away from their defaults that only megatron_ext's MoE layers use."""
    return ", ".join(FLAG_OF_FIELD[name] for name in ext_config.changed_fields() if name not in DENSE_FIELDS)


def _unused_moe_settings(ext_config) -> str:
    """What a MoE model whose MoE layers stay Megatron's does not use: said, not silently dropped
    (tools/bench_training.py's Megatron baseline appends its --spec to a case's --moe-ext-* flags)."""
    flags = _changed_moe_flags(ext_config)
    return f", which do not use {flags}" if flags else ""


def _no_moe_layers(args) -> str | None:
    """Why the model has no MoE layer, or None: no --num-experts, or --moe-layer-freq all zeros."""
    if getattr(args, "num_experts", None) is None:
        return "--num-experts is not set"
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)) and not any(freq):
        return f"--moe-layer-freq {list(freq)} places none"
    return None


def _refuse_moe_settings_without_experts(ext_config, why_dense: str) -> None:
    """A dense model (no --num-experts, or a --moe-layer-freq list of zeros) with MoE settings
    changed: refused, not ignored."""
    flags = _changed_moe_flags(ext_config)
    if flags:
        verb, them = ("configure", "them") if ", " in flags else ("configures", "it")
        raise MoEExtArgumentError(f"{flags} {verb} MoE layers, and this model has none ({why_dense}): set "
                                  f"--num-experts for a MoE model with --moe-layer-freq placing its MoE layers, or "
                                  f"drop {them}")


def _resolve_spec(spec: list[str]) -> None:
    """Import an explicit megatron_ext spec now: Megatron's import_module turns an ImportError into
    `None`, i.e. a silent fallback to its own MoE layers."""
    import importlib

    if len(spec) != 2:
        raise MoEExtArgumentError(f"--spec takes a module and a name, e.g. --spec {' '.join(EXT_SPEC)}; got {spec}")
    try:
        module = importlib.import_module(spec[0])
    except ImportError as error:
        raise MoEExtArgumentError(f"--spec {' '.join(spec)}: cannot import {spec[0]} ({error}); megatron_ext's "
                                  f"spec is --spec {' '.join(EXT_SPEC)}") from None
    builder = getattr(module, spec[1], None)
    if not callable(builder):
        raise MoEExtArgumentError(f"--spec {' '.join(spec)}: {spec[0]} has no spec builder {spec[1]!r}")
    if spec[0].split(".")[0] == "megatron_ext" and not isinstance(builder, type):
        first = next(iter(inspect.signature(builder).parameters), None)
        if first != "config":  # Megatron calls a --spec builder as builder(config[, vp_stage=...])
            raise MoEExtArgumentError(f"--spec {' '.join(spec)}: Megatron calls a --spec builder with the model's "
                                      f"config, and {spec[1]} takes {first!r} first; megatron_ext's spec is "
                                      f"--spec {' '.join(EXT_SPEC)}")


_printed: set[str] = set()


def _print_once(message: str) -> None:
    """Rank 0, once per process: Megatron's training may parse the arguments more than once."""
    if message not in _printed:
        _printed.add(message)
        _print_rank_0(message)


def _print_rank_0(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def install() -> callable:
    """Hook megatron.training's argument parsing; returns a function that removes the hook.

    Safe to call twice (the second call is a no-op that returns the first's remover).
    """
    from megatron.training import arguments

    check_megatron_hook_points()
    use_prebuilt_dataset_helpers()
    original = arguments.parse_args
    if getattr(original, "_megatron_ext_hook", False):
        return original._megatron_ext_uninstall
    original_validate = arguments.validate_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        provider = _chain_providers(extra_args_provider, add_moe_ext_args, escape_stray_percent, suggest_close_flags)
        args = original(provider, ignore_unknown_args)
        refuse_checkpoint_args(args)
        prepare_parsed_args(args)
        return args

    @functools.wraps(original_validate)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's signature
        args = original_validate(args, defaults)
        # Again after Megatron derived settings from others (a virtual pipeline from
        # --pipeline-model-parallel-layout, --cuda-graph-impl from a deprecated --cuda-graph-modules
        # value), which the first check, inside parse_args, could not see.
        if hasattr(args, "moe_ext_dispatcher"):  # parsed through the hook
            prepare_parsed_args(args)
        return args

    def uninstall():
        arguments.parse_args = original
        arguments.validate_args = original_validate

    parse_args._megatron_ext_hook = True
    parse_args._megatron_ext_uninstall = uninstall
    arguments.parse_args = parse_args
    arguments.validate_args = validate_args
    return uninstall


def refuse_checkpoint_args(args) -> None:
    """The hook runs inside parse_args; Megatron's parse_and_validate_args loads --use-checkpoint-args
    after it (0.19.2), so the checkpoint's model flags would bypass the checks and the spec choice.
    (examples/pretrain_gpt.py checks after Megatron has loaded them, where the flag works.)"""
    if getattr(args, "use_checkpoint_args", False):
        raise MoEExtArgumentError(
            "--use-checkpoint-args: Megatron loads the model's flags from the checkpoint after the launcher has "
            "checked them and chosen the MoE layers' spec, so a MoE model's flags from the checkpoint would go "
            "unchecked and its MoE layers could silently be Megatron's own; give the model's flags on the command "
            "line instead (those of the run that wrote the checkpoint: --num-experts, --moe-router-topk, the sizes), "
            "or run examples/pretrain_gpt.py without the launcher, which checks them after Megatron loads them")


def use_prebuilt_dataset_helpers() -> None:
    """Skip Megatron's `make` of the C++ dataset helpers when the wheel already ships them.

    megatron.training.initialize (0.19.2) runs `make -C megatron/core/datasets` on rank 0 and exits
    when it fails; the megatron-core wheel has the compiled helpers_cpp module but no Makefile.
    """
    import importlib.util

    from megatron.core.datasets import utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return  # a source checkout: let Megatron build them

    def compile_helpers():
        _print_rank_0("megatron_ext: using the prebuilt dataset helpers shipped in the megatron-core wheel")

    dataset_utils.compile_helpers = compile_helpers


def run_script(script: str, script_args: list[str]) -> None:
    """Run `script` as __main__ with sys.argv = [script, *script_args] (hook installed first)."""
    if not os.path.isfile(script):
        usage_error(f"megatron_ext.launch: no such script: {script}\n\n{USAGE}")
    install()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except MoEExtArgumentError as error:
        usage_error(f"megatron_ext: error: {error}")
    except AssertionError as error:  # Megatron's initialize asserts a GPU with this text (0.19.2)
        import torch

        if torch.cuda.is_available() or str(error) != "Megatron requires CUDA.":
            raise
        usage_error(f"megatron_ext: error: megatron.training needs a GPU ({error}); this machine has none. On CPU, "
                     f"train the tiny MoE model of examples/train_tiny_moe_cpu.py instead")


def usage_error(message: str) -> None:
    """A user error: one message on stderr, exit code 2 (as argparse's own errors), no traceback."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    from megatron_ext.quiet import quiet_known_warnings

    quiet_known_warnings(announce=int(os.environ.get("RANK", "0")) == 0)
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    # Through the imported module, not this __main__ copy: a script that imports megatron_ext.launch
    # (examples/pretrain_gpt.py) then shares its state (the notices printed once).
    from megatron_ext.launch import main as imported_main

    imported_main()
