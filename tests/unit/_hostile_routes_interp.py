"""Out-of-range routes cannot write or read outside a buffer: Triton row kernels under the interpreter.

    TRITON_INTERPRET=1 python tests/unit/_hostile_routes_interp.py

M local CPU buffers stand in for peers; each is allocated with CANARY extra rows past its capacity
C, filled with a sentinel, and the kernels get `capacity=C`. A route map is corrupted by hand:
rows at C, C+1 and 2^30, a rank equal to M and one far past it. Checked for put_rows (plain and
row-scaled), put_rows_mxfp8, get_rows and put_return.sum_returned: no canary row changes, no row
outside the table is read (the out-of-range routes add exactly 0 and their gathered rows are 0), and every other route's
result equals the same call on the map with the bad routes dropped (-1). Exits 0 when all hold.
`--unbounded` calls the kernels without `capacity` (the rank bound only, as before the fix): the
row checks must then fail, which shows they can see an out-of-range write.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

CANARY = 4
SENTINEL = 7.0


def corrupted_routes(T, K, M, C, seed, far=True):
    from tests.unit._row_transfer_interp import random_routes

    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.2, seed=seed)
    bad_rank, bad_row = dest_rank.clone(), dest_row.clone()
    bad_row[0, 0], bad_rank[0, 0] = C, 0              # one past the end
    bad_row[1, 1], bad_rank[1, 1] = C + 1, M - 1
    if far:  # far past the end (without the bound this one would fault, not just hit the canary)
        bad_row[2, 0], bad_rank[2, 0] = 2**30, 0
    bad_rank[3, 1], bad_row[3, 1] = M, 0              # a rank outside the group
    bad_rank[4, 0], bad_row[4, 0] = 2**30, 1
    hit = (bad_rank != dest_rank) | (bad_row != dest_row)
    clean_rank = torch.where(hit, -1, bad_rank)
    clean_row = torch.where(hit, -1, bad_row)
    return (bad_rank, bad_row), (clean_rank, clean_row)


def buffers(M, C, H, dtype, fill=SENTINEL):
    full = [torch.full((C + CANARY, H), fill, dtype=dtype) for _ in range(M)]
    return full, [f[:C] for f in full]  # views share storage: the canary rows follow each buffer


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.unit.interpreter import interpreter_ready

    if not interpreter_ready():
        return 2
    from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
    from megatron_ext.kernels.row_transfer import get_rows, peer_table_from_buffers, put_rows
    from megatron_ext.formats.mxfp8 import packed_row_bytes
    from megatron_ext.moe.transport.put_return import ReceiveBuffer, sum_returned

    failures = []
    T, K, H, C = 8, 2, 64, 16
    bound = None if "--unbounded" in sys.argv else C
    for M in (1, 2):
        (bad_rank, bad_row), (clean_rank, clean_row) = corrupted_routes(T, K, M, C, seed=M, far=bound is not None)
        src = torch.randn(T, H)
        scale = torch.rand(T, K)
        for scaled in (None, scale):
            got_full, got = buffers(M, C, H, torch.float32)
            want_full, want = buffers(M, C, H, torch.float32)
            put_rows(src, bad_rank, bad_row, peer_table_from_buffers(got), scaled, capacity=bound)
            put_rows(src, clean_rank, clean_row, peer_table_from_buffers(want), scaled, capacity=C)
            for m in range(M):
                if not (got_full[m][C:] == SENTINEL).all():
                    failures.append(f"put M={M} scaled={scaled is not None}: rank {m} canary rows written")
                if not torch.equal(got_full[m], want_full[m]):
                    failures.append(f"put M={M} scaled={scaled is not None}: rank {m} differs from the clean map")
        # MXFP8 PUT into uint8 buffers with canary rows
        P = packed_row_bytes(H)
        got_full = [torch.full((C + CANARY, P), 0xAB, dtype=torch.uint8) for _ in range(M)]
        want_full = [g.clone() for g in got_full]
        put_rows_mxfp8(src, bad_rank, bad_row, peer_table_from_buffers([g[:C] for g in got_full]), capacity=bound)
        put_rows_mxfp8(src, clean_rank, clean_row, peer_table_from_buffers([w[:C] for w in want_full]), capacity=C)
        for m in range(M):
            if not torch.equal(got_full[m], want_full[m]):
                failures.append(f"put_rows_mxfp8 M={M}: rank {m} differs from the clean map (canary or rows)")
        # GET: the canary rows hold NaN, so a read past C would poison the sums
        peers_full, peers = buffers(M, C, H, torch.float32, fill=float("nan"))
        for m in range(M):
            peers[m].copy_(torch.randn(C, H))
        out, gathered = torch.empty(T, H), torch.empty(T, K, H)
        out_ref, gathered_ref = torch.empty(T, H), torch.empty(T, K, H)
        get_rows(peer_table_from_buffers(peers), bad_rank, bad_row, out, scale, gathered, capacity=bound)
        get_rows(peer_table_from_buffers(peers), clean_rank, clean_row, out_ref, scale, gathered_ref, capacity=C)
        if torch.isnan(out).any() or not torch.equal(out, out_ref) or not torch.equal(gathered, gathered_ref):
            failures.append(f"get M={M}: out-of-range routes read memory or changed other routes")
        # the local sum of return_transfer="put": a route put_rows did not deliver reads nothing
        received = torch.full((T * K + CANARY, H), float("nan"))  # canary rows past T*K
        received[:T * K] = torch.randn(T * K, H)
        own = peer_table_from_buffers([received[:T * K]])
        for rank, row, dest in ((bad_rank, bad_row, out), (clean_rank, clean_row, out_ref)):
            get_rows(own, rank, row, dest, capacity=C, own_rows_of=M)
        if torch.isnan(out).any() or not torch.equal(out, out_ref):
            failures.append(f"sum of own rows M={M}: undelivered routes were read")
        # the same through put_return.sum_returned, which passes the owners' capacity on
        receive = ReceiveBuffer(SimpleNamespace(local=received[:T * K]), own, None)
        sums = [sum_returned(receive, SimpleNamespace(dest_rank=rank, dest_row=row), M, C, with_values=False)[0]
                for rank, row in ((bad_rank, bad_row), (clean_rank, clean_row))]
        if torch.isnan(sums[0]).any() or not torch.equal(sums[0], sums[1]):
            failures.append(f"put_return.sum_returned M={M}: undelivered routes were read")
    for line in failures:
        print("FAIL", line)
    print(f"hostile routes: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
