"""Device-only route map for rowwise expert parallelism (docs/design.md, "Route map").

For every route (token t, slot k) a source rank computes, on the device, the destination
rank and the exact row of that rank's static-capacity dispatch buffer, so rows can be moved
straight into place. Cost removed: the host wait for split sizes of a variable-split
all-to-all, and the pack/unpack permutations around it. Cost accepted per MoE layer: one
[E] int32 all-gather of route counts over the EP group, a stable sort of T*K expert ids, a
sort of M*L bucket sizes per destination, and a handful of vectorized [T*K] / [M, E] ops.

Nothing here reads a device value on the host (no .item(), .cpu(), .tolist(), nonzero,
boolean-mask indexing, value-dependent shapes) and no Python loop runs over experts or ranks;
everything also runs on CPU (and on the "meta" device, which the tests use to prove it).

Layout of a destination's buffer: expert-major, then source-major, then token order:
rows of local expert 0 from source 0, from source 1, ..., then local expert 1, ...; the
valid rows are packed from row 0 and the tail up to `capacity` is never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RouteMetrics:
    """Device-resident counters; read them on the host only at a metrics interval.

    `packed` [2E + 4] int32: requested [E], kept [E], dropped, received rows, non-finite, 1 (one
    step), what the layer accumulates in one add; the named counters are views of it, made when
    read (most steps read none: no host call spent on them)."""

    packed: torch.Tensor
    buffer_fill: torch.Tensor  # [] fp32, valid rows in this rank's dispatch buffer / capacity

    @property
    def num_experts(self) -> int:
        return (self.packed.shape[0] - 4) // 2

    @property
    def requested_per_expert(self) -> torch.Tensor:
        """[E] int32, routes to each global expert, all sources."""
        return self.packed[:self.num_experts]

    @property
    def kept_per_expert(self) -> torch.Tensor:
        """[E] int32, of those, routes kept under the capacity."""
        return self.packed[self.num_experts:2 * self.num_experts]

    @property
    def dropped_routes(self) -> torch.Tensor:
        """[] int32, this rank's routes dropped or with an invalid id."""
        return self.packed[2 * self.num_experts]

    @property
    def nonfinite_routes(self) -> torch.Tensor:
        """[] int32, this rank's routes whose router probability is NaN/Inf."""
        return self.packed[2 * self.num_experts + 2]


def pack_metrics(requested, kept, dropped, received, nonfinite) -> torch.Tensor:
    """RouteMetrics.packed from its parts (the torch form; the fused kernels write it directly)."""
    scalars = torch.stack([dropped.int(), received.int(), nonfinite.int(), torch.ones_like(dropped, dtype=torch.int32)])
    return torch.cat([requested.int(), kept.int(), scalars])


def unpack_metrics(packed: torch.Tensor) -> dict:
    """Accumulated RouteMetrics.packed -> named totals (the inverse of pack_metrics' layout)."""
    num_experts = (packed.numel() - 4) // 2
    requested, kept, tail = packed[:num_experts], packed[num_experts:2 * num_experts], packed[2 * num_experts:]
    dropped, received, nonfinite, steps = tail.unbind(0)
    return {"requested": requested, "kept": kept, "dropped": dropped, "received": received,
            "nonfinite": nonfinite, "steps": steps}


