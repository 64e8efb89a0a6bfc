"""Hostile or broken inputs cannot write outside a buffer, and other tokens are unaffected.

Kernels (Triton interpreter, tests/unit/_hostile_routes_interp.py): out-of-range routes of a
hand-corrupted route map write and read nothing. The torch transport masks the same routes.
"""

import os
import subprocess
import sys

import torch

from megatron_ext.moe.route_map import route
from megatron_ext.moe.transport.torch_ref import TorchRowTransport
from tests.unit.interpreter import REPO, run_under_interpreter


def test_row_kernels_mask_out_of_range_routes():
    out = run_under_interpreter("_hostile_routes_interp.py", timeout=240)
    assert "hostile routes: 0 failures" in out


def test_without_the_bound_the_check_sees_the_canary_writes():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "unit", "_hostile_routes_interp.py"),
                           "--unbounded"], env=dict(os.environ, TRITON_INTERPRET="1"), cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "canary rows written" in proc.stdout, proc.stdout + proc.stderr


def test_torch_transport_masks_a_corrupted_route_map():
    gen = torch.Generator().manual_seed(0)
    top_idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(10)]).sort(1).values
    capacity = 32
    good = route(top_idx, num_experts=4, capacity=capacity)
    bad_rank, bad_row = good.dest_rank.clone(), good.dest_row.clone()
    bad_row[0, 0] = capacity + 3
    bad_rank[1, 1] = 5  # one rank in this group
    bad_row[2, 0] = 2**30
    bad = good.__class__(**{**vars(good), "dest_rank": bad_rank, "dest_row": bad_row})
    hit = torch.zeros_like(bad_row, dtype=torch.bool)
    hit[0, 0] = hit[1, 1] = hit[2, 0] = True
    clean = good.__class__(**{**vars(good), "dest_rank": torch.where(hit, -1, bad_rank),
                              "dest_row": torch.where(hit, -1, bad_row)})
    tokens, probs = torch.randn(10, 8, generator=gen), torch.rand(10, 2, generator=gen)
    transport = TorchRowTransport(None, capacity)
    for got, want in zip(transport.dispatch(tokens, probs, bad)[:2], transport.dispatch(tokens, probs, clean)[:2]):
        assert torch.equal(got, want)
    expert_out, grad_row_probs = torch.randn(capacity, 8, generator=gen), torch.randn(capacity, generator=gen)
    assert torch.equal(transport.combine(expert_out, bad), transport.combine(expert_out, clean))
    for got, want in zip(transport.dispatch_backward(expert_out, grad_row_probs, bad),
                         transport.dispatch_backward(expert_out, grad_row_probs, clean)):
        assert torch.equal(got, want)


def test_a_route_is_in_range_only_inside_every_ranks_buffer():
    """Row C of rank r would be row 0 of rank r+1 in a flat view of the buffers: out of range, as are
    rank M and negative entries; the last row of the last rank is in range."""
    from types import SimpleNamespace

    from megatron_ext.moe.transport.base import routes_in_range

    ranks, capacity = 2, 8
    dest_rank = torch.tensor([[0, 1, 1, 2, -1, 0]])
    dest_row = torch.tensor([[7, 7, 8, 0, 0, -1]])
    kept = routes_in_range(SimpleNamespace(dest_rank=dest_rank, dest_row=dest_row), ranks, capacity)
    assert kept.tolist() == [[True, True, False, False, False, False]]
