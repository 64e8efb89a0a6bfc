"""The `--moe-ext-*` command-line flags: one per MoEExtConfig field, and their checks against
Megatron's own arguments.

    parser = add_moe_ext_args(parser)            # Megatron's extra_args_provider contract
    validate_against_megatron(args)              # wrong combinations, naming both flags
    ext_config = ext_config_from_args(args)      # -> MoEExtConfig

The flag table (`FLAGS`) is the single source: help texts, `--help`, the README table
(`python -m megatron_ext.arguments --markdown` prints it) and the tests read it. Defaults come
from MoEExtConfig's own field defaults. Runtime conditions (e.g. `--moe-ext-transport symm`
without GPUs) are checked where the layer is built, not here.

Written against megatron-core 0.19.2 (the names of Megatron's own flags and `args` fields).
"""

from __future__ import annotations

import importlib.util

import argparse
import dataclasses
import re
from dataclasses import dataclass

from megatron_ext.config import DISPATCHERS, TRANSPORTS, MoEExtConfig

GROUP_TITLE = "megatron_ext MoE"
DEST_PREFIX = "moe_ext_"


class MoEExtArgumentError(ValueError):
    """A bad `--moe-ext-*` flag, or a combination with Megatron's flags that cannot run."""


@dataclass(frozen=True)
class ExtFlag:
    """One command-line flag for one MoEExtConfig field.

    kind: "value" (takes a value of `type`), "on" (store_true: sets the field to True),
    "off" (store_false: the flag turns a default-True field off).
    """

    field: str
    flag: str
    kind: str
    help: str
    type: type | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return DEST_PREFIX + self.field


FLAGS: tuple[ExtFlag, ...] = (
    ExtFlag("dispatcher", "--moe-ext-dispatcher", "value", type=str, choices=DISPATCHERS,
            help="rowwise: megatron_ext's synchronization-free dispatcher (device route map, rows moved "
                 "straight into static-capacity expert buffers); megatron: keep Megatron's "
                 "--moe-token-dispatcher-type and swap only the experts for the grouped-GEMM ones."),
    ExtFlag("transport", "--moe-ext-transport", "value", type=str, choices=TRANSPORTS,
            help="How the rowwise dispatcher moves rows: torch (all_to_all reference, any backend), "
                 "symm (symmetric memory + Triton PUT/GET, GPUs of one NVLink domain), deepep (optional "
                 "DeepEP package), auto (symm on GPUs within one host, else torch)."),
    ExtFlag("capacity_factor", "--moe-ext-capacity-factor", "value", type=float, metavar="CF",
            help="Rows per destination rank: C = round_up(ceil(CF * T_max * top_k), 16). Routes beyond "
                 "C are dropped by a fair max-min policy (replaces Megatron's --moe-expert-capacity-factor)."),
    ExtFlag("dropless", "--moe-ext-dropless", "on",
            help="Size the capacity for the worst case (EP * T_max * top_k): nothing is ever dropped."),
    ExtFlag("max_tokens_per_rank", "--moe-ext-max-tokens-per-rank", "value", type=int, metavar="T_MAX",
            help="Tokens a rank holds in one microbatch (T_max). Default: fixed from the first "
                 "microbatch's shape, which is static in Megatron training."),
    ExtFlag("mxfp8_dispatch", "--moe-ext-mxfp8-dispatch", "on",
            help="Carry dispatched rows as MXFP8 (E4M3 + one E8M0 scale per 32 values); needs "
                 "--moe-ext-dispatcher rowwise and a hidden size divisible by 32."),
    ExtFlag("cuda_graphs", "--moe-ext-cuda-graphs", "on",
            help="Capture the whole MoE layer (forward and backward) in CUDA graphs; needs "
                 "--moe-ext-dispatcher rowwise."),
    ExtFlag("ddp_buckets", "--moe-ext-ddp-buckets", "on",
            help="Reduce gradients with megatron_ext's multi-group DDP buckets (dense over DP x CP, "
                 "experts over expert-data-parallel, one launch order on every rank)."),
    ExtFlag("metrics_interval", "--moe-ext-metrics-interval", "value", type=int, metavar="N",
            help="Read routing metrics (dropped routes, capacity fill, routes per expert) on the host "
                 "every N steps; reading synchronizes, so 0 (never) is the default."),
    ExtFlag("replica_check_interval", "--moe-ext-replica-check-interval", "value", type=int, metavar="N",
            help="Every N steps compare parameter checksums across each replica group (dense over "
                 "DP x CP, experts over expert-data-parallel) and stop naming the first parameter that "
                 "disagrees; synchronizes, so 0 (never) is the default."),
    ExtFlag("debug_poison", "--moe-ext-debug-poison", "on",
            help="Debug: fill capacity tails and released buffers with NaN so stale reads show up."),
    ExtFlag("debug_checks", "--moe-ext-debug-checks", "on",
            help="Debug: extra validation of route maps and offsets (synchronizes with the host)."),
    ExtFlag("lease_slots", "--moe-ext-lease-slots", "value", type=int, metavar="N",
            help="Dispatch-buffer slots per MoE layer (microbatches in flight per layer; symm transport); "
                 "raise it for pipeline schedules that keep several microbatches of a layer alive."),
    ExtFlag("compile_route_map", "--moe-ext-no-compile-route-map", "off",
            help="Do not fuse the route-map planning with torch.compile on GPUs (same results; "
                 "compiling saves host time per layer but costs a compile at the first step)."),
)

