"""megatron_ext's per-iteration work inside megatron.training: routing metrics, drop reports,
overflow and replica checks, and the dropless arena's attachment before the first step (moe/arena.py).

`--moe-ext-metrics-interval N` prints rank 0's routing metrics every N iterations (one host read
of the device-side counters); `--moe-ext-replica-check-interval N` checks every N iterations
that replicas agree (a collective: every rank runs it after the same iterations); bounded
dropless checks for overflow, and capacity-bounded layers report their drops, every
--log-interval iterations and after the last one. Iterations are counted from 1, as Megatron
logs them. All run after Megatron's `train_step`, whichever script drives training (an
unmodified pretrain_gpt.py under `python -m megatron_ext.launch`, or examples/pretrain_gpt.py):
`install` wraps `megatron.training.training.train_step`, which `train()` calls by its
module-level name, and `evaluate`, which `evaluate_and_print_results` calls by name (the arena
is attached before an evaluation that comes first, `--skip-train`; bounded dropless checks the
evaluation's forwards after it). Those wraps are the only Megatron training internals touched
here (checked by `check_hook_point`; megatron-core 0.19.2, see megatron_ext.rules).
"""

from __future__ import annotations

import functools
import inspect

import torch.distributed as dist

from megatron_ext.arguments import flag_words
from megatron_ext.config import MoEExtConfig
from megatron_ext.moe.drop_notice import how_to_drop_none, what_is_held
from megatron_ext.rules import MEGATRON_VERSION, MegatronInternalsChanged


def routing_metrics_line(model, iteration: int) -> str | None:
    """Rank 0's routing metrics since the last read, as one log line (reads the device)."""
    layers = [m for m in model_modules(model) if hasattr(m, "read_metrics")]
    reads = [m for m in (layer.read_metrics() for layer in layers) if m is not None]
    if not reads:
        return None
    dropped = sum(r["dropped_routes"] for r in reads)
    fill = sum(r["mean_buffer_fill"] for r in reads) / len(reads)
    nonfinite = sum(r.get("nonfinite_prob_routes", 0) for r in reads)
    warning = f" | NaN/Inf router probabilities on {nonfinite} routes" if nonfinite else ""
    return (f"megatron_ext routing (rank 0, iterations up to {iteration}): dropped routes {dropped} | "
            f"mean capacity fill {fill:.3f} | capacity {reads[0]['capacity']} rows{warning}")


def _sum_over_ranks(value: int) -> int:
    """`value` summed over the default group (every rank calls it after the same iterations)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    import torch

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total)


def report_drops(model, iteration: int, config: MoEExtConfig) -> str | None:
    """Capacity-bounded layers (on_overflow "drop") drop the routes beyond their capacity, where
    Megatron's own dropless layer would keep them: without --moe-ext-metrics-interval, the routes
    dropped on every rank since the last report, as a warning line when there were any (one host
    read and one all-reduce of one integer; returned on every rank)."""
    reads = [m.read_metrics() for m in model_modules(model) if hasattr(m, "read_metrics")]
    dropped = _sum_over_ranks(sum(r["dropped_routes"] for r in reads if r is not None))
    if dropped == 0:
        return None
    return (f"megatron_ext: warning: the MoE layers dropped {dropped} routes (all ranks) in the iterations up to "
            f"{iteration}: {what_is_held(config, flag_words)}. {how_to_drop_none(config, flag_words)}")


def check_overflows(model) -> None:
    """Bounded dropless: every rank checks its MoE layers (one host read), then all ranks raise
    CapacityExceeded together when any layer on any rank overflowed. A rank raising alone would
    leave the others waiting in their next collective (pipeline stages, data-parallel replicas).
    A collective over the default group: every rank calls it after the same iterations."""
    from megatron_ext.moe.overflow import CapacityExceeded

    message = None
    for module in model_modules(model):
        if hasattr(module, "check_overflow"):
            try:
                module.check_overflow()
            except CapacityExceeded as error:
                message = message or str(error)
    if _sum_over_ranks(int(message is not None)) > 0:
        raise CapacityExceeded(message or "another rank's MoE layer overflowed its capacity (that rank's error "
                                          "names the layer and the capacity factor it needs)")


def model_modules(model):
    """Every module of a model or of Megatron's list of model chunks."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        yield from chunk.modules()


