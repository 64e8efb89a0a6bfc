"""Triton row-transfer kernels vs the torch reference, under Triton's CPU interpreter.

Run as a script in a fresh process with TRITON_INTERPRET=1 in its environment (the variable is
read when triton is imported, and a pytest process has imported triton already):

    TRITON_INTERPRET=1 python tests/unit/_row_transfer_interp.py

Several local CPU buffers stand in for the peers through an int64 pointer table. Exits 0 when
every case matches, nonzero with a message otherwise. Importing this module has no side
effects: the route generator and the brute-force loops below are shared with the pytest tests.
"""

from __future__ import annotations

import os
import sys

import torch


def random_routes(T: int, K: int, M: int, capacity: int, drop: float, seed: int, device="cpu"):
    """(dest_rank, dest_row) int32 [T, K]: random ranks, a `drop` fraction dropped (-1), rows
    assigned in a random order densely from 0 on each rank, routes past `capacity` dropped."""
    gen = torch.Generator().manual_seed(seed)
    n = T * K
    rank = torch.randint(0, M, (n,), generator=gen)
    kept = torch.rand(n, generator=gen) >= drop
    order = torch.randperm(n, generator=gen)
    hits = torch.nn.functional.one_hot(rank[order], M) * kept[order].unsqueeze(1)
    row_in_order = (hits.cumsum(0) - 1).gather(1, rank[order].unsqueeze(1)).squeeze(1)
    row = torch.empty(n, dtype=torch.long).scatter_(0, order, row_in_order)
    kept &= row < capacity
    rank, row = torch.where(kept, rank, -1), torch.where(kept, row, -1)
    return (rank.view(T, K).to(torch.int32).to(device), row.view(T, K).to(torch.int32).to(device))


def brute_force_put(src, dest_rank, dest_row, buffers, row_scale=None):
    for t in range(src.shape[0]):
        for k in range(dest_rank.shape[1]):
            r, row = int(dest_rank[t, k]), int(dest_row[t, k])
            if r < 0 or row < 0:
                continue
            scale = 1.0 if row_scale is None else row_scale[t, k]
            buffers[r][row] = (src[t].float() * scale).to(buffers[r].dtype)


def brute_force_get(buffers, dest_rank, dest_row, out, weights=None, gathered=None):
    T, K = dest_rank.shape
    for t in range(T):
        acc = torch.zeros(out.shape[1], dtype=torch.float32)
        for k in range(K):
            r, row = int(dest_rank[t, k]), int(dest_row[t, k])
            fetched = torch.zeros_like(buffers[0][0]) if r < 0 or row < 0 else buffers[r][row]
            if gathered is not None:
                gathered[t, k] = fetched
            if r >= 0 and row >= 0:
                acc = acc + (1.0 if weights is None else weights[t, k]) * fetched.float()
        out[t] = acc.to(out.dtype)
    return out


def tolerance(dtype):
    return {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-2)}[dtype]  # (atol, rtol)


