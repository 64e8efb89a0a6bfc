"""Replica checker: do the replicas of every parameter still agree across their replica group?

Each rank reduces every parameter to three fp64 checksums: the sum, the sum of squares, and a
position-weighted sum (weights 1..251 cycling, so swapped or shifted elements change it). The
checksums of one replica group are all-gathered in one collective per group and compared
rank by rank; the report names parameters in registration order, so the first message is the
first disagreeing parameter of the model.

This check synchronizes with the host by nature (it reads the comparison on the host) and
materializes an fp64 copy of one parameter at a time: run it every N steps
(`maybe_check_replicas`), not in the steady-state step.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from megatron_ext.ddp.plan import AssignFn, expert_or_dense

_WEIGHT_PERIOD = 251
CHECKSUM_NAMES = ("sum", "sum of squares", "weighted sum")


class ReplicaMismatch(RuntimeError):
    """Replicas of a parameter disagree; the message names the first such parameter."""


def parameter_checksums(tensor: torch.Tensor) -> torch.Tensor:
    """[3] fp64: sum, sum of squares, position-weighted sum of `tensor`'s elements."""
    x = tensor.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % _WEIGHT_PERIOD + 1
    return torch.stack([x.sum(), (x * x).sum(), (x * weights.to(torch.float64)).sum()])


def _differ(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """Per-row: does any checksum differ (NaN equals NaN; rtol 0 means bitwise)?"""
    same = torch.isclose(a, b, rtol=rtol, atol=0.0, equal_nan=True)
    return ~same.all(dim=-1)


def check_replicas(model: torch.nn.Module, groups: Mapping[str, dist.ProcessGroup | None],
                   assign: AssignFn = expert_or_dense, *, rtol: float = 0.0,
                   raise_on_mismatch: bool = False) -> list[str]:
    """Compare parameter checksums across each replica group; one message per disagreeing
    parameter, in registration order (empty when every replica agrees).

    Every rank gets the same messages for its groups (the checksums are all-gathered), so all
    ranks of a group raise together with `raise_on_mismatch`. rtol = 0 asks for bitwise-equal
    checksums, which replicas updated by identical reduced gradients have. Groups that are None
    or of size 1 have nothing to compare. Host sync: yes (by design).
    """
    named = list(model.named_parameters())
    by_group: dict[str, list[int]] = {}
    for index, (name, param) in enumerate(named):
        group = assign(name, param)
        if group not in groups:
            raise ValueError(f"assign() put {name!r} in group {group!r}, which is not in {sorted(groups)}")
        by_group.setdefault(group, []).append(index)

    found: list[tuple[int, str]] = []
    for group_name, indices in by_group.items():
        pg = groups[group_name]
        if pg is None or dist.get_world_size(pg) == 1:
            continue
        mine = torch.stack([parameter_checksums(named[i][1]) for i in indices])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(gathered, mine, group=pg)
        ranks = dist.get_process_group_ranks(pg)
        for member in range(1, len(ranks)):
            bad = _differ(gathered[member], gathered[0], rtol).tolist()  # host sync (documented)
            for row, is_bad in enumerate(bad):
                if is_bad:
                    index = indices[row]
                    found.append((index, _message(named[index][0], group_name, ranks, ranks[0], ranks[member],
                                                  gathered[0][row], gathered[member][row])))
    found.sort(key=lambda item: item[0])
    first_per_param: dict[int, str] = {}
    for index, message in found:
        first_per_param.setdefault(index, message)
    messages = [first_per_param[i] for i in sorted(first_per_param)]
    if messages and raise_on_mismatch:
        more = f" ({len(messages) - 1} more parameters disagree)" if len(messages) > 1 else ""
        raise ReplicaMismatch(messages[0] + more)
    return messages


def _message(name: str, group: str, ranks: list[int], rank_a: int, rank_b: int,
             a: torch.Tensor, b: torch.Tensor) -> str:
    values = ", ".join(f"{label} {x:.17g} vs {y:.17g}" for label, x, y in zip(CHECKSUM_NAMES, a.tolist(), b.tolist()))
    return (f"parameter {name!r} differs between replicas: rank {rank_a} vs rank {rank_b} of "
            f"replica group {group!r} (ranks {ranks}): {values}")


def maybe_check_replicas(step: int, every_n: int, model: torch.nn.Module,
                         groups: Mapping[str, dist.ProcessGroup | None], assign: AssignFn = expert_or_dense,
                         *, rtol: float = 0.0, raise_on_mismatch: bool = True) -> list[str] | None:
    """Run `check_replicas` when `every_n` > 0 and `step` % `every_n` == 0 (every rank must call
    this with the same step, since it is collective); returns None on the steps it skips.
    Raises ReplicaMismatch by default, naming the first disagreeing parameter."""
    if every_n < 0:
        raise ValueError(f"every_n must be >= 0 (0 = never), got {every_n}")
    if every_n == 0 or step % every_n:
        return None
    return check_replicas(model, groups, assign, rtol=rtol, raise_on_mismatch=raise_on_mismatch)