@dataclass(frozen=True)
class RouteMap:
    """Where each of this rank's routes goes, and what this rank receives."""

    dest_rank: torch.Tensor  # [T, K] int32, owning EP rank of the expert; -1 dropped/invalid
    dest_row: torch.Tensor  # [T, K] int32, row in the destination's buffer; -1 dropped/invalid
    recv_counts: torch.Tensor  # [L] int32, rows this rank receives per local expert
    recv_offsets: torch.Tensor  # [L] int32, cumulative end offsets (torch._grouped_mm form)
    row_source: torch.Tensor | None  # [capacity] int32, source rank writing each row; -1 past the end
    # (None where the transport does not read it: the symm transport's kernels do not)
    metrics: RouteMetrics


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def count_routes(top_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per global expert, [E] int32; ids outside [0, E) are not counted.

    scatter_add_ into a fixed [E + 1] buffer (invalid ids go to the spare slot) keeps the
    shape static, unlike bincount whose output length can depend on the data.
    """
    ids = top_idx.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    slot = torch.where(valid, ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=top_idx.device)
    counts.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
    return counts[:num_experts]


def _buckets_per_destination(requested: torch.Tensor) -> torch.Tensor:
    """[M_src, E] -> [M_dst, L * M_src]; bucket b = l * M + s holds requested[s, d * L + l]."""
    m = requested.shape[0]
    by_dest = requested.reshape(m, m, -1)  # [s, d, l]
    return by_dest.permute(1, 2, 0).reshape(m, -1)  # [d, l, s] -> [d, b]


def check_plan(num_ranks: int, num_experts: int, capacity: int) -> None:
    """What every keep plan needs (host integers only): a capacity and experts sharded evenly."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 rows, got {capacity}")
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be sharded over {num_ranks} EP ranks; "
                         f"choose num_experts divisible by the expert-parallel size")


def plan_keep(requested: torch.Tensor, capacity: int | torch.Tensor) -> torch.Tensor:
    """How many routes each (source rank, expert) bucket keeps: [M, E] int32.

    `capacity`: rows every destination may receive (a host int), or [M] rows per destination
    on the device (the arena's, moe/arena.py: what is left of a shared budget differs by rank).

    `requested[s, e]` is the number of routes source rank s sends to global expert e.
    Experts are sharded contiguously: destination rank d owns experts d*L .. d*L+L-1
    (L = E // M), and its `capacity` rows are shared by its M*L buckets (s, l).

    Policy, per destination, max-min fair water-filling:
      - if the destination's total request fits in `capacity`, keep everything;
      - otherwise find the largest integer level λ with sum_b min(req_b, λ) <= capacity,
        give each bucket min(req_b, λ), then hand the remaining rows
        (capacity - that sum) out one each to the buckets still wanting more (req_b > λ),
        in a rotating deterministic order: buckets ordered by bucket index b = l * M + s,
        starting at offset (total rows requested of this destination) mod (M * L), wrapping.
    It is a pure function of the gathered matrix, hence identical on all ranks; no bucket can
    end more than one row below another unless it asked for less, so neither high expert
    indices nor high source ranks are starved, and the rotating start spreads the last rows
    instead of always favouring bucket 0. Within a bucket earlier tokens win
    (see build_route_map).

    Vectorized over destinations: sort the bucket requests, find λ from prefix sums, then
    assign the remainder with a cumsum over the rotated "still wanting" mask.
    """
    m, num_experts = requested.shape
    if torch.is_tensor(capacity):
        check_plan(m, num_experts, 0)
        capacity = capacity.to(device=requested.device, dtype=torch.long).view(m, 1)
    else:
        check_plan(m, num_experts, capacity)
    req = _buckets_per_destination(requested.long())  # [M, n]
    n = req.shape[1]
    total = req.sum(1, keepdim=True)  # [M, 1]

    # Filled volume at level v[i] is P_excl[i] + (n - i) * v[i] (nondecreasing in i); the
    # number of sorted entries whose level still fits tells which segment λ falls in.
    levels, _ = torch.sort(req, dim=1)
    below = _exclusive_cumsum(levels, 1)
    above = torch.arange(n, 0, -1, device=req.device)  # n - i
    fits = (below + above * levels <= capacity).sum(1, keepdim=True)  # [M, 1] in 0..n
    seg = fits.clamp(max=n - 1)
    # Inside the segment the volume is below[seg] + (n - seg) * λ; λ < levels[seg] there.
    level = (capacity - below.gather(1, seg)) // (n - seg)
    base = torch.minimum(req, level)
    remainder = capacity - base.sum(1, keepdim=True)

    # Rotated remainder: position j of the rotated order is bucket (j + start) mod n.
    start = total % n
    rotated_bucket = (torch.arange(n, device=req.device) + start) % n  # [M, n]
    wanting = (req > level).long().gather(1, rotated_bucket)
    extra_rotated = wanting * (_exclusive_cumsum(wanting, 1) < remainder).long()
    extra = torch.zeros_like(req).scatter_(1, rotated_bucket, extra_rotated)

    keep = torch.where(total <= capacity, req, base + extra)  # [d, b = l * M + s]
    keep = keep.reshape(m, -1, m).permute(2, 0, 1).reshape(m, num_experts)  # [s, d * L + l]
    return keep.int()