FLAG_OF_FIELD = {f.field: f.flag for f in FLAGS}


def _default(field: str):
    return next(f.default for f in dataclasses.fields(MoEExtConfig) if f.name == field)


def add_moe_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "megatron_ext MoE" argument group; returns the parser (extra_args_provider contract).

    Idempotent: a parser that already has the group (a patched script run through the
    launcher) is returned unchanged.
    """
    if FLAGS[0].flag in parser._option_string_actions:  # argparse has no public lookup
        return parser
    group = parser.add_argument_group(
        title=GROUP_TITLE, description="megatron_ext's MoE layer (megatron_ext.config.MoEExtConfig); "
                                       "used by MoE models (--num-experts) built from megatron_ext.specs.")
    for flag in FLAGS:
        default = _default(flag.field)
        if flag.kind == "value":
            shown = "" if default is None else f" (default: {default})"
            group.add_argument(flag.flag, dest=flag.dest, type=flag.type, choices=flag.choices,
                               default=default, metavar=flag.metavar, help=flag.help + shown)
        elif flag.kind == "on":
            assert default is False, flag
            group.add_argument(flag.flag, dest=flag.dest, action="store_true", help=flag.help)
        elif flag.kind == "off":
            assert default is True, flag
            group.add_argument(flag.flag, dest=flag.dest, action="store_false", help=flag.help)
        else:
            raise AssertionError(f"unknown flag kind {flag.kind!r}")
    return parser


def ext_config_from_args(args) -> MoEExtConfig:
    """MoEExtConfig from parsed args; a bad value raises MoEExtArgumentError naming its flag."""
    missing = [f.flag for f in FLAGS if not hasattr(args, f.dest)]
    if missing:
        raise MoEExtArgumentError(f"the parsed arguments lack {missing}: add the group with "
                                  f"megatron_ext.arguments.add_moe_ext_args (extra_args_provider) or run "
                                  f"through python -m megatron_ext.launch")
    values = {f.field: getattr(args, f.dest) for f in FLAGS}
    try:
        return MoEExtConfig(**values)
    except ValueError as error:
        raise MoEExtArgumentError(_name_flags(str(error))) from None


def ext_config_to_argv(config: MoEExtConfig) -> list[str]:
    """The flags that reproduce `config` (non-default fields only)."""
    argv = []
    for flag in FLAGS:
        value = getattr(config, flag.field)
        if value == _default(flag.field):
            continue
        if flag.kind == "value":
            argv += [flag.flag, str(value)]
        else:  # "on" fields differ from False only when True, "off" fields only when False
            argv.append(flag.flag)
    return argv


def _name_flags(message: str) -> str:
    """Rewrite MoEExtConfig field names in an error message as the flags that set them
    ("dispatcher='rowwise'" -> "--moe-ext-dispatcher rowwise", "dropless=True" -> "--moe-ext-dropless")."""
    for flag in FLAGS:
        if flag.kind == "off":
            continue

        def spell(match, flag=flag):
            value = match.group(1)
            if value is None or flag.kind == "on":
                return flag.flag
            quotes = "'\""
            return f"{flag.flag} {value.strip(quotes)}"

        message = re.sub(rf"\b{flag.field}\b(?:=('[^']*'|\"[^\"]*\"|[\w.+-]+))?", spell, message)
    return message


# ---- checks against Megatron's own arguments ------------------------------------------------------

def _value_flag(name: str, value) -> str:
    return name if value is True else f"{name} {value}"


def _rowwise_conflicts(args) -> list[str]:
    """Megatron options the rowwise dispatcher refuses (mirrors megatron_ext.moe.layer._INCOMPATIBLE)."""
    rowwise = "--moe-ext-dispatcher rowwise"
    problems = []
    checks = [
        ("moe_expert_capacity_factor", "--moe-expert-capacity-factor",
         "Megatron's per-expert capacity drops tokens on its host path; use --moe-ext-capacity-factor "
         "(per-destination-rank capacity) instead"),
        ("moe_pad_expert_input_to_capacity", "--moe-pad-expert-input-to-capacity",
         "padding to capacity happens in Megatron's dispatcher; the rowwise buffers are static already"),
        ("moe_shared_expert_overlap", "--moe-shared-expert-overlap",
         "the overlap lives inside Megatron's dispatcher; drop the flag (shared experts still run)"),
        ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
         "it is built for Megatron's alltoall/flex dispatchers"),
        ("moe_latent_size", "--moe-latent-size", "it needs Transformer Engine latent projections"),
        ("moe_enable_deepep", "--moe-enable-deepep",
         "it selects Megatron's flex dispatcher; for DeepEP use --moe-ext-transport deepep"),
    ]
    for dest, flag, why in checks:
        value = getattr(args, dest, None)
        if value not in (None, False, 0):
            problems.append(f"{rowwise} cannot be combined with {_value_flag(flag, value)}: {why}; "
                            f"or use --moe-ext-dispatcher megatron")
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        problems.append(f"{rowwise} cannot be combined with --moe-token-dispatcher-type flex: Megatron would "
                        f"build its flex (DeepEP/HybridEP) dispatcher first; use --moe-token-dispatcher-type "
                        f"alltoall (ignored by the rowwise layer) and --moe-ext-transport deepep for DeepEP, or "
                        f"--moe-ext-dispatcher megatron to keep flex")
    etp = getattr(args, "expert_tensor_parallel_size", None)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if etp is not None and etp > 1:
        problems.append(f"{rowwise} cannot be combined with --expert-tensor-parallel-size {etp}: experts are "
                        f"not sharded over tensor parallelism; use --expert-tensor-parallel-size 1 and fold the "
                        f"experts over --expert-model-parallel-size instead")
    elif etp is None and tp > 1:
        problems.append(f"{rowwise} with --tensor-model-parallel-size {tp} needs --expert-tensor-parallel-size 1 "
                        f"(Megatron defaults the expert tensor-parallel size to the tensor-parallel size, and "
                        f"the rowwise experts are not sharded over tensor parallelism)")
    return problems


def _ext_flag_conflicts(args) -> list[str]:
    """Combinations of --moe-ext-* flags with each other or with the model's shape."""
    problems = []
    dispatcher = getattr(args, "moe_ext_dispatcher")
    if dispatcher == "megatron":
        if getattr(args, "moe_ext_mxfp8_dispatch"):
            problems.append("--moe-ext-mxfp8-dispatch needs --moe-ext-dispatcher rowwise (the payload is "
                            "quantized inside the rowwise dispatch), got --moe-ext-dispatcher megatron")
        if getattr(args, "moe_ext_cuda_graphs"):
            problems.append("--moe-ext-cuda-graphs captures the synchronization-free rowwise layer; "
                            "--moe-ext-dispatcher megatron synchronizes with the host. Use "
                            "--moe-ext-dispatcher rowwise")
        if getattr(args, "moe_ext_transport") != "auto":
            problems.append(f"--moe-ext-transport {args.moe_ext_transport} only applies to "
                            f"--moe-ext-dispatcher rowwise; --moe-ext-dispatcher megatron moves tokens with "
                            f"--moe-token-dispatcher-type")
    hidden = getattr(args, "hidden_size", None)
    if getattr(args, "moe_ext_mxfp8_dispatch") and hidden is not None and hidden % 32:
        problems.append(f"--moe-ext-mxfp8-dispatch needs --hidden-size divisible by 32 (one E8M0 scale per 32 "
                        f"values), got --hidden-size {hidden}")
    return problems