def after_train_step(model, iteration: int, config: MoEExtConfig, log_interval: int = 1, last: bool = False) -> None:
    """The work due after training iteration `iteration` (counted from 1, as Megatron logs it):
    metrics and replica checks at their intervals; the bounded-dropless overflow check, or without
    metrics the report of dropped routes, every `log_interval` iterations and after the `last` one."""
    at_log = iteration % max(log_interval, 1) == 0 or last
    if config.overflow_policy == "error" and at_log:
        check_overflows(model)
    if config.drops_routes and not config.metrics_interval and at_log:
        line = report_drops(model, iteration, config)
        if line and (not dist.is_initialized() or dist.get_rank() == 0):
            print(line, flush=True)
    if config.metrics_interval and iteration % config.metrics_interval == 0:
        line = routing_metrics_line(model, iteration)
        if line and (not dist.is_initialized() or dist.get_rank() == 0):
            print(line, flush=True)
    if config.replica_check_interval:
        from megatron_ext.ddp.buckets import groups_from_parallel_state
        from megatron_ext.ddp.replica_check import maybe_check_replicas

        chunks = model if isinstance(model, (list, tuple)) else [model]
        for index, chunk in enumerate(chunks):
            _refuse_fsdp(chunk, index, "--moe-ext-replica-check-interval",
                         "FSDP gives each data-parallel rank a different shard of every parameter, so the ranks "
                         "hold no replicas to compare")
        for chunk in chunks:
            maybe_check_replicas(iteration, config.replica_check_interval, chunk, groups_from_parallel_state())


def _refuse_fsdp(chunk, index: int, flag: str, why: str) -> None:
    """Raise where model chunk `index` is wrapped in FSDP (Megatron's or torch's, as megatron.core.distributed
    exports them in 0.19.2): the launcher refuses `flag` with the FSDP flags at start-up, this covers other scripts."""
    from megatron.core.distributed import FullyShardedDataParallel, TorchFullyShardedDataParallel

    if isinstance(chunk, (FullyShardedDataParallel, TorchFullyShardedDataParallel)):
        raise TypeError(f"{flag} with model chunk {index} wrapped in {type(chunk).__name__}: {why}; drop {flag}, "
                        f"or train with Megatron's DDP (no --use-megatron-fsdp / --use-torch-fsdp2)")


def install_ddp_buckets(model) -> None:
    """--moe-ext-ddp-buckets: `install_folding_ddp` (megatron_ext.ddp.megatron_hook) on every
    model chunk, once, before its first gradient sync. Each chunk's reduction groups are checked
    against Megatron's parallel_state (DP x CP for dense buckets, EP_DP for expert ones), and every
    bucket group, dense and expert, launches in one order shared by all ranks. Rank 0 prints what
    was found once. A chunk that is not Megatron's DistributedDataParallel (an FSDP wrapper) is
    refused: the launcher refuses those flags at start-up, this covers other scripts."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_ext.ddp.megatron_hook import install_folding_ddp

    chunks = model if isinstance(model, (list, tuple)) else [model]
    for index, chunk in enumerate(chunks):
        if getattr(chunk, "grad_launcher", None) is not None:
            continue  # installed at an earlier step
        if not isinstance(chunk, DistributedDataParallel):
            raise TypeError(f"--moe-ext-ddp-buckets applies to Megatron's DistributedDataParallel, but model chunk "
                            f"{index} is a {type(chunk).__name__}: drop --moe-ext-ddp-buckets, or train with "
                            f"Megatron's DDP (no --use-megatron-fsdp / --use-torch-fsdp2)")
        report = install_folding_ddp(chunk)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"megatron_ext: DDP buckets of model chunk {index} in one launch order; " + "; ".join(report),
                  flush=True)


def check_hook_point() -> None:
    """Raise MegatronInternalsChanged if `train()` no longer calls `train_step(..., model, ...)` by name."""
    from megatron.training import training

    step = getattr(training.train_step, "__wrapped__", training.train_step)
    params = list(inspect.signature(step).parameters)
    problems = []
    if params[:3] != ["forward_step_func", "data_iterator", "model"] or "iteration" not in params:
        problems.append(f"megatron.training.training.train_step{inspect.signature(step)} (expected "
                        f"(forward_step_func, data_iterator, model, ..., iteration=None, ...))")
    if "train_step" not in training.train.__code__.co_names:
        problems.append("megatron.training.training.train no longer calls train_step by its module-level name")
    evaluate = getattr(training.evaluate, "__wrapped__", training.evaluate)
    if list(inspect.signature(evaluate).parameters)[:3] != ["forward_step_func", "data_iterator", "model"]:
        problems.append(f"megatron.training.training.evaluate{inspect.signature(evaluate)} (expected "
                        f"(forward_step_func, data_iterator, model, ...))")
    if "evaluate" not in training.evaluate_and_print_results.__code__.co_names:
        problems.append("megatron.training.training.evaluate_and_print_results no longer calls evaluate by name")
    if problems:
        raise MegatronInternalsChanged(f"megatron_ext.training_hooks was written against megatron-core "
                                       f"{MEGATRON_VERSION}; these changed:\n  - " + "\n  - ".join(problems))


def _megatron_args():
    """megatron.training's parsed args, or None before (or without) its initialisation."""
    try:
        from megatron.training import get_args

        return get_args()
    except (AssertionError, ImportError):
        return None


