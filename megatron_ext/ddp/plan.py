"""Bucket plan for multi-group gradient reduction (pure: no tensors, no process groups).

Parameters are walked in reverse registration order (roughly the order backward produces
their gradients); a new bucket starts whenever the replica group or dtype changes or the next
parameter would pass the byte cap. The list order is the launch order, identical on every rank
because it depends only on the model's parameters. `resolve_divisors` turns the per-group
averaging rule into the divisor of each group's sum (see buckets.py for the rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

DENSE = "dense"
EXPERT = "expert"
DEFAULT_BUCKET_BYTES = 40_000_000  # bytes; Megatron's DDP floor is 40M elements (160 MB of fp32 gradients)

AssignFn = Callable[[str, torch.nn.Parameter], str]


def expert_or_dense(name: str, param: torch.nn.Parameter) -> str:
    """Megatron's rule: parameters marked `allreduce = False` are expert-parallel ("expert",
    reduced over EP_DP); everything else is "dense" (reduced over DP x CP)."""
    return EXPERT if getattr(param, "allreduce", True) is False else DENSE


# ---------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ParamSlot:
    """A parameter's place in its bucket's flat buffer (elements)."""

    name: str
    offset: int
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: launched `index`-th, reduced over `group`, flat buffer of `dtype`."""

    index: int
    group: str
    dtype: torch.dtype
    slots: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)


def plan_buckets(params: Sequence[ParamInfo], bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> list[BucketPlan]:
    """Buckets for `params` given in registration order; the list order is the launch order.

    Rules: walk the parameters in reverse registration order; start a new bucket when the
    group or dtype differs from the current bucket's, or when adding the parameter would pass
    `bucket_bytes` (a parameter larger than the cap gets a bucket of its own; None = no cap).
    Deterministic: the same parameters give the same plan on every rank.
    """
    if bucket_bytes is not None and bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive or None, got {bucket_bytes}")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique, repeated: {dup}")
    plans: list[BucketPlan] = []
    current: list[ParamInfo] = []

    def close():
        if current:
            offset, slots = 0, []
            for p in current:
                slots.append(ParamSlot(p.name, offset, p.shape, p.numel))
                offset += p.numel
            plans.append(BucketPlan(len(plans), current[0].group, current[0].dtype, tuple(slots)))
            current.clear()

    for p in reversed(params):
        if current:
            same_kind = p.group == current[0].group and p.dtype == current[0].dtype
            fits = bucket_bytes is None or sum(q.nbytes for q in current) + p.nbytes <= bucket_bytes
            if not (same_kind and fits):
                close()
        current.append(p)
    close()
    return plans


def param_infos(model: torch.nn.Module, assign: AssignFn = expert_or_dense) -> list[ParamInfo]:
    """ParamInfo of every trainable parameter in registration order (for plan_buckets)."""
    return [ParamInfo(n, tuple(p.shape), p.dtype, assign(n, p))
            for n, p in model.named_parameters() if p.requires_grad]


def resolve_divisors(group_sizes: Mapping[str, int], average_over: Mapping[str, int | str] | None) -> dict[str, int]:
    """The divisor of each group's sum. Default: every group divides by the "dense" group's size
    (mean over DP x CP ranks); `average_over[g]` is an int or the name of a group whose size to use."""
    rule: dict[str, int | str] = {g: DENSE for g in group_sizes}
    rule.update(average_over or {})
    divisors = {}
    for group, value in rule.items():
        if group not in group_sizes:
            raise ValueError(f"average_over names group {group!r}, not one of {sorted(group_sizes)}")
        if isinstance(value, str):
            if value not in group_sizes:
                raise ValueError(
                    f"group {group!r} averages over {value!r}, which is not one of {sorted(group_sizes)}; "
                    f"pass average_over={{{group!r}: <int>}} or add a {value!r} group")
            value = group_sizes[value]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"average_over[{group!r}] must be a positive int or a group name, got {value!r}")
        divisors[group] = value
    return divisors
