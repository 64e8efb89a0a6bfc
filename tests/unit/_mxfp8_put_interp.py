"""Fused MXFP8 quantize + PUT under Triton's CPU interpreter, byte for byte against
``pack_rows(quantize_rows(src))``.

Run as a script in a fresh process (TRITON_INTERPRET must be set before triton is imported):

    TRITON_INTERPRET=1 python tests/unit/_mxfp8_put_interp.py

Several local CPU uint8 buffers, pre-filled with the sentinel byte 0xA5, stand in for the peers
through an int64 pointer table. Checks: every kept route's row equals the reference packed row
(values, scales, zero pad), every other row still holds the sentinel, dropped routes write
nothing. Prints one line per case; exits 0 when all match, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTINEL = 0xA5


def expected_buffers(src, dest_rank, dest_row, M, C):
    """Sentinel-filled [C, P] uint8 buffers with each kept route's reference packed row in place."""
    import torch

    from megatron_ext.formats import mxfp8

    packed = mxfp8.pack_rows(mxfp8.quantize_rows(src))
    want = [torch.full((C, packed.shape[1]), SENTINEL, dtype=torch.uint8, device=src.device) for _ in range(M)]
    token = torch.arange(src.shape[0], device=src.device)[:, None].expand_as(dest_rank)
    kept = (dest_rank >= 0) & (dest_row >= 0)
    for m in range(M):
        sel = kept & (dest_rank == m)
        want[m][dest_row[sel].long()] = packed[token[sel]]
    return want


def run_case(name, src, dest_rank, dest_row, M, C, **options) -> bool:
    import torch

    from megatron_ext.kernels.mxfp8_put import put_rows_mxfp8
    from megatron_ext.kernels.row_transfer import peer_table_from_buffers
    from megatron_ext.formats.mxfp8 import packed_row_bytes

    got = [torch.full((C, packed_row_bytes(src.shape[1])), SENTINEL, dtype=torch.uint8) for _ in range(M)]
    put_rows_mxfp8(src, dest_rank, dest_row, peer_table_from_buffers(got), **options)
    want = expected_buffers(src, dest_rank, dest_row, M, C)
    bad = [m for m in range(M) if not torch.equal(got[m], want[m])]
    for m in bad:
        rows = (got[m] != want[m]).any(1).nonzero().flatten().tolist()
        print(f"  rank {m}: {len(rows)} rows differ, first {rows[:8]}")
    print(f"{'FAIL' if bad else 'ok  '} {name}", flush=True)
    return not bad


def single_rank_route(dest_rank, dest_row, C):
    """A one-rank RouteMap: row_source marks the rows some kept route writes (0) and the tail (-1);
    one expert receives every kept route's row (random_routes packs them from row 0)."""
    import torch

    from megatron_ext.moe.route_map import RouteMap

    row_source = torch.full((C,), -1, dtype=torch.int32, device=dest_row.device)
    row_source[dest_row[dest_row >= 0].long()] = 0
    received = (dest_row >= 0).sum().to(torch.int32).reshape(1)
    return RouteMap(dest_rank, dest_row, received, received.clone(), row_source, None)


def check_put_return_after_mxfp8_dispatch() -> bool:
    """return_transfer="put" after an MXFP8 dispatch (EP=1, CPU): combine and dispatch backward
    equal the GET path's, which reads the same rows (the MXFP8 PUT wrote each row's return id)."""
    import torch

    from megatron_ext.moe.transport.symm import SymmRowTransport
    from tests.unit._row_transfer_interp import random_routes

    T, K, H, C = 8, 3, 64, 30
    dest_rank, dest_row = random_routes(T, K, 1, C, drop=0.2, seed=8)
    route = single_rank_route(dest_rank, dest_row, C)
    tokens, probs = torch.randn(T, H, dtype=torch.bfloat16), torch.rand(T, K)
    expert_out, grad_rows, grad_row_probs = torch.randn(C, H).bfloat16(), torch.randn(C, H).bfloat16(), torch.rand(C)
    results = []
    for return_put in (False, True):
        symm = SymmRowTransport(None, C, poison=True, return_put=return_put)
        *_, lease = symm.dispatch_quantized(tokens, probs, route)
        results.append((symm.combine(expert_out, route), *symm.dispatch_backward(grad_rows, grad_row_probs, route)))
        symm.release(lease)
    ok = all(torch.equal(a, b) for a, b in zip(*results)) and not results[1][0].isnan().any()
    print(f"{'ok  ' if ok else 'FAIL'} put return after MXFP8 dispatch == get (EP=1)", flush=True)
    return ok