def _expert_conflicts(args) -> list[str]:
    """What megatron_ext's grouped SwiGLU experts (both dispatchers) need from the model."""
    experts = f"--num-experts {args.num_experts} with megatron_ext's grouped experts (--moe-ext-dispatcher " \
              f"{args.moe_ext_dispatcher})"
    problems = []
    if not getattr(args, "swiglu", False):
        problems.append(f"{experts} needs --swiglu: the experts are SwiGLU (gated linear unit with SiLU) only")
    if getattr(args, "add_bias_linear", False):
        problems.append(f"{experts} needs --disable-bias-linear: the experts have no biases "
                        f"(Megatron's default --add-bias-linear behaviour is on)")
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if args.num_experts % ep:
        problems.append(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size "
                        f"{ep}: every expert-parallel rank holds the same number of experts")
    if getattr(args, "transformer_impl", None) == "local" and not getattr(args, "no_persist_layer_norm", True) \
            and importlib.util.find_spec("apex") is None:
        problems.append("--transformer-impl local without Apex needs --no-persist-layer-norm: Megatron's torch "
                        "norm (WrappedTorchNorm) refuses persist_layer_norm, which is on by default")
    topk = getattr(args, "moe_router_topk", None)
    if topk is not None and topk > args.num_experts:
        problems.append(f"--moe-router-topk {topk} exceeds --num-experts {args.num_experts}")
    return problems


