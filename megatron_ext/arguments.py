"""The `--moe-ext-*` command-line flags: one per MoEExtConfig field.

    parser = add_moe_ext_args(parser)            # Megatron's extra_args_provider contract
    validate_against_megatron(args)              # argument_checks.py: wrong combinations, naming both flags
    ext_config = ext_config_from_args(args)      # -> MoEExtConfig

The flag table (`FLAGS`) is the single source: help texts, `--help`, the README table
(`python -m megatron_ext.arguments --markdown` prints it) and the tests read it. Defaults come
from MoEExtConfig's own field defaults. Runtime conditions (e.g. `--moe-ext-transport symm`
without GPUs) are checked where the layer is built, not here.

Written against megatron-core 0.19.2 (megatron_ext.rules.MEGATRON_VERSION: the names of Megatron's
own flags and `args` fields). The checks of these flags against Megatron's own arguments live in
megatron_ext.argument_checks, the rules shared with the layer in megatron_ext.rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

from megatron_ext.config import DISPATCHERS, OVERFLOW_POLICIES, RETURN_TRANSFERS, ROUTER_GEMMS, TRANSPORTS, MoEExtConfig

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
    default_text: str | None = None  # the README's default column where the field's default is None

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
    ExtFlag("return_transfer", "--moe-ext-return-transfer", "value", type=str, choices=RETURN_TRANSFERS,
            help="How the symm transport brings rows back to their tokens (combine, dispatch backward): get "
                 "(each source reads the owners' rows, after a copy of them into symmetric scratch at EP > 1) "
                 "or put (each owner writes the rows into the sources' receive buffers; no copy, the faster "
                 "NVLink direction; not measured on two GPUs yet)."),
    ExtFlag("capacity_factor", "--moe-ext-capacity-factor", "value", type=float, metavar="CF",
            help="Rows per destination rank: C = round_up(ceil(CF * T_max * top_k), 16), at most "
                 "round_up(EP * T_max * top_k, 16) (the worst case: a factor of EP or more drops nothing). "
                 "Routes beyond C are dropped by a fair max-min policy (replaces Megatron's "
                 "--moe-expert-capacity-factor)."),
    ExtFlag("dropless", "--moe-ext-dropless", "on",
            help="Size the capacity for the worst case (EP * T_max * top_k): nothing is ever dropped."),
    ExtFlag("on_overflow", "--moe-ext-on-overflow", "value", type=str, choices=OVERFLOW_POLICIES,
            help="Routes beyond the capacity: drop (fair policy, counted in the metrics) or error (bounded "
                 "dropless: capacity from --moe-ext-capacity-factor, no route dropped silently; an overflow stops "
                 "training at the next logging interval with the layer, the count and what to raise). auto: error "
                 "with --moe-ext-dropless-arena, drop otherwise."),
    ExtFlag("dropless_arena", "--moe-ext-dropless-arena", "on",
            help="Bounded dropless with one budget for the MoE layers of a microbatch (regions and spill): "
                 "--moe-ext-capacity-factor * T_max * top_k rows per layer on average, shared by the layers; "
                 "routes beyond the budget follow --moe-ext-on-overflow. Keeps the experts' activation in the arena "
                 "(recomputed under --recompute-modules moe_act); SwiGLU experts without biases; torch or symm "
                 "transport; no MXFP8 or Megatron graphs."),
    ExtFlag("arena_region_factor", "--moe-ext-arena-region-factor", "value", type=float, metavar="RF",
            help="Rows of each MoE layer's own region in the arena, in T_max * top_k units (at most "
                 "--moe-ext-capacity-factor); the rest of the budget is the area loads above it spill into."),
    ExtFlag("max_tokens_per_rank", "--moe-ext-max-tokens-per-rank", "value", type=int, metavar="T_MAX",
            help="Tokens a rank holds in one microbatch (T_max). Default: fixed from the first "
                 "microbatch's shape, which is static in Megatron training (the largest of the EP group's: one "
                 "all-reduce at each MoE layer's first forward).", default_text="auto (first microbatch)"),
    ExtFlag("mxfp8_dispatch", "--moe-ext-mxfp8-dispatch", "on",
            help="Carry dispatched rows as MXFP8 (E4M3 + one E8M0 scale per 32 values); needs "
                 "--moe-ext-dispatcher rowwise and a hidden size divisible by 32."),
    ExtFlag("cuda_graphs", "--moe-ext-cuda-graphs", "on",
            help="Capture the whole MoE layer (forward and backward) in CUDA graphs; needs "
                 "--moe-ext-dispatcher rowwise."),
    ExtFlag("ddp_buckets", "--moe-ext-ddp-buckets", "on",
            help="Before the first step, check that Megatron's DDP reduces dense buckets over DP x CP and expert "
                 "buckets over the expert-data-parallel group, and launch every bucket group (dense and expert) in "
                 "one order on all ranks (megatron_ext.ddp.megatron_hook.install_folding_ddp). Any model; needs "
                 "Megatron's DDP (not FSDP) and one distributed-optimizer instance."),
    ExtFlag("metrics_interval", "--moe-ext-metrics-interval", "value", type=int, metavar="N",
            help="Print rank 0's routing metrics (dropped routes, capacity fill) every N iterations, after "
                 "Megatron's train_step, under any training script; reading synchronizes, "
                 "so 0 (never) is the default."),
    ExtFlag("replica_check_interval", "--moe-ext-replica-check-interval", "value", type=int, metavar="N",
            help="Every N iterations (after Megatron's train_step, under any training script) compare parameter "
                 "checksums across each replica group (dense over DP x CP, experts over expert-data-parallel) "
                 "and stop naming the first parameter that disagrees; synchronizes, so 0 (never) is the default. "
                 "Refused with --overlap-param-gather (parameters are gathered in the next forward) and under FSDP "
                 "(`--use-megatron-fsdp`, `--use-torch-fsdp2`: ranks hold shards, not replicas)."),
    ExtFlag("debug_poison", "--moe-ext-debug-poison", "on",
            help="Debug: fill capacity tails and freshly taken receive buffers (dispatch slots, scratch, arena "
                 "slots) with NaN, fenced across EP ranks, so stale reads show up."),
    ExtFlag("debug_checks", "--moe-ext-debug-checks", "on",
            help="Debug: validate every route map (destinations in range, owner ranks, distinct rows, offsets) "
                 "and the experts' offsets; synchronizes with the host, and CUDA graphs are refused."),
    ExtFlag("lease_slots", "--moe-ext-lease-slots", "value", type=int, metavar="N",
            help="Dispatch-buffer slots per MoE layer (microbatches in flight per layer) of the symm transport, "
                 "the dropless arena and the CUDA-graph runner; raise it for pipeline schedules that keep several "
                 "microbatches of a layer alive. The torch and deepep transports need none (refused there "
                 "unless the arena or the graph runner is on)."),
    ExtFlag("peer_timeout_s", "--moe-ext-peer-timeout-s", "value", type=float, metavar="SECONDS",
            help="How long a rank of the symm transport waits on its expert-parallel peers in a device barrier "
                 "(count exchange, row transfers) before it stops with a message naming the phase and the group. "
                 "Default: --distributed-timeout-minutes. The torch transport's waits are process-group "
                 "collectives, bounded by --distributed-timeout-minutes (refused there, and with deepep).",
            default_text="`--distributed-timeout-minutes`"),
    ExtFlag("fused_route_map", "--moe-ext-no-fused-route-map", "off",
            help="On GPUs, build the route map with torch ops instead of the fused Triton kernels (same "
                 "results; the fused kernels save about 1 ms of host time per layer)."),
    ExtFlag("fused_router", "--moe-ext-no-fused-router", "off",
            help="On GPUs, keep Megatron's own top-k routing instead of the fused router kernel (the fused "
                 "router gives the same results to fp32 rounding, gradients to one bf16 rounding, and took "
                 "18-35% of the host time and 0.32-0.37 ms of device time off a layer step at the reference "
                 "shape on an H200)."),
    ExtFlag("expert_wgrad_fusion", "--moe-ext-no-expert-wgrad-fusion", "off",
            help="Hand Megatron's DDP the grouped experts' weight gradients in 16 bits to add to main_grad, "
                 "instead of adding them to main_grad inside the weight-gradient GEMM in fp32 (the default "
                 "saves a pass over the expert gradients per microbatch, ~1.1 ms in isolation and ~0.6 ms "
                 "of a layer step's kernel time at 64 experts of 2048 x 1024 on an H200, and rounds them "
                 "once less). With the fusion on, with or without --no-gradient-accumulation-fusion, "
                 "the expert weights' .grad (and torch.autograd.grad's result for them) is an unwritten "
                 "placeholder under Megatron's DDP, as for Megatron's own fused linear layers: the "
                 "gradient is in main_grad. Turn the fusion off for code that reads .grad."),
    ExtFlag("router_gemms", "--moe-ext-router-gemms", "value", type=str, choices=ROUTER_GEMMS,
            help="Where the fused router's gating GEMMs run with bf16 tokens and an fp32 router: triton (inside "
                 "the routing kernels; no cuBLAS in the layer step, 9-11% less host time per layer step, 0-7% "
                 "more device time, most at small token counts; up to 256 experts) or cublas (for CUDA-graphed "
                 "runs at small token counts, where the host cost is gone)."),
    ExtFlag("pin_host_threads", "--moe-ext-pin-host-threads", "on",
            help="Keep the threads that submit the MoE layers' work (the main thread and PyTorch's autograd "
                 "thread) on one CPU core, this rank's share of its allowed cores (Linux). In the one kept run "
                 "timed in turns the eager layer's host time was 9% lower (x0.91, per-round 0.79..1.21, on "
                 "an H200 host; a later short run measured it 7% higher) and the training step did not "
                 "change; threads and processes started later by the main thread inherit the core."),
)

FLAG_OF_FIELD = {f.field: f.flag for f in FLAGS}


def flag_words(field: str, value=None) -> str:
    """A setting as the command line spells it: `--moe-ext-capacity-factor 1.25`, a switch alone
    (`--moe-ext-dropless`), or the flag alone when `value` is None."""
    flag = FLAG_OF_FIELD[field]
    if value is None or value is True:
        return flag
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


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
        text = flag.help.replace("%", "%%")  # argparse formats help texts: "18-35%" is not a format code
        if flag.kind == "value":
            shown = "" if default is None else f" (default: {default})"
            group.add_argument(flag.flag, dest=flag.dest, type=flag.type, choices=flag.choices,
                               default=default, metavar=flag.metavar, help=text + shown)
        elif flag.kind == "on":
            assert default is False, flag
            group.add_argument(flag.flag, dest=flag.dest, action="store_true", help=text)
        elif flag.kind == "off":
            assert default is True, flag
            group.add_argument(flag.flag, dest=flag.dest, action="store_false", help=text)
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
    except (ValueError, TypeError) as error:
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
    ("dispatcher='rowwise'" -> "--moe-ext-dispatcher rowwise", "dropless=True" -> "--moe-ext-dropless",
    "(or None)" -> "(or leave the flag out)")."""
    for flag in FLAGS:
        def spell(match, flag=flag):
            value = match.group(1)
            if value is None or flag.kind != "value":  # "on" flags set True, "off" flags (--moe-ext-no-*) False
                return flag.flag
            quotes = "'\""
            return f"{flag.flag} {value.strip(quotes)}"

        # A bare name only where it cannot be prose ("dropless_arena", not "the dropless arena").
        bare = "?" if "_" in flag.field else ""
        message = re.sub(rf"\b{flag.field}\b(?:=('[^']*'|\"[^\"]*\"|[\w.+-]+)){bare}", spell, message)
    return message.replace(" (or None)", " (or leave the flag out)")  # a field's None is a flag not given


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
            shown = flag.default_text if default is None else f"`{default}`"
        if flag.kind != "value":
            spelled = f"`{flag.flag}`"
        else:
            spelled = f"`{flag.flag} {flag.metavar or '{' + ','.join(flag.choices) + '}'}`"
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