def check_case(M, dtype, T, K, H, C, block_h, scaled, seed, failures):
    from megatron_ext.kernels.row_transfer import get_rows, peer_table_from_buffers, put_rows
    from megatron_ext.kernels.row_transfer_ref import get_rows_ref, put_rows_ref

    name = f"M={M} {dtype} T={T} K={K} H={H} C={C} block_h={block_h} scaled={scaled}"
    gen = torch.Generator().manual_seed(seed)
    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.25, seed=seed)
    src = torch.randn(T, H, generator=gen).to(dtype)
    scale = torch.rand(T, K, generator=gen) if scaled else None
    atol, rtol = tolerance(dtype)

    # PUT: buffers start as NaN; the kernel must fill exactly the kept rows and leave the rest NaN.
    got = [torch.full((C, H), float("nan"), dtype=dtype) for _ in range(M)]
    want = [b.clone() for b in got]
    put_rows(src, dest_rank, dest_row, peer_table_from_buffers(got), scale, block_h=block_h)
    put_rows_ref(src, dest_rank, dest_row, want, scale)
    for m in range(M):
        targeted = torch.zeros(C, dtype=torch.bool)
        targeted[dest_row[dest_rank == m].long()] = True
        if not got[m][~targeted].isnan().all():
            failures.append(f"put {name}: rank {m} wrote rows that no kept route targets")
        if dtype == torch.float32 and not torch.equal(got[m][targeted], want[m][targeted]):
            failures.append(f"put {name}: rank {m} kept rows differ from the reference (fp32 must be exact)")
        elif not torch.allclose(got[m][targeted].float(), want[m][targeted].float(), atol=atol, rtol=rtol):
            failures.append(f"put {name}: rank {m} kept rows differ from the reference beyond {dtype} tolerance")

    # GET: every row no kept route targets is NaN, so reading one (or a dropped route) shows up.
    peers = [torch.full((C, H), float("nan"), dtype=dtype) for _ in range(M)]
    for m, buf in enumerate(peers):
        buf[dest_row[dest_rank == m].long()] = torch.randn(int((dest_rank == m).sum()), H, generator=gen).to(dtype)
    weights = torch.rand(T, K, generator=gen) if scaled else None
    for out_dtype in (dtype, torch.float32):
        out, out_ref = torch.full((T, H), float("nan"), dtype=out_dtype), torch.empty(T, H, dtype=out_dtype)
        gathered, gathered_ref = torch.full((T, K, H), float("nan"), dtype=dtype), torch.empty(T, K, H, dtype=dtype)
        get_rows(peer_table_from_buffers(peers), dest_rank, dest_row, out, weights, gathered, buffer_dtype=dtype,
                 block_h=block_h)
        get_rows_ref(peers, dest_rank, dest_row, out_ref, weights, gathered_ref)
        o_atol, o_rtol = tolerance(out_dtype) if dtype == torch.float32 else tolerance(torch.bfloat16)
        if not torch.allclose(out.float(), out_ref.float(), atol=o_atol, rtol=o_rtol):
            err = (out.float() - out_ref.float()).abs().max().item()
            failures.append(f"get {name} out={out_dtype}: max error {err:.3g} beyond tolerance")
        if not torch.equal(gathered, gathered_ref):
            failures.append(f"get {name} out={out_dtype}: gathered rows differ from the reference")
    # Without weights or gathered.
    out, out_ref = torch.empty(T, H, dtype=dtype), torch.empty(T, H, dtype=dtype)
    get_rows(peer_table_from_buffers(peers), dest_rank, dest_row, out, block_h=block_h)
    get_rows_ref(peers, dest_rank, dest_row, out_ref)
    if not torch.allclose(out.float(), out_ref.float(), atol=atol, rtol=rtol):
        failures.append(f"get {name} (no weights): differs from the reference")


def check_copy_rows_below(dtype, C: int, H: int, bound: int, failures: list[str]) -> None:
    """Rows below the device count are copied; the others keep what dst held."""
    from megatron_ext.kernels.row_transfer import copy_rows_below

    gen = torch.Generator().manual_seed(bound)
    src = torch.randn(C, H, generator=gen).to(dtype)
    dst = torch.full((C, H), float("nan"), dtype=dtype)
    copy_rows_below(src, dst, torch.tensor([bound], dtype=torch.int32))
    if not torch.equal(dst[:bound], src[:bound]) or not torch.isnan(dst[bound:]).all():
        failures.append(f"copy_rows_below {dtype} bound={bound}: rows below not copied or rows past it written")


