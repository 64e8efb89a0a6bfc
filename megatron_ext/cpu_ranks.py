"""Run a function on N gloo ranks in forked processes (CPU tests and the CPU main job).

Fork is about 8x faster than spawn here because children inherit the imported torch and
Megatron. Each rank's exception (with its traceback) travels back to the parent, which
raises one error naming every failing rank, so a pytest failure shows the assertion
message of the rank that failed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron parallel sizes for `parallel_state.initialize_model_parallel`."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None


class RankFailure(AssertionError):
    """One or more ranks raised; the message carries each rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_megatron_parallel(sizes: ParallelSizes, seed: int = 1234) -> None:
    """Initialize Megatron's parallel_state and RNG tracker on the current gloo world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    # Megatron's MoE metrics tracker (megatron-core 0.19.2, moe_logging) is process-global and sized
    # by the first model's layer count; a forked rank inherits the parent's, so a rank running a model
    # deeper than an earlier test's failed there with an IndexError.
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
    )
    model_parallel_cuda_manual_seed(seed)


def _rank_main(rank, world_size, port, fn, args, kwargs, sizes, results):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        if sizes is not None:
            init_megatron_parallel(sizes)
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            except Exception:  # noqa: BLE001
                pass
            torch.distributed.destroy_process_group()


def _record_dead_ranks(procs, outcomes: dict, seen_dead: set) -> None:
    """Ranks whose process ended without putting a result: failed, with their exit code. A rank is
    recorded on the second empty poll after it died (a result it queued just before exiting is read
    first)."""
    for rank, proc in enumerate(procs):
        if rank in outcomes or proc.is_alive() or proc.exitcode is None:
            continue
        if rank in seen_dead:
            outcomes[rank] = (False, f"rank {rank} exited with code {proc.exitcode} without a result "
                                     f"(killed, or os._exit)\n")
        seen_dead.add(rank)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args, sizes: ParallelSizes | None = None,
                 timeout: float = 240.0, wait_all: bool = False, **kwargs) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked gloo ranks.

    With `sizes`, Megatron's parallel_state is initialized first. Returns the per-rank
    return values (picklable), or raises RankFailure with every failing rank's traceback
    (or a timeout naming the ranks that did not finish). A rank process that dies without a
    result (killed, os._exit) is reported as soon as it is gone. `wait_all` collects every
    rank's outcome even after one failed (fault tests: what did the survivors say?).
    """
    from megatron_ext._cpu import apply_cpu_shims

    apply_cpu_shims()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, kwargs, sizes, results),
                         daemon=False) for r in range(world_size)]  # ranks may start helpers (checkpoint writers)
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    seen_dead: set[int] = set()
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                _record_dead_ranks(procs, outcomes, seen_dead)
                if len(outcomes) == world_size:
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s "
                                      f"(deadlock or a rank waiting on a failed peer)") from None
                continue
            outcomes[rank] = (ok, value)
            if not ok and not wait_all:
                break  # peers may now hang in a collective; report what we have
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcomes) == world_size else 0.5)
            if proc.is_alive():
                proc.kill()
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        report = "\n".join(f"--- rank {r} of {world_size} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise RankFailure(report)
    return [outcomes[r][1] for r in range(world_size)]