def build_route_map(top_idx: torch.Tensor, requested_all: torch.Tensor, keep: torch.Tensor,
                    ep_rank: int, capacity: int, probs: torch.Tensor | None = None) -> RouteMap:
    """Destination rank and row for each of this rank's routes, and this rank's receive layout.

    Row of a kept route of source `ep_rank` to expert e = d*L + l on destination d:
      expert_base[d, l]  kept rows of local experts l' < l, from every source
    + source_base[e]     kept rows to e from sources s' < ep_rank
    + pos_in_bucket      index of the route among this rank's routes to e in t*K + k order.
    The route is kept iff pos_in_bucket < keep[ep_rank, e] (earlier tokens win). The position
    comes from one stable sort of the flattened ids, not a per-expert loop or a one-hot.
    """
    m, num_experts = requested_all.shape
    local = num_experts // m
    device = top_idx.device
    num_tokens, topk = top_idx.shape
    keep = keep.long()

    ids = top_idx.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    sort_key = torch.where(valid, ids, num_experts)  # invalid ids sort last, after expert E-1
    sorted_key, order = torch.sort(sort_key, stable=True)
    own_counts = count_routes(top_idx, num_experts).long()
    group_start = torch.cat([own_counts.new_zeros(1), torch.cumsum(own_counts, 0)])  # [E + 1]
    pos_sorted = torch.arange(ids.numel(), device=device) - group_start[sorted_key]
    pos_in_bucket = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)

    expert = sort_key.clamp(max=num_experts - 1)  # safe gather index; invalid routes masked
    kept = valid & (pos_in_bucket < keep[ep_rank, expert])
    kept_per_expert = keep.sum(0)  # [E]
    expert_base = _exclusive_cumsum(kept_per_expert.reshape(m, local), 1).reshape(-1)
    source_base = _exclusive_cumsum(keep, 0)[ep_rank]
    row = expert_base[expert] + source_base[expert] + pos_in_bucket
    dest_row = torch.where(kept, row, -1).int().reshape(num_tokens, topk)
    dest_rank = torch.where(kept, expert // local, -1).int().reshape(num_tokens, topk)

    mine = keep[:, ep_rank * local:(ep_rank + 1) * local]  # [s, l]
    recv_counts = mine.sum(0)
    recv_offsets = torch.cumsum(recv_counts, 0)
    row_source = rows_by_source(mine.t(), capacity)

    received = recv_offsets[-1]
    requested = requested_all.sum(0).int()
    dropped = (ids.numel() - kept.sum()).int()
    # NaN/Inf router probabilities (NaN/Inf hidden states or router weights) move like any other
    # route, as in Megatron's layer; counted here (and in the fused select kernel on GPUs).
    nonfinite = (torch.zeros((), dtype=torch.int32, device=device) if probs is None
                 else (~torch.isfinite(probs)).sum().int())
    metrics = RouteMetrics(pack_metrics(requested, kept_per_expert, dropped, received, nonfinite),
                           buffer_fill=received.float() / max(capacity, 1))
    return RouteMap(dest_rank=dest_rank, dest_row=dest_row, recv_counts=recv_counts.int(),
                    recv_offsets=recv_offsets.int(), row_source=row_source, metrics=metrics)


def rows_by_source(mine: torch.Tensor, capacity: int) -> torch.Tensor:
    """[capacity] int32 source rank writing each row of this rank's buffer (-1 past the end), from
    its kept rows per bucket `mine` [L, M] (buffer order: local expert, then source): the
    buckets' cumulative ends give each row's writer by binary search, with a fixed output shape."""
    m = mine.shape[1]
    bucket_ends = torch.cumsum(mine.reshape(-1).long(), 0)  # [L * M], bucket l * M + s
    rows = torch.arange(capacity, device=mine.device)
    bucket = torch.searchsorted(bucket_ends, rows, right=True)
    return torch.where(bucket < bucket_ends.numel(), bucket % m, -1).int()


# torch renamed all_gather_into_tensor to all_gather_single (2.13 warns on the old name; 2.11 lacks the new one)
gather_into_one_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """[E] counts from every EP rank -> [M, E], on device (gloo and NCCL). The only exchange."""
    if group is None or dist.get_world_size(group) == 1:
        return counts[None]
    size = dist.get_world_size(group)
    gathered = counts.new_empty(size * counts.numel())  # flat: gloo rejects a stacked output
    gather_into_one_tensor(gathered, counts.contiguous(), group=group)
    return gathered.view(size, counts.numel())


def exchange_counts(counts: torch.Tensor, group=None, gather_counts=None, ep_rank: int | None = None):
    """This rank's [E] route counts -> ([M, E] of every EP rank, this rank's index): through the
    transport's `gather_counts` where it has one, else an all-gather over `group`."""
    if ep_rank is None:
        ep_rank = 0 if group is None else dist.get_rank(group)
    if gather_counts is not None:
        return gather_counts(counts), ep_rank
    from megatron_ext.moe.peer_failure import named_phase

    with named_phase("route-count exchange", group):
        return all_gather_counts(counts, group), ep_rank


def route(top_idx: torch.Tensor, num_experts: int, capacity: int, group=None,
          gather_counts=None, ep_rank: int | None = None, probs: torch.Tensor | None = None,
          dest_capacity: torch.Tensor | None = None) -> RouteMap:
    """Count, all-gather over the EP group, plan the keep decision, build this rank's map.

    The torch form: CPU ranks, tests and `fused_route_map=False`; GPUs run the same plan in
    Triton kernels (moe/fused_routes.py). `gather_counts(counts [E]) -> [M, E]` replaces the
    NCCL/gloo all-gather (the symm transport exchanges counts over symmetric memory); `ep_rank`
    then names this rank when no process group does (simulated peers in tests). `probs` [T, K],
    when given, feeds the nonfinite_routes metric. `dest_capacity` [M] (device): rows each
    destination may keep, at most `capacity` (the buffer's rows); None: `capacity` for all.
    """
    requested_all, ep_rank = exchange_counts(count_routes(top_idx, num_experts), group, gather_counts, ep_rank)
    keep = plan_keep(requested_all, capacity if dest_capacity is None else dest_capacity)
    return build_route_map(top_idx, requested_all, keep, ep_rank, capacity, probs)


def check_route_map(route_map: RouteMap, top_idx: torch.Tensor, num_experts: int, capacity: int, ep_size: int) -> None:
    """Validate one rank's route map on the host (MoEExtConfig.debug_checks: synchronizes).

    Raises RuntimeError naming the first broken invariant: destinations inside [0, M) x [0, C),
    dropped exactly when the row is -1, each kept route on the rank owning its expert, distinct
    rows for distinct kept routes, and receive offsets that are the cumulative counts within C.
    """
    rank, row = route_map.dest_rank.long().cpu(), route_map.dest_row.long().cpu()
    kept = row >= 0
    problems = []
    if bool(((rank < 0) != ~kept).any()):
        problems.append("dest_rank is -1 exactly where dest_row is not")
    if bool(((rank >= ep_size) | (row >= capacity)).any()):
        problems.append(f"a destination outside {ep_size} ranks x {capacity} rows")
    owner = top_idx.long().cpu() // (num_experts // ep_size)
    if bool((kept & (rank != owner)).any()):
        problems.append("a kept route goes to a rank that does not own its expert")
    flat = (rank * capacity + row)[kept]
    if flat.numel() != flat.unique().numel():
        problems.append("two kept routes share a destination row")
    counts, offsets = route_map.recv_counts.long().cpu(), route_map.recv_offsets.long().cpu()
    if not torch.equal(torch.cumsum(counts, 0), offsets) or bool((counts < 0).any()) or int(offsets[-1]) > capacity:
        problems.append(f"receive offsets {offsets.tolist()} are not the cumulative counts {counts.tolist()} within "
                        f"capacity {capacity}")
    if problems:
        raise RuntimeError("megatron_ext debug_checks: broken route map: " + "; ".join(problems))