def check_route_values(M: int, T: int, K: int, C: int, seed: int, failures: list[str]) -> None:
    """put_rows with route_values stores each kept route's value at its row of the owner's [C]
    array and nothing else; get_rows with values_out fetches it back per route (0 if dropped);
    copy_rows_below with values copies the values below the bound. Brute force: Python loops."""
    from megatron_ext.kernels.row_transfer import copy_rows_below, get_rows, peer_table_from_buffers, put_rows

    name = f"route values M={M} T={T} K={K} C={C}"
    gen = torch.Generator().manual_seed(seed)
    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.25, seed=seed)
    src, values = torch.randn(T, 8, generator=gen), torch.rand(T, K, generator=gen)
    rows = [torch.full((C, 8), float("nan")) for _ in range(M)]
    arrays = [torch.full((C, 1), float("nan")) for _ in range(M)]
    put_rows(src, dest_rank, dest_row, peer_table_from_buffers(rows), route_values=values,
             value_table=peer_table_from_buffers(arrays))
    want = [torch.full((C,), float("nan")) for _ in range(M)]
    for t in range(T):
        for k in range(K):
            if dest_row[t, k] >= 0:
                want[int(dest_rank[t, k])][int(dest_row[t, k])] = values[t, k]
    if not all(torch.equal(a[:, 0].nan_to_num(-7.0), w.nan_to_num(-7.0)) for a, w in zip(arrays, want)):
        failures.append(f"put {name}: the value arrays differ from the brute force")
    fetched = torch.full((T, K), float("nan"))
    get_rows(peer_table_from_buffers(rows), dest_rank, dest_row, torch.empty(T, 8),
             value_table=peer_table_from_buffers(arrays), values_out=fetched)
    if not torch.equal(fetched, torch.where(dest_row >= 0, values, 0.0)):
        failures.append(f"get {name}: fetched values differ (kept: the route's value, dropped: 0)")
    bound = C // 2
    copied = torch.full((C,), float("nan"))
    copy_rows_below(rows[0], torch.empty_like(rows[0]), torch.tensor([bound], dtype=torch.int32),
                    values=(arrays[0][:, 0].contiguous(), copied))
    if not torch.equal(copied[:bound].nan_to_num(-7.0), arrays[0][:bound, 0].nan_to_num(-7.0)) \
            or not copied[bound:].isnan().all():
        failures.append(f"copy_rows_below {name}: values below the bound not copied or past it written")


