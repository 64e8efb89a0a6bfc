"""Brute-force pure-Python oracle of the route-map policy (megatron_ext.moe.route_map).

Written differently on purpose: the water level rises one row at a time, the remainder is
dealt by walking the rotated bucket order, and rows are laid out by looping over tokens.
"""

from __future__ import annotations


def oracle_keep(requested: list[list[int]], capacity: int) -> list[list[int]]:
    """requested[s][e] -> keep[s][e] under max-min water-filling with a rotating remainder."""
    m, num_experts = len(requested), len(requested[0])
    local = num_experts // m
    keep = [[0] * num_experts for _ in range(m)]
    for d in range(m):
        # Bucket b = local_expert * M + s.
        buckets = [(s, d * local + local_expert) for local_expert in range(local) for s in range(m)]
        req = [requested[s][e] for s, e in buckets]
        total = sum(req)
        if total <= capacity:
            grant = list(req)
        else:
            level = 0
            while sum(min(r, level + 1) for r in req) <= capacity:
                level += 1
            grant = [min(r, level) for r in req]
            left = capacity - sum(grant)
            n = len(buckets)
            for j in range(n):
                b = (total % n + j) % n
                if left == 0:
                    break
                if req[b] > level:
                    grant[b] += 1
                    left -= 1
            assert left == 0
        for (s, e), g in zip(buckets, grant):
            keep[s][e] = g
    return keep


def oracle_rows(top_idx_per_rank: list[list[list[int]]], num_experts: int, capacity: int):
    """Full oracle for M simulated source ranks.

    Returns (keep, per_rank) where per_rank[s] is a dict with dest_rank, dest_row ([T][K]
    lists), recv_counts, recv_offsets, row_source, requested_per_expert, kept_per_expert,
    dropped_routes, buffer_fill, all as seen by rank s.
    """
    m = len(top_idx_per_rank)
    local = num_experts // m
    requested = [[0] * num_experts for _ in range(m)]
    for s, tokens in enumerate(top_idx_per_rank):
        for routes in tokens:
            for e in routes:
                if 0 <= e < num_experts:
                    requested[s][e] += 1
    keep = oracle_keep(requested, capacity)

    # First row of bucket (s, e) on its destination, laid out expert-major then source-major.
    first_row = {}
    writer = {d: [] for d in range(m)}  # rows of destination d -> source rank, in order
    for d in range(m):
        row = 0
        for local_expert in range(local):
            e = d * local + local_expert
            for s in range(m):
                first_row[(s, e)] = row
                row += keep[s][e]
                writer[d] += [s] * keep[s][e]

    per_rank = []
    for s, tokens in enumerate(top_idx_per_rank):
        seen = [0] * num_experts
        dest_rank, dest_row, dropped = [], [], 0
        for routes in tokens:
            ranks_t, rows_t = [], []
            for e in routes:
                if 0 <= e < num_experts and seen[e] < keep[s][e]:
                    ranks_t.append(e // local)
                    rows_t.append(first_row[(s, e)] + seen[e])
                else:
                    ranks_t.append(-1)
                    rows_t.append(-1)
                    dropped += 1
                if 0 <= e < num_experts:
                    seen[e] += 1
            dest_rank.append(ranks_t)
            dest_row.append(rows_t)
        recv_counts = [sum(keep[src][s * local + local_expert] for src in range(m)) for local_expert in range(local)]
        recv_offsets, acc = [], 0
        for c in recv_counts:
            acc += c
            recv_offsets.append(acc)
        row_source = writer[s] + [-1] * (capacity - len(writer[s]))
        per_rank.append(dict(
            dest_rank=dest_rank, dest_row=dest_row, recv_counts=recv_counts,
            recv_offsets=recv_offsets, row_source=row_source,
            requested_per_expert=[sum(row[e] for row in requested) for e in range(num_experts)],
            kept_per_expert=[sum(keep[r][e] for r in range(m)) for e in range(num_experts)],
            dropped_routes=dropped, buffer_fill=acc / max(capacity, 1),
        ))
    return keep, per_rank