def install(config: MoEExtConfig) -> bool:
    """Run `after_train_step` after every Megatron train_step; idempotent (the newest config wins).
    Returns whether a hook is active (nothing is installed for Megatron's dispatcher without a
    replica check)."""
    from megatron.training import training

    current = training.train_step
    if getattr(current, "_megatron_ext_config", None) is not None:
        current._megatron_ext_config[0] = config
        return True
    if config.dispatcher != "rowwise" and not (config.replica_check_interval or config.ddp_buckets):
        return False  # Megatron's MoE layers: nothing of ours to check, report or wrap
    check_hook_point()
    signature = inspect.signature(current)
    holder = [config]

    @functools.wraps(current)
    def train_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        if holder[0].ddp_buckets:  # before the first gradient sync; idempotent afterwards
            install_ddp_buckets(bound["model"])
        if holder[0].dropless_arena:  # before the first forward; idempotent afterwards
            from megatron_ext.moe.arena import attach_arenas

            attach_arenas(bound["model"])
        result = current(*args, **kwargs)
        args = _megatron_args()
        done = bound.get("iteration")  # train() passes the iterations done before this one (0.19.2)
        if done is None:
            done = getattr(args, "curr_iteration", 0)
        step = done + 1  # the number Megatron logs for this iteration
        after_train_step(bound["model"], step, holder[0], getattr(args, "log_interval", 1) or 1,
                         last=_ends_training(args, step))
        return result

    train_step._megatron_ext_config = holder
    training.train_step = train_step
    _wrap_evaluate(training, holder)
    return True


def _ends_training(args, step: int) -> bool:
    """Whether Megatron stops after iteration `step`: its --train-iters, or an --exit-interval
    multiple (a run stopped by --exit-duration-in-mins or a signal is not foreseen)."""
    train_iters = getattr(args, "train_iters", None)
    exit_interval = getattr(args, "exit_interval", None)
    return bool(train_iters and step >= train_iters) or bool(exit_interval and step % exit_interval == 0)


def _wrap_evaluate(training, holder: list) -> None:
    """An evaluation may run before any train_step (`--skip-train`, or evaluation first): the
    arena must be attached there too (idempotent once attached). Under on_overflow "error" the
    evaluation's forwards are checked after it (the guard counts them; the last evaluation comes
    after the last train_step). Re-wraps Megatron's own function each time, so it shares the
    newest train_step wrap's config."""
    current = getattr(training.evaluate, "__wrapped__", training.evaluate)
    signature = inspect.signature(current)

    @functools.wraps(current)
    def evaluate(*args, **kwargs):
        model = signature.bind(*args, **kwargs).arguments["model"]
        if holder[0].dropless_arena:
            from megatron_ext.moe.arena import attach_arenas

            attach_arenas(model)
        result = current(*args, **kwargs)
        if holder[0].overflow_policy == "error":  # every rank evaluates: the check's collective matches
            check_overflows(model)
        return result

    training.evaluate = evaluate