def check_symm_transport() -> bool:
    """SymmRowTransport.dispatch_quantized (EP=1, CPU slot) == TorchRowTransport's on every written
    row, NaN-poisoned words elsewhere; the autograd dispatch carries the same payload to the
    experts and keeps its lease until the backward."""
    import torch

    from megatron_ext.moe.mxfp8_dispatch import dispatch_rows_mxfp8
    from megatron_ext.moe.transport.symm import SymmRowTransport
    from megatron_ext.moe.transport.torch_ref import TorchRowTransport
    from tests.unit._row_transfer_interp import random_routes

    T, K, H, C = 8, 3, 96, 30
    dest_rank, dest_row = random_routes(T, K, 1, C, drop=0.2, seed=7)
    route = single_rank_route(dest_rank, dest_row, C)
    tokens = torch.randn(T, H, dtype=torch.bfloat16)
    symm = SymmRowTransport(None, C, lease_slots=1, poison=True)
    ref = TorchRowTransport(None, C)
    probs = torch.rand(T, K)
    got, got_probs, lease = symm.dispatch_quantized(tokens, probs, route)
    want, want_probs, _ = ref.dispatch_quantized(tokens, probs, route)
    written = route.row_source >= 0
    nan_row = torch.full((1,), float("nan")).view(torch.uint8)
    ok = got.dtype == torch.uint8 and got.shape == want.shape
    ok = ok and torch.equal(got[written], want[written]) and not want[~written].any()
    ok = ok and bool((got[~written].view(-1, 4) == nan_row).all())
    ok = ok and torch.equal(got_probs[written], want_probs[written]) and bool(got_probs[~written].isnan().all())
    symm.release(lease)
    _, _, payload_symm, _ = dispatch_rows_mxfp8(tokens, probs, symm, route)
    _, _, payload_ref, _ = dispatch_rows_mxfp8(tokens, probs, ref, route)
    payload_symm, payload_ref = payload_symm.packed, payload_ref.packed
    ok = ok and torch.equal(payload_symm[written], payload_ref[written]) and symm.pool.live == 1
    print(f"{'ok  ' if ok else 'FAIL'} symm dispatch_quantized == torch_ref (EP=1)", flush=True)
    return ok


def main() -> int:
    sys.path.insert(0, REPO)
    from tests.unit.interpreter import interpreter_ready

    if not interpreter_ready():
        return 2
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # numpy on 448 * 2^127
    import torch

    from tests.unit._row_transfer_interp import random_routes
    from tests.unit.mxfp8_spec_reference import make_spec_inputs

    results = []
    seed = 0
    for M in (1, 2, 4):
        for dtype in (torch.bfloat16, torch.float32):
            # H=64: pad 14; H=96: 3 blocks in a 4-block tile, pad 13; H=2048: 64 blocks, no pad.
            for H, T, K in ((64, 9, 3), (96, 7, 4), (2048, 5, 2)):
                seed += 1
                C = T * K // M + 3  # every rank keeps a few untouched tail rows
                dest_rank, dest_row = random_routes(T, K, M, C, drop=0.25, seed=seed)
                gen = torch.Generator().manual_seed(seed)
                src = (torch.randn(T, H, generator=gen) * torch.exp2(torch.randint(-20, 20, (T, 1), generator=gen))
                       ).to(dtype)
                src[0, 5] *= 900.0  # one saturating block
                results.append(run_case(f"M={M} {dtype} T={T} K={K} H={H}", src, dest_rank, dest_row, M, C))
    # Several tiles per row (the last one partly masked), and a narrow one-warp launch.
    dest_rank, dest_row = random_routes(6, 3, 2, 12, drop=0.2, seed=99)
    x = torch.randn(6, 96, dtype=torch.bfloat16)
    results.append(run_case("H=96 blocks_per_program=2", x, dest_rank, dest_row, 2, 12, blocks_per_program=2))
    x = torch.randn(6, 2048)
    results.append(run_case("H=2048 blocks_per_program=16 num_warps=1", x, dest_rank, dest_row, 2, 12,
                            blocks_per_program=16, num_warps=1))
    # H=1056: 33 blocks in a 64-block tile, pad 15 bytes: a masked block's scale byte stored anyway
    # would land past the pad, in the next row's values (the H above keep such bytes inside the pad).
    x = torch.randn(6, 1056, dtype=torch.bfloat16)
    results.append(run_case("H=1056 (33 blocks in a 64-block tile)", x, dest_rank, dest_row, 2, 12))
    # Dropped routes of every shape: rank -1 with a valid row, a valid rank with row -1, both -1;
    # rank 0 gets nothing kept, so its row 0 (where a dropped route's masked address points) stays sentinel.
    dest_rank = torch.tensor([[1, -1], [0, 1], [-1, -1], [1, 0]], dtype=torch.int32)
    dest_row = torch.tensor([[2, 0], [-1, 0], [-1, -1], [3, -1]], dtype=torch.int32)
    results.append(run_case("dropped routes write nothing", torch.randn(4, 64), dest_rank, dest_row, 2, 5))
    # Every clause of the format (zero blocks, subnormals, ties, saturation, NaN/Inf blocks).
    for name, x in make_spec_inputs(seed=3).items():
        T = x.shape[0]
        dest_rank, dest_row = random_routes(T, 2, 2, T + 2, drop=0.2, seed=T)
        results.append(run_case(f"spec {name}", x, dest_rank, dest_row, 2, T + 2))
    results.append(check_symm_transport())
    results.append(check_put_return_after_mxfp8_dispatch())
    failures = results.count(False)
    print(f"{len(results)} cases, {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