def check_put_back(M: int, T: int, K: int, C: int, seed: int, failures: list[str]) -> None:
    """put_rows with return_table stores each kept route's return id, (t * K + k) * M + source
    rank, at its row; put_rows_back sends every owner row below the count back to that route of
    that rank (rows and values), writes nothing for rows at or past the count or for ids outside
    [0, T * K * M), and leaves the routes nobody returned untouched. Brute force: Python loops."""
    from megatron_ext.kernels.row_transfer import peer_table_from_buffers, put_rows, put_rows_back

    name = f"put back M={M} T={T} K={K} C={C}"
    gen = torch.Generator().manual_seed(seed)
    routes = [random_routes(T, K, M, C, drop=0.25, seed=seed + source) for source in range(M)]
    rows = [torch.full((C, 8), float("nan")) for _ in range(M)]
    returns = [torch.full((C, 1), -5, dtype=torch.int32) for _ in range(M)]  # [C, 1]: a peer table's shape
    for source, (dest_rank, dest_row) in enumerate(routes):
        put_rows(torch.randn(T, 8, generator=gen), dest_rank, dest_row, peer_table_from_buffers(rows),
                 return_table=peer_table_from_buffers(returns), source_rank=source)
    returns = [ids[:, 0] for ids in returns]
    want_ids = [torch.full((C,), -5, dtype=torch.int32) for _ in range(M)]
    for source, (dest_rank, dest_row) in enumerate(routes):
        for t in range(T):
            for k in range(K):
                if dest_row[t, k] >= 0:
                    want_ids[int(dest_rank[t, k])][int(dest_row[t, k])] = (t * K + k) * M + source
    if not all(torch.equal(a, w) for a, w in zip(returns, want_ids)):
        failures.append(f"put {name}: the return ids differ from the brute force")
    received = [int((ids >= 0).sum()) for ids in returns]  # rows are packed from 0 in random_routes
    for owner in range(M):
        assert bool((returns[owner][:received[owner]] >= 0).all()), "random_routes packs each rank's rows"
    if M > 1 and received[0] > 1:  # hostile ids below the count: one past the end, one negative
        returns[0][0], returns[0][1] = T * K * M, -3
    # the routes' buffers are views with two canary rows after them: an id one past the end writes there
    back_full = [torch.full((T * K + 2, 8), -9.0) for _ in range(M)]
    back_values_full = [torch.full((T * K + 2, 1), -9.0) for _ in range(M)]
    back, back_values = [b[:T * K] for b in back_full], [b[:T * K] for b in back_values_full]
    results = [torch.randn(C, 8, generator=gen) for _ in range(M)]
    result_values = [torch.rand(C, generator=gen) for _ in range(M)]
    for owner in range(M):
        count = torch.tensor([max(0, received[owner] - 1)], dtype=torch.int32)  # the last received row stays
        put_rows_back(results[owner], returns[owner], count, peer_table_from_buffers(back), T * K,
                      values=(result_values[owner], peer_table_from_buffers(back_values)))
    want = [torch.full((T * K, 8), -9.0) for _ in range(M)]
    want_values = [torch.full((T * K, 1), -9.0) for _ in range(M)]
    for owner in range(M):
        for row in range(max(0, received[owner] - 1)):
            rid = int(returns[owner][row])
            if 0 <= rid < T * K * M:
                want[rid % M][rid // M] = results[owner][row]
                want_values[rid % M][rid // M] = result_values[owner][row]
    if not all((b[T * K:] == -9.0).all() for b in back_full + back_values_full):
        failures.append(f"put_rows_back {name}: a row past the routes' buffer was written")
    if not all(torch.equal(a, w) for a, w in zip(back, want)):
        failures.append(f"put_rows_back {name}: rows differ from the brute force")
    if not all(torch.equal(a, w) for a, w in zip(back_values, want_values)):
        failures.append(f"put_rows_back {name}: values differ from the brute force")


def check_in_place(dtype, T: int, K: int, C: int, seed: int, failures: list[str]) -> None:
    """get_rows in place (one rank, no table): the same rows, sums and per-route values as
    through a one-entry table and as the brute force; a route at or past `capacity` reads
    nothing, so a source longer than capacity is bounded by it."""
    from megatron_ext.kernels.row_transfer import get_rows, peer_table_from_buffers

    name = f"in place {dtype} T={T} K={K} C={C}"
    gen = torch.Generator().manual_seed(seed)
    dest_rank, dest_row = random_routes(T, K, 1, C, drop=0.25, seed=seed)
    source = torch.randn(C + 4, 40, generator=gen).to(dtype)
    values = torch.rand(C + 4, generator=gen)
    source[C:], values[C:] = float("nan"), float("nan")  # 4 rows past capacity: a read of one shows
    weights = torch.rand(T, K, generator=gen)
    dest_row[0, 0], dest_rank[0, 0] = C, 0  # one route past capacity: reads nothing, adds 0
    out, fetched = torch.empty(T, 40, dtype=dtype), torch.full((T, K), float("nan"))
    get_rows(source, dest_rank, dest_row, out, weights, value_table=values, values_out=fetched, capacity=C,
             in_place=True)
    table_out, table_fetched = torch.empty(T, 40, dtype=dtype), torch.full((T, K), float("nan"))
    get_rows(peer_table_from_buffers([source]), dest_rank, dest_row, table_out, weights,
             value_table=peer_table_from_buffers([values[:, None]]), values_out=table_fetched, capacity=C)
    kept_row = torch.where(dest_row < C, dest_row, -1)
    want = brute_force_get([source], dest_rank, kept_row, torch.empty(T, 40, dtype=dtype), weights)
    want_values = torch.where(kept_row >= 0, values[kept_row.clamp(min=0).long()], 0.0)
    atol, rtol = tolerance(dtype)
    if not (torch.equal(out, table_out) and torch.allclose(out.float(), want.float(), atol=atol, rtol=rtol)):
        failures.append(f"get {name}: rows differ from the table form or the brute force")
    if not (torch.equal(fetched, table_fetched) and torch.equal(fetched, want_values)):
        failures.append(f"get {name}: values differ from the table form or the brute force")


def check_in_place_bounds(failures: list[str]) -> None:
    """In place, the source's own rows bound the reads whatever `capacity` says: a route to a row past
    the source's end (but below a larger capacity) or to another rank than 0 reads nothing and adds 0.
    The source is a view of a longer tensor whose rows past the view are NaN, so a read past its end
    shows up as NaN (deterministically: it is the same storage)."""
    from megatron_ext.kernels.row_transfer import get_rows

    C, H = 6, 40
    backing = torch.full((C + 4, H), float("nan"))
    backing[:C] = torch.arange(C * H, dtype=torch.float32).view(C, H)
    values_backing = torch.full((C + 4,), float("nan"))
    values_backing[:C] = torch.arange(C, dtype=torch.float32)
    source, values = backing[:C], values_backing[:C]
    dest_rank = torch.tensor([[0, 0], [0, 1], [0, -1]], dtype=torch.int32)
    dest_row = torch.tensor([[1, C], [2, 3], [C + 1, 0]], dtype=torch.int32)  # (0,1), (2,0): past the rows
    out, fetched = torch.empty(3, H), torch.full((3, 2), float("nan"))
    get_rows(source, dest_rank, dest_row, out, value_table=values, values_out=fetched, capacity=C + 4, in_place=True)
    want = torch.stack([backing[1], backing[2], torch.zeros(H)])  # only (0,0) and (1,0) are inside rank 0's rows
    want_values = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    if not (torch.equal(out, want) and torch.equal(fetched, want_values)):
        failures.append("get in place: a route past the source's rows or to rank != 0 was read")


def check_unread_routes(failures: list[str]) -> None:
    """A route get_rows does not read adds exactly 0, whatever its weight or its row holds: weights
    NaN or Inf at dropped routes and at a route past `capacity`, and (own_rows_of, the sum of
    return_transfer="put") NaN in the receive rows of routes put_rows did not deliver. Brute force:
    Python loops over the read routes, fp32 sums in route order."""
    from megatron_ext.kernels.row_transfer import get_rows, peer_table_from_buffers

    M, T, K, C, H = 2, 9, 3, 16, 40
    gen = torch.Generator().manual_seed(5)
    dest_rank, dest_row = random_routes(T, K, M, C, drop=0.3, seed=5)
    dest_rank[1, 2], dest_row[1, 2] = 1, C  # past capacity
    read = (dest_rank >= 0) & (dest_row >= 0) & (dest_row < C)
    weights = torch.rand(T, K, generator=gen)
    unread = (~read).nonzero().tolist()
    for i, (t, k) in enumerate(unread):
        weights[t, k] = float("nan") if i % 2 else float("inf")
    peers = [torch.randn(C, H, generator=gen) for _ in range(M)]
    received = torch.randn(T * K, H, generator=gen)
    received[(~read).flatten()] = float("nan")  # put_rows_back writes nothing there
    want_peers, want_own = torch.zeros(T, H), torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            if read[t, k]:
                want_peers[t] += weights[t, k] * peers[int(dest_rank[t, k])][int(dest_row[t, k])]
                want_own[t] += weights[t, k] * received[t * K + k]
    assert len(unread) >= 4, "too few unread routes to test"
    out = get_rows(peer_table_from_buffers(peers), dest_rank, dest_row, torch.empty(T, H), weights, capacity=C)
    if not torch.allclose(out, want_peers, rtol=1e-6, atol=1e-6):
        failures.append("get with NaN/Inf weights at unread routes: differs from the loop over read routes")
    own = get_rows(peer_table_from_buffers([received]), dest_rank, dest_row, torch.empty(T, H), weights,
                   capacity=C, own_rows_of=M)
    if not torch.allclose(own, want_own, rtol=1e-6, atol=1e-6):
        failures.append("get own rows: an undelivered route's receive row was read, or the sum differs")


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.unit.interpreter import interpreter_ready

    if not interpreter_ready():
        return 2
    failures: list[str] = []
    cases = 0
    for M in (1, 2, 4):
        for dtype in (torch.float32, torch.bfloat16):
            # H=40 with block_h=16 runs three H-steps, the last one masked; None = _launch_config.
            for H, block_h, scaled in ((40, 16, True), (64, None, False)):
                check_case(M, dtype, T=7, K=3, H=H, C=12, block_h=block_h, scaled=scaled,
                           seed=cases, failures=failures)
                cases += 1
    for dtype in (torch.float32, torch.bfloat16):
        for bound in (0, 5, 12):
            check_copy_rows_below(dtype, C=12, H=40, bound=bound, failures=failures)
            cases += 1
    for M in (1, 3):
        check_route_values(M, T=9, K=3, C=16, seed=M, failures=failures)
        cases += 1
    for M in (1, 2, 3):
        check_put_back(M, T=9, K=3, C=16, seed=10 + M, failures=failures)
        cases += 1
    for dtype in (torch.float32, torch.bfloat16):
        check_in_place(dtype, T=9, K=3, C=16, seed=20, failures=failures)
        cases += 1
    check_in_place_bounds(failures)
    cases += 1
    check_unread_routes(failures)
    cases += 1
    for line in failures:
        print("MISMATCH", line)
    print(f"{cases} cases, {len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