def validate_against_megatron(args) -> None:
    """Raise MoEExtArgumentError listing every wrong combination (each naming both flags).

    Dense models (no --num-experts) are checked only for --moe-ext-* values and combinations.
    Runtime conditions (GPU present, one NVLink domain, DeepEP importable) are checked when
    the layers are built.
    """
    if not hasattr(args, FLAGS[0].dest):
        ext_config_from_args(args)  # raises: the group was never added
    problems = _ext_flag_conflicts(args)  # before MoEExtConfig, whose own message names fields
    if not problems:
        ext_config_from_args(args)  # single-value errors, named by flag
    if getattr(args, "num_experts", None) is not None:
        problems += _expert_conflicts(args)
        if args.moe_ext_dispatcher == "rowwise":
            problems += _rowwise_conflicts(args)
    if problems:
        raise MoEExtArgumentError("megatron_ext cannot run with these flags:\n  - " + "\n  - ".join(problems))


# ---- documentation --------------------------------------------------------------------------------

def flag_table_markdown() -> str:
    """The README table of every flag (generated from FLAGS; a test keeps the README in sync)."""
    rows = ["| flag | MoEExtConfig field | default | meaning |", "| --- | --- | --- | --- |"]
    for flag in FLAGS:
        default = _default(flag.field)
        if flag.kind == "off":
            shown = "on (flag turns it off)"
        elif flag.kind == "on":
            shown = "off"
        else:
            shown = "auto (first microbatch)" if default is None else f"`{default}`"
        spelled = f"`{flag.flag}`" if flag.kind != "value" else f"`{flag.flag} {flag.metavar or '{' + ','.join(flag.choices) + '}'}`"
        rows.append(f"| {spelled} | `{flag.field}` | {shown} | {flag.help} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="megatron_ext's --moe-ext-* flags")
    parser.add_argument("--markdown", action="store_true", help="print the README table of the flags")
    options, _ = parser.parse_known_args(argv)
    if options.markdown:
        print(flag_table_markdown())
    else:
        add_moe_ext_args(argparse.ArgumentParser(prog="... --moe-ext-*")).print_help()


if __name__ == "__main__":
    main()
